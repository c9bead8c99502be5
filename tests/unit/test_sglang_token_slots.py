"""The SGLang allocator's page arithmetic (``kvpool.integrations.sglang.token_slots``), against
a slot-by-slot reference written the obvious way."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvpool.integrations.sglang.token_slots import (
    decode_starts,
    extend_new_pages,
    extend_slots,
    page_tokens,
)

PS = 4


def reference(prefix: list[int], seq: list[int], pages: list[int],
              last_loc: list[int]) -> list[int]:
    """Each request's new tokens: after ``last_loc`` while its last page has room, then on its
    next new page (one page at a time, in request order)."""
    out, nxt = [], iter(pages)
    for p, s, loc in zip(prefix, seq, last_loc, strict=True):
        cur = loc
        for pos in range(p, s):
            cur = next(nxt) * PS if pos % PS == 0 else cur + 1
            out.append(cur)
    return out


@given(st.lists(st.tuples(st.integers(0, 13), st.integers(0, 13)), min_size=1, max_size=6),
       st.randoms(use_true_random=False))
def test_extend_slots_match_the_reference(reqs: list[tuple[int, int]], rnd) -> None:
    prefix = np.array([min(a, b) for a, b in reqs], dtype=np.int64)
    seq = np.array([max(a, b) for a, b in reqs], dtype=np.int64)
    _, new = extend_new_pages(prefix, seq, PS)
    pages = np.array(rnd.sample(range(1, 200), int(new.sum())), dtype=np.int64)
    # a request's last token sits on some old page (its slot within it: prefix - 1)
    last_loc = [int(rnd.randrange(200, 300)) * PS + (int(p) - 1) % PS for p in prefix]
    slots = extend_slots(prefix, seq, pages, PS)
    got = np.where(slots.in_old, np.asarray(last_loc)[slots.owner] + 1 + slots.local,
                   slots.new_slot)
    assert got.tolist() == reference(prefix.tolist(), seq.tolist(), pages.tolist(), last_loc)


def test_page_tokens_and_decode_starts() -> None:
    assert page_tokens(np.array([2, 5]), PS).tolist() == [8, 9, 10, 11, 20, 21, 22, 23]
    # the 1st, 5th, 9th token start a page; the 2nd and 8th do not
    assert decode_starts(np.array([1, 2, 5, 8, 9]), PS).tolist() == [
        True, False, True, False, True]

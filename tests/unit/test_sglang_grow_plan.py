"""The SGLang allocator's elastic decisions (``kvpool.integrations.sglang.grow_plan``): pure
functions of counts, checked by tables worked by hand and by hypothesis over all counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.integrations.sglang.grow_plan import (
    GROW_RETRY_MAX_S,
    GROW_RETRY_S,
    Backoff,
    admission_growth,
    available_tokens,
    capacity_growth,
    chunk_growth,
    decode_growth,
    evictable_pages,
    grow_ask,
    live_tokens,
    pages_for,
    prefill_growth,
    upkeep_growth,
)

PS = 16
counts = st.integers(min_value=0, max_value=10_000)


def ask(pages: int, quota: int = 100, in_use: int = 0, cached: int = 0, batch: int = 8,
        now: float = 10.0, backoff: Backoff | None = None) -> int:
    return grow_ask(pages, quota_pages=quota, in_use=in_use, cached=cached, batch=batch,
                    now=now, backoff=Backoff() if backoff is None else backoff)


@pytest.mark.parametrize(("pages", "quota", "in_use", "cached", "want"), [
    (0, 100, 0, 0, 0),        # nothing lacking: nothing asked
    (-3, 100, 0, 0, 0),
    (1, 100, 0, 0, 8),        # at least the batch: the cache's miss makes one Allocate
    (20, 100, 0, 0, 20),      # what is lacking, when more than the batch
    (20, 100, 70, 20, 10),    # up to the room: 100 - 70 - 20
    (20, 100, 90, 5, 8),      # room 5 < batch: still the batch (the rest stays cached)
    (5, 100, 60, 40, 0),      # no room past what the cache holds
])
def test_grow_ask_table(pages: int, quota: int, in_use: int, cached: int, want: int) -> None:
    assert ask(pages, quota, in_use, cached) == want


def test_grow_is_held_off_after_a_refusal_doubling_to_the_cap() -> None:
    b = Backoff()
    assert ask(5, backoff=b, now=0.0) == 8
    b = b.refused(0.0)
    assert (b.at, b.wait_s) == (GROW_RETRY_S, 2 * GROW_RETRY_S)
    assert ask(5, backoff=b, now=GROW_RETRY_S / 2) == 0  # held off: nothing asked
    assert ask(5, backoff=b, now=GROW_RETRY_S) == 8
    for _ in range(20):
        b = b.refused(100.0)
    assert b.wait_s == GROW_RETRY_MAX_S and b.at == 100.0 + GROW_RETRY_MAX_S
    assert b.granted() == Backoff()


@given(pages=st.integers(-50, 10_000), quota=counts, in_use=counts, cached=counts,
       batch=st.integers(1, 512))
def test_grow_ask_is_none_or_one_allocate_within_reason(pages: int, quota: int, in_use: int,
                                                         cached: int, batch: int) -> None:
    n = ask(pages, quota, in_use, cached, batch)
    room = quota - in_use - cached
    if pages <= 0 or room <= 0:
        assert n == 0
    else:
        # at least the batch (one Allocate, never a fallback), never more than needed or room
        assert n >= batch
        assert n <= max(batch, min(pages, room))
        assert n >= min(pages, room)


@given(cached=counts, low=counts)
def test_upkeep_tops_up_to_low(cached: int, low: int) -> None:
    n = upkeep_growth(cached=cached, low_pages=low)
    assert n >= 0 and (n == 0) == (cached >= low) and (n == 0 or cached + n == low)


@pytest.mark.parametrize(("tokens", "sharing", "want"), [
    (0, True, 0), (15, True, 0), (16, True, 1), (47, True, 2), (64, False, None),
    (-5, True, 0),
])
def test_evictable_pages(tokens: int, sharing: bool, want: int | None) -> None:
    assert evictable_pages(tokens, PS, prefix_sharing=sharing) == want


@given(quota=counts, in_use=counts, cached=counts)
def test_live_is_the_cached_pages_within_the_quota(quota: int, in_use: int, cached: int) -> None:
    live = live_tokens(quota_pages=quota, in_use=in_use, cached=cached, page_size=PS)
    assert live % PS == 0 and 0 <= live <= cached * PS
    assert live <= max(0, quota - in_use) * PS


@given(quota=counts, in_use=counts, cached=counts, tree=counts)
def test_available_at_rest_adds_up_else_live(quota: int, in_use: int, cached: int,
                                             tree: int) -> None:
    kw = {"quota_pages": quota, "in_use": in_use, "cached": cached, "page_size": PS}
    fixed = available_tokens(**kw, elastic=False, tree_tokens=tree)
    assert fixed == (quota - in_use) * PS  # SGLang's count, whatever the tree holds
    at_rest = available_tokens(**kw, elastic=True, tree_tokens=in_use * PS)
    assert at_rest == fixed  # SGLang's idle identity adds up
    if tree != in_use * PS:
        assert available_tokens(**kw, elastic=True, tree_tokens=tree) == live_tokens(**kw)


@pytest.mark.parametrize(("num_tokens", "live", "want"), [
    (10, 32, 0), (32, 32, 0), (33, 32, 1), (64, 0, 4), (65, 0, 5),
])
def test_decode_growth(num_tokens: int, live: int, want: int) -> None:
    assert decode_growth(num_tokens, live=live, page_size=PS) == want


def test_admission_hooks_growth_table() -> None:
    # the request's input, its decode and a page, less the smaller remainder: 100+50+16-60
    assert prefill_growth(paged_input=100, max_new_tokens=50, remaining_current=60,
                          remaining_total=80, page_size=PS) == 106
    assert prefill_growth(paged_input=10, max_new_tokens=0, remaining_current=500,
                          remaining_total=500, page_size=PS) == 0
    assert admission_growth(total_tokens=300, remaining_total=200) == 101
    assert admission_growth(total_tokens=100, remaining_total=200) == 0
    assert capacity_growth(remaining_current=-40, remaining_total=-10, page_size=PS) == 56
    assert capacity_growth(remaining_current=5, remaining_total=3, page_size=PS) == PS
    assert chunk_growth(0, remaining_total=0) == 0  # no chunked prefill
    assert chunk_growth(512, remaining_total=100) == 412
    assert chunk_growth(512, remaining_total=600) == 0


@given(tokens=st.integers(-100, 100_000))
def test_pages_for_covers(tokens: int) -> None:
    p = pages_for(tokens, PS)
    assert p >= 0 and p * PS >= tokens and (p == 0 or (p - 1) * PS < tokens)

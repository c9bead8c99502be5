"""The paged allocator's page arithmetic: which token slots an extend or a decode step gets,
from page ids, on the host (numpy, O(tokens of the batch); no torch, no I/O).

Page ``p`` covers token indices ``p * page_size + j``, ``j < page_size``. A request extended
from ``prefix`` to ``seq`` tokens first fills the rest of its last page (the slots after its
last token's index ``last_loc``, known only on its device), then new pages. The allocator
(``allocator.py``) takes the pages, asks these functions for the slots and puts them on the
device (``device_copies.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

I64 = np.int64


def page_tokens(pages: np.ndarray, page_size: int) -> np.ndarray:
    """Every token index of ``pages``, page after page (int64)."""
    return (pages[:, None] * page_size + np.arange(page_size, dtype=I64)).reshape(-1)


def extend_new_pages(prefix: np.ndarray, seq: np.ndarray, page_size: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``(have, new)`` per request: the pages it holds (its last one maybe partly) and the new
    pages extending it from ``prefix`` to ``seq`` tokens takes."""
    have = (prefix + page_size - 1) // page_size
    return have, (seq + page_size - 1) // page_size - have


@dataclass(frozen=True)
class ExtendSlots:
    """The slots of an extend, request after request: ``new_slot`` for tokens on new pages;
    tokens still on a request's old page (``in_old``) follow its ``last_loc`` at offset
    ``local`` (the token's rank within its request), ``owner`` being the request."""

    owner: np.ndarray
    local: np.ndarray
    new_slot: np.ndarray
    in_old: np.ndarray


def extend_slots(prefix: np.ndarray, seq: np.ndarray, pages: np.ndarray,
                 page_size: int) -> ExtendSlots:
    """The slots for extending each request ``i`` from ``prefix[i]`` to ``seq[i]`` tokens over
    ``pages`` (the new pages of every request, in request order: ``extend_new_pages``)."""
    ps = page_size
    ext = seq - prefix
    n_tok = int(ext.sum())
    have, new_per_req = extend_new_pages(prefix, seq, ps)
    total = int(new_per_req.sum())
    owner = np.repeat(np.arange(prefix.shape[0], dtype=I64), ext)
    first_tok = np.cumsum(ext) - ext
    local = np.arange(n_tok, dtype=I64) - first_tok[owner]  # 0.. within the request
    pos = prefix[owner] + local  # the token's position in its sequence
    page_start = (have * ps)[owner]  # first position of the request's first new page
    in_old = pos < page_start
    rank = (np.cumsum(new_per_req) - new_per_req)[owner] + (pos - page_start) // ps
    if total:
        new_slot = pages[np.clip(rank, 0, total - 1)] * ps + pos % ps
    else:
        new_slot = np.zeros(n_tok, dtype=I64)
    return ExtendSlots(owner, local, new_slot, in_old)


def decode_starts(seq: np.ndarray, page_size: int) -> np.ndarray:
    """Per request: whether its ``seq[i]``-th token starts a new page."""
    return (seq - 1) % page_size == 0


__all__ = ["ExtendSlots", "decode_starts", "extend_new_pages", "extend_slots", "page_tokens"]

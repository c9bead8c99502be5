"""The plugin's one hook on SGLang's radix tree: its ``insert``, wrapped on the instance.

Every way SGLang 0.5.23 puts KV into its radix tree goes through ``tree.insert``
(``UnifiedRadixCache.checkpoint_into_tree`` for a finished request and for each chunk of an
unfinished one), and the insert is where the tree takes pages: the request's pages for the
part of the key the tree did not hold. The plugin replaces ``insert`` on the tree *object*
(SGLang's files and classes are untouched) with a wrapper that asks the tree for the ranges
it took (``InsertParams.track_adopted_ranges``, which both of the unified tree's cores
support: the Python and the Rust one) and hands them to the sealer; the insert itself is
SGLang's, unchanged. A tree that does not report them (a disabled tree; the legacy
``RadixCache``, which SGLang 0.5.23 builds for no model by default) is not sealed from.

SGLang's KV-event recorder was the other candidate seam: it is off unless
``--kv-events-config`` is set, the Rust tree core records its events inside the extension,
and an event carries hashes and tokens but not the pages.

Keys with a namespace (``extra_key``: LoRA; ``cache_salt``) and bigram keys (EAGLE) are not
sealed (counted in ``Sealer.skipped``).

:func:`insert_paths` inserts adopted token paths with the adopted page ids as their KV
indices (``page * page_size + offset``), through SGLang's insert, not the wrapper.
"""

from __future__ import annotations

import logging
from array import array
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from kvpool.integrations.sglang.sealer import Sealer

log = logging.getLogger("kvpool.integrations.sglang.sealer")

FULL = 0  # sglang ComponentType.FULL (an int enum): the ranges of the full-attention KV
ORIGINAL = "_kvpool_original_insert"


def install(tree: Any, sealer: Sealer) -> None:
    """Wrap ``tree.insert`` (once per tree) so that the sealer hears of the pages it takes."""
    if getattr(tree, ORIGINAL, None) is not None:
        return
    original = tree.insert

    def insert(params: Any) -> Any:
        key = params.key
        if (not sealer.active or key is None or params.value is None
                or getattr(key, "is_bigram", False) or key.extra_key is not None
                or getattr(key, "cache_salt", None) is not None):
            if key is not None and sealer.active:
                sealer.skipped += 1
            return original(params)
        # Ask the tree what it takes: set on the caller's params for this call only (a copy
        # would cost more than the insert's own bookkeeping), put back after.
        ask = not params.track_adopted_ranges
        if ask:
            params.track_adopted_ranges = True
        try:
            result = original(params)
        finally:
            if ask:
                params.track_adopted_ranges = False
        try:
            adopted = result.adopted_ranges
            ranges = adopted.get(FULL) if adopted else None
            if ranges and not getattr(result, "rotation_tail_declined", False):
                sealer.inserted(key.token_ids, len(key), ranges, params.value)
        except Exception:  # sealing must never fail SGLang's insert
            log.exception("kvpool: sealing an insert failed; it is not sealed")
        if ask:
            result.adopted_ranges = None
        return result

    setattr(tree, ORIGINAL, original)
    tree.insert = insert


def insert_paths(tree: Any, paths: list[tuple[np.ndarray, np.ndarray]], page_size: int,
                 device: torch.device) -> set[int]:
    """Insert adopted ``(tokens, pages)`` paths into ``tree`` (evictable, no hit counted);
    returns the page ids the tree took (a path's prefix another path inserted is the tree's
    already; a page whose tokens the tree held with other pages is not taken)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    insert = getattr(tree, ORIGINAL, None) or tree.insert
    offsets = np.arange(page_size, dtype=np.int64)
    taken: set[int] = set()
    for tokens, pages in paths:
        n = int(tokens.shape[0])
        key = RadixKey(array("q", tokens.astype(np.int64).tobytes()), None)
        value = torch.from_numpy((pages[:, None] * page_size + offsets).reshape(-1)).to(device)
        # prev_prefix_len = the whole key: the tree frees nothing of ours as a duplicate (the
        # pages it does not take are freed by the caller); inserted_len: no hit counted.
        result = insert(InsertParams(key=key, value=value, prev_prefix_len=n, inserted_len=n,
                                     track_adopted_ranges=True))
        adopted = getattr(result, "adopted_ranges", None)
        for s, e in (() if adopted is None else adopted.get(FULL, ())):
            taken.update(pages[int(s) // page_size:int(e) // page_size].tolist())
    return taken


__all__ = ["insert_paths", "install"]

"""The paged allocator's free paths: page ids back to the page cache (at once, or once their
copy from the GPU is done), free groups' held frees, double frees refused or skipped.

With ``SGLANG_DEBUG_MEMORY_POOL`` set, freeing a page that is not in use (freed twice, never
handed out, page 0, out of range) raises AssertionError, as SGLang's debug check does, and
changes nothing. Without it SGLang's allocator silently takes the page onto its free list
twice (and later hands it to two requests); this one logs a warning, skips the pages that are
not in use and frees the rest, so its state and the page cache's stay right and the scheduler
carries on.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.integrations.sglang.device_copies import DeviceCopies, cpu_int64

log = logging.getLogger("kvpool.integrations.sglang.allocator")

DEBUG_ENV = "SGLANG_DEBUG_MEMORY_POOL"


def debug_memory_pool(env: Any = None) -> bool:
    """Whether ``SGLANG_DEBUG_MEMORY_POOL`` asks for SGLang's allocator checks (``1`` or
    ``true``, any case, as SGLang reads it)."""
    env = os.environ if env is None else env
    return str(env.get(DEBUG_ENV, "false")).strip().lower() in ("1", "true")


def release_pages(cache: Any, pages: np.ndarray, *, debug: bool, pool: str) -> None:
    """Give ``pages`` (int64 page ids) back to ``cache`` (a page cache). Pages not in use (or
    listed twice): AssertionError when ``debug`` (nothing changes), else a warning and only
    the others are freed.

    Raises:
        AssertionError: a double free in debug mode.
        KVPoolError: the page cache's refusal of pages that are all in use (it is closed).
    """
    if pages.size == 0:
        return
    uniq = np.unique(pages)
    if uniq.size == pages.size:
        try:  # the page cache checks every page is in use (and changes nothing if not)
            cache.free(uniq.astype(np.int32))
            return
        except (FailedPrecondition, InvalidArgument):
            ok = cache.in_use_of(uniq)
            if ok.all():
                raise  # not a page of ours at fault: the daemon refused (cache closed)
    else:
        ok = cache.in_use_of(uniq)
    bad = uniq[~ok]
    repeated = pages.size - uniq.size
    parts = []
    if bad.size:
        parts.append(f"{bad.size} page(s) not in use {bad[:8].tolist()}"
                     f"{' ...' if bad.size > 8 else ''}")
    if repeated:
        parts.append(f"{repeated} listed more than once")
    what = " and ".join(parts)
    if debug:
        raise AssertionError(f"double free in kvpool pool {pool!r}: {what} "
                             f"({DEBUG_ENV} is set)")
    log.warning("kvpool pool %r: free of %d page(s): %s; skipped, the rest freed "
                "(set %s=1 to fail here instead)", pool, pages.size, what, DEBUG_ENV)
    uniq = uniq[ok]
    if uniq.size:
        cache.free(uniq.astype(np.int32))


class PageFrees:
    """Frees of one allocator's pages into its page cache.

    Args:
        cache: the page cache.
        copies: the allocator's host<->device copies (deferred page-id frees).
        page_size: tokens per page.
        debug: SGLang's debug mode (double frees raise).
        pool: the pool's name (for messages).
    """

    def __init__(self, cache: Any, copies: DeviceCopies, *, page_size: int, debug: bool,
                 pool: str, sealer: Any = None) -> None:
        self.cache = cache
        self.sealer = sealer  # sealer.Sealer: sealed pages go to the daemon, not the cache
        self.copies = copies
        self.page_size = page_size
        self.debug = debug
        self.pool = pool
        self.count = 0  # frees made (the elastic idle check runs when allocations moved)

    def release(self, pages: np.ndarray) -> None:
        """Give ``pages`` (int64 page ids) back to the page cache (:func:`release_pages`)."""
        if pages.size:
            self.count += 1
            if self.sealer is not None:
                pages = self.sealer.freed(pages)
            release_pages(self.cache, pages, debug=self.debug, pool=self.pool)

    def return_copied(self, *, wait: bool) -> None:
        """Free the deferred page-id frees whose copies to the host are done (``wait``: all,
        waiting for the copies)."""
        for host in self.copies.done(wait=wait):
            self.release(host)

    def page_ids(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages (a tensor on any device): deferred on CUDA, else now."""
        if self.copies.deferrable(page_ids):
            self.copies.start(page_ids)
        else:
            self.release(cpu_int64(page_ids))

    def tokens(self, free_index: torch.Tensor) -> None:
        """Free the pages of these token indices, each page once (one copy to the host)."""
        self.release(np.unique(cpu_int64(free_index) // self.page_size))

    def group(self, tokens: list[torch.Tensor], page_ids: list[torch.Tensor]) -> None:
        """A free group's held frees in one page-cache free: the pages of the token indices
        (each once) and the page ids, which must not overlap. One copy to the host when there
        are token indices; page ids alone are deferred on CUDA."""
        if not tokens:
            if page_ids:
                self.page_ids(torch.cat(page_ids))
            return
        token_pages = torch.cat(tokens).to(torch.int64) // self.page_size
        n_tok = int(token_pages.numel())
        both = cpu_int64(torch.cat([token_pages, *(p.to(token_pages) for p in page_ids)]))
        self.release(np.concatenate((np.unique(both[:n_tok]), both[n_tok:])))


__all__ = ["DEBUG_ENV", "PageFrees", "debug_memory_pool", "release_pages"]

"""kvpool's paged allocator for SGLang: SGLang's ``PagedTokenToKVPoolAllocator`` interface,
with the pages coming from a kvpool lease.

SGLang's scheduler and radix caches ask their ``token_to_kv_pool_allocator`` for token indices
(``alloc``, ``alloc_extend``, ``alloc_decode``) and give them back (``free``, free groups,
``free_segment(s)``, ``free_page_ids``). :class:`PagedAllocator` answers the same calls, with
the same results as SGLang's allocator (which calls succeed, ``available_size`` after each),
but it owns no free list: the pages are ids of the pool's ``kv`` space, held by the
scheduler's lease in the kvpool daemon and served from a client page cache
(``kvpool.cache.page_cache``), so several engines can share one pool and a crashed scheduler's pages
go back to the pool when its lease expires.

- Page ``p`` (an id of the pool's ``kv`` space, ``1..capacity``; 0 is never handed out, as in
  SGLang, whose page 0 is the padding page) covers token indices ``p * page_size + j``,
  ``j < page_size``; indices are int64 tensors on ``device``. The inner allocator of the SWA
  side of a hybrid SWA pool takes ``swa`` pages instead: the space is the allocator's own
  configuration, never read from the ``kvcache`` SGLang passes (which may be any object:
  SGLang's own pools, its tests' mocks): the SWA code that built the side records it
  (``allocator_config.py``), and every other ``kvcache`` gets ``kv``.
- ``size`` tokens is the allocator's quota in the pool: at most ``size // page_size`` pages in
  use at once. ``available_size()`` is the quota less the pages in use, in tokens, as SGLang
  counts it. The pool may be larger and shared with other leases; when the pool itself runs
  short first, an allocation returns None as if the quota had been reached (a warning is
  logged once).
- Where the pool comes from: a kvpool KV pool carries its binding (``kvpool_binding``, see
  ``scheduler_binding.py``) and the allocator uses that binding's lease (not closing it); given any
  other KV pool (SGLang's own, None) the allocator makes a binding from the environment
  (``KVPOOL_POOL``, ``KVPOOL_TARGET``, ...) and owns it: :meth:`PagedAllocator.close`, also
  run at interpreter exit, ends that lease and the daemon takes every page back.

Frees: SGLang's allocator keeps freed pages on its free list (or staged on a side list with
``need_sort``) and only sorts them when an allocation runs short. Here a free goes straight
back to the page cache, so ``need_sort`` changes nothing observable (``merge_and_sort_free``
has nothing to do); free groups still hold their frees until ``free_group_end``, as SGLang's
do, so ``available_size`` moves at the same points.

Double frees: with ``SGLANG_DEBUG_MEMORY_POOL`` set, freeing a page that is not in use (freed
twice, never handed out, page 0, out of range) raises AssertionError, as SGLang's debug check
does, and changes nothing. Without it SGLang's allocator silently takes the page onto its
free list twice (and later hands it to two requests); this one logs a warning, skips the pages
that are not in use and frees the rest, so its state and the page cache's stay right and the
scheduler carries on.

Host-device synchronization (CUDA): the page arithmetic runs on the host, so token indices go
host->device and freed ids device->host. Neither may make the scheduler wait for the GPU where
SGLang's own allocator does not (its ``alloc``/``alloc_extend``/``alloc_decode``,
``free_segment`` and ``free_page_ids`` never synchronize; its ``free`` and a free group that
holds token frees do, in ``torch.unique``). So indices go to the device from pinned memory,
asynchronously; ``free`` and a free group with token frees copy to the host once (one
synchronization, as SGLang's); ``free_page_ids`` and ``free_segment`` (the radix cache's
eviction and a finished request's row) and free groups of page ids alone copy asynchronously
into pinned memory and are returned to the page cache once the copy is done (a CUDA event,
polled at the next allocation, never waited for unless the pool itself runs short, and at
``close``); meanwhile they count as free, as in SGLang. Not for elastic pools
(their idle checks count the pages themselves) nor with ``SGLANG_DEBUG_MEMORY_POOL`` (whose
checks synchronize anyway): there those frees copy to the host at once.
``tests/gpu/test_sglang_sync.py`` counts the synchronizations of both allocators.

Elastic pools (``docs/sglang.md``, "Elastic pools"): when the pool is elastic the page cache
keeps every page it fetched (no high watermark, no return on free) and runs without a worker
thread: its upkeep (the give-backs the daemon asks for) runs only between scheduler steps
(when SGLang starts an admission or a decode check, and at idle), never between a capacity
check and its allocation (SGLang also frees inside a step, so frees run no upkeep).
``available_size()`` is then the live size, the pages the cache holds unused (see
``kvpool.integrations.sglang.elastic_scheduler`` for idle); the cache grows ahead of need, by half a
group of pages when it holds fewer than ``low_pages`` between steps, and by what a request
lacks when SGLang's admission or decode check finds it short.

Importing this module imports SGLang (the ``kvpool[sglang]`` extra); ``import kvpool`` never
does.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

from kvpool.cache.page_cache import PageCache
from kvpool.cache.policy import DEFAULT_HIGH, space_capacity
from kvpool.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVPoolError,
    ResourceExhausted,
)
from kvpool.contract.records import Stats
from kvpool.integrations.sglang.allocator_config import CONFIGS
from kvpool.integrations.sglang.elastic_scheduler import (
    conservation_violations,
    live_prefill_budget,
    tree_tokens,
)
from kvpool.integrations.sglang.scheduler_binding import PoolBinding, binding_from_env, binding_of

log = logging.getLogger("kvpool.integrations.sglang.allocator")

DEBUG_ENV = "SGLANG_DEBUG_MEMORY_POOL"
# How long a refused allocation waits for the page cache's worker before asking again.
SETTLE_S = 1.0
# After the daemon refused to grow an elastic pool's cache, growth is retried after this long
# (doubling up to GROW_RETRY_MAX_S), so a scheduler short of memory does not ask every step.
GROW_RETRY_S = 0.05
GROW_RETRY_MAX_S = 1.0
_I64 = np.int64


def debug_memory_pool(env: Any = None) -> bool:
    """Whether ``SGLANG_DEBUG_MEMORY_POOL`` asks for SGLang's allocator checks (``1`` or
    ``true``, any case, as SGLang reads it)."""
    env = os.environ if env is None else env
    return str(env.get(DEBUG_ENV, "false")).strip().lower() in ("1", "true")


def cpu_int64(values: Any) -> np.ndarray:
    """``values`` (a tensor on any device, an array, a list) as a 1-D int64 numpy array."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.int64).reshape(-1).numpy()
    return np.asarray(values, dtype=_I64).reshape(-1)


class PagedAllocator(BaseTokenToKVPoolAllocator):
    """SGLang's paged token-to-KV allocator over a kvpool lease (see the module docstring).

    Args:
        size: the quota in tokens: at most ``size // page_size`` pages in use at once.
        page_size: tokens per page; must be the pool's page size.
        dtype: the KV cache dtype (kept for SGLang, unused here).
        device: where the returned token indices live.
        kvcache: SGLang's KV pool; a kvpool KV pool's ``kvpool_binding`` names the daemon,
            the pool and the lease, anything else means: from the environment.
        need_sort: SGLang's option to stage frees for sorting; accepted, changes nothing here.

    Attributes:
        lease: the kvpool lease the pages are held by.
        cache: the page cache of the pool's ``kv`` space that serves them.
        binding: the scheduler's :class:`PoolBinding`.
        config: what the code that built ``kvcache`` recorded for its allocator
            (``allocator_config.CONFIGS``; the defaults for any other ``kvcache``).
        space: the id space the pages are taken from (``config.space``: ``kv``, or ``swa``
            for the SWA side of a hybrid SWA pool).
        num_pages: the quota in pages (SGLang's name).
        capacity: the pool's ``kv`` capacity in pages.
        elastic: whether the pool is elastic (then ``pages_per_group``, its group length in
            pages, and ``low_pages``, what the cache keeps ahead between steps).

    Raises:
        FailedPrecondition: no binding on ``kvcache`` and ``KVPOOL_POOL`` not set.
        NotFound: the pool is not configured in the daemon.
        InvalidArgument: ``page_size`` is not the pool's, or the quota exceeds its capacity.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: Any,
                 kvcache: Any, need_sort: bool) -> None:
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        self.debug_mode = debug_memory_pool()
        self.use_triton_kernels = False  # SGLang's flag; the work here is numpy on the host
        if getattr(kvcache, "mamba_pool", None) is not None:
            # A hybrid linear model's mamba state: the first hook that reaches it. Imported
            # here: it needs SGLang's memory_pool, which the allocator alone does not.
            from kvpool.integrations.sglang.mamba_state import bind_state

            bind_state(kvcache)
        # Recorded by the code that built ``kvcache`` (a side of a hybrid SWA pool), else
        # the defaults: nothing read from ``kvcache`` itself.
        self.config = CONFIGS.of(kvcache)
        binding = binding_of(kvcache)
        self.owns_binding = binding is None
        self.binding: PoolBinding = binding_from_env() if binding is None else binding
        self.pool_name = self.binding.pool
        self._closed = False
        try:
            stats = self.binding.client.stats(self.pool_name)
            self.space: str = self.config.space
            self.capacity = space_capacity(stats, self.pool_name, self.space)
            self._check_page_size(stats)
            self.num_pages = self._quota_pages(size)
            self.lease = self.binding.lease
            pool_stats = stats.pool(self.pool_name)
            self.elastic = pool_stats.elastic is not None
            if self.elastic:
                e = pool_stats.elastic
                assert e is not None
                # Page ids 1..capacity and the padding page 0 fill the groups.
                self.pages_per_group = (self.capacity + 1) // max(1, e.groups)
                self.low_pages = min(self.num_pages, max(1, self.pages_per_group // 2))
                self.cache: PageCache = self.lease.page_cache(
                    self.pool_name, self.space, low=0, high=self.capacity,
                    batch=max(1, min(self.capacity, self.pages_per_group // 2)),
                    background=False, fill=False)
                # The daemon's give-backs reach the radix tree's unreferenced pages too.
                self.cache.set_evictor(self._evict_tree)
            else:
                high = max(1, min(DEFAULT_HIGH, self.capacity // 4, self.num_pages))
                self.cache = self.lease.page_cache(self.pool_name, self.space, high=high)
        except BaseException:
            if self.owns_binding:
                self.binding.close()
            raise
        # Pages in use are the page cache's: it marks what it hands out (``in_use_of``).
        self._page_group: list[torch.Tensor] = []
        # Elastic: SGLang's radix tree (it passes it to the capacity hooks), when growth may be
        # asked again, and the allocation state the last idle check saw.
        self._tree: Any = None
        self._grow_at = 0.0
        self._grow_wait = GROW_RETRY_S
        self._version = 0
        self._checked: tuple[int, int] | None = None
        self._admission = "none"  # the last admission: none yet, "refused" or "admitted"

        self._short_warned = False
        # Page-id frees whose device->host copy is in flight (CUDA; see the module docstring):
        # (pinned host ids, the event after the copy), oldest first; their pages count as free.
        self._cuda = torch.device(device).type == "cuda"
        self._defer = self._cuda and not self.debug_mode and not self.elastic
        self._deferred: list[tuple[torch.Tensor, Any]] = []
        self._deferred_pages = 0
        # The binding's close returns the cached pages before it ends the lease (which would
        # otherwise take them from under the open cache, and log that it did).
        self.binding.on_close(self._close_cache)
        if self.owns_binding:
            atexit.register(self.close)
        self.clear()

    # -- setup --------------------------------------------------------------------------------

    def _check_page_size(self, stats: Stats) -> None:
        pool_ps = stats.pool(self.pool_name).page_size
        if self.page_size != pool_ps:
            raise InvalidArgument(
                f"SGLang's page size {self.page_size} (--page-size) differs from kvpool pool "
                f"{self.pool_name!r}'s page size {pool_ps}: run SGLang with --page-size "
                f"{pool_ps}, or configure the pool with page_size={self.page_size}",
                field="page_size")

    def _quota_pages(self, size: int) -> int:
        pages = int(size) // self.page_size
        if pages > self.capacity:
            raise InvalidArgument(
                f"SGLang asked for {int(size)} tokens ({pages} pages of {self.page_size}) but "
                f"kvpool pool {self.pool_name!r} holds {self.capacity} {self.space} pages "
                f"({self.capacity * self.page_size} tokens): lower --max-total-tokens, or "
                "configure the pool with a larger budget_bytes / max_total_tokens",
                field="max_total_tokens")
        return pages

    # -- state --------------------------------------------------------------------------------

    @property
    def pages_in_use(self) -> int:
        """Pages handed out by this allocator and not freed (free groups' pending frees
        included; frees whose copy to the host is in flight are freed)."""
        return self.cache.in_use - self._deferred_pages

    def available_size(self) -> int:
        """Tokens the allocator may still hand out: (quota pages - pages in use) * page_size,
        as SGLang counts its free (and staged) pages. Frees pending in a free group are still
        in use.

        Elastic pools: :meth:`live_available_size`, except at rest (the pages in use are
        exactly the radix tree's: no request holds any), where it is the quota less the pages
        in use, the number SGLang's idle identity adds up (``verify_byte_accounting`` checks
        the pages themselves)."""
        if self.elastic and self.pages_in_use * self.page_size != tree_tokens(self._tree):
            return self.live_available_size()
        return (self.num_pages - self.pages_in_use) * self.page_size

    def live_available_size(self) -> int:
        """Tokens the allocator can hand out now without asking the daemon: for an elastic
        pool the pages its cache holds unused (granted, this lease's), within the quota; for
        a fixed pool :meth:`available_size`."""
        if not self.elastic:
            return self.available_size()
        return min(self.cache.cached, self.num_pages - self.pages_in_use) * self.page_size

    # -- elastic pools: SGLang's capacity hooks, growth, upkeep -------------------------------

    def _upkeep(self) -> None:
        """Between scheduler steps: the page cache's give-backs (the daemon's shrink asks),
        then growth ahead of need when the cache holds fewer than ``low_pages``."""
        if not self.elastic or self._closed:
            return
        tree = self._tree
        if tree is not None and tree.supports_prefix_sharing():
            self.cache.set_evictable(int(tree.evictable_size()) // self.page_size)
        try:
            self.cache.maintain()
        except KVPoolError as err:
            log.warning("kvpool pool %r: page cache upkeep failed: %s", self.pool_name, err)
        if self.cache.cached < self.low_pages:
            self.grow(self.low_pages - self.cache.cached)

    def _evict_tree(self, pages: int) -> None:
        """The page cache's evictor: a give-back asked for ``pages`` more than the cache holds
        unused, so the radix tree evicts that many pages of its least recently used entries
        (SGLang frees them through :meth:`free`, into the cache, which gives them back)."""
        tree = self._tree
        if tree is None or pages <= 0:
            return
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        tree.evict(EvictParams(num_tokens=int(pages) * self.page_size))
        log.info("kvpool pool %r: the radix tree evicted %d pages for the daemon's give-back",
                 self.pool_name, pages)

    def grow(self, pages: int) -> int:
        """Fetch at least ``pages`` more pages into the cache (one Allocate of at least half a
        group; the daemon grants groups for it or refuses), within the quota. After a refusal
        growth waits a little (doubling) before it asks again.

        Returns:
            The pages fetched (0: refused, held off, or at the quota).
        """
        if not self.elastic or self._closed:
            return 0
        now = time.monotonic()
        room = self.num_pages - self.pages_in_use - self.cache.cached
        want = min(room, max(int(pages), self.cache.batch))
        if want <= 0 or now < self._grow_at:
            log.debug("kvpool pool %r: growth by %d pages not asked (room %d, held off %.2f s)",
                      self.pool_name, pages, room, max(0.0, self._grow_at - now))
            return 0
        had = self.cache.cached
        ids = None
        refused = False
        # Past what the cache holds: one Allocate (at least the cache's batch; what is
        # missing exactly when the daemon refuses that).
        for ask in dict.fromkeys((want, min(want, max(1, int(pages))))):
            try:
                ids = self.cache.alloc(had + ask)
                break
            except ResourceExhausted as err:
                refused = True
                log.debug("kvpool pool %r: growth by %d pages refused: %s", self.pool_name,
                          ask, err)
            except KVPoolError as err:  # the lease or pool is gone: the allocs will say so
                log.warning("kvpool pool %r: growth failed: %s", self.pool_name, err)
                break
        if refused:  # the pool is at its share or the budget is short: not every step
            self._grow_at = now + self._grow_wait
            self._grow_wait = min(GROW_RETRY_MAX_S, self._grow_wait * 2)
        if ids is None:
            return 0
        self.cache.free(ids)  # into the cache: held by the lease, unused
        log.debug("kvpool pool %r: grew its cache %d -> %d pages (%d in use)", self.pool_name,
                  had, self.cache.cached, self.pages_in_use)
        if not refused:
            self._grow_wait = GROW_RETRY_S
        return int(self.cache.cached - had)

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0
                              ) -> Any:
        """SGLang's admission budget; over an elastic pool it counts the live free size (the
        cache's upkeep runs first: an admission starts a step)."""
        if not self.elastic:
            return super().create_prefill_budget(
                tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)
        self._tree = tree_cache
        if self._admission == "refused":
            # The last admission (SGLang makes one only with requests waiting) admitted none:
            # whichever of SGLang's checks refused them, grow by a batch (the daemon may say no).
            self.grow(self.cache.batch)
        self._upkeep()
        self._admission = "refused"  # until the budget admits a request
        return live_prefill_budget()(self, tree_cache,
                                 num_mixed_decode_tokens=num_mixed_decode_tokens)

    def admitted(self) -> None:
        """The current admission admitted a request (the live prefill budget says so)."""
        self._admission = "admitted"

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> bool | None:
        """SGLang's eviction before an allocation, against the live free size (elastic)."""
        if not self.elastic:
            return super().evict_to_free_tokens(tree_cache, num_tokens)
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self._tree = tree_cache
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return None
        shortfall = int(num_tokens) - self.live_available_size()
        if shortfall > 0:
            tree_cache.evict_for_alloc(EvictParams(num_tokens=shortfall))
        return None

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests: Any = None,
                              spec_algorithm: Any = None) -> bool:
        """Whether the next decode step's ``num_tokens`` fit (elastic: the upkeep runs, the
        radix cache is evicted, then the cache grows by what is still missing; False makes
        SGLang retract, as on a full pool)."""
        if not self.elastic:
            return super().check_decode_capacity(num_tokens=num_tokens, tree_cache=tree_cache,
                                                 requests=requests,
                                                 spec_algorithm=spec_algorithm)
        self._tree = tree_cache
        self._upkeep()
        self.evict_to_free_tokens(tree_cache, num_tokens)
        short = int(num_tokens) - self.live_available_size()
        if short > 0:
            self.grow(-(-short // self.page_size))
        return self.live_available_size() >= int(num_tokens)

    def verify_byte_accounting(self) -> list[str]:
        """SGLang's idle diagnostic. Elastic pools: the upkeep runs (idle is between steps),
        then kvpool's conservation check (``kvpool.integrations.sglang.elastic_scheduler``) whenever
        the allocation state changed since the last one; violations are returned for SGLang
        to report (it raises under its strict idle check)."""
        if not self.elastic or self._closed:
            return []
        self._upkeep()
        state = (self._version, tree_tokens(self._tree))
        if state == self._checked:
            return []
        try:
            held = self.lease.client.stats(self.pool_name)
            lease = next((x for x in held.leases if x.lease_id == self.lease.lease_id), None)
            lease_held = None if lease is None else lease.held.get(self.pool_name, {}).get(
                self.space, 0)
        except KVPoolError as err:
            log.warning("kvpool pool %r: Stats for the idle check failed: %s",
                        self.pool_name, err)
            lease_held = None
        out = conservation_violations(
            pool=self.pool_name, page_size=self.page_size,
            in_use=self.cache.handed_out().astype(np.int64), cached=self.cache.cached,
            tree=self._tree, lease_held=lease_held)
        if not out:
            self._checked = state
        return out

    def get_all_free_pages(self) -> None:
        """None: the allocator has no free list of its own (the free pages of a kvpool pool
        are the daemon's, shared by its leases). SGLang's leak census skips on None."""
        return None

    def merge_and_sort_free(self) -> None:
        """Nothing to do: frees go straight back to the page cache (SGLang sorts its staged
        free pages here)."""

    def debug_print(self) -> str:
        return (f"kvpool pool={self.pool_name} lease={self.lease.lease_id} "
                f"in_use={self.pages_in_use}/{self.num_pages} pages")

    def __repr__(self) -> str:
        return (f"PagedAllocator(pool={self.pool_name!r}, page_size={self.page_size}, "
                f"quota={self.num_pages} pages, in_use={self.pages_in_use}, "
                f"lease={self.lease.lease_id}, device={self.device})")

    # -- allocation ---------------------------------------------------------------------------

    def _take(self, n: int) -> np.ndarray | None:
        """``n`` pages (int64) from the page cache, marked in use; None when the quota or the
        pool cannot give that many (nothing changes)."""
        if n > self.num_pages - self.pages_in_use:
            return None
        self._version += 1
        if n == 0:
            return np.empty(0, dtype=_I64)
        self._return_deferred(wait=False)
        try:
            try:
                ids = self.cache.alloc(n)
            except ResourceExhausted:
                # Frees still copying to the host hold pages the pool may need; the page
                # cache's own refill or return may be in flight (ids neither in its cache nor
                # free in the pool): let both finish, then ask once more.
                self._return_deferred(wait=True)
                self.cache.settle(SETTLE_S)
                ids = self.cache.alloc(n)
        except ResourceExhausted as err:
            if not self._short_warned:
                self._short_warned = True
                log.warning("kvpool pool %r ran short before this allocator's quota "
                            "(%d of %d pages in use, asked %d more): %s; the allocation "
                            "fails as if out of memory", self.pool_name, self.pages_in_use,
                            self.num_pages, n, err)
            return None
        return ids.astype(_I64)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """``array`` on ``device``. On CUDA from pinned memory, asynchronously: a copy from
        pageable memory would wait for everything queued on the stream (the forward pass)."""
        t = torch.from_numpy(array)
        if self._cuda:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _defer_release(self, page_ids: torch.Tensor) -> None:
        """Start copying ``page_ids`` (each once, on the device) to pinned host memory without
        waiting; :meth:`_return_deferred` gives them back once the copy is done."""
        src = page_ids.reshape(-1).to(torch.int64)
        host = torch.empty(src.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()  # on the current stream, after the copy
        self._deferred.append((host, event))
        self._deferred_pages += int(host.numel())

    def _return_deferred(self, *, wait: bool) -> None:
        """Give the page cache the deferred frees whose copies are done (``wait``: all of
        them, waiting for the copies: a synchronization)."""
        while self._deferred:
            host, event = self._deferred[0]
            if wait:
                event.synchronize()
            elif not event.query():
                return
            self._deferred.pop(0)
            self._deferred_pages -= int(host.numel())
            self._release(host.numpy())

    def _release_page_ids(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages (a tensor on any device): deferred on CUDA (see the module
        docstring), else at once."""
        if self._defer and page_ids.is_cuda:
            self._defer_release(page_ids)
        else:
            self._release(cpu_int64(page_ids))

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size // page_size`` whole pages as their token indices (int64, on
        ``device``, page after page), or None when the quota (or the pool) has not that many
        pages free. In debug mode ``need_size`` must be page-aligned, as in SGLang."""
        need_size = int(need_size)
        if self.debug_mode:
            assert need_size % self.page_size == 0, "The allocation size should be page-aligned"
        pages = self._take(need_size // self.page_size)
        if pages is None:
            return None
        ps = self.page_size
        idx = (pages[:, None] * ps + np.arange(ps, dtype=_I64)).reshape(-1)
        return self._to_device(idx)

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                     seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor, extend_num_tokens: int,
                     num_new_pages: int | None = None) -> torch.Tensor | None:
        """Token indices for extending each request ``i`` from ``prefix_lens[i]`` to
        ``seq_lens[i]`` tokens: first the rest of its current page (the slots after
        ``last_loc[i]``, its last token's index), then new pages, one ``cache.alloc`` for the
        whole batch. Returns ``extend_num_tokens`` int64 indices on ``device``, request after
        request, or None (changing nothing) when the quota or the pool has too few pages.

        The page arithmetic runs on the host from the CPU copies (O(tokens of the batch));
        only ``last_loc`` is read on its device. ``num_new_pages`` (SGLang's hint) is
        recomputed, not trusted.
        """
        ps = self.page_size
        prefix = cpu_int64(prefix_lens_cpu)
        seq = cpu_int64(seq_lens_cpu)
        if self.debug_mode:
            assert torch.all((last_loc + 1) % ps == prefix_lens % ps)
        ext = seq - prefix
        n_tok = int(ext.sum())
        if n_tok != int(extend_num_tokens) or (ext < 0).any():
            raise ValueError(
                f"alloc_extend: extend_num_tokens={int(extend_num_tokens)} but seq_lens - "
                f"prefix_lens sums to {n_tok} (min {int(ext.min()) if ext.size else 0})")
        have = (prefix + ps - 1) // ps  # pages each request holds (its last one maybe partly)
        new_per_req = (seq + ps - 1) // ps - have
        total = int(new_per_req.sum())
        pages = self._take(total)
        if pages is None:
            return None
        if n_tok == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        owner = np.repeat(np.arange(prefix.shape[0], dtype=_I64), ext)
        first_tok = np.cumsum(ext) - ext
        local = np.arange(n_tok, dtype=_I64) - first_tok[owner]  # 0.. within the request
        pos = prefix[owner] + local  # the token's position in its sequence
        page_start = (have * ps)[owner]  # first position of the request's first new page
        in_old = pos < page_start
        rank = (np.cumsum(new_per_req) - new_per_req)[owner] + (pos - page_start) // ps
        if total:
            new_slot = pages[np.clip(rank, 0, total - 1)] * ps + pos % ps
        else:
            new_slot = np.zeros(n_tok, dtype=_I64)
        if not in_old.any():
            return self._to_device(new_slot)
        # Old-page slots follow last_loc: base = offset after it, added on last_loc's device.
        packed = self._to_device(np.stack((owner, np.where(in_old, local, new_slot),
                                           in_old.astype(_I64))))
        follow = last_loc.to(torch.int64)[packed[0]] + 1
        return packed[1] + packed[2] * follow

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor | None:
        """One token index per request for its ``seq_lens[i]``-th token: the slot after
        ``last_loc[i]``, or the first slot of a new page when the token starts one. Returns
        int64 indices on ``device``, or None (changing nothing) when the quota or the pool has
        too few pages for the requests that start a page."""
        ps = self.page_size
        seq = cpu_int64(seq_lens_cpu)
        if self.debug_mode:
            assert torch.all((last_loc + 2) % ps == seq_lens % ps)
        starts = (seq - 1) % ps == 0
        total = int(starts.sum())
        pages = self._take(total)
        if pages is None:
            return None
        if total == 0:
            return last_loc.to(torch.int64) + 1
        if total == seq.shape[0]:
            return self._to_device(pages * ps)
        new_slot = np.zeros(seq.shape[0], dtype=_I64)
        new_slot[starts] = pages * ps
        packed = self._to_device(np.stack((new_slot, starts.astype(_I64))))
        return torch.where(packed[1].bool(), packed[0], last_loc.to(torch.int64) + 1)

    # -- frees --------------------------------------------------------------------------------

    def _release(self, pages: np.ndarray) -> None:
        """Give ``pages`` (int64 page ids) back to the page cache and mark them free. Pages not
        in use (or listed twice): AssertionError in debug mode (nothing changes), else a
        warning and only the others are freed."""
        if pages.size == 0:
            return
        self._version += 1
        uniq = np.unique(pages)
        if uniq.size == pages.size:
            try:  # the page cache checks every page is in use (and changes nothing if not)
                self.cache.free(uniq.astype(np.int32))
                return
            except (FailedPrecondition, InvalidArgument):
                ok = self.cache.in_use_of(uniq)
                if ok.all():
                    raise  # not a page of ours at fault: the daemon refused (cache closed)
        else:
            ok = self.cache.in_use_of(uniq)
        bad = uniq[~ok]
        repeated = pages.size - uniq.size
        parts = []
        if bad.size:
            parts.append(f"{bad.size} page(s) not in use {bad[:8].tolist()}"
                         f"{' ...' if bad.size > 8 else ''}")
        if repeated:
            parts.append(f"{repeated} listed more than once")
        what = " and ".join(parts)
        if self.debug_mode:
            raise AssertionError(f"double free in kvpool pool {self.pool_name!r}: {what} "
                                 f"({DEBUG_ENV} is set)")
        log.warning("kvpool pool %r: free of %d page(s): %s; skipped, the rest freed "
                    "(set %s=1 to fail here instead)", self.pool_name, pages.size, what,
                    DEBUG_ENV)
        uniq = uniq[ok]
        if uniq.size:
            self.cache.free(uniq.astype(np.int32))

    def free(self, free_index: torch.Tensor) -> None:
        """Free the pages of these token indices (each page once, however many of its tokens
        are listed): back to the page cache, or held until ``free_group_end`` inside a free
        group."""
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
            return
        self._release(np.unique(cpu_int64(free_index) // self.page_size))

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages (each listed once), or hold them until
        ``free_group_end`` inside a free group."""
        if page_ids.numel() == 0:
            return
        if self.free_group is not None:
            self._page_group.append(page_ids.clone())
            return
        self._release_page_ids(page_ids)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free ``kv_row[start_pos : start_pos + n]`` of one request: its pages are those of
        every ``page_size``-th index (``start_pos`` must be page-aligned; the last page may be
        partly listed and is freed whole)."""
        if free_index.numel() == 0:
            return
        ps = self.page_size
        assert start_pos % ps == 0, f"segment start {start_pos} is not page-aligned"
        pages = free_index[::ps] // ps  # on free_index's device: no copy yet
        if self.debug_mode:
            assert np.array_equal(np.sort(cpu_int64(pages)),
                                  np.unique(cpu_int64(free_index) // ps)), (
                "free_segment: the segment's tokens are not contiguous within its pages")
        self.free_page_ids(pages)

    def free_group_begin(self) -> None:
        """Start holding frees (SGLang frees a batch's pages together); free groups do not
        nest."""
        assert self.free_group is None, "free groups cannot be nested"
        self.free_group = []
        self._page_group = []

    def free_group_end(self) -> None:
        """Free everything held since ``free_group_begin`` in one page-cache free: the pages of
        the token indices (each once) and the page ids, which must not overlap. One copy to
        the host when there are token indices; page ids alone are deferred on CUDA."""
        tokens, self.free_group = self.free_group, None
        page_ids, self._page_group = self._page_group, []
        if not tokens:
            if page_ids:
                self._release_page_ids(torch.cat(page_ids))
            return
        token_pages = torch.cat(tokens).to(torch.int64) // self.page_size
        n_tok = int(token_pages.numel())
        both = cpu_int64(torch.cat([token_pages, *(p.to(token_pages) for p in page_ids)]))
        self._release(np.concatenate((np.unique(both[:n_tok]), both[n_tok:])))

    def clear(self) -> None:
        """Free every page in use (back to the page cache) and drop pending free groups:
        the allocator is empty, its whole quota available. The SWA side of a hybrid SWA pool
        takes its SWA allocator's mapping into the daemon here (its configuration's
        ``on_clear``: ``swa.adopt_mapping``)."""
        if self.config.on_clear is not None:
            self.config.on_clear(self)
        # Deferred frees are among the pages handed out: freed with them, their copies dropped
        # (the pinned blocks stay torch's until the copies are done).
        self._deferred = []
        self._deferred_pages = 0
        pages = self.cache.handed_out()
        if pages.size:
            # After the lease ended (closed or expired) the page cache only unmarks them.
            self.cache.free(pages)
        self.free_group = None
        self._page_group = []

    def resize(self, config: Any) -> None:
        """SGLang re-sized its pools (``config.max_total_num_tokens``): the quota follows,
        checked against the pool's capacity, and every page is freed."""
        num_pages = self._quota_pages(config.max_total_num_tokens)
        self.size = int(config.max_total_num_tokens)
        self.num_pages = num_pages
        self.clear()

    # -- host copies (SGLang's hooks, the KV pool's work) --------------------------------------

    def get_cpu_copy(self, indices: Any, mamba_indices: Any = None,
                     req_pool_index: Any = None) -> Any:
        return self._kvcache.get_cpu_copy(indices, mamba_indices=mamba_indices,
                                          req_pool_index=req_pool_index)

    def load_cpu_copy(self, kv_cache_cpu: Any, indices: Any, mamba_indices: Any = None,
                      req_pool_index: Any = None) -> Any:
        return self._kvcache.load_cpu_copy(kv_cache_cpu, indices, mamba_indices=mamba_indices,
                                           req_pool_index=req_pool_index)

    # -- end ----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """End the allocator. With a binding it made from the environment: close the binding,
        which ends the lease (the daemon takes back every page, in use or cached). With the KV
        pool's binding: return the cached pages (the lease and the pages in use stay the
        binding's). Idempotent; run at interpreter exit for an owned binding. Allocating
        afterwards raises the lease's error."""
        if self._closed:
            return
        with contextlib.suppress(KVPoolError):  # the lease's end takes them anyway
            self._return_deferred(wait=True)
        self._closed = True
        if not self.owns_binding:
            self._close_cache()
            return
        atexit.unregister(self.close)
        try:
            self.binding.close()
        except KVPoolError as err:  # the daemon is gone: the lease expires by itself
            log.warning("kvpool pool %r: closing lease %d failed: %s", self.pool_name,
                        self.lease.lease_id, err)

    def _close_cache(self) -> None:
        """Return the page cache's cached pages to the daemon (the pages in use stay the
        lease's); a failure is logged, not raised (the lease's end takes them anyway)."""
        try:
            self.cache.close()
        except KVPoolError as err:
            log.warning("kvpool pool %r: returning cached pages failed: %s", self.pool_name,
                        err)

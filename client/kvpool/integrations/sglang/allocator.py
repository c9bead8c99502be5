"""kvpool's paged allocator for SGLang: SGLang's ``PagedTokenToKVPoolAllocator`` interface,
with the pages coming from a kvpool lease.

SGLang's scheduler and radix caches ask their ``token_to_kv_pool_allocator`` for token indices
(``alloc``, ``alloc_extend``, ``alloc_decode``) and give them back (``free``, free groups,
``free_segment(s)``, ``free_page_ids``). :class:`PagedAllocator` answers the same calls, with
the same results as SGLang's allocator (which calls succeed, ``available_size`` after each),
but it owns no free list: the pages are ids of the pool's ``kv`` space, held by the
scheduler's lease in the kvpool daemon and served from a client page cache
(``kvpool.cache.page_cache``), so several engines can share one pool and a crashed scheduler's
pages go back to the pool when its lease expires.

- Page ``p`` (``1..capacity``; 0 is never handed out, as in SGLang, whose page 0 is the
  padding page) covers token indices ``p * page_size + j``, ``j < page_size``
  (``token_slots.py``); indices are int64 tensors on ``device``. The inner allocator of the
  SWA side of a hybrid SWA pool takes ``swa`` pages instead: the space is the allocator's own
  configuration (``allocator_config.py``), never read from the ``kvcache`` SGLang passes
  (which may be any object: SGLang's own pools, its tests' mocks).
- ``size`` tokens is the allocator's quota: at most ``size // page_size`` pages in use at
  once; ``available_size()`` is the quota less the pages in use, in tokens, as SGLang counts
  it. The pool may be larger and shared with other leases.
- "Does not fit" is a value: an allocation past the quota returns None without asking
  anyone; one the cache cannot serve makes the page cache's one ``try_alloc`` miss (one
  Allocate; a second for exactly what is missing only when that is under the cache's batch and
  the batch was refused), and when the pool itself refuses, it returns None as SGLang's
  allocator does when out of pages (a warning is logged once), with nothing changed and no
  wait. The one exception: frees still being copied back from the GPU (``device_copies.py``)
  are pages SGLang counts as free, so a refusal waits for those copies and serves from the
  cache what they brought back, without asking the daemon again.
- Where the pool comes from: a kvpool KV pool carries its binding (``kvpool_binding``, see
  ``scheduler_binding.py``) and the allocator uses that binding's lease (not closing it); given
  any other KV pool the allocator makes a binding from the environment (``KVPOOL_POOL``,
  ``KVPOOL_TARGET``, ...) and owns it: :meth:`PagedAllocator.close`, also run at interpreter
  exit, ends that lease and the daemon takes every page back.

Frees go straight back to the page cache, so ``need_sort`` changes nothing observable
(``merge_and_sort_free`` has nothing to do); free groups still hold their frees until
``free_group_end``, as SGLang's do, so ``available_size`` moves at the same points. Double
frees: ``page_frees.py``. Host-device copies and which calls synchronize:
``device_copies.py`` (``tests/gpu/test_sglang_sync.py`` counts both allocators'). Elastic
pools (``docs/sglang.md``, "Elastic pools"): ``elastic_upkeep.py``, deciding by
``grow_plan.py``.

Importing this module imports SGLang (the ``kvpool[sglang]`` extra); ``import kvpool`` never
does.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

from kvpool.cache.page_cache import PageCache
from kvpool.cache.policy import DEFAULT_HIGH, space_capacity
from kvpool.contract.errors import InvalidArgument, KVPoolError
from kvpool.contract.records import Stats
from kvpool.integrations.sglang.allocator_config import CONFIGS
from kvpool.integrations.sglang.device_copies import DeviceCopies, cpu_int64
from kvpool.integrations.sglang.elastic_scheduler import tree_tokens
from kvpool.integrations.sglang.elastic_upkeep import ElasticUpkeep
from kvpool.integrations.sglang.grow_plan import available_tokens, live_tokens
from kvpool.integrations.sglang.page_frees import PageFrees, debug_memory_pool
from kvpool.integrations.sglang.scheduler_binding import PoolBinding, binding_from_env, binding_of
from kvpool.integrations.sglang.seal_settings import (
    ADOPT_ENV,
    SEAL_ENV,
    SealSettings,
    sealing_layout,
)
from kvpool.integrations.sglang.sealer import Sealer
from kvpool.integrations.sglang.token_slots import (
    decode_starts,
    extend_new_pages,
    extend_slots,
    page_tokens,
)

log = logging.getLogger("kvpool.integrations.sglang.allocator")

_I64 = np.int64
# How long the constructor waits for a fixed pool's page cache to fill (a refused fill ends
# the wait at once).
FIRST_FILL_S = 5.0


def check_page_size(page_size: int, pool_page_size: int, pool: str) -> None:
    """Refuse SGLang's page size unless it is the pool's.

    Raises:
        InvalidArgument: naming both and the knobs.
    """
    if page_size != pool_page_size:
        raise InvalidArgument(
            f"SGLang's page size {page_size} (--page-size) differs from kvpool pool "
            f"{pool!r}'s page size {pool_page_size}: run SGLang with --page-size "
            f"{pool_page_size}, or configure the pool with page_size={page_size}",
            field="page_size")


def quota_pages(size: int, page_size: int, capacity: int, pool: str, space: str) -> int:
    """The quota in pages of ``size`` tokens.

    Raises:
        InvalidArgument: more pages than the pool's ``capacity`` (naming both and the knobs).
    """
    pages = int(size) // page_size
    if pages > capacity:
        raise InvalidArgument(
            f"SGLang asked for {int(size)} tokens ({pages} pages of {page_size}) but kvpool "
            f"pool {pool!r} holds {capacity} {space} pages ({capacity * page_size} tokens): "
            "lower --max-total-tokens, or configure the pool with a larger budget_bytes / "
            "max_total_tokens", field="max_total_tokens")
    return pages


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
        cache: the page cache of the pool's space that serves them.
        binding: the scheduler's :class:`PoolBinding`.
        config: what the code that built ``kvcache`` recorded for its allocator
            (``allocator_config.CONFIGS``; the defaults for any other ``kvcache``).
        space: the id space the pages are taken from (``kv``, or ``swa``).
        num_pages: the quota in pages (SGLang's name).
        capacity: the pool's capacity in pages of ``space``.
        elastic: the :class:`ElasticUpkeep` of an elastic pool, else None.

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
        self.config = CONFIGS.of(kvcache)
        binding = binding_of(kvcache)
        self.owns_binding = binding is None
        self.binding: PoolBinding = binding_from_env() if binding is None else binding
        self.pool_name = self.binding.pool
        self._closed = False
        self._takes = 0  # allocations made (see ``version``)
        self.elastic: ElasticUpkeep | None = None
        try:
            stats = self.binding.client.stats(self.pool_name)
            self.space: str = self.config.space
            self.capacity = space_capacity(stats, self.pool_name, self.space)
            check_page_size(page_size, stats.pool(self.pool_name).page_size, self.pool_name)
            self.num_pages = quota_pages(size, page_size, self.capacity, self.pool_name,
                                         self.space)
            self.lease = self.binding.lease
            self.sealer: Sealer | None = self._make_sealer(kvcache, stats, page_size, device)
            # Adopted pages are taken before the page cache's first fill: an Allocate short of
            # free pages would make the directory give back its oldest (the chains' roots).
            held = None if self.sealer is None else self.sealer.adopt_startup(self.num_pages)
            self.cache: PageCache = self._open_cache(stats, held)
            if self.sealer is not None:
                self.sealer.bind(self.cache)
        except BaseException:
            if getattr(self, "sealer", None) is not None:
                self.sealer.close()
            if self.owns_binding:
                self.binding.close()
            raise
        self._page_group: list[torch.Tensor] = []
        self._short_warned = False
        # Page-id frees on CUDA copy back without waiting; not for elastic pools (their idle
        # checks count the pages themselves) nor in debug mode (its checks synchronize).
        self.copies = DeviceCopies(device, defer=not self.debug_mode and self.elastic is None)
        self.frees = PageFrees(self.cache, self.copies, page_size=page_size,
                               debug=self.debug_mode, pool=self.pool_name, sealer=self.sealer)
        # The binding's close returns the cached pages before it ends the lease (which would
        # otherwise take them from under the open cache, and log that it did).
        self.binding.on_close(self._close_cache)
        if self.owns_binding:
            atexit.register(self.close)
        self._clear(keep_adopted=True)

    # -- setup --------------------------------------------------------------------------------

    def _make_sealer(self, kvcache: Any, stats: Stats, page_size: int,
                     device: Any) -> Sealer | None:
        """The sealing and adoption of this allocator's pages (``sealer.py``), or None
        (off, or a pool it does not cover: the reason is logged once)."""
        settings = SealSettings.from_env()
        if not (settings.seal or settings.adopt):
            log.info("kvpool pool %r: sealing and adoption off (%s=0, %s=0)", self.pool_name,
                     SEAL_ENV, ADOPT_ENV)
            return None
        spaces = set(stats.pool(self.pool_name).spaces)
        why = None
        if stats.pool(self.pool_name).elastic is not None:
            why = "an elastic pool (the daemon seals there; this plugin does not yet)"
        elif self.space != "kv" or "swa" in spaces or self.config.on_clear is not None:
            why = "a hybrid sliding-window pool (its pages have SWA pages beside them)"
        elif getattr(kvcache, "mamba_pool", None) is not None or "state" in spaces:
            why = "a hybrid linear pool (the mamba state is not in the pages)"
        layout = ""
        if why is None:
            try:
                layout, why = sealing_layout(page_size)
            except (ImportError, ValueError, AttributeError) as err:  # no published context
                why = f"SGLang's settings are not published here ({err})"
        if why is not None:
            if self.space == "kv":
                log.info("kvpool pool %r: no sealing or adoption: %s", self.pool_name, why)
            return None
        log.info("kvpool pool %r: sealing %s, adoption %s; layout %r", self.pool_name,
                 "on" if settings.seal else f"off ({SEAL_ENV}=0)",
                 "on" if settings.adopt else f"off ({ADOPT_ENV}=0)", layout)
        return Sealer(lease=self.lease, pool=self.pool_name, capacity=self.capacity,
                      page_size=page_size, device=device, layout=layout, settings=settings)

    def _step(self, tree_cache: Any, *, admission: bool = False) -> None:
        """Between scheduler steps: the sealer's work (``sealer.Sealer.step``)."""
        if self.sealer is not None and not self._closed:
            self.sealer.step(tree_cache, self.num_pages - self.pages_in_use,
                             admission=admission)

    def _open_cache(self, stats: Stats, held: np.ndarray | None = None) -> PageCache:
        """The page cache: an elastic pool's keeps every page it fetched, has no worker and
        grows on demand (``elastic_upkeep.py``). A fixed pool's has a worker that refills and
        returns around its watermarks; its first fill lands before the allocator is used (at
        startup, not in a step: an allocation racing it could be refused for the pages it is
        fetching)."""
        e = stats.pool(self.pool_name).elastic
        if e is None:
            high = max(1, min(DEFAULT_HIGH, self.capacity // 4, self.num_pages))
            cache = self.lease.page_cache(self.pool_name, self.space, high=high, held=held)
            cache.settle(FIRST_FILL_S)
            return cache
        # Page ids 1..capacity and the padding page 0 fill the groups.
        per_group = (self.capacity + 1) // max(1, e.groups)
        self.elastic = upkeep = ElasticUpkeep(self, per_group)
        cache = self.lease.page_cache(
            self.pool_name, self.space, low=0, high=self.capacity,
            batch=max(1, min(self.capacity, per_group // 2)), background=False, fill=False)
        # The daemon's give-backs reach the radix tree's unreferenced pages too.
        cache.set_evictor(upkeep.evict_tree)
        return cache

    # -- state --------------------------------------------------------------------------------

    @property
    def pages_in_use(self) -> int:
        """Pages handed out by this allocator and not freed (free groups' pending frees
        included; frees whose copy to the host is in flight are freed)."""
        return self.cache.core.in_use - self.copies.pending_pages

    @property
    def version(self) -> int:
        """Moves with every allocation and free (the elastic idle check runs when it did)."""
        return self._takes + self.frees.count

    def available_size(self) -> int:
        """Tokens the allocator may still hand out: (quota pages - pages in use) * page_size,
        as SGLang counts its free (and staged) pages; free groups' pending frees are in use.
        Elastic pools: the live size, except at rest (``grow_plan.available_tokens``)."""
        e = self.elastic
        # Adopted pages not yet in the radix tree (until SGLang's first admission) count as
        # free, so SGLang's idle identity holds before they are the tree's.
        unplaced = 0 if self.sealer is None else self.sealer.unplaced
        return available_tokens(
            quota_pages=self.num_pages, in_use=self.pages_in_use - unplaced,
            cached=self.cache.core.cached,
            page_size=self.page_size, elastic=e is not None,
            tree_tokens=0 if e is None else tree_tokens(e.tree))

    def live_available_size(self) -> int:
        """Tokens the allocator can hand out now without asking the daemon: for an elastic
        pool the pages its cache holds unused, within the quota; else :meth:`available_size`."""
        if self.elastic is None:
            return self.available_size()
        return live_tokens(quota_pages=self.num_pages, in_use=self.pages_in_use,
                           cached=self.cache.core.cached, page_size=self.page_size)

    # -- elastic pools: SGLang's capacity hooks (elastic_upkeep.py) ----------------------------

    def grow(self, pages: int) -> int:
        """Pages fetched into an elastic pool's cache for ``pages`` more (0: fixed pool)."""
        return 0 if self.elastic is None else self.elastic.grow(pages)

    def admitted(self) -> None:
        """The current admission admitted a request (the live prefill budget says so)."""
        if self.elastic is not None:
            self.elastic.admission = "admitted"

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0
                              ) -> Any:
        """SGLang's admission budget; over an elastic pool it counts the live free size. An
        admission starts a step: the sealer's work runs first (adopted pages go into the tree
        before any request is matched for this admission)."""
        self._step(tree_cache, admission=True)
        if self.elastic is None:
            return super().create_prefill_budget(
                tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)
        return self.elastic.prefill_budget(tree_cache, num_mixed_decode_tokens)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> bool | None:
        """SGLang's eviction before an allocation, against the live free size (elastic)."""
        if self.elastic is None:
            return super().evict_to_free_tokens(tree_cache, num_tokens)
        self.elastic.evict_to_free_tokens(tree_cache, num_tokens)
        return None

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests: Any = None,
                              spec_algorithm: Any = None) -> bool:
        """Whether the next decode step's ``num_tokens`` fit (elastic: after the upkeep,
        eviction and growth; False makes SGLang retract, as on a full pool)."""
        self._step(tree_cache)
        if self.elastic is None:
            return super().check_decode_capacity(num_tokens=num_tokens, tree_cache=tree_cache,
                                                 requests=requests,
                                                 spec_algorithm=spec_algorithm)
        return self.elastic.check_decode_capacity(num_tokens, tree_cache)

    def verify_byte_accounting(self) -> list[str]:
        """SGLang's idle diagnostic: an elastic pool's conservation check (SGLang reports).
        Idle is between steps: the sealer seals what the last ones added."""
        self._step(None)
        return [] if self.elastic is None else self.elastic.verify()

    def get_all_free_pages(self) -> None:
        """None: no free list here (the pool's free pages are the daemon's); SGLang skips."""
        return None

    def merge_and_sort_free(self) -> None:
        """Nothing to do: frees go straight back to the page cache."""

    def debug_print(self) -> str:
        return (f"kvpool pool={self.pool_name} lease={self.lease.lease_id} "
                f"in_use={self.pages_in_use}/{self.num_pages} pages")

    def __repr__(self) -> str:
        return (f"PagedAllocator(pool={self.pool_name!r}, page_size={self.page_size}, "
                f"quota={self.num_pages} pages, in_use={self.pages_in_use}, "
                f"lease={self.lease.lease_id}, device={self.device})")

    # -- allocation ---------------------------------------------------------------------------

    def _take(self, n: int) -> np.ndarray | None:
        """``n`` pages (int64) from the page cache, marked in use; None, changing nothing,
        when the quota or the pool cannot give that many (see the module docstring)."""
        if n > self.num_pages - self.pages_in_use:
            return None
        self._takes += 1
        if n == 0:
            return np.empty(0, dtype=_I64)
        self.frees.return_copied(wait=False)
        cache = self.cache
        ids = cache.try_alloc(n)
        if ids is None and self.copies.pending_pages:
            # The pool ran short while frees were still copying back: pages SGLang counts as
            # free, which only this cache can get back (no second Allocate).
            self.frees.return_copied(wait=True)
            if cache.core.cached >= n:
                ids = cache.try_alloc(n)
        if ids is None and cache.core.returning:  # pages on their way back: wait for that
            cache.settle()  # fact (the return's reply) and ask once more: SGLang expects pages
            ids = cache.try_alloc(n)
        if ids is None and self.sealer is not None and self.sealer.worker.busy:
            # Sealed pages SGLang freed are still this lease's until the sealer's worker frees
            # them (batched): make those Frees now, then ask once more (the daemon's directory
            # gives them back when the pool is short).
            self.sealer.worker.flush()
            ids = cache.try_alloc(n)
        if ids is None:
            if not self._short_warned:
                self._short_warned = True
                log.warning("kvpool pool %r ran short before this allocator's quota (%d of %d "
                            "pages in use, asked %d more, the pool refused): the allocation "
                            "fails as if out of memory", self.pool_name, self.pages_in_use,
                            self.num_pages, n)
            return None
        return ids.astype(_I64)

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
        return self.copies.to_device(page_tokens(pages, self.page_size))

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                     seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor, extend_num_tokens: int,
                     num_new_pages: int | None = None) -> torch.Tensor | None:
        """Token indices for extending each request ``i`` from ``prefix_lens[i]`` to
        ``seq_lens[i]`` tokens: the rest of its current page (after ``last_loc[i]``), then new
        pages, one page-cache allocation for the whole batch. Returns ``extend_num_tokens``
        int64 indices on ``device``, request after request, or None (changing nothing) when
        the quota or the pool has too few pages. The page arithmetic runs on the host from the
        CPU copies (``token_slots.py``); only ``last_loc`` is read on its device.
        ``num_new_pages`` (SGLang's hint) is recomputed, not trusted."""
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
        pages = self._take(int(extend_new_pages(prefix, seq, ps)[1].sum()))
        if pages is None:
            return None
        if n_tok == 0:
            return self.copies.empty()
        return self.copies.extend_indices(extend_slots(prefix, seq, pages, ps), last_loc)

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
        starts = decode_starts(seq, ps)
        pages = self._take(int(starts.sum()))
        if pages is None:
            return None
        return self.copies.decode_indices(pages * ps, starts, last_loc)

    # -- frees --------------------------------------------------------------------------------

    def free(self, free_index: torch.Tensor) -> None:
        """Free the pages of these token indices (each page once, however many of its tokens
        are listed): back to the page cache, or held until ``free_group_end`` inside a free
        group."""
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
            return
        self.frees.tokens(free_index)

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages (each listed once), or hold them until
        ``free_group_end`` inside a free group."""
        if page_ids.numel() == 0:
            return
        if self.free_group is not None:
            self._page_group.append(page_ids.clone())
            return
        self.frees.page_ids(page_ids)

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
        self.frees.group(tokens, page_ids)

    def clear(self) -> None:
        """Free every page in use (back to the page cache; sealed pages to the daemon) and
        drop pending free groups: the allocator is empty, its whole quota available. The SWA
        side of a hybrid SWA pool takes its SWA allocator's mapping into the daemon here (its
        configuration's ``on_clear``: ``swa.adopt_mapping``)."""
        self._clear(keep_adopted=False)

    def _clear(self, *, keep_adopted: bool) -> None:
        """``clear``; the constructor's keeps the adopted pages it holds for the tree."""
        if self.config.on_clear is not None:
            self.config.on_clear(self)
        # Deferred frees are among the pages handed out: freed with them.
        self.copies.drop()
        pages = self.cache.core.handed_out()
        if self.sealer is not None:
            if keep_adopted:
                pages = pages[~self.sealer.sealed.take(pages, mode="clip")]
            else:
                self.sealer.forget_adopted()
                pages = self.sealer.freed(pages.astype(np.int64)).astype(np.int32)
        if pages.size:
            # After the lease ended (closed or expired) the page cache only unmarks them.
            self.cache.free(pages)
        self.free_group = None
        self._page_group = []

    def resize(self, config: Any) -> None:
        """SGLang re-sized its pools (``config.max_total_num_tokens``): the quota follows,
        checked against the pool's capacity, and every page is freed."""
        num_pages = quota_pages(config.max_total_num_tokens, self.page_size, self.capacity,
                                self.pool_name, self.space)
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
            self.frees.return_copied(wait=True)
        self._closed = True
        if self.sealer is not None:
            self.sealer.close()
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


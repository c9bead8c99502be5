"""The paged allocator over an elastic pool: its page cache's growth and upkeep, SGLang's
capacity hooks and the idle check, carrying out the decisions of ``grow_plan.py``.

The page cache keeps every page it fetched (no high watermark, no return on free) and runs
without a worker thread: its upkeep (the give-backs the daemon asks for) runs only between
scheduler steps (when SGLang starts an admission or a decode check, and at idle), never
between a capacity check and its allocation (SGLang also frees inside a step, so frees run
no upkeep). The cache grows ahead of need, to ``low_pages`` between steps, and by what a
request lacks when SGLang's admission or decode check finds it short; each growth is one
Allocate (``grow_plan.grow_ask``), and a refusal holds growth off (``grow_plan.Backoff``)
while the daemon grants or reclaims groups on its own: SGLang's request waits, or decode
retracts, and the next step asks again.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.contract.errors import KVPoolError
from kvpool.integrations.sglang.elastic_scheduler import (
    conservation_violations,
    live_prefill_budget,
    tree_tokens,
)
from kvpool.integrations.sglang.grow_plan import (
    Backoff,
    decode_growth,
    evictable_pages,
    grow_ask,
    upkeep_growth,
)

if TYPE_CHECKING:
    from kvpool.integrations.sglang.allocator import PagedAllocator

log = logging.getLogger("kvpool.integrations.sglang.allocator")


class ElasticUpkeep:
    """What the allocator does for an elastic pool (see the module docstring).

    Args:
        allocator: the allocator whose counts it reads and whose cache it grows.
        pages_per_group: the pool's group length in pages.
    """

    def __init__(self, allocator: PagedAllocator, pages_per_group: int) -> None:
        self.allocator = allocator
        self.pages_per_group = pages_per_group
        # What the cache keeps ahead between steps: half a group, within the quota.
        self.low_pages = min(allocator.num_pages, max(1, pages_per_group // 2))
        self.backoff = Backoff()
        # SGLang's radix tree (it passes it to the capacity hooks).
        self.tree: Any = None
        # The allocation state the last idle check passed, and the last admission's outcome
        # (none yet, "refused" or "admitted").
        self.checked: tuple[int, int] | None = None
        self.admission = "none"

    # -- carrying out the plan ---------------------------------------------------------------

    def grow(self, pages: int) -> int:
        """Fetch at least ``pages`` more pages into the cache: one Allocate of
        ``grow_plan.grow_ask`` pages, or none while held off or at the quota.

        Returns:
            The pages fetched (0: refused, held off, at the quota, or the lease is gone: the
            next allocation says so).
        """
        a = self.allocator
        if a.closed:
            return 0
        cache = a.cache
        now = time.monotonic()
        had = cache.cached
        ask = grow_ask(int(pages), quota_pages=a.num_pages, in_use=a.pages_in_use, cached=had,
                       batch=cache.batch, now=now, backoff=self.backoff)
        if ask == 0:
            return 0
        try:
            ids = cache.try_alloc(had + ask)
        except KVPoolError as err:  # the lease or pool is gone: the allocations raise it
            log.warning("kvpool pool %r: growth failed: %s", a.pool_name, err)
            return 0
        if ids is None:
            self.backoff = self.backoff.refused(now)
            log.debug("kvpool pool %r: growth by %d pages refused; asked again after %.2f s",
                      a.pool_name, ask, self.backoff.at - now)
            return 0
        cache.free(ids)  # into the cache: held by the lease, unused
        self.backoff = self.backoff.granted()
        log.debug("kvpool pool %r: grew its cache %d -> %d pages (%d in use)", a.pool_name,
                  had, cache.cached, a.pages_in_use)
        return int(cache.cached - had)

    def upkeep(self) -> None:
        """Between scheduler steps: report the radix tree's evictable pages, run the page
        cache's give-backs (the daemon's shrink asks), then grow to ``low_pages``."""
        a = self.allocator
        if a.closed:
            return
        cache = a.cache
        tree = self.tree
        if tree is not None:
            n = evictable_pages(int(tree.evictable_size()), a.page_size,
                                prefix_sharing=bool(tree.supports_prefix_sharing()))
            if n is not None:
                cache.set_evictable(n)
        try:
            cache.maintain()
        except KVPoolError as err:
            log.warning("kvpool pool %r: page cache upkeep failed: %s", a.pool_name, err)
        self.grow(upkeep_growth(cached=cache.cached, low_pages=self.low_pages))

    def evict_tree(self, pages: int) -> None:
        """The page cache's evictor: a give-back asked for ``pages`` more than the cache holds
        unused, so the radix tree evicts that many pages of its least recently used entries
        (SGLang frees them through the allocator, into the cache, which gives them back)."""
        tree = self.tree
        if tree is None or pages <= 0:
            return
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        tree.evict(EvictParams(num_tokens=int(pages) * self.allocator.page_size))
        log.info("kvpool pool %r: the radix tree evicted %d pages for the daemon's give-back",
                 self.allocator.pool_name, pages)

    # -- SGLang's capacity hooks -------------------------------------------------------------

    def prefill_budget(self, tree_cache: Any, num_mixed_decode_tokens: int) -> Any:
        """SGLang's admission budget over the live free size; the upkeep runs first (an
        admission starts a step), after growing by a batch when the last admission (SGLang
        makes one only with requests waiting) admitted none."""
        self.tree = tree_cache
        if self.admission == "refused":
            self.grow(self.allocator.cache.batch)
        self.upkeep()
        self.admission = "refused"  # until the budget admits a request
        return live_prefill_budget()(self.allocator, tree_cache,
                                     num_mixed_decode_tokens=num_mixed_decode_tokens)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> None:
        """SGLang's eviction before an allocation, against the live free size."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.tree = tree_cache
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        shortfall = int(num_tokens) - self.allocator.live_available_size()
        if shortfall > 0:
            tree_cache.evict_for_alloc(EvictParams(num_tokens=shortfall))

    def check_decode_capacity(self, num_tokens: int, tree_cache: Any) -> bool:
        """Whether the next decode step's ``num_tokens`` fit: the upkeep runs, the radix cache
        is evicted, then the cache grows by what is still missing (False: SGLang retracts)."""
        a = self.allocator
        self.tree = tree_cache
        self.upkeep()
        self.evict_to_free_tokens(tree_cache, num_tokens)
        self.grow(decode_growth(num_tokens, live=a.live_available_size(),
                                page_size=a.page_size))
        return a.live_available_size() >= int(num_tokens)

    def verify(self) -> list[str]:
        """SGLang's idle diagnostic: the upkeep runs (idle is between steps), then the
        conservation check (``elastic_scheduler.conservation_violations``) whenever the
        allocation state changed since the last one passed."""
        a = self.allocator
        if a.closed:
            return []
        self.upkeep()
        state = (a.version, tree_tokens(self.tree))
        if state == self.checked:
            return []
        try:
            held = a.lease.client.stats(a.pool_name)
            lease = next((x for x in held.leases if x.lease_id == a.lease.lease_id), None)
            lease_held = None if lease is None else lease.held.get(a.pool_name, {}).get(
                a.space, 0)
        except KVPoolError as err:
            log.warning("kvpool pool %r: Stats for the idle check failed: %s",
                        a.pool_name, err)
            lease_held = None
        out = conservation_violations(
            pool=a.pool_name, page_size=a.page_size,
            in_use=a.cache.handed_out().astype(np.int64), cached=a.cache.cached,
            tree=self.tree, lease_held=lease_held)
        if not out:
            self.checked = state
        return out


__all__ = ["ElasticUpkeep"]

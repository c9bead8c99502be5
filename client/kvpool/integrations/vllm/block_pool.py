"""kvpool's block pool for vLLM 0.32: vLLM's ``BlockPool``, with the free blocks coming from a
kvpool lease through a page cache (``kvpool.cache.page_cache``).

vLLM's scheduler asks its block pool for new blocks (``get_new_blocks``), frees them
(``free_blocks``), hits cached ones (``get_cached_block`` + ``touch``), caches full ones
(``cache_full_blocks``), evicts (``evict_blocks``) and resets the prefix cache
(``reset_prefix_cache``), and checks ``get_num_free_blocks()`` before it allocates.
:class:`KVPoolBlockPool` answers the same calls with the same results, but the blocks that no
one uses and that hold no prefix are not the engine's: they are pages of the pool's ``kv``
space, in the daemon or in the engine's page cache, and other engines may take them.

- Block id == page id of the pool's ``kv`` space. vLLM's block 0 is its null block, never
  handed out; the daemon reserves page 0 the same way, so the space's ids are ``1..N-1`` for
  vLLM's ``N`` blocks: a pool whose ``kv`` capacity is not ``num_gpu_blocks - 1`` is refused.
- vLLM's free queue keeps two kinds of free block: ones freed without a prefix hash (it puts
  them at the front, to be reused first) and ones that hold a prefix (at the back, in LRU
  order, reused, and so evicted, only when the first kind runs out). Here the first kind goes
  back to the page cache at once; the free queue holds only the second kind (and blocks
  released with ``unpin_blocks``, which vLLM also puts at the back), and they stay held by the
  lease until vLLM evicts or reuses them. ``get_new_blocks`` takes from the page cache first,
  then from the front of the queue, evicting what it takes: the blocks vLLM would evict, in
  the same order, so prefix hits are the same. A block whose hash is dropped while it sits in
  the queue (``evict_blocks``) stays there, as in vLLM; ``reset_prefix_cache`` (which
  succeeds only when no block is in use) returns the whole queue to the page cache.
- ``get_num_free_blocks()`` = what the lease may still take (the quota, ``N - 1`` blocks,
  less the blocks it holds) + the queue. With the engine as the pool's only user this is
  vLLM's own count, call for call. When other leases share the pool and take pages first,
  ``get_new_blocks`` takes what the page cache still holds, then evicts from the queue; if
  that is still short it raises vLLM's own ``ValueError`` (which vLLM does not expect after
  its check) naming the pool, and until :meth:`KVPoolBlockPool.new_step` the pool counts only
  the pages it holds, so the scheduler's next checks refuse instead. Size the engines'
  pools so that they fit, or give each its own pool.
- Hot path: the page cache serves ``alloc``/``free`` locally; the scheduler opens it with no
  worker thread and no watermarks (it keeps every block it fetched, an eighth of the pool a
  miss, and gives back only what the daemon asks for), so once warm no call or step makes an
  RPC; ``get_num_free_blocks`` reads two counters.
- Reuse watchers (``unpin_blocks``' ``on_reuse``): vLLM calls one when it hands the block out
  again; here a block that goes back to the page cache may be handed to another engine at any
  time, so its watcher is called when it goes back.
- ``touch`` of a block that is neither in use nor in the queue (one of the page cache's, which
  vLLM's scheduler never hits: it holds no prefix) raises ``FailedPrecondition``.

Importing this module imports vLLM (the ``kvpool[vllm]`` extra); ``import kvpool`` never does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvpool.cache.page_cache import PageCache
from kvpool.contract.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("kvpool.integrations.vllm.block_pool")

SPACE = "kv"


def check_capacity(num_gpu_blocks: int, capacity: int, pool: str) -> None:
    """vLLM's ``num_gpu_blocks`` (the null block 0 included) must be the pool's ``kv`` ids
    ``1..capacity`` plus page 0.

    Raises:
        InvalidArgument: they differ (both numbers and the fix are named).
    """
    if capacity != num_gpu_blocks - 1:
        raise InvalidArgument(
            f"vLLM's KV cache has {num_gpu_blocks} blocks (block 0 is its null block, so "
            f"{num_gpu_blocks - 1} to hand out) but kvpool pool {pool!r} has {capacity} "
            f"{SPACE} pages (ids 1..{capacity}): configure the pool with "
            f"{num_gpu_blocks - 1} {SPACE} pages (max_total_tokens = "
            f"{num_gpu_blocks - 1} * block size), or run vLLM with "
            f"num_gpu_blocks_override={capacity + 1}", field="num_gpu_blocks")


class KVPoolBlockPool(BlockPool):
    """vLLM's ``BlockPool`` over a kvpool page cache; see the module docstring.

    Args (beside vLLM's): cache: the page cache of the pool's ``kv`` space, held by the
        engine's lease (the block pool frees into it; :meth:`close` closes it).

    Raises:
        InvalidArgument: the cache's capacity is not ``num_gpu_blocks - 1``.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False, metrics_collector: Any = None,
                 medium: str | None = None, *, cache: PageCache) -> None:
        check_capacity(num_gpu_blocks, int(cache.core.capacity), str(cache.core.pool))
        kwargs: dict[str, Any] = {} if medium is None else {"medium": medium}
        super().__init__(num_gpu_blocks, enable_caching, hash_block_size,
                         enable_kv_cache_events, metrics_collector, **kwargs)
        self.cache = cache
        self.pool_name = str(cache.core.pool)
        # The blocks the lease may hold at once: all but the null block.
        self.quota = num_gpu_blocks - 1
        # vLLM's queue starts with every block; here it starts empty (the blocks are the
        # pool's) and holds only free blocks the lease keeps (prefix-cached, unpinned).
        for block in self.blocks:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = FreeKVCacheBlockQueue([])
        # The pool ran short of what the quota promised (another lease took the pages):
        # until new_step, count only what the lease holds.
        self.short = False
        self._short_warned = False
        self._closed = False

    # -- counts -------------------------------------------------------------------------------

    @property
    def held_free(self) -> int:
        """Free blocks the lease keeps (the queue: prefix-cached and unpinned blocks)."""
        return self.free_block_queue.num_free_blocks

    @property
    def blocks_in_use(self) -> int:
        """Blocks handed out and referenced (the null block not counted)."""
        return self.cache.core.in_use - self.free_block_queue.num_free_blocks

    def _can_take(self) -> int:
        """Blocks the lease may still take from the pool: the quota less what it holds (after
        a shortage, what its page cache holds)."""
        room = self.quota - self.cache.core.in_use
        if self.short:
            room = min(room, self.cache.core.cached)
        return max(0, room)

    def get_num_free_blocks(self) -> int:
        """Blocks the engine can get: what the lease may still take + the queue."""
        return self._can_take() + self.free_block_queue.num_free_blocks

    def new_step(self) -> None:
        """Between scheduler steps: forget a shortage (the pages may be back), and do the page
        cache's upkeep when it has no worker thread."""
        self.short = False
        if not self.cache.background and not self._closed:
            self.cache.maintain()

    # -- the calls vLLM makes -----------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """``num_blocks`` blocks: from the page cache first, then from the front of the queue
        (evicting their prefixes), as vLLM takes uncached free blocks before cached ones.

        Raises:
            ValueError: fewer free blocks than asked (vLLM's error; see the module docstring
                for a pool that ran short).
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        take = min(num_blocks, self._can_take())
        ids = self._take(take) if take else None
        got = 0 if ids is None else int(ids.shape[0])
        rest = num_blocks - got
        if rest > self.free_block_queue.num_free_blocks:
            if ids is not None and got:
                self._free_ids(ids)
            raise ValueError(
                f"Cannot get {num_blocks} free blocks from the pool: kvpool pool "
                f"{self.pool_name!r} ran short (other leases hold its pages); the engine "
                f"holds {self.cache.core.in_use} of its {self.quota} blocks")
        blocks = self.blocks
        ret: list[KVCacheBlock] = [] if ids is None else [blocks[i] for i in ids.tolist()]
        if rest:
            ret.extend(self.free_block_queue.popleft_n(rest))
        if self._reuse_watchers:
            self._notify_reuse(ret)
        collector = self.metrics_collector
        if self.enable_caching:
            for block in ret:
                self._maybe_evict_cached_block(block)
                assert block.ref_cnt == 0
                block.ref_cnt += 1
                if collector:
                    collector.on_block_allocated(block)
        else:
            for block in ret:
                assert block.ref_cnt == 0
                block.ref_cnt += 1
                if collector:
                    collector.on_block_allocated(block)
        return ret

    def _take(self, n: int) -> np.ndarray | None:
        """Up to ``n`` ids from the page cache: ``n``, or after the daemon refused them what
        the cache still holds (the pool is then short until :meth:`new_step`)."""
        ids = self.cache.try_alloc(n)
        if ids is not None:
            return ids
        self.short = True
        if not self._short_warned:
            self._short_warned = True
            log.warning("kvpool pool %r ran short of what the engine's quota promised (%d "
                        "blocks; other leases hold its pages): %d asked, %d in the cache",
                        self.pool_name, self.quota, n, self.cache.core.cached)
        have = min(n, int(self.cache.core.cached))
        return self.cache.try_alloc(have) if have else None

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference from each block; a block no one references goes back to the page
        cache when it holds no prefix (or prefix caching is off), else to the back of the
        queue (held, evicted last-in last), as in vLLM."""
        to_cache: list[int] = []
        evict_last: list[KVCacheBlock] = []
        other_pools: dict[BlockPool, list[KVCacheBlock]] = {}
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.pool is not None and block.pool is not self:
                other_pools.setdefault(block.pool, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if block.block_hash is None or not caching:
                    to_cache.append(block.block_id)
                else:
                    evict_last.append(block)
        self.free_block_queue.append_n(evict_last)
        if to_cache:
            self._release(to_cache)
        for pool, blocks in other_pools.items():
            pool.free_blocks(blocks)

    def _release(self, block_ids: list[int]) -> None:
        """Give blocks no one uses back to the page cache (their watchers first)."""
        if self._reuse_watchers:
            self._notify_reuse(self.blocks[i] for i in block_ids)
        self._free_ids(np.asarray(block_ids, dtype=np.int32))

    def _free_ids(self, ids: np.ndarray) -> None:
        if self._closed:
            return  # the lease's end takes them
        self.cache.free(ids)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix hit: reference each block; a free one leaves the queue.

        Raises:
            FailedPrecondition: a block that is free and not the lease's (see the module
                docstring); nothing is changed.
        """
        for block in blocks:
            if (block.ref_cnt == 0 and not block.is_null and block.prev_free_block is None
                    and block.pool is self):
                raise FailedPrecondition(
                    f"vLLM touched block {block.block_id}, which is free and back in kvpool "
                    f"pool {self.pool_name!r} (it holds no prefix, so no hit can reach it)",
                    field="block_id")
        super().touch(blocks)

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset (only when no block is in use); then the queue, whose blocks hold no
        prefix any more, goes back to the page cache."""
        if self.blocks_in_use == 0:
            self.short = False  # vLLM's check counts free blocks: count them all
        if not super().reset_prefix_cache():
            return False
        n = self.free_block_queue.num_free_blocks
        if n:
            ids = [b.block_id for b in self.free_block_queue.popleft_n(n)]
            self._free_ids(np.asarray(ids, dtype=np.int32))
        return True

    # -- end ----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Return the page cache's unused pages to the daemon; the blocks in use and the
        queue's stay the lease's until it ends (the binding's close). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.cache.close()

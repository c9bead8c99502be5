"""vLLM 0.32's own ``BlockPool`` with its free blocks from a kvpool lease: kvpool supplies the
pool's free-block queue (:class:`KVPoolFreeBlockQueue`), vLLM's code does the rest.

The seam. vLLM's ``BlockPool`` takes and returns block ids only through its free-block queue
(``vllm/v1/core/block_pool.py``): ``get_new_blocks`` pops ``free_block_queue.popleft_n(n)``
after checking ``get_num_free_blocks()`` (= ``free_block_queue.num_free_blocks``);
``free_blocks`` puts the blocks no one references and that hold no prefix (or all, with prefix
caching off) at the front (``prepend_n``) and those that hold one at the back (``append_n``),
``unpin_blocks`` at the back too; ``touch`` takes a prefix hit out of it (``remove``). Hashing,
prefix lookup, eviction of a reused block's prefix, reference counts, events, metrics and
reuse watchers are all the pool's own code around those five calls. So kvpool gives the pool
a queue answering them, and every one of vLLM's methods runs unchanged:

- the front of vLLM's queue (free blocks that hold nothing) is the engine's page cache of the
  pool's ``kv`` space: ``prepend_n`` frees into it, ``popleft_n`` takes from it first; those
  blocks are the pool's, and other leases may take them;
- the back (blocks that hold a prefix, in LRU order, and unpinned ones) is vLLM's own
  ``FreeKVCacheBlockQueue``: those blocks stay held by the lease until vLLM evicts or reuses
  them, taken after the page cache's as vLLM takes cached blocks after uncached ones, so
  prefix hits are the same;
- ``num_free_blocks`` = what the lease may still take (the quota, ``N - 1`` blocks, less what
  it holds) + the back. With the engine as the pool's only user this is vLLM's count, call
  for call.

vLLM offers no way to pass a queue in: ``BlockPool.__init__`` builds
``FreeKVCacheBlockQueue(self.blocks)`` itself (block_pool.py:178), ``KVCacheCoordinator``
builds ``BlockPool(...)`` itself (kv_cache_coordinator.py:119), ``KVCacheManager`` the
coordinator through ``get_kv_cache_coordinator`` (kv_cache_manager.py:167) and the
``Scheduler`` the manager inline in its ``__init__`` (sched/scheduler.py:328); no class or
factory argument on the way. So :func:`use_page_cache` sets that one attribute of the pool
vLLM built, once, before any request (its queue emptied through its own ``popleft_n``):
the least that reaches the seam without copying vLLM's code or patching its modules.

- Block id == page id of the pool's ``kv`` space. vLLM's block 0 is its null block, never
  handed out; the daemon reserves page 0 the same way, so the space's ids are ``1..N-1`` for
  vLLM's ``N`` blocks: a pool whose ``kv`` capacity is not ``num_gpu_blocks - 1`` is refused.
- A shared pool running short: when other leases took the pages the quota counted,
  ``popleft_n`` takes what the page cache still holds, then the back; if that is still short
  it raises vLLM's own ``ValueError`` (which vLLM does not expect after its check) naming the
  pool, having handed out nothing, and until :meth:`KVPoolFreeBlockQueue.new_step` counts only
  the pages its cache holds, so the scheduler's next checks refuse instead. Size the engines'
  pools so that they fit, or give each its own pool.
- Blocks whose prefix is dropped while they wait at the back (``reset_prefix_cache``,
  ``evict_blocks``) hold nothing any more: from the front of the back, they go to the page
  cache at the next :meth:`~KVPoolFreeBlockQueue.new_step` (one in the middle waits its turn,
  as in vLLM's queue).
- Reuse watchers (``unpin_blocks``' ``on_reuse``): vLLM calls one when it hands the block out
  again. A watched block freed without a prefix stays the lease's, at the front of the back,
  until vLLM hands it out (and calls the watcher): in the page cache another engine could take
  it while it is still read.
- Hot path: the page cache serves ``alloc``/``free`` locally; the scheduler opens it with no
  worker thread and no watermarks, so once warm no step makes an RPC; ``num_free_blocks``
  reads two counters.

Importing this module imports vLLM (the ``kvpool[vllm]`` extra); ``import kvpool`` never does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterator

import numpy as np
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvpool.cache.page_cache import PageCache
from kvpool.contract.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("kvpool.integrations.vllm.block_pool")

SPACE = "kv"
RELEASE_AHEAD = 32  # at most, and at most an eighth of the blocks


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


class KVPoolFreeBlockQueue:
    """The free-block queue of a vLLM ``BlockPool`` whose uncached free blocks are a kvpool
    page cache's; see the module docstring. It answers the calls ``BlockPool`` makes on its
    queue (``popleft_n``, ``prepend_n``, ``append_n``, ``remove``, ``num_free_blocks``).

    Args:
        blocks: the pool's blocks (``BlockPool.blocks``; block 0 its null block).
        cache: the page cache of the pool's ``kv`` space, held by the engine's lease (the
            queue frees into it; :meth:`close` closes it).
        watched: the ids of blocks with a reuse watcher (``BlockPool``'s own record, read).

    Raises:
        InvalidArgument: the cache's capacity is not ``len(blocks) - 1``.
    """

    def __init__(self, blocks: list[KVCacheBlock], cache: PageCache,
                 watched: Container[int]) -> None:
        check_capacity(len(blocks), int(cache.core.capacity), str(cache.core.pool))
        self.blocks = blocks
        self.cache = cache
        self.pool_name = str(cache.core.pool)
        self.watched = watched
        # Sealed blocks (the daemon keeps their KV for a later engine; the lease must never
        # write them again): one flag per block id, and how many are set.
        self.sealed = np.zeros(len(blocks), dtype=bool)
        self.n_sealed = 0
        self.released = 0  # sealed blocks freed without a prefix: handed back to the daemon
        self.unsealed = 0  # sealed blocks unsealed before vLLM reused them
        # Called before sealed blocks go back to the daemon (the sealer's): returns those
        # whose Seal call never left (not sealed: they may go into the page cache).
        self.before_release: Callable[[np.ndarray], np.ndarray] | None = None
        # Unseals sealed blocks before vLLM writes them again (the sealer's; returns once
        # the daemon confirmed), and how many blocks at the front are looked at with them.
        self.unseal: Callable[[np.ndarray], object] | None = None
        self.release_ahead = max(1, min(RELEASE_AHEAD, (len(blocks) - 1) // 8))
        # The blocks the lease may hold at once: all but the null block.
        self.quota = len(blocks) - 1
        # The back of vLLM's queue: free blocks the lease keeps (a prefix, or unpinned).
        self.held = FreeKVCacheBlockQueue([])
        # The pool ran short of what the quota promised (another lease took the pages):
        # until new_step, count only what the page cache holds.
        self.short = False
        self._short_warned = False
        self._closed = False

    # -- counts -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks the engine can get: what the lease may still take + the back."""
        return self._room() + self.held.num_free_blocks

    @property
    def held_free(self) -> int:
        """Free blocks the lease keeps (the back: prefix-cached and unpinned blocks)."""
        return self.held.num_free_blocks

    @property
    def blocks_in_use(self) -> int:
        """Blocks handed out and referenced (the null block not counted)."""
        return self.cache.core.in_use - self.held.num_free_blocks

    def _room(self) -> int:
        """Blocks the lease may still take from the pool: the quota less what it holds (after
        a shortage, what its page cache holds)."""
        core = self.cache.core
        room = self.quota - core.in_use
        if self.short:
            room = min(room, core.cached)
        return max(0, room)

    # -- the calls vLLM's BlockPool makes -----------------------------------------------------

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """``n`` free blocks: from the page cache first, then from the front of the back.

        Raises:
            ValueError: the pool ran short (see the module docstring); nothing is taken.
        """
        take = min(n, self._room())
        ids = self._take(take) if take else None
        got = 0 if ids is None else int(ids.shape[0])
        rest = n - got
        if rest > self.held.num_free_blocks:
            if ids is not None and got:
                self._free_ids(ids)
            raise ValueError(
                f"Cannot get {n} free blocks from the pool: kvpool pool {self.pool_name!r} "
                f"ran short (other leases hold its pages); the engine holds "
                f"{self.cache.core.in_use} of its {self.quota} blocks")
        blocks = self.blocks
        out: list[KVCacheBlock] = [] if ids is None else [blocks[i] for i in ids.tolist()]
        if rest:
            reused = self.held.popleft_n(rest)
            if self.n_sealed:
                try:
                    reused = self._unsealed(reused)
                except BaseException:
                    if ids is not None and got:
                        self._free_ids(ids)
                    raise
            out.extend(reused)
        return out

    def _unsealed(self, reused: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """``reused`` (taken from the back to be written), each sealed block of it unsealed
        first (:attr:`unseal`: the daemon confirms before vLLM writes it), with it the sealed
        blocks next in vLLM's eviction order (the front of the back, :attr:`release_ahead`
        blocks looked at): one call per ``release_ahead`` evicted sealed blocks, not per
        step. They stay where they are: vLLM evicts them as it would its own."""
        sealed = self.sealed
        gone = [b.block_id for b in reused if sealed[b.block_id]]
        if not gone:
            return reused
        for n, block in enumerate(self.held.iter_blocks_after(None)):
            if n >= self.release_ahead:
                break
            if sealed[block.block_id]:
                gone.append(block.block_id)
        ids = np.asarray(gone, dtype=np.int32)
        try:
            if self.unseal is None:
                raise FailedPrecondition(
                    f"vLLM reuses sealed blocks of kvpool pool {self.pool_name!r} and nothing "
                    "unseals them", field="block_id")
            self.unseal(ids)
        except BaseException:
            self.held.prepend_n(reused)  # as they were, first in line
            raise
        sealed[ids] = False
        self.n_sealed -= int(ids.shape[0])
        self.unsealed += int(ids.shape[0])
        return reused

    def mark_sealed(self, ids: np.ndarray) -> None:
        """Blocks ``ids`` (held by the lease) are sealed now."""
        fresh = ids[~self.sealed[ids]]
        self.sealed[fresh] = True
        self.n_sealed += int(fresh.shape[0])

    def _release(self, ids: np.ndarray) -> None:
        """Sealed blocks back to the daemon (one Free; its directory keeps them), never into
        the page cache; those the sealer never sealed (their Seal call had not left) go into
        the page cache as any other."""
        local = (self.before_release(ids) if self.before_release is not None
                 else ids[:0])
        self.sealed[ids] = False
        self.n_sealed -= int(ids.shape[0])
        rest = ids[~np.isin(ids, local)] if local.shape[0] else ids
        self.released += int(rest.shape[0])
        if self._closed:
            return
        if rest.shape[0]:
            self.cache.return_ids(self.cache.release(rest))
        if local.shape[0]:
            self.cache.free(local)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Free blocks that hold nothing: back to the page cache (a watched one stays the
        lease's, first in line)."""
        if not blocks:
            return
        watched = self.watched
        if watched:
            keep = [b for b in blocks if b.block_id in watched]
            if keep:
                self.held.prepend_n(keep)
                blocks = [b for b in blocks if b.block_id not in watched]
        if blocks:
            self._free_ids(np.fromiter((b.block_id for b in blocks), dtype=np.int32,
                                       count=len(blocks)))

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Free blocks that hold a prefix (or are unpinned): kept, at the back."""
        self.held.append_n(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        """A prefix hit on a free block: out of the back.

        Raises:
            FailedPrecondition: the block is in the page cache, not the back (vLLM's own queue
                raises RuntimeError for a block it does not hold); no prefix hit reaches one.
        """
        if block.prev_free_block is None:
            raise FailedPrecondition(
                f"vLLM touched block {block.block_id}, which is free and back in kvpool pool "
                f"{self.pool_name!r} (it holds no prefix, so no hit can reach it)",
                field="block_id")
        self.held.remove(block)

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """The back's blocks after ``cursor`` in eviction order (vLLM's offloading connector
        walks them; the page cache's blocks hold nothing to offload)."""
        return self.held.iter_blocks_after(cursor)

    # -- between steps ------------------------------------------------------------------------

    def new_step(self) -> None:
        """Between scheduler steps: forget a shortage (the pages may be back), return the
        blocks at the front of the back that hold nothing any more, and do the page cache's
        upkeep when it has no worker thread."""
        self.short = False
        if self._closed:
            return
        n = 0
        watched = self.watched
        for block in self.held.iter_blocks_after(None):
            if block.block_hash is not None or block.block_id in watched:
                break
            n += 1
        if n:
            self.prepend_n(self.held.popleft_n(n))
        if not self.cache.background:
            self.cache.maintain()

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

    def _free_ids(self, ids: np.ndarray) -> None:
        if self._closed:
            return  # the lease's end takes them
        if self.n_sealed:
            sealed = self.sealed[ids]
            if sealed.any():
                self._release(ids[sealed])
                ids = ids[~sealed]
                if not ids.shape[0]:
                    return
        self.cache.free(ids)

    # -- end ----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Return the page cache's unused pages to the daemon; the blocks in use and the
        back's stay the lease's until it ends (the binding's close). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.cache.close()


def use_page_cache(block_pool: BlockPool, cache: PageCache) -> KVPoolFreeBlockQueue:
    """Give ``block_pool`` (vLLM's, just built, nothing handed out) a
    :class:`KVPoolFreeBlockQueue` over ``cache``; returns it. Its own queue is emptied through
    its own ``popleft_n`` first. ``cache`` stays the caller's to close (or the queue's
    :meth:`~KVPoolFreeBlockQueue.close`) if this raises.

    Raises:
        InvalidArgument: the cache's capacity is not ``num_gpu_blocks - 1``, or the pool has
            handed out blocks already.
    """
    # The pool's record of watched blocks is private to vLLM: the queue only reads it.
    queue = KVPoolFreeBlockQueue(block_pool.blocks, cache, block_pool._reuse_watchers)
    own = block_pool.free_block_queue
    handed_out = block_pool.num_gpu_blocks - 1 - own.num_free_blocks
    if handed_out:
        raise InvalidArgument(
            f"vLLM's block pool has handed out {handed_out} blocks already; kvpool's free "
            "blocks can replace its own only before the first request (right after the "
            "scheduler is built)", field="scheduler")
    own.popleft_n(own.num_free_blocks)
    block_pool.free_block_queue = queue
    return queue


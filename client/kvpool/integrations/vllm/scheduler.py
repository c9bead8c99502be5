"""vLLM 0.32 schedulers whose KV-cache blocks come from a kvpool lease.

Select one with vLLM's ``scheduler_cls`` (a class or its dotted name)::

    LLM(model, scheduler_cls="kvpool.integrations.vllm.scheduler.KVPoolScheduler", ...)
    vllm serve MODEL --scheduler-cls kvpool.integrations.vllm.scheduler.KVPoolScheduler

``KVPoolScheduler`` follows vLLM's own choice: vLLM runs its ``AsyncScheduler`` when async
scheduling is on (``--async-scheduling``, and vLLM's default wherever the executor supports
it) and its ``Scheduler`` otherwise, but a custom ``scheduler_cls`` replaces that choice. So
``KVPoolScheduler`` makes a :class:`KVPoolAsyncScheduler` (``AsyncScheduler``'s subclass) when
the resolved ``scheduler_config.async_scheduling`` is on, and is vLLM's ``Scheduler`` otherwise;
a synchronous scheduler under async scheduling would make vLLM's engine core wait for every
step's output before it schedules the next (vLLM warns of "degraded performance" for such a
class). ``KVPoolAsyncScheduler`` can also be named directly. (vLLM's CPU build resolves async
scheduling off, so on CPU ``KVPoolScheduler`` is the synchronous one.) Each, right after
vLLM's own ``__init__``:

1. makes the engine core's binding from the environment (``KVPOOL_POOL``, ``KVPOOL_TARGET``,
   ... see ``kvpool.integrations.vllm.engine_core_binding``) and opens its lease (``vllm@host:pid``,
   renewed by the client while the engine runs);
2. checks the pool: it must exist, its page size must be vLLM's block size and its ``kv``
   space must have vLLM's ``num_gpu_blocks`` pages (ids ``1..N-1`` and the reserved page 0,
   vLLM's null block); each mismatch fails naming both numbers;
3. gives the block pool vLLM built a free-block queue over a page cache of the lease
   (:func:`~kvpool.integrations.vllm.block_pool.use_page_cache`): vLLM's own ``BlockPool``,
   with all its methods, and every reference to it (the coordinator's, the managers', the
   KV connector's binding) stay as vLLM made them; only where its free block ids come from
   and go to is kvpool's.

4. seals the full blocks vLLM caches and adopts the pool's sealed blocks of its layout into
   vLLM's block-hash map (``kvpool.integrations.vllm.sealing``; ``KVPOOL_SEAL``,
   ``KVPOOL_ADOPT``): ``schedule`` and ``update_from_output`` tell the sealer each step's
   start, its output and its end.

vLLM takes no block pool or free-block queue as an argument anywhere from the ``Scheduler``
down (``kvpool.integrations.vllm.block_pool`` names the lines), so the queue is set in the
pool vLLM built, before any request arrives; vLLM's files are not changed. Each scheduling
step, and a prefix-cache reset, first calls the queue's ``new_step``. ``shutdown`` (and
interpreter exit) closes the binding: the page cache returns its pages, the lease ends, and
the daemon takes back the blocks still held (in use or prefix-cached).

Importing this module imports vLLM (the ``kvpool[vllm]`` extra).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvpool.cache.policy import space_capacity
from kvpool.contract.errors import InvalidArgument, NotFound
from kvpool.integrations.vllm.block_pool import (
    SPACE,
    KVPoolFreeBlockQueue,
    use_page_cache,
)
from kvpool.integrations.vllm.engine_core_binding import VLLMBinding, binding_from_env
from kvpool.integrations.vllm.sealing import BlockSealer, start_sealing

log = logging.getLogger("kvpool.integrations.vllm.scheduler")

__all__ = ["KVPoolAsyncScheduler", "KVPoolScheduler", "use_lease_blocks"]


def use_lease_blocks(scheduler: Any, binding: VLLMBinding) -> KVPoolFreeBlockQueue:
    """Have the block pool of ``scheduler`` (a vLLM ``Scheduler`` just built) take its free
    blocks from ``binding``'s pool; returns the queue that does it. The binding closes it.

    Raises:
        NotFound: the pool is not configured in the daemon.
        InvalidArgument: the pool's page size is not vLLM's block size, its ``kv`` space
            does not have vLLM's block count, or the block pool is in use already.
    """
    block_pool = scheduler.kv_cache_manager.block_pool
    pool = binding.pool
    try:
        stats = binding.client.stats(pool)
    except NotFound as err:
        raise NotFound(
            f"kvpool pool {pool!r} ({binding.client.target}) does not exist: configure it "
            f"before vLLM starts (KVPOOL_POOL names it): {err}", field="pool") from err
    pool_stats = stats.pool(pool)
    sizes = {group.kv_cache_spec.block_size
             for group in scheduler.kv_cache_config.kv_cache_groups}
    if sizes != {pool_stats.page_size}:
        shown = ", ".join(map(str, sorted(sizes))) or "none"
        raise InvalidArgument(
            f"vLLM's KV-cache block size {shown} (--block-size) differs from kvpool pool "
            f"{pool!r}'s page size {pool_stats.page_size}: run vLLM with --block-size "
            f"{pool_stats.page_size}, or configure the pool with page_size={shown}",
            field="page_size")
    capacity = space_capacity(stats, pool, SPACE)
    # No worker thread: the upkeep runs in the scheduler's thread, between steps (new_step).
    # The engine owns its pool's blocks as vLLM's own pool does: the cache keeps what it
    # fetched (no high watermark, no returns, no refills: no RPC in a step once warm), takes
    # an eighth of the blocks a miss, and gives back only what the daemon asks for (another
    # lease short of blocks).
    cache = binding.lease.page_cache(pool, SPACE, background=False, fill=False, low=0,
                                     high=capacity, batch=max(1, capacity // 8))
    try:
        queue = use_page_cache(block_pool, cache)
    except BaseException:
        cache.close()
        raise
    binding.on_close(queue.close)
    log.info("kvpool: vLLM's %d KV-cache blocks come from pool %r (lease %d, %s)",
             block_pool.num_gpu_blocks, pool, binding.lease.lease_id, binding.lease_name)
    return queue


class _KVPoolBlocks:
    """What both schedulers add to vLLM's (a mixin before vLLM's class): the binding, the
    block pool's free blocks, sealing and adoption, the step hooks and the shutdown."""

    kvpool_binding: VLLMBinding
    kvpool_blocks: KVPoolFreeBlockQueue
    kvpool_sealer: BlockSealer | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # {gpu} is the engine's first device, 0: the engine core need not have CUDA (with
        # TP > 1 its workers are other processes), and asking torch would start a context.
        binding = binding_from_env(gpu=0)
        try:
            self.kvpool_blocks = use_lease_blocks(self, binding)
            self.kvpool_sealer = start_sealing(self, binding, self.kvpool_blocks)
        except BaseException:
            binding.close()
            raise
        self.kvpool_binding = binding
        binding.close_at_exit()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.kvpool_blocks.new_step()
        sealer = self.kvpool_sealer
        if sealer is None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        sealer.between_steps()
        sealer.scheduling()
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        sealer.scheduled(output)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        out = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output)
        sealer = self.kvpool_sealer
        if sealer is not None:
            sealer.step_done(scheduler_output)
        return out

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        # Between steps: a shortage is forgotten first (vLLM's check counts every free
        # block), and the blocks the reset emptied go back to the pool after.
        self.kvpool_blocks.new_step()
        done: bool = super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]
        self.kvpool_blocks.new_step()
        return done

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            binding = getattr(self, "kvpool_binding", None)
            if binding is not None:
                binding.close()


class KVPoolScheduler(_KVPoolBlocks, Scheduler):
    """vLLM's ``Scheduler`` with its blocks from a kvpool lease (see the module docstring);
    under async scheduling constructing it makes a :class:`KVPoolAsyncScheduler`, as vLLM's
    own choice would be its ``AsyncScheduler``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is KVPoolScheduler and _async_scheduling(args, kwargs):
            # not an instance of cls: Python does not call __init__ on it again
            return KVPoolAsyncScheduler(*args, **kwargs)
        return super().__new__(cls)


def _async_scheduling(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the ``vllm_config`` vLLM builds its scheduler with (keyword, or first
    positional) has async scheduling on."""
    config = kwargs.get("vllm_config", args[0] if args else None)
    scheduler_config = getattr(config, "scheduler_config", None)
    return bool(getattr(scheduler_config, "async_scheduling", False))


class KVPoolAsyncScheduler(_KVPoolBlocks, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with its blocks from a kvpool lease."""

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
3. replaces the block pool vLLM built (the KV-cache coordinator's, and every single-type
   manager's reference to it) with a :class:`~kvpool.integrations.vllm.block_pool.KVPoolBlockPool`
   over a page cache of the lease, and binds a KV connector, if any, to the new pool.

vLLM does not make the block pool pluggable (no ``block_pool_cls``), so the pool it built is
swapped before any request arrives; vLLM's files are not changed. Each scheduling step first
calls the block pool's ``new_step``. ``shutdown`` (and interpreter exit) closes the binding:
the page cache returns its pages, the lease ends, and the daemon takes back the blocks still
held (in use or prefix-cached).

Importing this module imports vLLM (the ``kvpool[vllm]`` extra).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvpool.cache.policy import space_capacity
from kvpool.contract.errors import InvalidArgument, NotFound
from kvpool.integrations.vllm.block_pool import SPACE, KVPoolBlockPool, check_capacity
from kvpool.integrations.vllm.engine_core_binding import VLLMBinding, binding_from_env

log = logging.getLogger("kvpool.integrations.vllm.scheduler")

__all__ = ["KVPoolAsyncScheduler", "KVPoolScheduler", "install_block_pool"]


def install_block_pool(scheduler: Any, binding: VLLMBinding) -> KVPoolBlockPool:
    """Replace the block pool of ``scheduler`` (a vLLM ``Scheduler`` just built) with a
    :class:`KVPoolBlockPool` over ``binding``'s pool; returns it. The binding closes it.

    Raises:
        NotFound: the pool is not configured in the daemon.
        InvalidArgument: the pool's page size is not vLLM's block size, or its ``kv`` space
            does not have vLLM's block count.
    """
    manager = scheduler.kv_cache_manager
    coordinator = manager.coordinator
    old = coordinator.block_pool
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
    if old.get_num_free_blocks() != old.num_gpu_blocks - 1:
        raise InvalidArgument("vLLM's block pool is already in use; the kvpool block pool "
                              "replaces it only right after the scheduler is built",
                              field="scheduler")
    capacity = space_capacity(stats, pool, SPACE)
    check_capacity(old.num_gpu_blocks, capacity, pool)
    # No worker thread: the upkeep runs in the scheduler's thread, between steps (new_step).
    # The engine owns its pool's blocks as vLLM's own pool does: the cache keeps what it
    # fetched (no high watermark, no returns, no refills: no RPC in a step once warm), takes
    # an eighth of the blocks a miss, and gives back only what the daemon asks for (another
    # lease short of blocks).
    cache = binding.lease.page_cache(pool, SPACE, background=False, fill=False, low=0,
                                     high=capacity, batch=max(1, capacity // 8))
    try:
        new = KVPoolBlockPool(old.num_gpu_blocks, old.enable_caching, old.hash_block_size,
                              old.enable_kv_cache_events, old.metrics_collector,
                              getattr(old, "medium", None), cache=cache)
    except BaseException:
        cache.close()
        raise
    binding.on_close(new.close)
    coordinator.block_pool = new
    manager.block_pool = new
    for single in coordinator.single_type_managers:
        if single.block_pool is old:
            single.block_pool = new
            single._null_block = new.null_block
    connector = getattr(scheduler, "connector", None)
    if connector is not None:
        connector.bind_kv_cache_manager(manager)
    log.info("kvpool: vLLM's %d KV-cache blocks come from pool %r (lease %d, %s)",
             old.num_gpu_blocks, pool, binding.lease.lease_id, binding.lease_name)
    return new


class _KVPoolBlocks:
    """What both schedulers add to vLLM's (a mixin before vLLM's class): the binding, the
    block pool, the step hook and the shutdown."""

    kvpool_binding: VLLMBinding
    kvpool_block_pool: KVPoolBlockPool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # {gpu} is the engine's first device, 0: the engine core need not have CUDA (with
        # TP > 1 its workers are other processes), and asking torch would start a context.
        binding = binding_from_env(gpu=0)
        try:
            self.kvpool_block_pool = install_block_pool(self, binding)
        except BaseException:
            binding.close()
            raise
        self.kvpool_binding = binding
        binding.close_at_exit()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.kvpool_block_pool.new_step()
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

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

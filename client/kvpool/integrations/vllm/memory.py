"""vLLM's KV-cache memory in a kvpool daemon pool: the pool vLLM's own config asks for, the
checks that the pool is vLLM's KV cache, and the allocation context that hands vLLM the
pool's memory instead of new memory.

vLLM 0.32 allocates its whole KV cache in ``allocate_kv_cache`` (``vllm/v1/worker/utils.py``)
as **one** ``torch.zeros(size, dtype=torch.int8, device=...)`` and views it per layer; it runs
that inside the KV connector's ``get_mem_pool_context()``. :class:`PoolAllocation` is that
context: a torch function mode under which each int8 ``torch.zeros`` of vLLM's is answered, in
order, with the matching tensor of the attached pool (a view of the daemon's memory, no copy),
after checking its size and device. Nothing else is intercepted.

The bytes are not zeroed: a new pool is zero (the daemon builds it so), and a pool an earlier
engine used holds what that engine left, which vLLM treats as it treats its own reused blocks
(every block is written before it is read).

Imports no vLLM (the vLLM config is read by attribute); torch is imported by
:class:`PoolAllocation` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.contract.errors import FailedPrecondition
from kvpool.contract.vllm_plan import VllmOptions, VllmPlan, make_vllm_options

if TYPE_CHECKING:
    import torch

# Where the fix lies when a pool and vLLM's KV cache differ.
MISMATCH_HINT = ("start vLLM with the knobs the pool was configured with, or Drop the pool "
                 "(kvpool drop) / name another one (KVPOOL_POOL) so that vLLM configures it")


class PoolMismatch(FailedPrecondition):
    """The pool is not the KV cache vLLM plans (another block count, tensor or layout);
    the message names vLLM's value and the pool's."""


def vllm_options_of(vllm_config: Any, *, pp_rank: int = 0) -> VllmOptions:
    """The :class:`VllmOptions` of a running vLLM (its ``VllmConfig``, resolved): what the
    daemon plans the pool from (``kv_cache_memory_bytes`` or ``num_gpu_blocks_override``,
    block size, KV dtype, TP/PP, ``max_model_len``, the hybrid manager and batching knobs).

    Raises:
        FailedPrecondition: neither ``kv_cache_memory_bytes`` nor ``num_gpu_blocks_override``
            is set (kvpool's pool has a fixed size: vLLM must not size it by profiling).
        InvalidArgument: a value the profile does not take (the field named).
    """
    cache = vllm_config.cache_config
    scheduler = vllm_config.scheduler_config
    parallel = vllm_config.parallel_config
    memory = cache.kv_cache_memory_bytes
    override = cache.num_gpu_blocks_override
    if memory is None and override is None:
        raise FailedPrecondition(
            "vLLM sizes its KV cache by profiling free memory, but a kvpool pool has a fixed "
            "size: set kv_cache_memory_bytes (LLM(kv_cache_memory_bytes=...), "
            "--kv-cache-memory-bytes; on CPU VLLM_CPU_KVCACHE_SPACE) or "
            "num_gpu_blocks_override", field="kv_cache_memory_bytes")
    return make_vllm_options(
        kv_cache_memory_bytes=memory or 0,
        block_size=cache.block_size,
        kv_cache_dtype=str(cache.cache_dtype),
        dtype=_dtype_name(vllm_config.model_config.dtype),
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        pp_rank=pp_rank,
        max_model_len=vllm_config.model_config.max_model_len,
        num_gpu_blocks_override=override,
        disable_hybrid_kv_cache_manager=bool(scheduler.disable_hybrid_kv_cache_manager),
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        async_scheduling=bool(scheduler.async_scheduling),
        no_enable_prefix_caching=not cache.enable_prefix_caching,
        backend="cpu",
    )


def _dtype_name(dtype: Any) -> str:
    """A ``torch.dtype`` (``torch.float32``) or a name as the profile's dtype name."""
    return str(dtype).removeprefix("torch.")


def _tensor_text(t: Any) -> str:
    layers = list(t.layers)
    shown = ", ".join(layers[:2]) + (f", ... ({len(layers)} layers)" if len(layers) > 2 else "")
    return (f"size {t.size:,} B, layers [{shown}], layer_stride {t.layer_stride:,}, "
            f"block_stride {t.block_stride:,}, offset {t.offset:,}")


def check_kv_cache(plan: VllmPlan, kv_cache_config: Any, *, pool: str,
                   layout: str | None = None) -> None:
    """That ``plan`` (the pool's) is vLLM's ``KVCacheConfig``: the block count, the KV-cache
    tensors (count, then each one's size, layers, strides and offset) and, when vLLM says
    it, the layout.

    Raises:
        PoolMismatch: the first difference, naming vLLM's value and the pool's.
    """
    where = f"kvpool pool {pool!r}"
    if kv_cache_config.num_blocks != plan.num_blocks:
        raise PoolMismatch(
            f"vLLM's KV cache has num_blocks {kv_cache_config.num_blocks:,} but {where} has "
            f"{plan.num_blocks:,} (of {plan.bytes_per_block:,} B); {MISMATCH_HINT}",
            field="num_blocks")
    layout = layout or getattr(kv_cache_config, "kv_cache_layout", None)
    if layout is not None and str(layout) != plan.layout.value:
        raise PoolMismatch(
            f"vLLM's KV-cache layout is {layout} but {where} is planned {plan.layout.value}; "
            f"{MISMATCH_HINT}", field="layout")
    theirs: Sequence[Any] = kv_cache_config.kv_cache_tensors
    if len(theirs) != len(plan.tensors):
        raise PoolMismatch(
            f"vLLM's KV cache has {len(theirs)} KV-cache tensor(s) but {where} has "
            f"{len(plan.tensors)}; {MISMATCH_HINT}", field="tensors")
    for i, (t, mine) in enumerate(zip(theirs, plan.tensors, strict=True)):
        if (t.size, tuple(t.layers), t.layer_stride, t.block_stride, t.offset) != (
                mine.size, mine.layers, mine.layer_stride, mine.block_stride, mine.offset):
            raise PoolMismatch(
                f"vLLM's KV-cache tensor {i} has {_tensor_text(t)} but {where}'s has "
                f"{_tensor_text(mine)}; {MISMATCH_HINT}", field=f"tensors[{i}]")


def _numel(size: Any) -> int | None:
    """The element count of a 1-D ``torch.zeros`` size argument (an int or a 1-sequence),
    else None."""
    if isinstance(size, int):
        return size
    if isinstance(size, Sequence) and len(size) == 1 and isinstance(size[0], int):
        return int(size[0])
    return None


class PoolAllocation:
    """The context vLLM allocates its KV cache in: each int8 ``torch.zeros`` of one dimension
    made inside it is answered, in order, with ``tensors[i]`` (the pool's memory), checked
    against the size and device vLLM asks for; on a clean exit every tensor must have been
    taken.

    Args:
        tensors: the pool's KV-cache backing, in vLLM's allocation order (int8, 1-D).
        pool: its name, for messages.

    Raises (inside the block, or at its exit):
        PoolMismatch: vLLM asks for another size or device, for more tensors than the pool
            has, or (at exit) for fewer.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], *, pool: str) -> None:
        self.tensors = list(tensors)
        self.pool = pool
        self.taken: list[torch.Tensor] = []
        self._mode: Any = None

    def _take(self, size: int, device: Any) -> torch.Tensor:
        import torch

        where = f"kvpool pool {self.pool!r}"
        i = len(self.taken)
        if i >= len(self.tensors):
            raise PoolMismatch(
                f"vLLM allocates KV-cache backing {i + 1} ({size:,} B) but {where} has "
                f"{len(self.tensors)}; {MISMATCH_HINT}", field="tensors")
        mine = self.tensors[i]
        if size != mine.numel():
            raise PoolMismatch(
                f"vLLM allocates its KV-cache backing {i} as {size:,} B but {where}'s is "
                f"{mine.numel():,} B; {MISMATCH_HINT}", field="size_bytes")
        want = torch.device(device) if device is not None else torch.device("cpu")
        if want.type != mine.device.type or (
                want.index is not None and mine.device.index is not None
                and want.index != mine.device.index):
            raise PoolMismatch(
                f"vLLM's KV cache is on {want} but {where} lives on {mine.device}: point "
                "KVPOOL_TARGET at the daemon of this device (one daemon per GPU)",
                field="device")
        self.taken.append(mine)
        return mine

    def __enter__(self) -> PoolAllocation:
        import torch
        from torch.overrides import TorchFunctionMode

        owner = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if func is torch.zeros and kwargs.get("dtype") is torch.int8 and len(args) == 1:
                    size = _numel(args[0])
                    extra = set(kwargs) - {"dtype", "device"}
                    if size is not None and not extra:
                        return owner._take(size, kwargs.get("device"))
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(exc_type, exc, tb)
        if exc_type is None and len(self.taken) != len(self.tensors):
            raise PoolMismatch(
                f"vLLM allocated {len(self.taken)} KV-cache backing(s) but kvpool pool "
                f"{self.pool!r} has {len(self.tensors)}; {MISMATCH_HINT}", field="tensors")

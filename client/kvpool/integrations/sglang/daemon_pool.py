"""The daemon pool behind an SGLang KV pool: configured, checked and attached.

SGLang's settings become Configure options, the plan is checked against the pool SGLang
builds, and the region is attached under the scheduler's lease.

Shared by kvpool's pool classes (``pools.py``), the two sides of a hybrid SWA pool
(``swa.py``) and the mamba state of a hybrid linear pool (``mamba_state.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpool.contract.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvpool.contract.options import KVCacheDType
from kvpool.contract.plan import BufferKind, PoolPlan
from kvpool.contract.records import ConfigureResult
from kvpool.integrations.hf_config import hf_config_path
from kvpool.integrations.sglang.scheduler_binding import (
    ElasticSettings,
    PoolBinding,
    binding_from_env,
)
from kvpool.mapping.regions import MappedRegion

log = logging.getLogger("kvpool.sglang")

# The torch dtype SGLang passes as the pool's ``dtype`` -> kvpool's --kv-cache-dtype.
KV_CACHE_DTYPES: dict[torch.dtype, KVCacheDType] = {
    torch.float32: KVCacheDType.float32,
    torch.float16: KVCacheDType.float16,
    torch.bfloat16: KVCacheDType.bfloat16,
    torch.float8_e4m3fn: KVCacheDType.fp8_e4m3,
    torch.float8_e5m2: KVCacheDType.fp8_e5m2,
    # SGLang's storage dtype of both FP4 recipes (fp4_mx_block16, nvfp4): quantized.py.
    **({torch.float4_e2m1fn_x2: KVCacheDType.fp4_e2m1}
       if hasattr(torch, "float4_e2m1fn_x2") else {}),
}
# SGLang's switch for a --context-length above the model's; the daemon's allow_longer_context.
LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def kv_cache_dtype_name(dtype: torch.dtype) -> KVCacheDType:
    """kvpool's KV dtype for the torch dtype SGLang gives its KV pool.

    Raises:
        InvalidArgument: a dtype kvpool's SGLang pools do not map (lists the ones they do).
    """
    try:
        return KV_CACHE_DTYPES[dtype]
    except KeyError:
        known = ", ".join(f"{d} -> {n.value}" for d, n in KV_CACHE_DTYPES.items())
        raise InvalidArgument(
            f"SGLang asked for a KV cache of {dtype}, which kvpool's SGLang pools do not "
            f"support (supported: {known}); choose another --kv-cache-dtype",
            field="kv_cache_dtype") from None


@dataclass(frozen=True)
class EngineSettings:
    """What SGLang resolved that decides the daemon's plan (read from SGLang's runtime
    context, or given by a test)."""

    model_path: str
    revision: str | None = None
    tp_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    context_length: int | None = None
    max_running_requests: int | None = None
    allow_longer_context: bool = False
    # Decide the state slots of a hybrid linear plan (SGLang's mamba pool: mamba_state.py).
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    mamba_radix_cache_strategy: str = "auto"


def engine_settings() -> EngineSettings:
    """The running SGLang scheduler's settings, from its published runtime context."""
    from sglang.srt.runtime_context import (
        get_exec,
        get_memory,
        get_model,
        get_parallel,
        get_schedule,
    )

    model, parallel, schedule = get_model(), get_parallel(), get_schedule()
    try:
        # KV heads are split over attention TP (tp_size unless DP attention is on).
        tp_size = int(parallel.attn_tp_size)
    except (AttributeError, RuntimeError, ValueError):
        tp_size = int(parallel.tp_size)
    return EngineSettings(
        model_path=str(model.model_path),
        revision=getattr(model, "revision", None),
        tp_size=tp_size,
        pp_size=int(parallel.pp_size),
        pp_rank=int(parallel.pp_rank),
        context_length=model.context_length,
        max_running_requests=schedule.max_running_requests,
        allow_longer_context=os.environ.get(LONGER_CONTEXT_ENV, "").lower() in ("1", "true"),
        disable_radix_cache=bool(get_memory().disable_radix_cache),
        disable_overlap_schedule=bool(schedule.disable_overlap_schedule),
        mamba_radix_cache_strategy=(
            "extra_buffer" if get_exec().mamba.enable_mamba_extra_buffer else "no_buffer"),
    )


def model_config_path(model_path: str, revision: str | None = None) -> Path:
    """The ``config.json`` of the model SGLang serves (``hf_config_path``).

    Raises:
        FailedPrecondition: no config.json could be found (names the path or repo).
    """
    path = hf_config_path(model_path, revision, field="model_path")
    assert path is not None
    return path


def plan_request(settings: EngineSettings, *, size: int, page_size: int,
                 dtype: torch.dtype, elastic: ElasticSettings | None = None) -> dict[str, Any]:
    """The Configure options for a pool of ``size`` tokens (``max_total_tokens``); with
    ``elastic``, an elastic pool whose virtual range is those tokens."""
    return {
        **({} if elastic is None else elastic.options()),
        "max_total_tokens": size,
        "page_size": page_size,
        "kv_cache_dtype": kv_cache_dtype_name(dtype).value,
        "tp_size": settings.tp_size,
        "pp_size": settings.pp_size,
        "pp_rank": settings.pp_rank,
        "context_length": settings.context_length,
        "max_running_requests": settings.max_running_requests,
        "allow_longer_context": settings.allow_longer_context,
        "disable_radix_cache": settings.disable_radix_cache,
        "disable_overlap_schedule": settings.disable_overlap_schedule,
        "mamba_radix_cache_strategy": settings.mamba_radix_cache_strategy,
    }


class PoolMismatch(FailedPrecondition):
    """The daemon's plan differs from the pool SGLang is building."""


# Plans whose full-attention KV buffers are a pool of each kind inside one of SGLang's composite
# pools (HybridLinearKVPool builds its full layers with the platform's mha / mla class, over
# those layers only, numbered densely from 0).
COMPOSITE_PLANS: dict[str, tuple[str, ...]] = {"mha": ("hybrid_linear",),
                                               "mla": ("hybrid_linear",)}
# A KV buffer's name: ``<prefix>.<global layer>`` (``k``/``v`` of MHA, ``kv`` of MLA and DSA).
KV_PREFIXES = ("k", "kv")


def kv_layers(plan: PoolPlan) -> tuple[int, ...]:
    """The global layer ids of the plan's (target) KV buffers, ascending."""
    layers = set()
    for b in plan.buffers:
        prefix, _, layer = b.name.partition(".")
        if b.kind == BufferKind.kv and prefix in KV_PREFIXES and layer.isdigit():
            layers.add(int(layer))
    return tuple(sorted(layers))


def pool_layers(plan: PoolPlan, *, start_layer: int, layer_num: int) -> tuple[int, ...]:
    """The global layer id of each of the pool's ``layer_num`` layers: its own range, or, in a
    composite plan, the plan's KV layers (the pool's dense layer ``i`` is the ``i``-th)."""
    if any(plan.architecture in plans for plans in COMPOSITE_PLANS.values()):
        return kv_layers(plan)
    return tuple(range(start_layer, start_layer + layer_num))


def check_plan(result: ConfigureResult, *, architecture: str, size: int, page_size: int,
               start_layer: int, layer_num: int, pool: str) -> None:
    """Refuse a plan whose architecture, token count, page size or layers differ from SGLang's.

    Raises:
        PoolMismatch: naming SGLang's value and the plan's.
    """
    plan = result.plan
    where = f"kvpool pool {pool!r}"
    if plan.elastic is not None and plan.max_total_num_tokens != size:
        # The virtual range is whole groups: the views' rows (size + the padding page) must be.
        e = plan.elastic
        below = max(1, (size + page_size) // e.tokens_per_group) * e.tokens_per_group
        raise PoolMismatch(
            f"SGLang sized its KV pool at {size} tokens but the elastic plan of {where} has "
            f"max_total_num_tokens {plan.max_total_num_tokens}: an elastic pool's range is "
            f"whole groups of {e.tokens_per_group} tokens, the padding page ({page_size} "
            f"tokens) included; run SGLang with --max-total-tokens {below - page_size} or "
            f"{below + e.tokens_per_group - page_size}", field="max_total_tokens")
    composite = plan.architecture in COMPOSITE_PLANS.get(architecture, ())
    if plan.architecture != architecture and not composite:
        raise PoolMismatch(
            f"SGLang builds a {architecture} KV pool but the daemon planned {where} as "
            f"{plan.architecture!r}; kvpool's SGLang pools map mha, mla and dsa plans, and "
            "hybrid_linear plans through their mha or mla full-attention layers",
            field="architecture")
    if plan.max_total_num_tokens != size:
        raise PoolMismatch(
            f"SGLang sized its KV pool at {size} tokens but the daemon's plan of {where} has "
            f"max_total_num_tokens {plan.max_total_num_tokens}; set --max-total-tokens (or "
            f"--mem-fraction-static) so both agree, or drop the pool if it was configured "
            "with other options", field="max_total_tokens")
    if plan.page_size != page_size:
        raise PoolMismatch(
            f"SGLang's page size is {page_size} but {where} has page_size {plan.page_size}",
            field="page_size")
    if composite:
        full = kv_layers(plan)
        if len(full) != layer_num:
            raise PoolMismatch(
                f"SGLang's full-attention KV pool holds {layer_num} layers but {where} "
                f"({plan.architecture}) has {len(full)} full-attention layers {list(full)} in "
                f"layers {plan.layer_start}..{plan.layer_end - 1}; check --pp-size / the PP "
                "rank", field="pp_rank")
        return
    end_layer = start_layer + layer_num
    if (plan.layer_start, plan.layer_end) != (start_layer, end_layer):
        raise PoolMismatch(
            f"SGLang's KV pool holds layers {start_layer}..{end_layer - 1} but {where} holds "
            f"{plan.layer_start}..{plan.layer_end - 1}; check --pp-size / the PP rank",
            field="pp_rank")


class Attachment:
    """A pool's attached daemon region, whose views are handed out after checking them."""

    def __init__(self, binding: PoolBinding, configured: ConfigureResult,
                 region: MappedRegion, layers: Sequence[int] = ()) -> None:
        self.binding = binding
        self.configured = configured
        self.region = region
        # The global layer id of each of the SGLang pool's layers (pool_layers).
        self.layers = tuple(layers)

    def view(self, name: str, shape: Sequence[int], dtype: torch.dtype,
             device: str | torch.device) -> torch.Tensor:
        """The daemon's buffer ``name``, checked against what SGLang expects.

        Raises:
            PoolMismatch: a missing buffer, another shape, dtype or device (both named).
        """
        where = f"kvpool pool {self.binding.pool!r}"
        try:
            tensor = self.region[name]
        except KeyError:
            names = ", ".join(list(self.region)[:6])
            raise PoolMismatch(
                f"SGLang expects buffer {name!r} of shape {tuple(shape)} but {where} has no "
                f"such buffer (it has {names}, ...)", field="buffers") from None
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise PoolMismatch(
                f"SGLang expects buffer {name!r} as {tuple(shape)} {dtype} but {where} has "
                f"{tuple(tensor.shape)} {tensor.dtype}", field="buffers")
        want = torch.device(device)
        if tensor.device.type != want.type or (
                want.index is not None and tensor.device.index != want.index):
            raise PoolMismatch(
                f"SGLang's KV cache is on {want} but {where} lives on {tensor.device} (the "
                f"daemon at {self.binding.client.target} serves {tensor.device.type}): start that "
                f"daemon with `kvpoold serve --device {want}`, or point KVPOOL_TARGET at the "
                "daemon of this device", field="device")
        return tensor


def attach_pool(pool: Any, *, architecture: str, settings: EngineSettings | None = None,
                binding: PoolBinding | None = None) -> Attachment:
    """Configure, check and attach the daemon pool for SGLang pool ``pool`` (being built).

    Args:
        pool: the SGLang pool (reads ``size``, ``page_size``, ``dtype``, ``start_layer``,
            ``layer_num``); gets ``kvpool_binding`` and ``kvpool_configured``.
        architecture: the plan architecture the pool class maps (``mha``, ``mla``, ``dsa``).
        settings: SGLang's settings (default: the running scheduler's).
        binding: the binding to use (default: a new one from the environment, closed at exit).

    Raises:
        FailedPrecondition: ``KVPOOL_POOL`` unset, a plan that differs from SGLang's pool.
        KVPoolError: the daemon's refusal (a different layout, not enough budget, ...).
    """
    own = binding is None
    binding = binding_from_env() if binding is None else binding
    try:
        settings = engine_settings() if settings is None else settings
        elastic = elastic_settings(binding)
        options = plan_request(settings, size=pool.size, page_size=pool.page_size,
                               dtype=pool.dtype, elastic=elastic)
        config = model_config_path(settings.model_path, settings.revision)
        try:
            configured = binding.client.configure(binding.pool, hf_config=config, **options)
        except AlreadyExists as exc:
            raise existing_pool_differs(binding, options, exc) from exc
        log.info("kvpool pool %r %s for SGLang (%s%s, %d tokens, page %d, %s): fingerprint %s",
                 binding.pool, "created" if configured.created else "reused", architecture,
                 ", elastic" if configured.plan.elastic is not None else "", pool.size,
                 pool.page_size, options["kv_cache_dtype"], configured.fingerprint)
        check_plan(configured, architecture=architecture, size=pool.size,
                   page_size=pool.page_size, start_layer=pool.start_layer,
                   layer_num=pool.layer_num, pool=binding.pool)
        stack = contextlib.ExitStack()
        region = stack.enter_context(binding.client.attach(
            binding.pool, configured.fingerprint, lease=binding.lease))
        binding.on_close(stack.close)
    except BaseException:
        if own:
            binding.close()
        raise
    if own:
        atexit.register(binding.close)
    pool.kvpool_binding = binding
    pool.kvpool_configured = configured
    layers = pool_layers(configured.plan, start_layer=pool.start_layer,
                         layer_num=pool.layer_num)
    return Attachment(binding, configured, region, layers)


def elastic_settings(binding: PoolBinding) -> ElasticSettings | None:
    """The elastic options of the scheduler's pool: the binding's (``KVPOOL_ELASTIC=1`` and
    its floor, cap and weight), else those of an existing elastic pool of that name (its floor,
    cap and weight from its Stats, so Configure matches it), else None (a fixed pool)."""
    if binding.elastic is not None:
        return binding.elastic
    try:
        have = binding.client.stats(binding.pool).pool(binding.pool)
    except (NotFound, KeyError):
        return None
    e = have.elastic
    if e is None:
        return None
    tokens = (have.max_total_num_tokens + have.page_size) // max(1, e.groups)
    return ElasticSettings(floor_tokens=e.floor_groups * tokens,
                           cap_tokens=e.cap_groups * tokens, weight=e.weight)


def existing_pool_differs(binding: PoolBinding, options: dict[str, Any],
                          exc: AlreadyExists) -> PoolMismatch:
    """The daemon's refusal of a pool that exists with another layout, with both sizes."""
    try:
        have = binding.client.stats(binding.pool).pool(binding.pool)
        existing = (f"{have.max_total_num_tokens} tokens, page {have.page_size}, "
                    f"{have.kv_cache_dtype}")
    except Exception:  # the refusal itself is the error; the sizes only explain it
        existing = "another layout"
    return PoolMismatch(
        f"SGLang needs kvpool pool {binding.pool!r} with {options['max_total_tokens']} tokens, "
        f"page {options['page_size']}, {options['kv_cache_dtype']} (tp {options['tp_size']}, "
        f"pp {options['pp_rank']}/{options['pp_size']}) but it exists with {existing}: "
        f"{exc.message}", field="max_total_tokens")


__all__ = [
    "KV_CACHE_DTYPES", "Attachment", "EngineSettings", "PoolMismatch", "attach_pool",
    "check_plan", "elastic_settings", "engine_settings", "existing_pool_differs",
    "kv_cache_dtype_name", "kv_layers", "model_config_path", "plan_request", "pool_layers",
]

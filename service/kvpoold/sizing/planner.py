"""``plan(spec, options) -> PoolPlan``: the one entry point of pure sizing.

Resolves what every architecture shares (KV format, PP stage, context length, draft layers),
asks the architecture table for the numbers and buffers, adds the request->token table, places
everything in one region and returns the frozen plan. No torch, no env vars, no I/O.
"""

from __future__ import annotations

import dataclasses

import msgspec

from kvpool.contract.devices import gpu_profile
from kvpool.contract.dtypes import DType
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.options import KVCacheDType, PlanOptions
from kvpool.contract.plan import ArchitectureSource, BufferKind, BufferSpec, ElasticPlan, PoolPlan
from kvpool.contract.spec import ModelSpec
from kvpoold.sizing import multimodal
from kvpoold.sizing.architectures import SGLANG_VERSION
from kvpoold.sizing.common import (
    REQ_TO_TOKEN_EXTRA_COLUMNS,
    Sizing,
    SizingContext,
    resolve_kv_format,
    stage_layers,
)
from kvpoold.sizing.elastic import elastic_layout
from kvpoold.sizing.layout import buffer, place
from kvpoold.sizing.registry import Architecture, select_architecture
from kvpoold.sizing.space_table import declare_spaces

# PoolPlan fields copied as they are from the Sizing, and from the options.
SIZING_FIELDS = (
    "max_running_requests", "full_max_total_num_tokens", "swa_max_total_num_tokens",
    "mamba_cache_size", "c4_max_total_num_tokens", "c128_max_total_num_tokens",
    "c4_state_pool_size", "c128_state_pool_size", "num_pages", "swa_num_pages",
)
OPTION_FIELDS = ("budget_bytes", "tp_size", "pp_size", "pp_rank")
# SGLang's max_running_requests when speculative decoding is on and the user gave none.
SPECULATIVE_MAX_RUNNING_REQUESTS = 48

# SGLang's swa_full_tokens_ratio when neither the user nor the model's overrides set one.
DEFAULT_SWA_FULL_TOKENS_RATIO = 0.8
# SGLang's defaults for one model class, where the user gave none (its arg_groups: the
# model_overrides and hooks that run before sizing). Keyed by the HF class a spec names.
MODEL_DEFAULTS: dict[str, dict[str, object]] = {
    # arg_groups/model_overrides/deepseek_v4.py (ratio) and deepseek_v4_hook.py (requests)
    "DeepseekV4ForCausalLM": {"swa_full_tokens_ratio": 0.1, "max_running_requests": 256},
}


def engine_defaults(spec: ModelSpec, options: PlanOptions) -> PlanOptions:
    """The options as SGLang's server resolves them before sizing: the device profile
    (``gpu``, default :data:`~kvpool.contract.devices.DEFAULT_GPU`) and its
    ``chunked_prefill_size``, the model class's own defaults (:data:`MODEL_DEFAULTS`), then
    speculative decoding's ``max_running_requests`` of 48, then ``swa_full_tokens_ratio`` 0.8;
    only where the option is not given. Idempotent."""
    changes: dict[str, object] = {}
    gpu = gpu_profile(options.gpu)
    if options.gpu is None:
        changes["gpu"] = gpu.name
    if options.chunked_prefill_size is None:
        changes["chunked_prefill_size"] = gpu.chunked_prefill_size()
    for name, value in MODEL_DEFAULTS.get(spec.architecture, {}).items():
        if getattr(options, name) is None:
            changes[name] = value
    if (options.speculative_algorithm != "none" and options.max_running_requests is None
            and "max_running_requests" not in changes):
        changes["max_running_requests"] = SPECULATIVE_MAX_RUNNING_REQUESTS
    if options.swa_full_tokens_ratio is None and "swa_full_tokens_ratio" not in changes:
        changes["swa_full_tokens_ratio"] = DEFAULT_SWA_FULL_TOKENS_RATIO
    return msgspec.structs.replace(options, **changes) if changes else options


def make_context(spec: ModelSpec, options: PlanOptions) -> SizingContext:
    """Resolve the shared inputs of sizing.

    Raises:
        InvalidArgument: for a PP split with more stages than layers, or a context length above
            the model's without ``allow_longer_context``.
    """
    options = engine_defaults(spec, options)
    if options.speculative_algorithm == "none":
        draft = 0
    elif options.speculative_num_draft_layers is not None:
        draft = options.speculative_num_draft_layers
    else:
        draft = spec.num_nextn_predict_layers or 1
    asked = options.context_length
    if asked is not None and asked > spec.context_length and not options.allow_longer_context:
        raise InvalidArgument(
            f"context_length {asked:,} is above the model's {spec.context_length:,} (from its "
            "config, rope scaling included), which SGLang refuses; lower --context-length, or "
            "give --allow-longer-context (SGLang: SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1)",
            field="context_length",
        )
    return SizingContext(
        spec=spec,
        options=options,
        kv=resolve_kv_format(options.kv_cache_dtype, spec),
        layers=stage_layers(spec.num_layers, options.pp_size, options.pp_rank),
        context_length=asked or spec.context_length,
        num_draft_layers=draft,
    )


def _agree_across_stages(
    spec: ModelSpec, options: PlanOptions, arch: Architecture, ctx: SizingContext,
    sizing: Sizing,
) -> tuple[SizingContext, Sizing]:
    """Every pipeline stage must hold the same token count (SGLang MIN-all-reduces it), so size
    all stages and cap this one at the smallest count of a stage that holds KV."""
    counts = []
    for rank in range(options.pp_size):
        if rank == options.pp_rank:
            other = sizing
        else:
            other = arch.size(make_context(spec, msgspec.structs.replace(options, pp_rank=rank)))
        if other.cell_size_bytes > 0:
            counts.append(_tokens(other, options.page_size))
    if not counts or _tokens(sizing, options.page_size) <= min(counts):
        return ctx, sizing
    capped = msgspec.structs.replace(options, max_total_tokens=min(counts))
    ctx = make_context(spec, capped)
    sizing = arch.size(ctx)
    note = f"capped at {min(counts)} tokens, the smallest of the {options.pp_size} PP stages"
    return ctx, dataclasses.replace(sizing, notes=(*sizing.notes, note))


def _tokens(sizing: Sizing, page_size: int) -> int:
    if sizing.max_total_num_tokens is not None:
        return sizing.max_total_num_tokens
    return sizing.num_pages * page_size


def plan(spec: ModelSpec, options: PlanOptions, *, source: ArchitectureSource = "spec",
         decided_by: tuple[str, ...] = ()) -> PoolPlan:
    """Size and lay out one pool.

    Args:
        spec: the model (from :mod:`kvpoold.hf` or a spec file).
        options: budget, page size, dtype, parallelism, speculative settings.
        source: how the spec was obtained, echoed as ``architecture_source``.
        decided_by: the config fields that decided the family (:func:`kvpoold.hf.read_hf`),
            named in the plan's first note.

    Returns:
        The frozen plan; ``plan.buffers`` are placed in one region of ``backing_bytes``.

    Raises:
        InvalidArgument: for any input the architecture cannot plan, naming the field.
    """
    # SGLang's Qwen3-VL override reads --max-running-requests before any default is applied
    given_running_requests = options.max_running_requests
    options = engine_defaults(spec, options)
    arch = select_architecture(spec)
    forced: tuple[str, ...] = ()
    page = arch.page_size_for(options.page_size) if arch.page_size_for else options.page_size
    if page != options.page_size:
        forced = (f"page size {page} (SGLang sets it for {arch.name}; asked "
                  f"{options.page_size})",)
        options = msgspec.structs.replace(options, page_size=page)
    gpu = gpu_profile(options.gpu)
    if arch.auto_kv_cache_dtype is not None and options.kv_cache_dtype is KVCacheDType.auto:
        dtype = KVCacheDType.fp8_e4m3 if gpu.blackwell else arch.auto_kv_cache_dtype
        forced = (*forced, (
            f"kv cache dtype {dtype.value}: SGLang's default for {arch.name} under "
            f"--kv-cache-dtype auto on {gpu.describe()} (bfloat16 before SM100, fp8_e4m3 "
            "from SM100 on)"))
        options = msgspec.structs.replace(options, kv_cache_dtype=dtype)
    asked = options
    mm = multimodal.reservation(spec, gpu, given_running_requests)
    if mm is not None and options.budget_bytes is not None:
        if options.budget_bytes <= mm.nbytes:
            raise InvalidArgument(
                f"budget {options.budget_bytes:,} B leaves nothing for the KV cache after the "
                f"{mm.nbytes:,} B reserved for {mm.why}, which SGLang refuses too; raise "
                "--budget", field="budget_bytes")
        forced = (*forced, f"{mm.nbytes:,} B of the budget reserved for {mm.why}")
        options = msgspec.structs.replace(options, budget_bytes=options.budget_bytes - mm.nbytes)
    ctx = make_context(spec, options)
    sizing = arch.size(ctx)
    if options.pp_size > 1:
        ctx, sizing = _agree_across_stages(spec, options, arch, ctx, sizing)
    if sizing.num_pages < 1:
        raise InvalidArgument(
            f"{arch.name}: the pool would hold no pages; raise --budget", field="budget_bytes"
        )
    columns = ctx.context_length + REQ_TO_TOKEN_EXTRA_COLUMNS
    if ctx.num_draft_layers:
        columns += ctx.num_draft_layers + 1
    def aux(sized: Sizing) -> list[BufferSpec]:
        return [buffer("req_to_token", DType.int32, (sized.max_running_requests + 1, columns),
                       BufferKind.req_to_token, in_budget=False)]

    elastic: ElasticPlan | None = None
    if options.elastic:
        sizing, placed, backing_bytes, elastic = elastic_layout(arch.name, ctx, sizing,
                                                                arch.layout, aux)
    else:
        placed, backing_bytes = place([*arch.layout(ctx, sizing), *aux(sizing)])
    total = sum(b.nbytes for b in placed if b.in_budget)
    aux = sum(b.nbytes for b in placed if not b.in_budget)
    max_total = sizing.max_total_num_tokens
    if max_total is None:
        max_total = sizing.num_pages * ctx.page_size
    notes = (*forced, *sizing.notes)
    if decided_by:
        notes = (f"family {sizing.architecture} decided by {', '.join(decided_by)} (as SGLang "
                 f"{SGLANG_VERSION} reads them)", *notes)
    if source == "assumed":
        notes = (*notes, (
            f"{spec.architecture or 'this model'} is not in SGLang's model registry: planned "
            f"as {sizing.architecture} because --assume-architecture said so, not because "
            "SGLang is known to size it so (SGLang runs an unknown class through its generic "
            "Transformers backend)"))
    if max_total < ctx.context_length:
        notes = (*notes, (
            f"the pool holds {max_total:,} tokens, less than one request at the context length "
            f"{ctx.context_length:,}: longer requests cannot run; raise --budget / "
            "--max-total-tokens or lower --context-length"))
    return PoolPlan(
        architecture=sizing.architecture,
        architecture_source=source,
        model_architecture=spec.architecture,
        kv_cache_dtype=ctx.kv.name,
        page_size=ctx.page_size,
        context_length=ctx.context_length,
        cell_size_bytes=sizing.cell_size_bytes,
        max_total_num_tokens=max_total,
        **{name: getattr(sizing, name) for name in SIZING_FIELDS},
        **{name: getattr(asked, name) for name in OPTION_FIELDS},
        total_bytes=total,
        aux_bytes=aux,
        backing_bytes=backing_bytes,
        layer_start=ctx.layers.start,
        layer_end=ctx.layers.stop,
        num_draft_layers=ctx.num_draft_layers,
        req_to_token_columns=columns,
        notes=notes,
        buffers=placed,
        id_spaces=declare_spaces(sizing, placed),
        gpu=gpu.describe(),
        elastic=elastic,
    )

"""The vLLM profile: a model and vLLM's knobs -> vLLM 0.32's KV cache (``get_kv_cache_configs``)
for one worker, as a :class:`~kvpool.contract.vllm_plan.VllmPlan`.

Pure but for one fact of the host, read only when ``options.cpu_avx512_bf16`` is ``auto`` and
the model has linear-attention layers (:mod:`kvpoold.sizing.vllm_host`): no torch, no other
environment or I/O. The sizing equation (layer-major layouts, the ones
vLLM's CPU backends resolve)::

    bytes_per_block = max over groups of the sum of the group's layers' pages
    num_blocks      = kv_cache_memory_bytes // bytes_per_block     (or num_gpu_blocks_override)
    size            = num_blocks * bytes_per_block                 (one int8 backing region)

then every pipeline stage takes the smallest stage's ``num_blocks``. Block 0 is vLLM's null
block: the capacity check asks that ``kv_cache_memory_bytes - bytes_per_block`` hold one
request of ``max_model_len`` in every group (full attention: ``ceil(len / block_size)``
blocks; a sliding window: ``ceil(min(window - 1 + in-flight tokens, len) / block_size) + 1``).
Each group's layers of one spec are one KV-cache tensor, at byte offset 0 for a group's first
layer: groups alias each other's bytes (a block id belongs to one group at a time).

Worked example, Llama-3.1-8B on CPU, 1 GiB, block 128, bf16: 32 layers of 524,288 B pages,
``bytes_per_block`` = 16 MiB, 64 blocks; one tensor of 1 GiB, layer stride 32 MiB (64 pages),
block stride 512 KiB; a 4,096-token request takes 32 blocks, and 63 usable blocks hold
``64 / 32 = 2.0`` such requests (vLLM's max concurrency counts all 64).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.vllm_plan import (
    VllmEntrypoint,
    VllmGroup,
    VllmLayerSpec,
    VllmLayout,
    VllmMambaDType,
    VllmOptions,
    VllmPlan,
    VllmPlatform,
    VllmSpecType,
    VllmTensor,
)
from kvpoold.sizing.vllm_groups import Group, kv_cache_groups, project
from kvpoold.sizing.vllm_model import VLLM_VERSION, LayerKind, VllmModel, read_vllm_model
from kvpoold.sizing.vllm_specs import (
    ITEMSIZE,
    NO_ATTENTION_LAYOUT,
    BackendFacts,
    LayerSpec,
    align_hybrid_block_size,
    backend_facts,
    kda_check_ssm_dtype,
    layer_specs,
    model_dtype,
    resolve_block_size,
    resolve_cache_dtype,
    ssm_state_dtype,
    stage_bounds,
    state_block_size,
    state_bytes,
)

# The strides of vLLM's logical axes [L, B, H, N, C] follow the layout's memory order.
_AXES = "LBHNC"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bytes_per_block(groups: list[Group]) -> int:
    """The widest group's bytes per block (layer-major layouts: each layer's page)."""
    return max((sum(n.spec.page_size_bytes for n in g.layers) for g in groups), default=0)


def blocks_per_request(spec: LayerSpec, max_model_len: int, in_flight_tokens: int) -> int:
    """Blocks one request of ``max_model_len`` tokens holds in a group of this spec."""
    if spec.type is VllmSpecType.mamba:
        # the running state and, with prefix caching ("align" mode), the one it came from
        # (and a Mamba-2 mixer's prefill checkpoint)
        return spec.state_blocks
    if spec.type is VllmSpecType.sliding_window:
        assert spec.sliding_window is not None
        tokens = min(spec.sliding_window - 1 + in_flight_tokens, max_model_len)
        # +1: the window need not start at a block boundary
        return _cdiv(tokens, spec.block_size) + 1
    return _cdiv(max_model_len, spec.block_size)


def _group_blocks(g: Group, max_model_len: int, in_flight: int) -> int:
    if g.uniform_type and g.layers:
        return max(blocks_per_request(n.spec, max_model_len, in_flight) for n in g.layers)
    return blocks_per_request(g.spec, max_model_len, in_flight)


def _needed_bytes(groups: list[Group], max_model_len: int, in_flight: int) -> int:
    return bytes_per_block(groups) * sum(_group_blocks(g, max_model_len, in_flight)
                                         for g in groups)


def _estimate_max_len(groups: list[Group], available: int, max_model_len: int,
                      in_flight: int) -> int:
    """The longest request that fits (vLLM's binary search), 0 when not one token does."""
    lo, hi, best = 1, max_model_len, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if _needed_bytes(groups, mid, in_flight) <= available:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def _check_capacity(groups: list[Group], available: int, options: VllmOptions,
                    max_model_len: int, in_flight: int) -> None:
    """vLLM's "enough KV cache for one request" check, on the memory less the null block.

    Raises:
        InvalidArgument: naming the memory needed and given and the longest length that
            fits.
    """
    if available <= 0:
        raise InvalidArgument(
            f"kv_cache_memory_bytes {options.kv_cache_memory_bytes:,} B leaves no memory for "
            f"KV blocks beyond vLLM's null block of {bytes_per_block(groups):,} B; raise "
            "--kv-cache-memory-bytes", field="kv_cache_memory_bytes")
    needed = _needed_bytes(groups, max_model_len, in_flight)
    if needed > available and all(g.spec.type is VllmSpecType.mamba for g in groups):
        raise InvalidArgument(
            f"one request's Mamba states need {needed:,} B ({needed // bytes_per_block(groups)} "
            f"blocks of {bytes_per_block(groups):,} B, whatever its length), more than the "
            f"{available:,} B that kv_cache_memory_bytes {options.kv_cache_memory_bytes:,} B "
            "leaves beside the null block; raise --kv-cache-memory-bytes",
            field="kv_cache_memory_bytes")
    if needed > available:
        fits = _estimate_max_len(groups, available, max_model_len, in_flight)
        raise InvalidArgument(
            f"one request of max_model_len {max_model_len:,} tokens needs {needed:,} B of KV "
            f"cache, more than the {available:,} B that kv_cache_memory_bytes "
            f"{options.kv_cache_memory_bytes:,} B leaves beside the null block"
            + (f"; at most {fits:,} tokens fit" if fits else "")
            + "; raise --kv-cache-memory-bytes or lower --max-model-len",
            field="kv_cache_memory_bytes")


def _strides(spec: LayerSpec, num_blocks: int, num_layers: int,
             layout: VllmLayout) -> tuple[int, int]:
    """(layer stride, block stride) in bytes of ``spec``'s layers in ``layout``
    (vLLM's ``compute_layout_strides``: the memory order of [L, B, H, N, C], a padded page
    widening the stride of the page grid's inner axis)."""
    shape = {"L": num_layers, "B": num_blocks, "H": spec.heads, "N": spec.tokens,
             "C": spec.content_bytes}
    order = layout.value
    grid_end = max(order.index("L"), order.index("B"))
    strides: dict[str, int] = {}
    current = 1
    for position in range(len(order) - 1, -1, -1):
        axis = order[position]
        if spec.page_size_padded is not None and position == grid_end:
            current = max(current, spec.page_size_padded)
        strides[axis] = current
        current *= shape[axis]
    return strides["L"], strides["B"]


def _tensors(groups: list[Group], num_blocks: int, layout: VllmLayout) -> list[VllmTensor]:
    size = bytes_per_block(groups) * num_blocks
    out = []
    for g in groups:
        by_spec: dict[LayerSpec, list[str]] = {}
        for n in g.layers:
            by_spec.setdefault(n.spec if g.uniform_type else g.spec, []).append(n.name)
        offset = 0
        for spec, names in by_spec.items():
            layer_stride, block_stride = _strides(spec, num_blocks, len(names), layout)
            out.append(VllmTensor(size=size, layers=tuple(names), layer_stride=layer_stride,
                                  block_stride=block_stride, offset=offset))
            offset += len(names) * layer_stride
    return out


def _max_model_len(model: VllmModel, options: VllmOptions) -> int:
    """The user's ``max_model_len``, at most the model's, else the model's. A config that
    states no length (the Mamba models') has vLLM's default 2,048 and takes any length asked
    (vLLM checks nothing then).

    Raises:
        InvalidArgument: a length above the length the model's config states.
    """
    derived = model.derived_max_model_len
    asked = options.max_model_len
    if asked is None:
        return derived
    if model.max_len_key is None:
        return asked
    if asked > derived and (model.model_max_length is None or asked > model.model_max_length):
        raise InvalidArgument(
            f"max_model_len {asked:,} exceeds the model's {derived:,} "
            f"({model.max_len_key or 'default'} in its config); lower --max-model-len",
            field="max_model_len")
    return asked


# vLLM 0.32's ``EngineArgs.get_batch_defaults``: (max_num_batched_tokens, max_num_seqs) by
# platform and entry point; the CPU platform's are per rank (times TP x PP).
BATCH_DEFAULTS: dict[VllmPlatform, dict[VllmEntrypoint, tuple[int, int]]] = {
    VllmPlatform.cpu: {VllmEntrypoint.llm: (4096, 256), VllmEntrypoint.serve: (2048, 128)},
    VllmPlatform.gpu: {VllmEntrypoint.llm: (8192, 256), VllmEntrypoint.serve: (2048, 256)},
    VllmPlatform.gpu_70gib: {VllmEntrypoint.llm: (16384, 1024),
                             VllmEntrypoint.serve: (8192, 1024)},
    VllmPlatform.gpu_160gib: {VllmEntrypoint.llm: (16384, 1024),
                              VllmEntrypoint.serve: (16384, 1024)},
}


def batched_tokens(options: VllmOptions, max_model_len: int) -> int:
    """vLLM's ``max_num_batched_tokens``: the user's, else its default for the entry point
    and platform (``_set_default_max_num_seqs_and_batched_tokens_args``), at most
    ``max_num_seqs * max_model_len``.

    Worked example: ``LLM(...)`` on CPU with TP 2: 4,096 x 2 = 8,192 tokens; ``vllm serve``
    there: 4,096; a 16-token model on a B200: min(1,024 x 16, 16,384) = 16,384.
    """
    if options.max_num_batched_tokens is not None:
        return options.max_num_batched_tokens
    tokens, seqs = BATCH_DEFAULTS[options.platform][options.entrypoint]
    if options.platform is VllmPlatform.cpu:
        world = options.tp_size * options.pp_size
        tokens, seqs = tokens * world, seqs * world
    # chunked prefill is on for every generative model vLLM plans here, so no max_model_len
    # floor; the cap keeps a tiny model's batch within what its sequences can hold
    return min(seqs * max_model_len, tokens)


def _in_flight_tokens(options: VllmOptions, batched: int) -> int:
    """vLLM's ``max_in_flight_tokens``: a batch per pipeline stage (two with async
    scheduling and one stage) of ``max_num_batched_tokens`` each."""
    batches = options.pp_size
    if options.async_scheduling and options.pp_size == 1:
        batches = 2
    return batches * batched


def _layer_record(name: str, s: LayerSpec) -> VllmLayerSpec:
    return VllmLayerSpec(name=name, type=s.type, block_size=s.block_size,
                         num_kv_heads=s.num_kv_heads, head_size=s.head_size,
                         head_size_v=s.head_size_v, dtype=s.dtype,
                         sliding_window=s.sliding_window, page_size_padded=s.page_size_padded,
                         page_size_bytes=s.page_size_bytes)


def _group_record(g: Group) -> VllmGroup:
    return VllmGroup(layer_names=tuple(n.name for n in g.layers), type=g.spec.type,
                     block_size=g.block_size, page_size_bytes=g.page_size_bytes,
                     sliding_window=g.spec.sliding_window, uniform_type=g.uniform_type)


# what a state layer is called in the notes, by "is it a Mamba mixer"
_STATE_WORD = {False: "linear-attention", True: "Mamba"}


def _state_word(model: VllmModel) -> str:
    return "Kimi delta attention" if model.is_kda else _STATE_WORD[model.gdn is None]


def _refuse_without_a_path(model: VllmModel, options: VllmOptions, facts: BackendFacts,
                           block_size: int, dtype: str) -> None:
    """What vLLM 0.32 cannot run on this backend, refused with vLLM's reasons.

    Kimi Linear on the CPU backend: its model class (``KimiLinearModel``) opens a CUDA stream
    while it is built, so vLLM has no CPU path for it on any CPU; with prefix caching on,
    vLLM's config check refuses first (the CPU platform turns prefix caching off for MLA on a
    CPU without AMX after the hybrid hook set ``mamba_block_size`` to the block size). And an
    MLA hybrid on an MLA kernel of one block size (CPU_MLA: 16) cannot take the block its
    state pages need.

    Raises:
        InvalidArgument: naming what vLLM does and what it would need.
    """
    aligned, _ = align_hybrid_block_size(model, options, block_size, dtype, facts)
    name = model.architecture or model.model_type
    if model.is_kda and not facts.cuda:
        first = ("" if options.no_enable_prefix_caching else
                 "with prefix caching on, vLLM's config check refuses it first (\"--mamba-"
                 "block-size can only be set with --enable-prefix-caching\": the CPU platform "
                 "turns prefix caching off for MLA after the hybrid hook set the state block); "
                 "without it, ")
        raise InvalidArgument(
            f"vLLM {VLLM_VERSION} has no {options.backend.value} path for {name}: {first}its "
            "model class (KimiLinearModel) opens a CUDA stream while it is built, and the CPU "
            f"MLA kernel runs {facts.mla_block_size}-token blocks only where a Kimi delta "
            f"attention state of {state_bytes(model, options):,} B needs {aligned:,} tokens of "
            "MLA page. kvpool's vLLM profile plans vLLM's CPU backend (--backend); plan this "
            "model for SGLang, or from a spec file", field="model_config")
    if model.is_mla and model.has_state and facts.mla_exact_block and aligned != block_size:
        raise InvalidArgument(
            f"vLLM {VLLM_VERSION} refuses {name} on its {options.backend.value} backend: a "
            f"{_state_word(model)} state page needs a {aligned:,}-token block, which its MLA "
            f"kernel (block {facts.mla_block_size} only) does not run (\"Aligned KV cache block "
            "size ... is not supported\")", field="model_config")


def _ssm_why(model: VllmModel, options: VllmOptions, ssm: str) -> str:
    """Who set the SSM dtype: the flag, the model's config hook, or the CPU platform."""
    if model.is_kda:
        return "vLLM's Kimi delta attention layers keep float32 recurrent states"
    if options.mamba_ssm_cache_dtype is not VllmMambaDType.auto \
            and options.mamba_ssm_cache_dtype.value == ssm:
        return "--mamba-ssm-cache-dtype"
    if model.mamba is not None and model.mamba.auto_ssm_dtype == ssm \
            and options.mamba_ssm_cache_dtype is VllmMambaDType.auto:
        return f"vLLM's default for {model.architecture or model.model_type}"
    return "vLLM's CPU platform on a CPU with AVX-512 BF16"


def _mamba_note(model: VllmModel, options: VllmOptions, block_size: int, dtype: str,
                max_model_len: int) -> str:
    """One request's Mamba state on one TP rank, its parts and its padded page (an
    attention-free model: what its blocks are instead of KV pages)."""
    assert model.mamba is not None
    conv, ssm = model.mamba.split(options.tp_size)
    conv_dtype, ssm_dtype = model_dtype(model, options), ssm_state_dtype(model, options)
    conv_b, ssm_b = conv * ITEMSIZE[conv_dtype], ssm * ITEMSIZE[ssm_dtype]
    padded = align_hybrid_block_size(model, options, block_size, dtype)[1]
    count = sum(layer.kind is LayerKind.mamba for layer in model.layers)
    head = (f"Mamba-{model.mamba.version} state per request and layer: conv {conv_b:,} B "
            f"({conv_dtype}) + SSM {ssm_b:,} B ({ssm_dtype}) = {conv_b + ssm_b:,} B")
    if not model.is_attention_free:
        return (head + (f", padded to {padded:,} B" if padded else "")
                + f"; {count} state layers, their groups beside the attention groups")
    state_block = state_block_size(model, options, block_size, max_model_len)
    return (head + f"; {count} state layers and no attention layer: vLLM plans the model "
            "attention-free (no KV pages: a block holds one request's state in each layer; "
            f"states kept per {state_block:,} tokens, block_size {block_size} sizes nothing)")


def _kda_note(model: VllmModel, options: VllmOptions, block_size: int, dtype: str,
              facts: BackendFacts) -> str:
    """One request's Kimi delta attention state on one TP rank, its parts and padded page."""
    assert model.gdn is not None
    gdn, tp = model.gdn, options.tp_size
    conv_dtype = model_dtype(model, options)
    conv_b = 3 * gdn.num_value_heads * gdn.value_head_dim // tp * (gdn.conv_kernel - 1) \
        * ITEMSIZE[conv_dtype]
    ssm_b = state_bytes(model, options) - conv_b
    padded = align_hybrid_block_size(model, options, block_size, dtype, facts)[1]
    count = sum(layer.kind is LayerKind.linear for layer in model.layers)
    return (f"Kimi delta attention state per request and layer: conv {conv_b:,} B "
            f"({conv_dtype}) + recurrent {ssm_b:,} B (float32) = {conv_b + ssm_b:,} B"
            + (f", padded to {padded:,} B" if padded else "")
            + f"; {count} state layers, their groups beside the MLA groups")


def plan_vllm_model(model: VllmModel, options: VllmOptions,
                    facts: BackendFacts | None = None) -> VllmPlan:
    """vLLM's KV cache for worker ``options.pp_rank`` (every TP rank of a stage is alike).

    ``facts``: the attention backend's facts, default ``options.backend``'s (a test gives a GPU
    backend's to follow vLLM's GPU code path by hand).

    Raises:
        InvalidArgument: a knob vLLM refuses, a model it cannot run on the backend, or memory
            that does not hold one request of ``max_model_len`` (naming needed and available
            bytes and the knob to turn).
    """
    if options.pp_size > 1 and not model.pipeline_parallel:
        raise InvalidArgument(
            f"vLLM {VLLM_VERSION} runs {model.architecture or model.model_type} in one pipeline "
            f"stage only (its model class does not implement SupportsPP: \"Pipeline parallelism "
            f"is not supported for this model\"), asked pp_size {options.pp_size}; use "
            "--pp-size 1", field="pp_size")
    notes: list[str] = []
    if model.decided_by:
        kinds = ", ".join(dict.fromkeys(layer.kind.value for layer in model.layers))
        notes.append(f"layers {kinds} decided by {', '.join(model.decided_by)} (as vLLM "
                     f"{VLLM_VERSION} reads them)")
    facts = backend_facts(options, facts)
    block_size = resolve_block_size(model, options, notes, facts)
    dtype = resolve_cache_dtype(model, options, facts)
    _refuse_without_a_path(model, options, facts, block_size, dtype)
    kda_check_ssm_dtype(model, options)
    max_model_len = _max_model_len(model, options)
    if model.has_state:
        ssm = ssm_state_dtype(model, options)
        if ssm != model_dtype(model, options):
            notes.append(f"{_state_word(model)} SSM states are {ssm} "
                         f"({_ssm_why(model, options, ssm)}); conv states "
                         f"{model_dtype(model, options)}")
    if model.mamba is not None:
        notes.append(_mamba_note(model, options, block_size, dtype, max_model_len))
    if model.is_kda:
        notes.append(_kda_note(model, options, block_size, dtype, facts))
    aligned, _ = align_hybrid_block_size(model, options, block_size, dtype, facts)
    if aligned != block_size:
        notes.append(f"block_size {block_size} raised to {aligned}: an attention page holds "
                     f"one {_state_word(model)} state")
        block_size = aligned
    layout = (NO_ATTENTION_LAYOUT if model.is_attention_free else
              facts.mla_layout if model.is_mla else facts.layout)
    hybrid = not options.disable_hybrid_kv_cache_manager
    batched = batched_tokens(options, max_model_len)
    if options.max_num_batched_tokens is None and any(
            layer.kind is LayerKind.sliding for layer in model.layers):
        notes.append(f"max_num_batched_tokens {batched:,}: vLLM's default for "
                     f"--entrypoint {options.entrypoint.value} on --platform "
                     f"{options.platform.value} (it sets the blocks a sliding window holds)")
    in_flight = _in_flight_tokens(options, batched)

    layers = layer_specs(model, options, block_size, dtype, max_model_len, facts)
    groups = kv_cache_groups(layers, hybrid=hybrid)
    stages = [project(groups, range(*stage_bounds(model.num_decoder_layers, rank, options.pp_size)))
              for rank in range(options.pp_size)]
    memory = options.kv_cache_memory_bytes
    counts = []
    for stage in stages:
        per_block = bytes_per_block(stage)
        available = memory
        if options.num_gpu_blocks_override is not None:
            available = options.num_gpu_blocks_override * per_block
        _check_capacity(stage, available - per_block, options, max_model_len, in_flight)
        counts.append(options.num_gpu_blocks_override or memory // per_block)
    num_blocks = min(counts)
    mine = stages[options.pp_rank]
    start, end = stage_bounds(model.num_decoder_layers, options.pp_rank, options.pp_size)
    per_block = bytes_per_block(mine)
    if options.num_gpu_blocks_override is not None:
        notes.append(f"num_gpu_blocks_override {options.num_gpu_blocks_override} fixes the "
                     f"block count (the memory holds {memory // per_block})")
    elif num_blocks < counts[options.pp_rank]:
        notes.append(f"another pipeline stage holds only {num_blocks} blocks; this one "
                     f"takes as many")
    request_blocks = sum(_group_blocks(g, max_model_len, in_flight) for g in mine)
    return VllmPlan(
        model_architecture=model.architecture,
        num_blocks=num_blocks,
        bytes_per_block=per_block,
        size_bytes=num_blocks * per_block,
        kv_cache_memory_bytes=memory,
        block_size=block_size,
        cache_dtype=dtype,
        layout=layout,
        max_model_len=max_model_len,
        hybrid=hybrid,
        tp_size=options.tp_size,
        pp_size=options.pp_size,
        pp_rank=options.pp_rank,
        layers=tuple(_layer_record(n.name, n.spec) for n in layers if start <= n.index < end),
        groups=tuple(_group_record(g) for g in mine),
        tensors=tuple(_tensors(mine, num_blocks, layout)),
        max_concurrency=num_blocks / request_blocks,
        notes=tuple(notes),
    )


def plan_vllm(config: Mapping[str, Any], options: VllmOptions, *,
              where: str = "config.json") -> VllmPlan:
    """Read a HF config as vLLM does and plan its KV cache (:func:`plan_vllm_model`).

    Raises:
        InvalidArgument: a config the profile cannot read, or a plan vLLM would refuse.
    """
    return plan_vllm_model(read_vllm_model(config, where=where), options)

"""vLLM 0.32's per-layer KV-cache specs: what each attention layer reports to the model
runner, and the bytes of one block of it.

One block of one layer holds ``block_size`` tokens of every KV head of this TP rank::

    page_size_bytes = num_kv_heads * block_size * (head_size + head_size_v) * itemsize

(MLA: one latent per token, ``num_kv_heads = 1``, ``head_size_v = 0``), or ``page_size_padded``
when vLLM pads the page to another layer's. Worked example, Llama-3.1-8B on CPU (block 128,
bf16, TP 1): 8 * 128 * 256 * 2 = 524,288 B per layer and block, 32 layers: 16 MiB per block.

The backend decides the rest (:data:`BACKENDS`): vLLM's CPU_ATTN runs kernel blocks that are
multiples of 32 tokens, so a sliding-window layer takes the largest multiple of 32 within
the primary block (at least 32), and the CPU MLA backend runs only 16-token blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.vllm_plan import (
    VllmBackend,
    VllmCacheDType,
    VllmLayout,
    VllmMambaDType,
    VllmModelDType,
    VllmOptions,
    VllmSpecType,
)
from kvpoold.sizing.vllm_host import has_avx512_bf16
from kvpoold.sizing.vllm_model import LayerKind, VllmModel

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}
# --kv-cache-dtype -> the stored element type (vLLM's STR_DTYPE_TO_TORCH_DTYPE: every fp8 form
# is stored as uint8, the kernels reading it as fp8)
CACHE_DTYPES = {
    VllmCacheDType.bfloat16: "bfloat16",
    VllmCacheDType.float16: "float16",
    VllmCacheDType.fp8: "uint8",
    VllmCacheDType.fp8_e4m3: "uint8",
    VllmCacheDType.fp8_e5m2: "uint8",
}


@dataclass(frozen=True)
class BackendFacts:
    """What an attention backend tells vLLM's KV-cache planning."""

    default_block_size: int
    kernel_block_multiple: int  # kernel blocks are multiples of this many tokens
    layout: VllmLayout  # the layout the engine core resolves for its layers
    mla_block_size: int  # MLA layers' block size (the MLA kernel's smallest block)
    mla_layout: VllmLayout
    cache_dtypes: tuple[VllmCacheDType, ...]
    # the MLA kernel runs mla_block_size only, no multiple of it (vLLM's CPU_MLA): a hybrid
    # block raised for a state page is refused (``_check_aligned_block_size``)
    mla_exact_block: bool = False
    # a CUDA platform: model classes that open CUDA streams while they are built (Kimi
    # Linear's) build only there
    cuda: bool = False


# vLLM's reference CPU MLA kernel (CPU_MLA), what vLLM's CPU platform picks on a CPU without
# AMX tiles (with them, an AMX MLA backend the profile does not plan: the differential
# harness has vLLM see a CPU without AMX).
BACKENDS: dict[VllmBackend, BackendFacts] = {
    VllmBackend.cpu: BackendFacts(
        default_block_size=128, kernel_block_multiple=32, layout=VllmLayout.LBHNC,
        mla_block_size=16, mla_layout=VllmLayout.LBNHC,
        cache_dtypes=tuple(VllmCacheDType), mla_exact_block=True,
    ),
}
# vLLM's hybrid alignment keeps an MLA model's block a multiple of this many tokens (its
# TRTLLM / FlashInfer MLA decode kernels' invariant, applied on every platform).
MLA_HYBRID_BLOCK_ALIGNMENT = 128
# vLLM's CacheConfig.DEFAULT_BLOCK_SIZE: what ``block_size`` is when the model's Mamba config
# hook copies it into ``mamba_block_size`` (with prefix caching, before the platform sets its
# own default, 128 on CPU). A hybrid's alignment then overwrites it; an attention-free model
# keeps it.
CACHE_DEFAULT_BLOCK_SIZE = 16
# The layout of a model with no attention layer: no backend declares one (vLLM's Mamba
# backends declare none), so vLLM takes the first of its default preference.
NO_ATTENTION_LAYOUT = VllmLayout.LBNHC


def backend_facts(options: VllmOptions, facts: BackendFacts | None = None) -> BackendFacts:
    """``facts``, else those of ``options.backend``."""
    return facts if facts is not None else BACKENDS[options.backend]


@dataclass(frozen=True)
class LayerSpec:
    """One layer's spec; equal specs are the same spec to vLLM's grouping (dataclass
    equality over every field, as vLLM's frozen ``KVCacheSpec`` dataclasses)."""

    type: VllmSpecType
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: str
    sliding_window: int | None = None
    page_size_padded: int | None = None
    state_bytes: int = 0  # mamba: one request's state, the whole page
    state_blocks: int = 0  # mamba: blocks a request holds (1; with prefix caching 2, Mamba-2 3)

    @property
    def unpadded_page_size_bytes(self) -> int:
        if self.type is VllmSpecType.mamba:
            return self.state_bytes
        return self.num_kv_heads * self.block_size * self.content_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.unpadded_page_size_bytes

    @property
    def content_bytes(self) -> int:
        """Bytes of one token of one KV head (vLLM's C axis; mamba: the whole state)."""
        if self.type is VllmSpecType.mamba:
            return self.state_bytes
        return (self.head_size + self.head_size_v) * ITEMSIZE[self.dtype]

    @property
    def heads(self) -> int:
        """vLLM's H axis (mamba: 1)."""
        return 1 if self.type is VllmSpecType.mamba else self.num_kv_heads

    @property
    def tokens(self) -> int:
        """vLLM's N axis: tokens per block (mamba: one state)."""
        return 1 if self.type is VllmSpecType.mamba else self.block_size

    def with_block_size(self, block_size: int) -> LayerSpec:
        return replace(self, block_size=block_size)


@dataclass(frozen=True)
class NamedSpec:
    index: int  # the model's layer index (pipeline stages split by it)
    name: str
    spec: LayerSpec


def layer_name(model: VllmModel, index: int, kind: LayerKind = LayerKind.full) -> str:
    """vLLM's name of a decoder layer's KV-cache module: its state's for a state layer, its
    attention's otherwise (the model class names them)."""
    if kind in (LayerKind.linear, LayerKind.mamba):
        return model.state_module.format(i=index + model.state_index_offset)
    return model.attention_module.format(i=index)


def model_dtype(model: VllmModel, options: VllmOptions | None = None) -> str:
    """The model dtype vLLM runs: ``options.dtype`` when set, else vLLM's ``dtype="auto"``:
    the checkpoint's half dtype (float32 is cast down to bfloat16)."""
    if options is not None and options.dtype is not VllmModelDType.auto:
        return options.dtype.value
    return "bfloat16" if model.dtype == "float32" else model.dtype


def kda_check_ssm_dtype(model: VllmModel, options: VllmOptions) -> None:
    """A Kimi delta attention model's ``--mamba-ssm-cache-dtype``: vLLM 0.32 sizes its block
    alignment with the flag's dtype (``get_mamba_state_dtype_from_config``) but the layers keep
    float32 recurrent states whatever it says, so only ``auto`` and ``float32`` plan.

    Raises:
        InvalidArgument: float16 (vLLM: "KDA recurrent state supports only auto, float32, and
            bfloat16") or bfloat16 (the bfloat16-sized page vLLM pads the state to is smaller
            than the float32 state its layers build: ``MambaSpec`` asserts).
    """
    asked = options.mamba_ssm_cache_dtype
    if not model.is_kda or asked in (VllmMambaDType.auto, VllmMambaDType.float32):
        return
    if asked is VllmMambaDType.float16:
        why = ("vLLM's KDA recurrent state supports only auto, float32 and bfloat16 "
               "(MambaStateDtypeCalculator.kda_state_dtype raises)")
    else:
        why = ("vLLM aligns the block to a bfloat16 recurrent state while its Kimi delta "
               "attention layers build float32 ones (their get_state_dtype does not pass the "
               "flag), so the padded state page is smaller than the state and vLLM's MambaSpec "
               "asserts")
    raise InvalidArgument(f"--mamba-ssm-cache-dtype {asked.value} with Kimi delta attention: "
                          f"{why}; use auto or float32", field="mamba_ssm_cache_dtype")


def ssm_state_dtype(model: VllmModel, options: VllmOptions) -> str:
    """The element type of a state layer's SSM state (vLLM's ``mamba_ssm_cache_dtype`` once
    the model's config hook and the platform have updated the config).

    ``--mamba-ssm-cache-dtype auto`` is what the model's hook sets (Nemotron-H: float32,
    :attr:`~kvpoold.sizing.vllm_model.MambaMixer.auto_ssm_dtype`), else the model dtype. On
    the CPU backend on a CPU with AVX-512 BF16
    (:func:`~kvpoold.sizing.vllm_host.has_avx512_bf16`) vLLM's CPU platform resets an
    ``auto`` that is still unset to float32, and keeps a named bfloat16 or float16 only when
    transformers' ``layer_types`` of the config lists ``linear_attention`` (Qwen3-Next's gated
    delta nets; Nemotron-H's, Jamba's and Granite-4.0-H's Mamba mixers, whose ``mamba`` layers
    transformers renames so), else stores float32 (Falcon-H1, whose ``layer_types`` is its
    ``layers_block_type``, ``hybrid`` in every layer:
    :attr:`~kvpoold.sizing.vllm_layers.MambaMixer.linear_layer_types`).
    """
    if model.is_kda:
        return "float32"  # kda_state_dtype: float32 under auto; the layers ignore the flag
    asked = options.mamba_ssm_cache_dtype
    hook = model.mamba.auto_ssm_dtype if model.mamba is not None else None
    dtype = asked.value if asked is not VllmMambaDType.auto else hook
    if options.backend is VllmBackend.cpu and has_avx512_bf16(options) and (
            dtype is None or (dtype != "float32" and model.mamba is not None
                              and not model.mamba.linear_layer_types)):
        return "float32"
    return dtype or model_dtype(model, options)


def state_bytes(model: VllmModel, options: VllmOptions) -> int:
    """One request's state (a gated delta net's or a Mamba mixer's) on one TP rank: the conv
    state in the model dtype, the SSM state in :func:`ssm_state_dtype`.

    Raises:
        InvalidArgument: a Mamba dimension that does not split over ``tp_size``.
    """
    state = model.gdn if model.gdn is not None else model.mamba
    assert state is not None
    return state.state_bytes(options.tp_size, ITEMSIZE[model_dtype(model, options)],
                             ITEMSIZE[ssm_state_dtype(model, options)])


def resolve_block_size(model: VllmModel, options: VllmOptions, notes: list[str],
                       facts: BackendFacts | None = None) -> int:
    """The engine's ``cache_config.block_size``: the user's, else the backend's; MLA on CPU
    always runs the MLA kernel's block size (elsewhere the MLA kernel's preferred one)."""
    facts = backend_facts(options, facts)
    if model.is_mla:
        if options.block_size not in (None, facts.mla_block_size):
            notes.append(f"MLA on the {options.backend} backend runs block_size "
                         f"{facts.mla_block_size}; --block-size {options.block_size} ignored")
        return facts.mla_block_size
    return options.block_size or facts.default_block_size


def resolve_cache_dtype(model: VllmModel, options: VllmOptions,
                        facts: BackendFacts | None = None) -> str:
    """The stored element type.

    Raises:
        InvalidArgument: a cache dtype the backend does not run.
    """
    facts = backend_facts(options, facts)
    if options.kv_cache_dtype not in facts.cache_dtypes:
        accepted = ", ".join(d.value for d in facts.cache_dtypes)
        raise InvalidArgument(
            f"kv cache dtype {options.kv_cache_dtype} is not run by vLLM's {options.backend} "
            f"attention backend (accepted: {accepted}); change --kv-cache-dtype",
            field="kv_cache_dtype")
    if options.kv_cache_dtype is VllmCacheDType.auto:
        return "uint8" if model.kv_cache_fp8 else model_dtype(model, options)
    return CACHE_DTYPES[options.kv_cache_dtype]


def _sliding_block_size(facts: BackendFacts, block_size: int) -> int:
    """The largest kernel block within the primary block, else the smallest kernel block."""
    m = facts.kernel_block_multiple
    return max(m, block_size // m * m)


def attention_page_per_token(model: VllmModel, options: VllmOptions, dtype: str) -> int:
    """One token's bytes in one attention layer's page on one TP rank: K and V of the rank's
    KV heads, or MLA's one latent (``kv_lora_rank + qk_rope_head_dim``)."""
    if model.is_mla:
        return model.head_size * ITEMSIZE[dtype]
    return max(1, model.num_kv_heads // options.tp_size) * 2 * model.head_size * ITEMSIZE[dtype]


def align_hybrid_block_size(model: VllmModel, options: VllmOptions, block_size: int,
                            dtype: str, facts: BackendFacts | None = None,
                            ) -> tuple[int, int | None]:
    """Models with state layers (gated delta nets, Kimi delta attention, Mamba mixers): the
    block size at which an attention page holds one state, and the padded state page (the
    platform's ``update_block_size_for_backend``, ``_align_hybrid_block_size``).

    With ``k`` the attention kernel's smallest block (MLA: its MLA kernel's), the alignment is
    ``a = max(k, block_size)``, raised to 128 for MLA; the block grows to ``a * ceil(state /
    (a * attention bytes per token))``, rounded up to a multiple of ``k``; the state page is
    padded to the attention page. Qwen3-Next on CPU (2 KV heads of 256, bf16: 2,048 B per
    token) with a bfloat16 SSM state (a 1,097,728 B state): ``128 * ceil(1,097,728 /
    262,144) = 640`` tokens, states padded to 1,310,720 B; with the float32 SSM state of a
    CPU with AVX-512 BF16 (:func:`ssm_state_dtype`; 2,146,304 B): ``128 * 9 = 1,152``
    tokens, states padded to 2,359,296 B. Nemotron-H-56B (8 KV heads of 128: 4,096 B per
    token; a 16,900,096 B state, :class:`~kvpoold.sizing.vllm_model.MambaMixer`): ``128 *
    ceil(16,900,096 / 524,288) = 4,224`` tokens, states padded to 17,301,504 B. Kimi Linear
    (MLA: 576 * 2 = 1,152 B per token; a 2,170,880 B KDA state), any MLA kernel of at most 128
    tokens: ``128 * ceil(2,170,880 / 147,456) = 1,920`` tokens, states padded to 2,211,840 B.
    """
    if not model.has_state or model.is_attention_free:
        return block_size, None  # no attention backend to align (vLLM returns early)
    facts = backend_facts(options, facts)
    per_token = attention_page_per_token(model, options, dtype)
    state = state_bytes(model, options)
    m = facts.mla_block_size if model.is_mla else facts.kernel_block_multiple
    align = max(m, block_size)
    if model.is_mla:
        align = max(align, MLA_HYBRID_BLOCK_ALIGNMENT)
    aligned = align * -(-state // (align * per_token))
    aligned = m * -(-aligned // m)
    block_size = max(block_size, aligned)
    page = block_size * per_token
    return block_size, (page if page != state else None)


def state_block_size(model: VllmModel, options: VllmOptions, block_size: int,
                     max_model_len: int) -> int:
    """vLLM's ``mamba_block_size``, the block size of a state layer's spec: without prefix
    caching one state covers the whole request (``max_model_len``); with it (mode "align")
    states are kept per block: a hybrid's aligned attention block (``block_size``), an
    attention-free model's ``--block-size``, else :data:`CACHE_DEFAULT_BLOCK_SIZE` (the value
    the model's config hook saw; the CPU platform's 128 comes later and sizes nothing)."""
    if options.no_enable_prefix_caching:
        return max_model_len
    if model.is_attention_free:
        return options.block_size or CACHE_DEFAULT_BLOCK_SIZE
    return block_size


def layer_specs(model: VllmModel, options: VllmOptions, block_size: int,
                dtype: str, max_model_len: int,
                facts: BackendFacts | None = None) -> list[NamedSpec]:
    """Every layer's spec on one TP rank, in layer order (``block_size`` already aligned by
    :func:`align_hybrid_block_size`).

    Raises:
        InvalidArgument: attention heads that do not split over ``tp_size``.
    """
    tp = options.tp_size
    if model.num_attention_heads % tp:
        raise InvalidArgument(
            f"the model's {model.num_attention_heads} attention heads do not split over "
            f"tp_size {tp}; choose a --tp-size that divides them", field="tp_size")
    facts = backend_facts(options, facts)
    heads = max(1, model.num_kv_heads // tp)
    state_padded = align_hybrid_block_size(model, options, block_size, dtype, facts)[1]
    state_block = state_block_size(model, options, block_size, max_model_len)
    # a request holds its running state; with prefix caching also the one it came from and
    # a Mamba-2 mixer's prefill checkpoint
    state_blocks = 1 if options.no_enable_prefix_caching else 2 + (
        model.mamba.checkpoint_blocks if model.mamba is not None else 0)
    out = []
    for layer in model.layers:
        if layer.kind is LayerKind.ffn:
            continue  # an MLP / MoE block: no KV-cache module
        if layer.kind in (LayerKind.linear, LayerKind.mamba):
            spec = LayerSpec(VllmSpecType.mamba, state_block, 0, 0, 0,
                             model_dtype(model, options),
                             page_size_padded=state_padded,
                             state_bytes=state_bytes(model, options),
                             state_blocks=state_blocks)
        elif layer.kind is LayerKind.mla:
            spec = LayerSpec(VllmSpecType.mla, block_size, 1, model.head_size, 0, dtype)
        elif layer.kind is LayerKind.sliding:
            spec = LayerSpec(VllmSpecType.sliding_window, _sliding_block_size(facts, block_size),
                             heads, model.head_size, model.head_size, dtype,
                             sliding_window=layer.sliding_window)
        else:
            spec = LayerSpec(VllmSpecType.full_attention, block_size, heads, model.head_size,
                             model.head_size, dtype)
        named = layer.index if layer.name_index is None else layer.name_index
        out.append(NamedSpec(layer.index, layer_name(model, named, layer.kind), spec))
    return out


def stage_bounds(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """vLLM's pipeline split (``get_pp_indices``): an even split, the remainder given one each
    to the stages before the last, from the second-to-last backwards (12 layers over 5
    stages: 2, 2, 3, 3, 2).

    Raises:
        InvalidArgument: more stages than layers.
    """
    if pp_size > num_layers:
        raise InvalidArgument(f"pp_size {pp_size} exceeds the model's {num_layers} layers; "
                              "lower --pp-size", field="pp_size")
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]

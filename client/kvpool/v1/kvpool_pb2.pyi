from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_PENDING: _ClassVar[TransferState]
    TRANSFER_STATE_DONE: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_PENDING: TransferState
TRANSFER_STATE_DONE: TransferState
TRANSFER_STATE_FAILED: TransferState

class MHAAttention(_message.Message):
    __slots__ = ("num_kv_heads", "head_dim", "v_head_dim")
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    V_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    def __init__(self, num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., v_head_dim: _Optional[int] = ...) -> None: ...

class MLAAttention(_message.Message):
    __slots__ = ("kv_lora_rank", "qk_rope_head_dim")
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    kv_lora_rank: int
    qk_rope_head_dim: int
    def __init__(self, kv_lora_rank: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ...) -> None: ...

class SlidingWindow(_message.Message):
    __slots__ = ("window", "layers", "num_kv_heads", "head_dim", "v_head_dim")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    V_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    window: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    def __init__(self, window: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., v_head_dim: _Optional[int] = ...) -> None: ...

class DSAIndexer(_message.Message):
    __slots__ = ("index_head_dim",)
    INDEX_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    index_head_dim: int
    def __init__(self, index_head_dim: _Optional[int] = ...) -> None: ...

class LinearAttention(_message.Message):
    __slots__ = ("full_attention_layers", "conv_kernel", "num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_dtype", "ssm_dtype", "state_layers", "conv_layout")
    FULL_ATTENTION_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CONV_KERNEL_FIELD_NUMBER: _ClassVar[int]
    NUM_KEY_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_VALUE_HEADS_FIELD_NUMBER: _ClassVar[int]
    KEY_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VALUE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    CONV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SSM_DTYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CONV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    full_attention_layers: _containers.RepeatedScalarFieldContainer[int]
    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_dtype: str
    ssm_dtype: str
    state_layers: _containers.RepeatedScalarFieldContainer[int]
    conv_layout: str
    def __init__(self, full_attention_layers: _Optional[_Iterable[int]] = ..., conv_kernel: _Optional[int] = ..., num_key_heads: _Optional[int] = ..., num_value_heads: _Optional[int] = ..., key_head_dim: _Optional[int] = ..., value_head_dim: _Optional[int] = ..., conv_dtype: _Optional[str] = ..., ssm_dtype: _Optional[str] = ..., state_layers: _Optional[_Iterable[int]] = ..., conv_layout: _Optional[str] = ...) -> None: ...

class DSV4Compression(_message.Message):
    __slots__ = ("compress_ratios", "window_size", "nope_head_dim", "rope_head_dim", "index_head_dim", "state_dtype")
    COMPRESS_RATIOS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    NOPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    INDEX_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    compress_ratios: _containers.RepeatedScalarFieldContainer[int]
    window_size: int
    nope_head_dim: int
    rope_head_dim: int
    index_head_dim: int
    state_dtype: str
    def __init__(self, compress_ratios: _Optional[_Iterable[int]] = ..., window_size: _Optional[int] = ..., nope_head_dim: _Optional[int] = ..., rope_head_dim: _Optional[int] = ..., index_head_dim: _Optional[int] = ..., state_dtype: _Optional[str] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("num_layers", "mha", "mla", "context_length", "dtype", "architecture", "sliding_window", "indexer", "linear", "dsv4", "num_nextn_predict_layers", "kv_cache_quant_fp8", "multimodal")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MHA_FIELD_NUMBER: _ClassVar[int]
    MLA_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    INDEXER_FIELD_NUMBER: _ClassVar[int]
    LINEAR_FIELD_NUMBER: _ClassVar[int]
    DSV4_FIELD_NUMBER: _ClassVar[int]
    NUM_NEXTN_PREDICT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_QUANT_FP8_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    mha: MHAAttention
    mla: MLAAttention
    context_length: int
    dtype: str
    architecture: str
    sliding_window: SlidingWindow
    indexer: DSAIndexer
    linear: LinearAttention
    dsv4: DSV4Compression
    num_nextn_predict_layers: int
    kv_cache_quant_fp8: bool
    multimodal: bool
    def __init__(self, num_layers: _Optional[int] = ..., mha: _Optional[_Union[MHAAttention, _Mapping]] = ..., mla: _Optional[_Union[MLAAttention, _Mapping]] = ..., context_length: _Optional[int] = ..., dtype: _Optional[str] = ..., architecture: _Optional[str] = ..., sliding_window: _Optional[_Union[SlidingWindow, _Mapping]] = ..., indexer: _Optional[_Union[DSAIndexer, _Mapping]] = ..., linear: _Optional[_Union[LinearAttention, _Mapping]] = ..., dsv4: _Optional[_Union[DSV4Compression, _Mapping]] = ..., num_nextn_predict_layers: _Optional[int] = ..., kv_cache_quant_fp8: _Optional[bool] = ..., multimodal: _Optional[bool] = ...) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("pool", "hf_config_json", "spec", "budget_bytes", "max_total_tokens", "page_size", "kv_cache_dtype", "tp_size", "pp_size", "pp_rank", "context_length", "max_running_requests", "speculative_algorithm", "speculative_num_draft_layers", "swa_full_tokens_ratio", "mamba_full_memory_ratio", "disable_radix_cache", "dry_run", "speculative_num_draft_tokens", "allow_longer_context", "mamba_radix_cache_strategy", "chunked_prefill_size", "disable_overlap_schedule", "assume_architecture", "gpu", "elastic", "elastic_floor_tokens", "elastic_cap_tokens", "elastic_weight", "swa_pairing", "engine", "vllm")
    POOL_FIELD_NUMBER: _ClassVar[int]
    HF_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_NUM_DRAFT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SWA_FULL_TOKENS_RATIO_FIELD_NUMBER: _ClassVar[int]
    MAMBA_FULL_MEMORY_RATIO_FIELD_NUMBER: _ClassVar[int]
    DISABLE_RADIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_LONGER_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAMBA_RADIX_CACHE_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_PREFILL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DISABLE_OVERLAP_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    ASSUME_ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FLOOR_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_CAP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SWA_PAIRING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    VLLM_FIELD_NUMBER: _ClassVar[int]
    pool: str
    hf_config_json: str
    spec: ModelSpec
    budget_bytes: int
    max_total_tokens: int
    page_size: int
    kv_cache_dtype: str
    tp_size: int
    pp_size: int
    pp_rank: int
    context_length: int
    max_running_requests: int
    speculative_algorithm: str
    speculative_num_draft_layers: int
    swa_full_tokens_ratio: float
    mamba_full_memory_ratio: float
    disable_radix_cache: bool
    dry_run: bool
    speculative_num_draft_tokens: int
    allow_longer_context: bool
    mamba_radix_cache_strategy: str
    chunked_prefill_size: int
    disable_overlap_schedule: bool
    assume_architecture: str
    gpu: str
    elastic: bool
    elastic_floor_tokens: int
    elastic_cap_tokens: int
    elastic_weight: float
    swa_pairing: str
    engine: str
    vllm: VllmOptions
    def __init__(self, pool: _Optional[str] = ..., hf_config_json: _Optional[str] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., budget_bytes: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., context_length: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., speculative_algorithm: _Optional[str] = ..., speculative_num_draft_layers: _Optional[int] = ..., swa_full_tokens_ratio: _Optional[float] = ..., mamba_full_memory_ratio: _Optional[float] = ..., disable_radix_cache: _Optional[bool] = ..., dry_run: _Optional[bool] = ..., speculative_num_draft_tokens: _Optional[int] = ..., allow_longer_context: _Optional[bool] = ..., mamba_radix_cache_strategy: _Optional[str] = ..., chunked_prefill_size: _Optional[int] = ..., disable_overlap_schedule: _Optional[bool] = ..., assume_architecture: _Optional[str] = ..., gpu: _Optional[str] = ..., elastic: _Optional[bool] = ..., elastic_floor_tokens: _Optional[int] = ..., elastic_cap_tokens: _Optional[int] = ..., elastic_weight: _Optional[float] = ..., swa_pairing: _Optional[str] = ..., engine: _Optional[str] = ..., vllm: _Optional[_Union[VllmOptions, _Mapping]] = ...) -> None: ...

class VllmOptions(_message.Message):
    __slots__ = ("kv_cache_memory_bytes", "block_size", "kv_cache_dtype", "tp_size", "pp_size", "pp_rank", "max_model_len", "num_gpu_blocks_override", "disable_hybrid_kv_cache_manager", "max_num_batched_tokens", "async_scheduling", "no_enable_prefix_caching", "backend", "dtype", "mamba_ssm_cache_dtype", "cpu_avx512_bf16", "entrypoint", "platform")
    KV_CACHE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    DISABLE_HYBRID_KV_CACHE_MANAGER_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ASYNC_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    NO_ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SSM_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CPU_AVX512_BF16_FIELD_NUMBER: _ClassVar[int]
    ENTRYPOINT_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    kv_cache_memory_bytes: int
    block_size: int
    kv_cache_dtype: str
    tp_size: int
    pp_size: int
    pp_rank: int
    max_model_len: int
    num_gpu_blocks_override: int
    disable_hybrid_kv_cache_manager: bool
    max_num_batched_tokens: int
    async_scheduling: bool
    no_enable_prefix_caching: bool
    backend: str
    dtype: str
    mamba_ssm_cache_dtype: str
    cpu_avx512_bf16: str
    entrypoint: str
    platform: str
    def __init__(self, kv_cache_memory_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_gpu_blocks_override: _Optional[int] = ..., disable_hybrid_kv_cache_manager: _Optional[bool] = ..., max_num_batched_tokens: _Optional[int] = ..., async_scheduling: _Optional[bool] = ..., no_enable_prefix_caching: _Optional[bool] = ..., backend: _Optional[str] = ..., dtype: _Optional[str] = ..., mamba_ssm_cache_dtype: _Optional[str] = ..., cpu_avx512_bf16: _Optional[str] = ..., entrypoint: _Optional[str] = ..., platform: _Optional[str] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ("plan_json", "fingerprint", "created", "dry_run", "budget_available_bytes")
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    BUDGET_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    plan_json: str
    fingerprint: str
    created: bool
    dry_run: bool
    budget_available_bytes: int
    def __init__(self, plan_json: _Optional[str] = ..., fingerprint: _Optional[str] = ..., created: _Optional[bool] = ..., dry_run: _Optional[bool] = ..., budget_available_bytes: _Optional[int] = ...) -> None: ...

class OpenLeaseRequest(_message.Message):
    __slots__ = ("name", "ttl_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ttl_seconds: float
    def __init__(self, name: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class OpenLeaseResponse(_message.Message):
    __slots__ = ("lease_id", "ttl_seconds", "lease_secret")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    ttl_seconds: float
    lease_secret: bytes
    def __init__(self, lease_id: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., lease_secret: _Optional[bytes] = ...) -> None: ...

class CacheReport(_message.Message):
    __slots__ = ("pool", "space", "cached", "in_use", "evictable")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SPACE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    space: str
    cached: int
    in_use: int
    evictable: int
    def __init__(self, pool: _Optional[str] = ..., space: _Optional[str] = ..., cached: _Optional[int] = ..., in_use: _Optional[int] = ..., evictable: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("lease_id", "caches", "seq", "lease_secret", "unmapped")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CACHES_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    UNMAPPED_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    caches: _containers.RepeatedCompositeFieldContainer[CacheReport]
    seq: int
    lease_secret: bytes
    unmapped: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., caches: _Optional[_Iterable[_Union[CacheReport, _Mapping]]] = ..., seq: _Optional[int] = ..., lease_secret: _Optional[bytes] = ..., unmapped: _Optional[_Iterable[int]] = ...) -> None: ...

class GiveBack(_message.Message):
    __slots__ = ("pool", "space", "count", "min_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SPACE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MIN_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    space: str
    count: int
    min_id: int
    def __init__(self, pool: _Optional[str] = ..., space: _Optional[str] = ..., count: _Optional[int] = ..., min_id: _Optional[int] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_id", "ttl_seconds", "expires_in_seconds", "give_back", "seq", "unmap")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GIVE_BACK_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    UNMAP_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    ttl_seconds: float
    expires_in_seconds: float
    give_back: _containers.RepeatedCompositeFieldContainer[GiveBack]
    seq: int
    unmap: _containers.RepeatedCompositeFieldContainer[Unmap]
    def __init__(self, lease_id: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., expires_in_seconds: _Optional[float] = ..., give_back: _Optional[_Iterable[_Union[GiveBack, _Mapping]]] = ..., seq: _Optional[int] = ..., unmap: _Optional[_Iterable[_Union[Unmap, _Mapping]]] = ...) -> None: ...

class Unmap(_message.Message):
    __slots__ = ("pool", "groups", "reclaim", "deadline_seconds")
    POOL_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    groups: bytes
    reclaim: int
    deadline_seconds: float
    def __init__(self, pool: _Optional[str] = ..., groups: _Optional[bytes] = ..., reclaim: _Optional[int] = ..., deadline_seconds: _Optional[float] = ...) -> None: ...

class CloseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "lease_secret")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    lease_secret: bytes
    def __init__(self, lease_id: _Optional[int] = ..., lease_secret: _Optional[bytes] = ...) -> None: ...

class Held(_message.Message):
    __slots__ = ("pool", "count", "space")
    POOL_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SPACE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    count: int
    space: str
    def __init__(self, pool: _Optional[str] = ..., count: _Optional[int] = ..., space: _Optional[str] = ...) -> None: ...

class CloseLeaseResponse(_message.Message):
    __slots__ = ("released", "detached")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    released: _containers.RepeatedCompositeFieldContainer[Held]
    detached: int
    def __init__(self, released: _Optional[_Iterable[_Union[Held, _Mapping]]] = ..., detached: _Optional[int] = ...) -> None: ...

class AllocateItem(_message.Message):
    __slots__ = ("count", "space")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SPACE_FIELD_NUMBER: _ClassVar[int]
    count: int
    space: str
    def __init__(self, count: _Optional[int] = ..., space: _Optional[str] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("pool", "lease_id", "items", "lease_secret")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    pool: str
    lease_id: int
    items: _containers.RepeatedCompositeFieldContainer[AllocateItem]
    lease_secret: bytes
    def __init__(self, pool: _Optional[str] = ..., lease_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[AllocateItem, _Mapping]]] = ..., lease_secret: _Optional[bytes] = ...) -> None: ...

class IdList(_message.Message):
    __slots__ = ("ids", "paired_ids", "space", "paired_space")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PAIRED_IDS_FIELD_NUMBER: _ClassVar[int]
    SPACE_FIELD_NUMBER: _ClassVar[int]
    PAIRED_SPACE_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    paired_ids: bytes
    space: str
    paired_space: str
    def __init__(self, ids: _Optional[bytes] = ..., paired_ids: _Optional[bytes] = ..., space: _Optional[str] = ..., paired_space: _Optional[str] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[IdList]
    def __init__(self, items: _Optional[_Iterable[_Union[IdList, _Mapping]]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("pool", "lease_id", "items", "lease_secret")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    pool: str
    lease_id: int
    items: _containers.RepeatedCompositeFieldContainer[IdList]
    lease_secret: bytes
    def __init__(self, pool: _Optional[str] = ..., lease_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[IdList, _Mapping]]] = ..., lease_secret: _Optional[bytes] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("freed",)
    FREED_FIELD_NUMBER: _ClassVar[int]
    freed: int
    def __init__(self, freed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class WatchStatsRequest(_message.Message):
    __slots__ = ("pool", "interval_seconds")
    POOL_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    interval_seconds: float
    def __init__(self, pool: _Optional[str] = ..., interval_seconds: _Optional[float] = ...) -> None: ...

class SpaceStats(_message.Message):
    __slots__ = ("capacity", "used", "high_water", "frees", "failed_allocs", "space", "unit", "bytes_per_unit", "follows", "pinned", "quarantined")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATER_FIELD_NUMBER: _ClassVar[int]
    FREES_FIELD_NUMBER: _ClassVar[int]
    FAILED_ALLOCS_FIELD_NUMBER: _ClassVar[int]
    SPACE_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_UNIT_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    capacity: int
    used: int
    high_water: int
    frees: int
    failed_allocs: int
    space: str
    unit: str
    bytes_per_unit: int
    follows: str
    pinned: int
    quarantined: int
    def __init__(self, capacity: _Optional[int] = ..., used: _Optional[int] = ..., high_water: _Optional[int] = ..., frees: _Optional[int] = ..., failed_allocs: _Optional[int] = ..., space: _Optional[str] = ..., unit: _Optional[str] = ..., bytes_per_unit: _Optional[int] = ..., follows: _Optional[str] = ..., pinned: _Optional[int] = ..., quarantined: _Optional[int] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("name", "fingerprint", "architecture", "kv_cache_dtype", "page_size", "max_total_num_tokens", "max_running_requests", "backing_bytes", "spaces", "attached", "age_seconds", "sharing", "elastic", "sealed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BACKING_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPACES_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    architecture: str
    kv_cache_dtype: str
    page_size: int
    max_total_num_tokens: int
    max_running_requests: int
    backing_bytes: int
    spaces: _containers.RepeatedCompositeFieldContainer[SpaceStats]
    attached: int
    age_seconds: float
    sharing: str
    elastic: ElasticStats
    sealed: SealedResponse
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ..., architecture: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., max_total_num_tokens: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., backing_bytes: _Optional[int] = ..., spaces: _Optional[_Iterable[_Union[SpaceStats, _Mapping]]] = ..., attached: _Optional[int] = ..., age_seconds: _Optional[float] = ..., sharing: _Optional[str] = ..., elastic: _Optional[_Union[ElasticStats, _Mapping]] = ..., sealed: _Optional[_Union[SealedResponse, _Mapping]] = ...) -> None: ...

class ElasticStats(_message.Message):
    __slots__ = ("group_bytes", "groups", "granted_groups", "reclaiming_groups", "floor_groups", "cap_groups", "weight", "virtual_bytes", "granted_bytes", "backed_bytes", "grants", "reclaims", "reclaim_seconds_sum", "reclaim_seconds_max", "revoked_leases", "failed_groups", "failed_releases")
    GROUP_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    GRANTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMING_GROUPS_FIELD_NUMBER: _ClassVar[int]
    FLOOR_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CAP_GROUPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMS_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_SECONDS_MAX_FIELD_NUMBER: _ClassVar[int]
    REVOKED_LEASES_FIELD_NUMBER: _ClassVar[int]
    FAILED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    FAILED_RELEASES_FIELD_NUMBER: _ClassVar[int]
    group_bytes: int
    groups: int
    granted_groups: int
    reclaiming_groups: int
    floor_groups: int
    cap_groups: int
    weight: float
    virtual_bytes: int
    granted_bytes: int
    backed_bytes: int
    grants: int
    reclaims: int
    reclaim_seconds_sum: float
    reclaim_seconds_max: float
    revoked_leases: int
    failed_groups: int
    failed_releases: int
    def __init__(self, group_bytes: _Optional[int] = ..., groups: _Optional[int] = ..., granted_groups: _Optional[int] = ..., reclaiming_groups: _Optional[int] = ..., floor_groups: _Optional[int] = ..., cap_groups: _Optional[int] = ..., weight: _Optional[float] = ..., virtual_bytes: _Optional[int] = ..., granted_bytes: _Optional[int] = ..., backed_bytes: _Optional[int] = ..., grants: _Optional[int] = ..., reclaims: _Optional[int] = ..., reclaim_seconds_sum: _Optional[float] = ..., reclaim_seconds_max: _Optional[float] = ..., revoked_leases: _Optional[int] = ..., failed_groups: _Optional[int] = ..., failed_releases: _Optional[int] = ...) -> None: ...

class LeaseStats(_message.Message):
    __slots__ = ("lease_id", "name", "ttl_seconds", "expires_in_seconds", "held", "attached", "cached")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    name: str
    ttl_seconds: float
    expires_in_seconds: float
    held: _containers.RepeatedCompositeFieldContainer[Held]
    attached: int
    cached: _containers.RepeatedCompositeFieldContainer[Held]
    def __init__(self, lease_id: _Optional[int] = ..., name: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., expires_in_seconds: _Optional[float] = ..., held: _Optional[_Iterable[_Union[Held, _Mapping]]] = ..., attached: _Optional[int] = ..., cached: _Optional[_Iterable[_Union[Held, _Mapping]]] = ...) -> None: ...

class DaemonStats(_message.Message):
    __slots__ = ("version", "device", "budget_bytes", "used_bytes", "uptime_seconds", "num_pools", "num_leases", "leases_opened", "leases_closed", "leases_expired", "nixl_agent", "other_leases", "loop_stalls", "loop_stalled_seconds", "loop_longest_stall_seconds", "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic", "kv_events_published", "kv_events_dropped", "kv_events_last_seq")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_POOLS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASES_OPENED_FIELD_NUMBER: _ClassVar[int]
    LEASES_CLOSED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_FIELD_NUMBER: _ClassVar[int]
    OTHER_LEASES_FIELD_NUMBER: _ClassVar[int]
    LOOP_STALLS_FIELD_NUMBER: _ClassVar[int]
    LOOP_STALLED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOP_LONGEST_STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_TOPIC_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    version: str
    device: str
    budget_bytes: int
    used_bytes: int
    uptime_seconds: float
    num_pools: int
    num_leases: int
    leases_opened: int
    leases_closed: int
    leases_expired: int
    nixl_agent: str
    other_leases: int
    loop_stalls: int
    loop_stalled_seconds: float
    loop_longest_stall_seconds: float
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    kv_events_topic: str
    kv_events_published: int
    kv_events_dropped: int
    kv_events_last_seq: int
    def __init__(self, version: _Optional[str] = ..., device: _Optional[str] = ..., budget_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., num_pools: _Optional[int] = ..., num_leases: _Optional[int] = ..., leases_opened: _Optional[int] = ..., leases_closed: _Optional[int] = ..., leases_expired: _Optional[int] = ..., nixl_agent: _Optional[str] = ..., other_leases: _Optional[int] = ..., loop_stalls: _Optional[int] = ..., loop_stalled_seconds: _Optional[float] = ..., loop_longest_stall_seconds: _Optional[float] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_replay_endpoint: _Optional[str] = ..., kv_events_topic: _Optional[str] = ..., kv_events_published: _Optional[int] = ..., kv_events_dropped: _Optional[int] = ..., kv_events_last_seq: _Optional[int] = ...) -> None: ...

class PeerStats(_message.Message):
    __slots__ = ("peer", "sent", "sent_bytes", "send_failures", "received", "received_bytes", "receive_failures", "fenced_writes", "fenced_pages")
    PEER_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEND_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    FENCED_WRITES_FIELD_NUMBER: _ClassVar[int]
    FENCED_PAGES_FIELD_NUMBER: _ClassVar[int]
    peer: str
    sent: int
    sent_bytes: int
    send_failures: int
    received: int
    received_bytes: int
    receive_failures: int
    fenced_writes: int
    fenced_pages: int
    def __init__(self, peer: _Optional[str] = ..., sent: _Optional[int] = ..., sent_bytes: _Optional[int] = ..., send_failures: _Optional[int] = ..., received: _Optional[int] = ..., received_bytes: _Optional[int] = ..., receive_failures: _Optional[int] = ..., fenced_writes: _Optional[int] = ..., fenced_pages: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("daemon", "pools", "leases", "peers")
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    daemon: DaemonStats
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseStats]
    peers: _containers.RepeatedCompositeFieldContainer[PeerStats]
    def __init__(self, daemon: _Optional[_Union[DaemonStats, _Mapping]] = ..., pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[LeaseStats, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[PeerStats, _Mapping]]] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("pool", "force")
    POOL_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    force: bool
    def __init__(self, pool: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DropResponse(_message.Message):
    __slots__ = ("reclaimed", "detached", "released_bytes")
    RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    reclaimed: _containers.RepeatedCompositeFieldContainer[Held]
    detached: int
    released_bytes: int
    def __init__(self, reclaimed: _Optional[_Iterable[_Union[Held, _Mapping]]] = ..., detached: _Optional[int] = ..., released_bytes: _Optional[int] = ...) -> None: ...

class SharedHandle(_message.Message):
    __slots__ = ("sharing", "size", "path", "device_uuid", "ipc_handle", "storage_offset", "storage_size", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "fd_socket")
    SHARING_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    sharing: str
    size: int
    path: str
    device_uuid: str
    ipc_handle: bytes
    storage_offset: int
    storage_size: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    fd_socket: str
    def __init__(self, sharing: _Optional[str] = ..., size: _Optional[int] = ..., path: _Optional[str] = ..., device_uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., storage_offset: _Optional[int] = ..., storage_size: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., fd_socket: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("pool", "expected_fingerprint", "lease_id", "lease_secret")
    POOL_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    pool: str
    expected_fingerprint: str
    lease_id: int
    lease_secret: bytes
    def __init__(self, pool: _Optional[str] = ..., expected_fingerprint: _Optional[str] = ..., lease_id: _Optional[int] = ..., lease_secret: _Optional[bytes] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("fingerprint", "plan_json", "handle", "attach_id", "device", "elastic_groups")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    ATTACH_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_GROUPS_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    plan_json: str
    handle: SharedHandle
    attach_id: int
    device: str
    elastic_groups: bytes
    def __init__(self, fingerprint: _Optional[str] = ..., plan_json: _Optional[str] = ..., handle: _Optional[_Union[SharedHandle, _Mapping]] = ..., attach_id: _Optional[int] = ..., device: _Optional[str] = ..., elastic_groups: _Optional[bytes] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("attach_id",)
    ATTACH_ID_FIELD_NUMBER: _ClassVar[int]
    attach_id: int
    def __init__(self, attach_id: _Optional[int] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GrantReceiveRequest(_message.Message):
    __slots__ = ("lease_id", "pool", "pages", "ttl_seconds", "lease_secret")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    pool: str
    pages: bytes
    ttl_seconds: float
    lease_secret: bytes
    def __init__(self, lease_id: _Optional[int] = ..., pool: _Optional[str] = ..., pages: _Optional[bytes] = ..., ttl_seconds: _Optional[float] = ..., lease_secret: _Optional[bytes] = ...) -> None: ...

class GrantReceiveResponse(_message.Message):
    __slots__ = ("token", "expires_in_seconds", "pages", "swa_pages")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SWA_PAGES_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    expires_in_seconds: float
    pages: int
    swa_pages: bytes
    def __init__(self, token: _Optional[bytes] = ..., expires_in_seconds: _Optional[float] = ..., pages: _Optional[int] = ..., swa_pages: _Optional[bytes] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("lease_id", "pool", "pages", "peer", "token", "lease_secret", "hold", "transfer_id", "wait_seconds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    pool: str
    pages: bytes
    peer: str
    token: bytes
    lease_secret: bytes
    hold: bool
    transfer_id: int
    wait_seconds: float
    def __init__(self, lease_id: _Optional[int] = ..., pool: _Optional[str] = ..., pages: _Optional[bytes] = ..., peer: _Optional[str] = ..., token: _Optional[bytes] = ..., lease_secret: _Optional[bytes] = ..., hold: _Optional[bool] = ..., transfer_id: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class SendResponse(_message.Message):
    __slots__ = ("transfer_id", "bytes", "descriptors", "peer_agent", "status", "post_socket")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    PEER_AGENT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    POST_SOCKET_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    bytes: int
    descriptors: int
    peer_agent: str
    status: TransferStatus
    post_socket: str
    def __init__(self, transfer_id: _Optional[int] = ..., bytes: _Optional[int] = ..., descriptors: _Optional[int] = ..., peer_agent: _Optional[str] = ..., status: _Optional[_Union[TransferStatus, _Mapping]] = ..., post_socket: _Optional[str] = ...) -> None: ...

class WaitTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "token", "timeout_seconds")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    token: bytes
    timeout_seconds: float
    def __init__(self, transfer_id: _Optional[int] = ..., token: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class TransferStatus(_message.Message):
    __slots__ = ("state", "message", "bytes", "pages", "seconds", "peer")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    state: TransferState
    message: str
    bytes: int
    pages: int
    seconds: float
    peer: str
    def __init__(self, state: _Optional[_Union[TransferState, str]] = ..., message: _Optional[str] = ..., bytes: _Optional[int] = ..., pages: _Optional[int] = ..., seconds: _Optional[float] = ..., peer: _Optional[str] = ...) -> None: ...

class PageBuffer(_message.Message):
    __slots__ = ("name", "dtype", "kind", "page_bytes", "id_space")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ID_SPACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    kind: str
    page_bytes: int
    id_space: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., kind: _Optional[str] = ..., page_bytes: _Optional[int] = ..., id_space: _Optional[str] = ...) -> None: ...

class PageLayout(_message.Message):
    __slots__ = ("architecture", "kv_cache_dtype", "page_size", "layer_start", "layer_end", "tp_size", "buffers")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    kv_cache_dtype: str
    page_size: int
    layer_start: int
    layer_end: int
    tp_size: int
    buffers: _containers.RepeatedCompositeFieldContainer[PageBuffer]
    def __init__(self, architecture: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., tp_size: _Optional[int] = ..., buffers: _Optional[_Iterable[_Union[PageBuffer, _Mapping]]] = ...) -> None: ...

class PeerReceiveRequest(_message.Message):
    __slots__ = ("token", "layout", "pages", "swa_mask", "known_agent", "sender", "known_generations", "sender_process")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SWA_MASK_FIELD_NUMBER: _ClassVar[int]
    KNOWN_AGENT_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KNOWN_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    SENDER_PROCESS_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    layout: PageLayout
    pages: int
    swa_mask: bytes
    known_agent: str
    sender: str
    known_generations: _containers.RepeatedScalarFieldContainer[int]
    sender_process: SenderProcess
    def __init__(self, token: _Optional[bytes] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ..., pages: _Optional[int] = ..., swa_mask: _Optional[bytes] = ..., known_agent: _Optional[str] = ..., sender: _Optional[str] = ..., known_generations: _Optional[_Iterable[int]] = ..., sender_process: _Optional[_Union[SenderProcess, _Mapping]] = ...) -> None: ...

class SenderProcess(_message.Message):
    __slots__ = ("boot_id", "pid_namespace", "pid", "start_ticks")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    pid_namespace: int
    pid: int
    start_ticks: int
    def __init__(self, boot_id: _Optional[str] = ..., pid_namespace: _Optional[int] = ..., pid: _Optional[int] = ..., start_ticks: _Optional[int] = ...) -> None: ...

class PeerReceiveResponse(_message.Message):
    __slots__ = ("agent", "generation", "agent_metadata", "buffer_addresses", "pages", "swa_pages", "notification", "memory", "device", "write_deadline_seconds")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SWA_PAGES_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WRITE_DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    agent: str
    generation: int
    agent_metadata: bytes
    buffer_addresses: _containers.RepeatedScalarFieldContainer[int]
    pages: bytes
    swa_pages: bytes
    notification: bytes
    memory: str
    device: int
    write_deadline_seconds: float
    def __init__(self, agent: _Optional[str] = ..., generation: _Optional[int] = ..., agent_metadata: _Optional[bytes] = ..., buffer_addresses: _Optional[_Iterable[int]] = ..., pages: _Optional[bytes] = ..., swa_pages: _Optional[bytes] = ..., notification: _Optional[bytes] = ..., memory: _Optional[str] = ..., device: _Optional[int] = ..., write_deadline_seconds: _Optional[float] = ...) -> None: ...

class PeerDoneRequest(_message.Message):
    __slots__ = ("token", "ok", "message")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    ok: bool
    message: str
    def __init__(self, token: _Optional[bytes] = ..., ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class PeerDoneResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CancelGrantRequest(_message.Message):
    __slots__ = ("lease_id", "lease_secret", "token")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    lease_secret: bytes
    token: bytes
    def __init__(self, lease_id: _Optional[int] = ..., lease_secret: _Optional[bytes] = ..., token: _Optional[bytes] = ...) -> None: ...

class CancelGrantResponse(_message.Message):
    __slots__ = ("status", "freed_pages", "fenced_pages")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FREED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FENCED_PAGES_FIELD_NUMBER: _ClassVar[int]
    status: TransferStatus
    freed_pages: int
    fenced_pages: int
    def __init__(self, status: _Optional[_Union[TransferStatus, _Mapping]] = ..., freed_pages: _Optional[int] = ..., fenced_pages: _Optional[int] = ...) -> None: ...

class SealRequest(_message.Message):
    __slots__ = ("pool", "lease_id", "lease_secret", "layout", "page_ids", "keys", "parents", "tokens")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    lease_id: int
    lease_secret: bytes
    layout: str
    page_ids: bytes
    keys: bytes
    parents: bytes
    tokens: bytes
    def __init__(self, pool: _Optional[str] = ..., lease_id: _Optional[int] = ..., lease_secret: _Optional[bytes] = ..., layout: _Optional[str] = ..., page_ids: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., parents: _Optional[bytes] = ..., tokens: _Optional[bytes] = ...) -> None: ...

class SealResponse(_message.Message):
    __slots__ = ("sealed",)
    SEALED_FIELD_NUMBER: _ClassVar[int]
    sealed: int
    def __init__(self, sealed: _Optional[int] = ...) -> None: ...

class UnsealRequest(_message.Message):
    __slots__ = ("pool", "lease_id", "lease_secret", "page_ids")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    lease_id: int
    lease_secret: bytes
    page_ids: bytes
    def __init__(self, pool: _Optional[str] = ..., lease_id: _Optional[int] = ..., lease_secret: _Optional[bytes] = ..., page_ids: _Optional[bytes] = ...) -> None: ...

class UnsealResponse(_message.Message):
    __slots__ = ("unsealed",)
    UNSEALED_FIELD_NUMBER: _ClassVar[int]
    unsealed: int
    def __init__(self, unsealed: _Optional[int] = ...) -> None: ...

class AdoptRequest(_message.Message):
    __slots__ = ("pool", "lease_id", "lease_secret", "layout")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    pool: str
    lease_id: int
    lease_secret: bytes
    layout: str
    def __init__(self, pool: _Optional[str] = ..., lease_id: _Optional[int] = ..., lease_secret: _Optional[bytes] = ..., layout: _Optional[str] = ...) -> None: ...

class AdoptResponse(_message.Message):
    __slots__ = ("page_ids", "keys", "parents", "tokens", "epoch", "unfenced", "corrupt", "other_layout")
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UNFENCED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    OTHER_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    page_ids: bytes
    keys: bytes
    parents: bytes
    tokens: bytes
    epoch: int
    unfenced: int
    corrupt: int
    other_layout: int
    def __init__(self, page_ids: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., parents: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., epoch: _Optional[int] = ..., unfenced: _Optional[int] = ..., corrupt: _Optional[int] = ..., other_layout: _Optional[int] = ...) -> None: ...

class SealedRequest(_message.Message):
    __slots__ = ("pool", "evict")
    POOL_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    pool: str
    evict: bool
    def __init__(self, pool: _Optional[str] = ..., evict: _Optional[bool] = ...) -> None: ...

class SealedResponse(_message.Message):
    __slots__ = ("held", "kept", "kept_bytes", "oldest_seconds", "newest_seconds", "sealed_total", "adopted_total", "evicted_total", "corrupt_total", "epoch", "evicted", "layouts", "events_rank")
    HELD_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    KEPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEALED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_RANK_FIELD_NUMBER: _ClassVar[int]
    held: int
    kept: int
    kept_bytes: int
    oldest_seconds: float
    newest_seconds: float
    sealed_total: int
    adopted_total: int
    evicted_total: int
    corrupt_total: int
    epoch: int
    evicted: int
    layouts: _containers.RepeatedScalarFieldContainer[str]
    events_rank: int
    def __init__(self, held: _Optional[int] = ..., kept: _Optional[int] = ..., kept_bytes: _Optional[int] = ..., oldest_seconds: _Optional[float] = ..., newest_seconds: _Optional[float] = ..., sealed_total: _Optional[int] = ..., adopted_total: _Optional[int] = ..., evicted_total: _Optional[int] = ..., corrupt_total: _Optional[int] = ..., epoch: _Optional[int] = ..., evicted: _Optional[int] = ..., layouts: _Optional[_Iterable[str]] = ..., events_rank: _Optional[int] = ...) -> None: ...

"""DSA sizing (DeepSeek-V3.2): MLA latent plus a lightning-indexer key per token and layer.

    main   = 656 B per layer with fp8_e4m3 (512 fp8 nope + 4 fp32 scales + 64 bf16 rope),
             else (kv_lora_rank + qk_rope_head_dim) * kv_itemsize          (576 * 2 in bf16)
    index  = index_head_dim + index_head_dim / 128 * 4 = 132 B per layer   (fp8 K + fp32 scale)
    cell   = (main + index) * L, then int(cell * (1 + D / L)) with D draft layers

The page size is 64 (the indexer kernels' page): SGLang sets it whatever ``--page-size`` says, and
so does the planner (:func:`page_size_for`, with a plan note). Worked example, DeepSeek-V3.2 (61
layers), bf16, page 64, 40 GiB: cell = (1152 + 132) * 61 = 78,324 B; one page = 5,012,736 B;
pages = 42,949,672,960 // 5,012,736 = 8,568 (the padding page on top); tokens = 548,352.
Buffers: ``kv.<l>`` ``(rows, 1, kv_dim)`` (uint8 ``(rows, 1, 656)`` with fp8_e4m3) and
``index_k.<l>`` uint8 ``(num_pages + 1, page_size * 132)``, page-major: page ``p`` holds
``page_size * 128`` fp8 bytes then ``page_size`` fp32 scales.
"""

from __future__ import annotations

from kvpool.contract.devices import gpu_profile
from kvpool.contract.dtypes import DType
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.options import KVCacheDType
from kvpool.contract.plan import BufferKind, BufferSpec
from kvpool.contract.spec import MLAAttention, ModelSpec
from kvpoold.sizing import mla
from kvpoold.sizing.common import Sizing, SizingContext, uniform_sizing
from kvpoold.sizing.layout import buffer, token_rows

NAME = "dsa"
DSA_PAGE_SIZE = 64
# SGLang's DSA default for `--kv-cache-dtype auto` (``_dsa_kv_cache_dtype_default``): bfloat16
# before Blackwell (SM < 100, the H100/H200 kvpool assumes), whatever the checkpoint's
# quantization says; SM100+ takes fp8_e4m3 (give --kv-cache-dtype fp8_e4m3 there).
AUTO_KV_CACHE_DTYPE = KVCacheDType.bfloat16
SCALE_BYTES_PER_128 = 4


def page_size_for(asked: int) -> int:
    """SGLang's DSA override sets page size 64 whatever ``--page-size`` says."""
    return DSA_PAGE_SIZE


def matches(spec: ModelSpec) -> bool:
    return spec.indexer is not None and isinstance(spec.attention, MLAAttention)


def _packed_fp8(ctx: SizingContext) -> bool:
    """fp8 in the packed DSA layout (its own scales, bf16 rope: 656 B for DeepSeek). On SM100+
    SGLang's default DSA backend is trtllm, which keeps the raw MLA layout (576 B at fp8)."""
    return ctx.kv.name == "fp8_e4m3" and not gpu_profile(ctx.options.gpu).blackwell


def _main_dim_bytes(ctx: SizingContext) -> int:
    """Per-layer bytes of the main latent (the packed fp8 layout holds its own scales)."""
    attn = ctx.spec.attention
    assert isinstance(attn, MLAAttention)
    if _packed_fp8(ctx):
        return attn.kv_lora_rank + attn.kv_lora_rank // 128 * 4 + attn.qk_rope_head_dim * 2
    return mla.kv_dim(ctx.spec) * ctx.kv.itemsize


def index_bytes(ctx: SizingContext) -> int:
    assert ctx.spec.indexer is not None
    dim = ctx.spec.indexer.index_head_dim
    return dim + dim // 128 * SCALE_BYTES_PER_128


def _check(ctx: SizingContext) -> None:
    if ctx.page_size != DSA_PAGE_SIZE:
        raise InvalidArgument(
            f"DSA (DeepSeek sparse attention) needs page_size {DSA_PAGE_SIZE}, "
            f"got {ctx.page_size}; use --page-size {DSA_PAGE_SIZE}",
            field="page_size",
        )
    if ctx.kv.is_fp4:
        raise InvalidArgument(
            "DSA pools do not support fp4_e2m1 KV (accepted: auto, bfloat16, float16, "
            "fp8_e4m3, fp8_e5m2)",
            field="kv_cache_dtype",
        )


def size(ctx: SizingContext) -> Sizing:
    _check(ctx)
    return uniform_sizing(NAME, ctx, _main_dim_bytes(ctx) + index_bytes(ctx))


def _layer(ctx: SizingContext, suffix: str, rows: int, prefix: str) -> list[BufferSpec]:
    page = ctx.page_size
    if _packed_fp8(ctx):
        main = [buffer(f"{prefix}kv.{suffix}", DType.uint8, (rows, 1, _main_dim_bytes(ctx)),
                       BufferKind.kv, rows_per_page=page)]
    else:
        main = mla.layer_buffers(suffix, ctx.kv, rows, mla.kv_dim(ctx.spec), page, prefix)
    index = buffer(f"{prefix}index_k.{suffix}", DType.uint8,
                   (rows // page, page * index_bytes(ctx)), BufferKind.index)
    return [*main, index]


def layout(ctx: SizingContext, sizing: Sizing) -> list[BufferSpec]:
    rows = token_rows(sizing.num_pages, ctx.page_size)
    out: list[BufferSpec] = []
    for layer in ctx.layers:
        out += _layer(ctx, str(layer), rows, "")
    for i in range(ctx.num_draft_layers):
        out += _layer(ctx, str(i), rows, "draft_")
    return out

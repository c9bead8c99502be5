"""MLA sizing (DeepSeek-V2/V3, Kimi-K2): one latent per token and layer, not split by TP.

    kv_dim = kv_lora_rank + qk_rope_head_dim                     (512 + 64 = 576 for DSv3)
    cell   = kv_dim * L * kv_itemsize                            (FP4: 324 B per layer)
    cell   = int(cell * (1 + D / L))                             with D EAGLE/MTP draft layers

Worked example, DeepSeek-V3 (61 layers), bf16, 40 GiB, page 1: cell = 576 * 61 * 2 = 70,272 B;
tokens = 42,949,672,960 // 70,272 = 611,191 (the padding row on top: 611,192 rows). Buffers
``kv.<l>`` of shape ``(rows, 1, kv_dim)``; V is the first ``kv_lora_rank`` columns of the same
buffer.
"""

from __future__ import annotations

from kvpool.contract.plan import BufferKind, BufferSpec
from kvpool.contract.spec import MLAAttention, ModelSpec
from kvpoold.sizing import fp4
from kvpoold.sizing.common import KVFormat, Sizing, SizingContext, uniform_sizing
from kvpoold.sizing.layout import buffer, token_rows

NAME = "mla"


def matches(spec: ModelSpec) -> bool:
    return isinstance(spec.attention, MLAAttention)


def kv_dim(spec: ModelSpec) -> int:
    attn = spec.attention
    assert isinstance(attn, MLAAttention)
    return attn.kv_lora_rank + attn.qk_rope_head_dim


def layer_bytes(fmt: KVFormat, dim: int) -> int:
    """Bytes per token of one MLA layer's latent in format ``fmt``."""
    return fp4.mla_layer_bytes(dim) if fmt.is_fp4 else dim * fmt.itemsize


def layer_buffers(suffix: str, fmt: KVFormat, rows: int, dim: int, page_size: int,
                  prefix: str = "") -> list[BufferSpec]:
    """The ``kv.<suffix>`` buffer of one layer (plus its scale for FP4)."""
    if fmt.is_fp4:
        return fp4.mla_buffers(suffix, rows, dim, page_size, prefix)
    return [buffer(f"{prefix}kv.{suffix}", fmt.store, (rows, 1, dim), BufferKind.kv,
                   rows_per_page=page_size)]


def size(ctx: SizingContext) -> Sizing:
    return uniform_sizing(NAME, ctx, layer_bytes(ctx.kv, kv_dim(ctx.spec)))


def layout(ctx: SizingContext, sizing: Sizing) -> list[BufferSpec]:
    rows = token_rows(sizing.num_pages, ctx.page_size)
    dim = kv_dim(ctx.spec)
    out: list[BufferSpec] = []
    for layer in ctx.layers:
        out += layer_buffers(str(layer), ctx.kv, rows, dim, ctx.page_size)
    for i in range(ctx.num_draft_layers):
        out += layer_buffers(str(i), ctx.kv, rows, dim, ctx.page_size, prefix="draft_")
    return out

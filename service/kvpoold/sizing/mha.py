"""MHA / GQA sizing (Llama, Mistral, Qwen2/3, gpt-oss full layers...).

Per-token cell over the ``L`` layers of this PP stage, with ``H = max(1, kv_heads // tp)``:

    cell = H * (head_dim + v_head_dim) * L * kv_itemsize        (FP4: see fp4.py)
    cell = int(cell * (1 + D / L))                               with D EAGLE draft layers
    num_pages = budget // cell // page_size                      (the common rule, SGLang's)

Page 0 is the padding page and comes on top of the budget. Worked example, Llama-3.1-8B
(32 layers, 8 KV heads, head_dim 128), bf16, TP 1, 40 GiB = 42,949,672,960 B:
cell = 8 * 256 * 32 * 2 = 131,072 B; tokens (page 16) = 42,949,672,960 // 131,072 // 16 * 16 =
327,680; pages = 20,480. Buffers ``k.<l>`` and ``v.<l>`` of shape ``(rows, H, head_dim)`` with
``rows = (num_pages + 1) * page_size`` = 327,696, 42,951,770,112 B in all (the budget plus one
page); draft layers add ``draft_k.<i>`` / ``draft_v.<i>``.
"""

from __future__ import annotations

from kvpool.contract.plan import BufferKind, BufferSpec
from kvpool.contract.spec import MHAAttention, ModelSpec
from kvpoold.sizing import fp4
from kvpoold.sizing.common import KVFormat, Sizing, SizingContext, tp_heads, uniform_sizing
from kvpoold.sizing.layout import buffer, token_rows

NAME = "mha"


def matches(spec: ModelSpec) -> bool:
    return isinstance(spec.attention, MHAAttention)


def layer_bytes(fmt: KVFormat, heads: int, head_dim: int, v_head_dim: int) -> int:
    """Bytes per token of one MHA layer in format ``fmt``."""
    if fmt.is_fp4:
        return fp4.mha_layer_bytes(heads, head_dim, v_head_dim)
    return heads * (head_dim + v_head_dim) * fmt.itemsize


def layer_buffers(
    suffix: str, fmt: KVFormat, rows: int, heads: int, head_dim: int, v_head_dim: int,
    page_size: int, kind: BufferKind = BufferKind.kv, prefix: str = "",
) -> list[BufferSpec]:
    """The ``k.<suffix>`` / ``v.<suffix>`` buffers of one layer (plus scales for FP4)."""
    if fmt.is_fp4:
        return fp4.mha_buffers(suffix, rows, heads, head_dim, v_head_dim, page_size, kind,
                               prefix)
    return [
        buffer(f"{prefix}k.{suffix}", fmt.store, (rows, heads, head_dim), kind,
               rows_per_page=page_size),
        buffer(f"{prefix}v.{suffix}", fmt.store, (rows, heads, v_head_dim), kind,
               rows_per_page=page_size),
    ]


def _geometry(ctx: SizingContext) -> tuple[int, int, int]:
    attn = ctx.spec.attention
    assert isinstance(attn, MHAAttention)
    return tp_heads(attn.num_kv_heads, ctx.tp_size), attn.head_dim, attn.v_dim


def size(ctx: SizingContext) -> Sizing:
    return uniform_sizing(NAME, ctx, layer_bytes(ctx.kv, *_geometry(ctx)))


def layout(ctx: SizingContext, sizing: Sizing) -> list[BufferSpec]:
    heads, hd, vd = _geometry(ctx)
    rows = token_rows(sizing.num_pages, ctx.page_size)
    out: list[BufferSpec] = []
    for layer in ctx.layers:
        out += layer_buffers(str(layer), ctx.kv, rows, heads, hd, vd, ctx.page_size)
    for i in range(ctx.num_draft_layers):
        out += layer_buffers(str(i), ctx.kv, rows, heads, hd, vd, ctx.page_size,
                             prefix="draft_")
    return out

"""FP4 (e2m1) KV cells: two values per byte plus one uint8 scale per 16 values.

MHA, per layer and token, with ``H`` heads of K dim ``hd`` and V dim ``vd``:

    data  = H * (hd + vd) / 2          scales = H * hd / 16 + H * vd / 16

Llama-3.1-8B (H=8, hd=vd=128): 1024 + 128 = 1152 B per layer (vs 4096 B in bf16).
MLA, per layer and token, with latent dim ``d`` (512 + 64 = 576 for DeepSeek-V3):

    data  = d / 2 = 288                scales = d / 16 = 36          -> 324 B

Buffers: ``k.<l>`` ``(rows, H, hd/2)``, ``v.<l>`` ``(rows, H, vd/2)``, ``k_scale.<l>``
``(rows, H*hd/16)``, ``v_scale.<l>`` ``(rows, H*vd/16)`` for MHA; ``kv.<l>`` ``(rows, 1, d/2)``
and ``kv_scale.<l>`` ``(rows, d/16)`` for MLA; all uint8.
"""

from __future__ import annotations

from kvpool.contract.dtypes import DType
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import BufferKind, BufferSpec
from kvpoold.sizing.layout import buffer

SCALE_BLOCK = 16


def _check_dim(dim: int, what: str) -> None:
    if dim % SCALE_BLOCK:
        raise InvalidArgument(
            f"fp4_e2m1 KV needs {what} divisible by {SCALE_BLOCK}, got {dim}; "
            "choose another --kv-cache-dtype",
            field="kv_cache_dtype",
        )


def mha_layer_bytes(heads: int, head_dim: int, v_head_dim: int) -> int:
    """FP4 bytes per token for one MHA layer (K and V data plus their scales)."""
    _check_dim(head_dim, "head_dim")
    _check_dim(v_head_dim, "v_head_dim")
    data = heads * (head_dim + v_head_dim) // 2
    scales = heads * head_dim // SCALE_BLOCK + heads * v_head_dim // SCALE_BLOCK
    return data + scales


def mha_buffers(
    suffix: str, rows: int, heads: int, head_dim: int, v_head_dim: int, page_size: int,
    kind: BufferKind, prefix: str = "",
) -> list[BufferSpec]:
    """K, V and their scale buffers of one MHA layer (``suffix`` is the layer id)."""
    def mk(name: str, shape: tuple[int, ...]) -> BufferSpec:
        return buffer(f"{prefix}{name}.{suffix}", DType.uint8, shape, kind,
                      rows_per_page=page_size)

    return [
        mk("k", (rows, heads, head_dim // 2)),
        mk("v", (rows, heads, v_head_dim // 2)),
        mk("k_scale", (rows, heads * head_dim // SCALE_BLOCK)),
        mk("v_scale", (rows, heads * v_head_dim // SCALE_BLOCK)),
    ]


def mla_layer_bytes(kv_dim: int) -> int:
    """FP4 bytes per token for one MLA layer: latent data plus scales."""
    _check_dim(kv_dim, "kv_lora_rank + qk_rope_head_dim")
    return kv_dim // 2 + kv_dim // SCALE_BLOCK


def mla_buffers(suffix: str, rows: int, kv_dim: int, page_size: int,
                prefix: str = "") -> list[BufferSpec]:
    """Latent and scale buffers of one MLA layer."""
    return [
        buffer(f"{prefix}kv.{suffix}", DType.uint8, (rows, 1, kv_dim // 2), BufferKind.kv,
               rows_per_page=page_size),
        buffer(f"{prefix}kv_scale.{suffix}", DType.uint8, (rows, kv_dim // SCALE_BLOCK),
               BufferKind.kv, rows_per_page=page_size),
    ]

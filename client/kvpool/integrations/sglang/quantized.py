"""SGLang's FP4 KV (``--kv-cache-dtype fp4_mx_block16`` / ``nvfp4``) on a kvpool daemon pool.

SGLang 0.5.23 builds an FP4 MHA pool with the platform's pool class and a quantization method
(``quant_method``) whose ``create_buffers`` would allocate packed K/V and their block scales.
kvpool's pool (``pools.KVPoolMHATokenToKVPool``) maps the daemon's ``fp4_e2m1`` plan instead
(``sizing/fp4.py``: ``k.<l>``/``v.<l>`` ``(rows, H, hd / 2)`` uint8, ``k_scale.<l>`` /
``v_scale.<l>`` ``(rows, H * hd / 16)`` uint8, one scale per 16 values), the shapes SGLang's
block-16 recipe makes; NVFP4's per-head scale shape ``(rows, H, hd / 16)`` is the same bytes,
viewed so. SGLang's own ``quantize_and_store`` then writes daemon memory. The dequantization
workspace (one shared scratch copy, not cache) stays SGLang's.

Refused with an error: NVFP4's native (page-major, trtllm-gen) scale layout, and every other
quantization method (its buffers have no daemon plan).

SGLang reaches the hook only on CUDA: on an out-of-tree platform (kvpool's CPU platform) its
configurator rejects FP4 and MXFP8 KV before any pool class is asked (``reject_out_of_tree_path``,
"the block-scaled (fp4 / mxfp8) KV pool"); MXFP8 (``MHATokenToKVPoolMXFP8``), FP4 MLA
(``MLATokenToKVPoolFP4``) and DeepSeek-V4 (``DeepSeekV4TokenToKVPool``) are built as in-tree
classes without asking the platform at all.
"""

from __future__ import annotations

from typing import Any

import torch

# SGLang's FP4 recipes whose packed data and scales are the daemon's fp4_e2m1 buffers.
FP4_METHODS = ("fp4_mx_block16", "nvfp4")
SCALE_BLOCK = 16


def unsupported(pool: Any) -> str | None:
    """Why kvpool cannot map ``pool``'s quantization method, or None when it can."""
    method = pool.quant_method
    if method.name not in FP4_METHODS:
        return f"the quantized KV method {method.name!r}"
    if getattr(method, "needs_native_fp4_scales", lambda: False)():
        return f"{method.name}'s native (page-major) scale layout"
    if pool.v_head_dim != pool.head_dim:
        return f"FP4 KV with v_head_dim {pool.v_head_dim} != head_dim {pool.head_dim}"
    return None


def create_buffers(pool: Any, attachment: Any) -> None:
    """Set ``pool``'s FP4 buffers (SGLang's ``_create_quantized_buffers`` names) to the daemon's
    views: packed K/V, their scales, and SGLang's dequantization workspace if its recipe has one.

    Raises:
        PoolMismatch: (from the attachment) a buffer of another shape or dtype.
    """
    rows, heads, dim = pool.size + pool.page_size, pool.head_num, pool.head_dim
    store = torch.uint8
    linear_scales = getattr(pool.quant_method, "needs_linear_scale_buffer", lambda: True)()
    pool.k_buffer, pool.v_buffer, pool.k_scale_buffer, pool.v_scale_buffer = [], [], [], []
    for layer in attachment.layers:
        for name, out in (("k", pool.k_buffer), ("v", pool.v_buffer)):
            out.append(attachment.view(f"{name}.{layer}", (rows, heads, dim // 2), store,
                                       pool.device))
        for name, out in (("k_scale", pool.k_scale_buffer), ("v_scale", pool.v_scale_buffer)):
            flat = attachment.view(f"{name}.{layer}", (rows, heads * dim // SCALE_BLOCK), store,
                                   pool.device)
            # NVFP4 keeps one row of scales per head; block-16 flattens the heads.
            out.append(flat if pool.quant_method.name == "fp4_mx_block16"
                       else flat.view(rows, heads, dim // SCALE_BLOCK))
    if not linear_scales:
        pool.k_scale_buffer = pool.v_scale_buffer = None
    pool.native_k_scale_buffer = pool.native_v_scale_buffer = None
    workspace = pool.quant_method.dequant_workspace_dtype()
    pool.dq_k_buffer = pool.dq_v_buffer = None
    if workspace is not None:
        pool.dq_k_buffer = torch.zeros((rows, heads, dim), dtype=workspace, device=pool.device)
        pool.dq_v_buffer = torch.zeros((rows, heads, dim), dtype=workspace, device=pool.device)
    pool.store_dtype = store
    pool._check_quantized_buffer_access_requirements()


__all__ = ["FP4_METHODS", "create_buffers", "unsupported"]

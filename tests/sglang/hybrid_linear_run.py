"""Build SGLang 0.5.23's hybrid linear (Qwen3-Next) pools as its configurator does, on CPU, for
``tests/integration/sglang/test_hybrid_linear.py`` (side venv only: ``.venv-sglang/bin/python``,
``stubs/`` on ``PYTHONPATH``). SGLang's CPU paths cannot run the model (its gated delta net and
causal conv need Triton or the ``sgl_kernel`` CPU build), so this drives the pools directly.

    hybrid_linear_run.py < job.json

The job (one line of JSON on stdin)::

    {"model": DIR,          # config.json of a Qwen3-Next model (SGLang's Qwen3NextConfig reads it)
     "size": 64, "page_size": 4, "max_running_requests": 4, "mamba_size": 4,
     "settings": {...},     # EngineSettings fields besides the model path
     "baseline": false}     # true: SGLang's own pools and allocator (kvpool's hooks off)

It builds ``HybridReqToTokenPool`` (its ``MambaPool``), ``HybridLinearKVPool`` (its full-attention
pool from the platform's ``get_kv_pool_cls(kind="mha")``) and the platform's paged allocator,
with the arguments SGLang's configurator passes, then runs one script of SGLang calls through
SGLang's own tensors and methods: allocate token pages and mamba slots, ``set_kv_buffer`` on the
full-attention layers, state writes through ``mamba2_layer_cache``, ``copy_from`` (the radix
cache's copy on write), ``clear_slots``, frees. Events go to stdout as ``HARNESS {json}``:
``built`` (shapes), ``written`` (slot and token ids, the SHA-256 of both state tensors and of
each KV buffer's rows at the tokens written, in order, and its count of non-zero rows), or
``error`` (the refusal, instead of ``built``); then it waits for a line on stdin and ends its
binding (``closed``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from stub_probes import hide_stubs  # beside this script

BASELINE_ENV = "KVPOOL_HARNESS_BASELINE"


def emit(event: str, **fields: Any) -> None:
    print("HARNESS " + json.dumps({"event": event, **fields}), flush=True)


def digest(t: Any) -> str:
    import torch

    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def build(job: dict[str, Any]) -> tuple[Any, Any, Any]:
    """SGLang's req pool, hybrid KV pool and allocator for ``job``."""
    import torch
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import (
        HybridLinearKVPool,
        HybridReqToTokenPool,
        MHATokenToKVPool,
    )
    from sglang.srt.runtime_context import get_parallel

    from kvpool.integrations.sglang import daemon_pool, pools
    from kvpool.integrations.sglang.allocator import PagedAllocator

    config = Qwen3NextConfig(**json.loads((Path(job["model"]) / "config.json").read_text()))
    # What an engine publishes before it builds the pools: one rank, no context parallelism.
    get_parallel().override_permanently(enable_cp_tp_group_sharing=False, tp_size=1,
                                        attn_tp_size=1, attn_dcp_size=1)
    cache_params = config.mamba2_cache_params
    dtype = getattr(torch, job.get("dtype", "float32"))
    mrr, size, page = job["max_running_requests"], job["size"], job["page_size"]
    req_pool = HybridReqToTokenPool(
        size=mrr, mamba_size=job["mamba_size"], mamba_spec_state_size=mrr,
        max_context_len=job.get("context_length", 256) + 4, device="cpu",
        enable_memory_saver=False, cache_params=cache_params,
        mamba_layer_ids=list(cache_params.layers),
        enable_mamba_extra_buffer=job.get("extra_buffer", False),
        enable_overlap_schedule=False, start_layer=0)
    baseline = bool(job.get("baseline"))
    if not baseline:
        settings = daemon_pool.EngineSettings(model_path=job["model"], **job.get("settings", {}))
        daemon_pool.engine_settings = lambda: settings  # type: ignore[misc]
    full_cls = MHATokenToKVPool if baseline else pools.pool_class("mha")
    kv_pool = HybridLinearKVPool(
        page_size=page, size=size, dtype=dtype, head_num=config.num_key_value_heads,
        head_dim=config.head_dim, full_attention_layer_ids=list(config.full_attention_layer_ids),
        device="cpu", mamba_pool=req_pool.mamba_pool, enable_memory_saver=False,
        enable_kv_cache_copy=False, start_layer=0, full_kv_pool_class=full_cls,
        quant_method=None, post_capture_active=False, use_mla=False)
    alloc_cls = PagedTokenToKVPoolAllocator if baseline else PagedAllocator
    allocator = alloc_cls(size, page_size=page, dtype=dtype, device="cpu", kvcache=kv_pool,
                          need_sort=False)
    return req_pool, kv_pool, allocator


def script(req_pool: Any, kv_pool: Any, allocator: Any, full_layers: list[int]) -> dict[str, Any]:
    """SGLang's calls over the pools, deterministic values; returns what it allocated."""
    import torch

    gen = torch.Generator().manual_seed(0)
    mamba = req_pool.mamba_pool
    slots = req_pool.mamba_allocator.alloc(3)
    assert slots is not None
    for layer in mamba.mamba_layer_ids:
        cache = req_pool.mamba2_layer_cache(layer)
        for slot in slots[:2].tolist():
            conv, ssm = cache.conv[0][slot], cache.temporal[slot]
            conv.copy_(torch.randn(conv.shape, generator=gen).to(conv.dtype))
            ssm.copy_(torch.randn(ssm.shape, generator=gen).to(ssm.dtype))
    mamba.copy_from(slots[:1], slots[2:3])  # the radix cache's copy on write
    mamba.clear_slots(slots[1:2])
    loc = allocator.alloc(2 * allocator.page_size)
    assert loc is not None
    for layer in full_layers:
        shape = (len(loc), kv_pool.head_num, kv_pool.head_dim)
        k = torch.randn(shape, generator=gen).to(kv_pool.dtype)
        v = torch.randn(shape, generator=gen).to(kv_pool.dtype)
        kv_pool.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, k, v)
    freed = allocator.alloc(allocator.page_size)
    assert freed is not None
    allocator.free(freed)
    return {"slots": slots.tolist(), "loc": loc.tolist(),
            "available_tokens": allocator.available_size(),
            "available_slots": req_pool.mamba_allocator.available_size()}


def main() -> int:
    hide_stubs()
    import torch

    job = json.loads(sys.stdin.readline())
    if job.get("baseline"):
        os.environ.pop("KVPOOL_POOL", None)
    try:
        req_pool, kv_pool, allocator = build(job)
    except Exception as exc:  # the plugin's refusal is the result
        emit("error", error=f"{type(exc).__name__}: {exc}")
        return 0
    mamba = req_pool.mamba_pool
    cache = mamba.mamba_cache
    full_layers = sorted(kv_pool.full_attention_layer_id_mapping)
    emit("built", cls=type(kv_pool.full_kv_pool).__qualname__,
         allocator=type(allocator).__qualname__, full_layers=full_layers,
         mamba_layers=list(mamba.mamba_layer_ids),
         conv={"shape": list(cache.conv[0].shape), "dtype": str(cache.conv[0].dtype),
               "contiguous": cache.conv[0].is_contiguous()},
         ssm={"shape": list(cache.temporal.shape), "dtype": str(cache.temporal.dtype),
              "contiguous": cache.temporal.is_contiguous()},
         k={"shape": list(kv_pool.get_key_buffer(full_layers[0]).shape)},
         state_slots=(getattr(kv_pool.full_kv_pool, "kvpool_state_slots", None) is not None))
    ran = script(req_pool, kv_pool, allocator, full_layers)
    hashes = {"conv": digest(mamba.mamba_cache.conv[0]),
              "ssm": digest(mamba.mamba_cache.temporal)}
    rows = torch.tensor(ran["loc"])
    for layer in full_layers:
        for name, buf in (("k", kv_pool.get_key_buffer(layer)),
                          ("v", kv_pool.get_value_buffer(layer))):
            hashes[f"{name}.{layer}"] = digest(buf[rows])
            hashes[f"{name}.{layer}.nonzero_rows"] = int(buf.reshape(len(buf), -1).any(1).sum())
    emit("written", hashes=hashes, **ran)
    sys.stdin.readline()
    binding = getattr(kv_pool.full_kv_pool, "kvpool_binding", None)
    if binding is not None:
        binding.close()
    emit("closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build SGLang 0.5.23's FP4 MHA KV pool (``--kv-cache-dtype fp4_mx_block16``) with its
configurator's arguments, on CPU, for ``tests/integration/sglang/test_quantized_kv.py`` (side
venv only). SGLang's configurator rejects FP4 KV on an out-of-tree platform before it asks for a
pool class (kvpool's CPU platform is one), so this builds the pool the way its CUDA path does:
the platform's MHA class with SGLang's FP4 quantization method.

    fp4_run.py < job.json

The job: ``{"model": DIR, "size": 64, "page_size": 4, "layer_num": 2, "head_num": 2,
"head_dim": 16, "method": "fp4_mx_block16", "raw": false, "baseline": false}`` (baseline:
SGLang's own ``MHATokenToKVPool``). It writes seeded K/V through SGLang's ``set_kv_buffer``
(SGLang's own FP4 quantization; with ``raw``, seeded packed bytes straight into SGLang's data
and scale tensors, for NVFP4, whose quantizer needs an SM90+ GPU) at pages 1 and 3,
then emits ``written`` with the SHA-256 of every packed K/V and scale buffer and the tokens it
wrote, waits for a line on stdin and ends its binding.
"""

from __future__ import annotations

import hashlib
import json
import sys
from types import SimpleNamespace
from typing import Any

from stub_probes import hide_stubs  # beside this script


def emit(event: str, **fields: Any) -> None:
    print("HARNESS " + json.dumps({"event": event, **fields}), flush=True)


def main() -> int:
    hide_stubs()
    import torch
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import (
        get_kv_cache_quant_method,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from kvpool.integrations.sglang import daemon_pool, pools

    job = json.loads(sys.stdin.readline())
    layers, page = job["layer_num"], job["page_size"]
    method = get_kv_cache_quant_method(job.get("method", "fp4_mx_block16"), num_layers=layers,
                                       device="cpu", page_size=page)
    if job.get("baseline"):
        cls: type = MHATokenToKVPool
    else:
        settings = daemon_pool.EngineSettings(model_path=job["model"], context_length=256)
        daemon_pool.engine_settings = lambda: settings  # type: ignore[misc]
        cls = pools.pool_class("mha")
    try:
        pool = cls(job["size"], page_size=page, dtype=torch.float4_e2m1fn_x2,
                   head_num=job["head_num"], head_dim=job["head_dim"], layer_num=layers,
                   device="cpu", enable_memory_saver=False, start_layer=0, end_layer=layers,
                   enable_alt_stream=False, quant_method=method)
    except Exception as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}")
        return 0
    gen = torch.Generator().manual_seed(0)
    loc = torch.tensor([page + i for i in range(page)] + [3 * page + i for i in range(page)])
    for layer in range(layers):
        if job.get("raw"):
            # NVFP4's quantizer needs an SM90+ GPU: write packed bytes through SGLang's tensors.
            for tensors in (pool.k_buffer, pool.v_buffer, pool.k_scale_buffer,
                            pool.v_scale_buffer):
                t = tensors[layer]
                t[loc] = torch.randint(0, 256, t[loc].shape, generator=gen, dtype=torch.uint8)
            continue
        shape = (len(loc), job["head_num"], job["head_dim"])
        k = torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        v = torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, k, v)
    hashes = {}
    for name, tensors in (("k", pool.k_buffer), ("v", pool.v_buffer),
                          ("k_scale", pool.k_scale_buffer), ("v_scale", pool.v_scale_buffer)):
        for layer, t in enumerate(tensors):
            hashes[f"{name}.{layer}"] = {
                "sha256": hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest(),
                "shape": list(t.shape), "dtype": str(t.dtype)}
    emit("written", cls=type(pool).__qualname__, method=method.name, hashes=hashes,
         loc=loc.tolist())
    sys.stdin.readline()
    binding = getattr(pool, "kvpool_binding", None)
    if binding is not None:
        binding.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SGLang 0.5.23's FP4 KV pools on kvpool memory, built as SGLang's CUDA path builds them
(``tests/sglang/fp4_run.py``, side venv).

SGLang's configurator refuses FP4 (and MXFP8) KV on an out-of-tree platform before it asks for a
pool class, and kvpool's CPU platform is one, so no CPU engine runs these; on CUDA it builds the
platform's MHA class with its FP4 quantization method, which this test does directly: a tiny
Llama config (2 layers, 2 KV heads of 16), page size 4, 64 tokens, KV dtype
``torch.float4_e2m1fn_x2`` (the daemon's ``fp4_e2m1`` plan).

- ``fp4_mx_block16``: seeded bfloat16 K/V through SGLang's ``set_kv_buffer`` (SGLang's own
  block-16 FP4 quantization, pure torch) at pages 1 and 3.
- ``nvfp4``: its quantizer needs an SM90+ GPU, so seeded packed bytes go straight into SGLang's
  data and scale tensors at the same tokens (NVFP4 keeps its scales per head, ``(rows, H,
  hd / 16)``, a view of the daemon's ``(rows, H * hd / 16)``).

Each: packed data and scales byte-equal to SGLang's own pool after the same writes; this process
reads the same bytes from the daemon's ``k.<l>``, ``v.<l>``, ``k_scale.<l>``, ``v_scale.<l>``,
non-zero only at the tokens written; nothing attached after the binding ends.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import REPO, DaemonProcess, temp_dir
from tests.integration.sglang.pool_harness import Run, digest, run_to_end
from tests.integration.side_venv import SGLANG_DIR, sglang_env

pytestmark = pytest.mark.timeout(600)

HARNESS = SGLANG_DIR / "fp4_run.py"
TINY_LLAMA = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "head_dim": 16, "intermediate_size": 128,
              "vocab_size": 256, "max_position_embeddings": 256, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def tiny_llama() -> Iterator[Path]:
    with temp_dir("kvp-sgl-fp4-") as d:
        config = json.loads(
            (REPO / "tests" / "data" / "models" / "tinyllama-1.1b-chat-v0.4.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **TINY_LLAMA}))
        yield d


@pytest.mark.parametrize("method", ["fp4_mx_block16", "nvfp4"])
def test_fp4_pool(method: str, sglang_python: Path, sglang_daemon: DaemonProcess,
                  tiny_llama: Path) -> None:
    job = {"model": str(tiny_llama), "size": 64, "page_size": 4, "layer_num": 2,
           "head_num": 2, "head_dim": 16, "method": method, "raw": method == "nvfp4"}
    env = sglang_env()
    for name in ("KVPOOL_POOL", "KVPOOL_TARGET", "SGLANG_PLATFORM"):
        env.pop(name, None)
    (own,) = run_to_end(sglang_python, HARNESS, {**job, "baseline": True}, env,
                        tiny_llama / f"{method}-baseline.log", events=1)
    assert (own["event"], own["cls"]) == ("written", "MHATokenToKVPool"), own

    pool = f"sgl-{method}"
    run = Run(sglang_python, HARNESS, job,
              sglang_env(KVPOOL_TARGET=sglang_daemon.target, KVPOOL_POOL=pool,
                         SGLANG_PLATFORM="kvpool"), tiny_llama / f"{method}.log")
    try:
        ours = run.next_event()
        assert (ours["event"], ours["cls"]) == ("written", "KVPoolMHATokenToKVPool"), ours
        assert ours["hashes"] == own["hashes"]
        rows = ours["loc"]
        with KVPoolClient(sglang_daemon.target) as client:
            assert client.stats().pool(pool).kv_cache_dtype == "fp4_e2m1"
            with client.attach(pool) as region:
                for name, want in ours["hashes"].items():
                    t = region[name]
                    assert digest(t) == want["sha256"], name
                    nonzero = t.reshape(len(t), -1).any(1).nonzero().reshape(-1).tolist()
                    assert nonzero and set(nonzero) <= set(rows), name
            run.finish()  # the harness ends its binding (detach, lease) before it exits
            stats = client.stats()
            assert stats.pool(pool).attached == 0
            assert not [lease for lease in stats.leases if lease.held.get(pool)]
    finally:
        run.kill()

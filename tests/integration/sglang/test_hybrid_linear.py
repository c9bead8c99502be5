"""SGLang 0.5.23's hybrid linear (Qwen3-Next) pools on kvpool memory, built as SGLang's
configurator builds them (``tests/sglang/hybrid_linear_run.py``, side venv).

SGLang's CPU paths cannot run the model (its gated delta net and causal conv need Triton or the
``sgl_kernel`` CPU build, neither of which this machine has), so the test drives the pools with
SGLang's own classes and calls instead of an engine: ``HybridReqToTokenPool`` (its
``MambaPool`` and slot allocator), ``HybridLinearKVPool`` (its full-attention pool from the
plugin's ``get_kv_pool_cls(kind="mha")``) and the plugin's paged allocator, then one script of
SGLang calls (mamba slots and token pages allocated, state written through
``mamba2_layer_cache``, ``copy_from``, ``clear_slots``, ``set_kv_buffer`` on the full layers,
frees). The model is a tiny Qwen3-Next config (4 layers, full attention every 2nd: layers 1
and 3; linear layers 0 and 2 with 4 value heads and 2 key heads of 16, conv kernel 4; 2 KV
heads of 16; float32 KV, SGLang's bfloat16 conv and float32 SSM state), page size 4, 64
tokens, 4 running requests without the radix cache (so 4 state slots: ratio 1).

- ``test_hybrid_linear_pools``: the same script on SGLang's own pools and allocator, then on
  kvpool's: the state tensors end byte-equal, and so do the KV rows at the tokens written;
  this process, attached to the daemon's pool, reads the same bytes in ``conv.<l>``,
  ``ssm.<l>`` and ``k.<l>``/``v.<l>``; the daemon's Stats show the scheduler's lease holding
  all 4 state slots and the KV pages; a second scheduler on the same pool is refused (the
  slots are held); after the binding ends every page and slot is back.
- ``test_state_slot_mismatch``: SGLang's mamba pool at 6 slots against the daemon's 4 is
  refused at startup, naming both and the flag.
- ``test_radix_cache_extra_buffer_slots``: with the radix cache (extra_buffer, no overlap
  schedule) the plan has SGLang's 4 slots per running request, 16, and the state binds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.clients.client import KVPoolClient
from tests.conftest import REPO, DaemonProcess, temp_dir
from tests.integration.sglang.pool_harness import Run, digest, run_to_end
from tests.integration.side_venv import SGLANG_DIR, sglang_env

pytestmark = pytest.mark.timeout(600)

HARNESS = SGLANG_DIR / "hybrid_linear_run.py"
MODELS = REPO / "tests" / "data" / "models"
TTL_S = 30.0  # the harness ends its binding itself; a busy machine must not expire it
# A tiny Qwen3-Next: SGLang's Qwen3NextConfig and kvpool's hf.py both read it.
TINY = {"hidden_size": 64, "num_hidden_layers": 4, "full_attention_interval": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
        "vocab_size": 256, "max_position_embeddings": 256, "torch_dtype": "float32"}
SLOTS = 4


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    with temp_dir("kvp-sgl-hl-") as d:
        yield d


@pytest.fixture(scope="module")
def tiny_qwen3_next(work: Path) -> Path:
    model = work / "tiny-qwen3-next"
    model.mkdir()
    config = json.loads((MODELS / "qwen3-next-80b-a3b-instruct.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **TINY}))
    return model


def job(model: Path, **extra: Any) -> dict[str, Any]:
    settings = {"context_length": 256, "max_running_requests": SLOTS,
                "disable_radix_cache": True, "disable_overlap_schedule": True}
    return {"model": str(model), "size": 64, "page_size": 4, "max_running_requests": SLOTS,
            "mamba_size": SLOTS, "context_length": 256, "settings": settings, **extra}


def kvpool_env(daemon: DaemonProcess, pool: str) -> dict[str, str]:
    return sglang_env(KVPOOL_TARGET=daemon.target, KVPOOL_POOL=pool, SGLANG_PLATFORM="kvpool",
                      KVPOOL_LEASE_TTL_S=str(TTL_S))


def test_hybrid_linear_pools(sglang_python: Path, sglang_daemon: DaemonProcess,
                             tiny_qwen3_next: Path, work: Path) -> None:
    baseline_env = sglang_env()
    for name in ("KVPOOL_POOL", "KVPOOL_TARGET", "SGLANG_PLATFORM"):
        baseline_env.pop(name, None)
    built, written = run_to_end(sglang_python, HARNESS, job(tiny_qwen3_next, baseline=True),
                                baseline_env, work / "baseline.log")
    assert (built["cls"], built["allocator"]) == ("MHATokenToKVPool",
                                                  "PagedTokenToKVPoolAllocator")

    pool = "sgl-hybrid-linear"
    run = Run(sglang_python, HARNESS, job(tiny_qwen3_next), kvpool_env(sglang_daemon, pool),
              work / "kvpool.log")
    try:
        ours = run.next_event()
        assert ours["event"] == "built", ours
        assert (ours["cls"], ours["allocator"]) == ("KVPoolMHATokenToKVPool", "PagedAllocator")
        assert ours["state_slots"] is True
        # The same tensors SGLang made for itself: shapes, dtypes, contiguity.
        for key in ("full_layers", "mamba_layers", "conv", "ssm", "k"):
            assert ours[key] == built[key], key
        assert ours["conv"]["shape"] == [2, SLOTS + 1, 128, 3]
        done = run.next_event()
        assert done["event"] == "written", done
        # The same script gives the same state bytes, and the same KV bytes at its tokens.
        assert done["hashes"] == written["hashes"]
        assert (done["available_tokens"], done["available_slots"]) == (
            written["available_tokens"], written["available_slots"])
        print(f"  slots {done['slots']}, tokens {done['loc']} (SGLang's own: {written['loc']})")

        with KVPoolClient(sglang_daemon.target) as client:
            stats = client.stats()
            p = stats.pool(pool)
            assert p.attached == 1
            leases = [lease for lease in stats.leases if lease.held.get(pool)]
            assert len(leases) == 1
            held = leases[0].held[pool]
            assert held.get("state") == SLOTS  # every slot SGLang's slot allocator hands out
            assert held.get("kv", 0) >= 2  # the two pages the script still uses
            with client.attach(pool) as region:
                conv = torch.stack([region["conv.0"], region["conv.2"]])
                ssm = torch.stack([region["ssm.0"], region["ssm.2"]])
                assert digest(conv) == done["hashes"]["conv"]
                assert digest(ssm) == done["hashes"]["ssm"]
                rows = torch.tensor(done["loc"])
                for layer in (1, 3):
                    for name in ("k", "v"):
                        buf = region[f"{name}.{layer}"]
                        assert digest(buf[rows]) == done["hashes"][f"{name}.{layer}"]
                        nonzero = int(buf.reshape(len(buf), -1).any(1).sum())
                        assert nonzero == len(rows)
                # Slot 1 (cleared) is zero, slots 0 (padding) and 4 (never used) too.
                for slot in (0, 2, 4):
                    assert not conv[:, slot].any() and not ssm[:, slot].any(), slot
                assert conv[:, 1].any() and torch.equal(conv[:, 1], conv[:, 3])

            # A second scheduler on the same pool cannot take the slots this one holds.
            events = run_to_end(sglang_python, HARNESS, job(tiny_qwen3_next),
                                kvpool_env(sglang_daemon, pool), work / "second.log")
            assert events[0]["event"] == "error", events
            assert events[0]["error"].startswith("ResourceExhausted"), events[0]
            assert f"all {SLOTS} of its state slots" in events[0]["error"]

            lease_id = leases[0].lease_id
            run.finish()
            deadline = time.monotonic() + TTL_S + 10
            while time.monotonic() < deadline:
                stats = client.stats()
                p = stats.pool(pool)
                gone = all(lease.lease_id != lease_id for lease in stats.leases)
                if gone and p.attached == 0 and all(s.used == 0 for s in p.spaces.values()):
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"pool {pool!r} not idle after the binding ended: {p}")
            assert p.spaces["state"].used == 0
    finally:
        run.kill()


def test_state_slot_mismatch(sglang_python: Path, sglang_daemon: DaemonProcess,
                             tiny_qwen3_next: Path, work: Path) -> None:
    events = run_to_end(sglang_python, HARNESS, job(tiny_qwen3_next, mamba_size=6),
                        kvpool_env(sglang_daemon, "sgl-hybrid-linear-6"), work / "mismatch.log")
    assert events[0]["event"] == "error", events
    error = events[0]["error"]
    assert error.startswith("PoolMismatch"), error
    assert "6 state slots" in error and f"planned {SLOTS}" in error
    assert "--max-mamba-cache-size" in error


def test_radix_cache_extra_buffer_slots(sglang_python: Path, sglang_daemon: DaemonProcess,
                                        tiny_qwen3_next: Path, work: Path) -> None:
    """With SGLang's radix cache and its extra_buffer strategy (no overlap schedule) a running
    request holds 3 slots plus 1 tracking slot: the plugin passes those settings to the plan, so
    the daemon's 4 x 4 = 16 state slots are SGLang's ``mamba_size`` 16."""
    settings = {"context_length": 256, "max_running_requests": SLOTS,
                "disable_overlap_schedule": True, "mamba_radix_cache_strategy": "extra_buffer"}
    built, written = run_to_end(
        sglang_python, HARNESS,
        job(tiny_qwen3_next, mamba_size=4 * SLOTS, extra_buffer=True, settings=settings),
        kvpool_env(sglang_daemon, "sgl-hybrid-linear-radix"), work / "radix.log")
    assert built["event"] == "built", built
    assert built["state_slots"] is True
    assert built["conv"]["shape"] == [2, 4 * SLOTS + 1, 128, 3]
    assert written["available_slots"] == 4 * SLOTS - 3

"""SGLang 0.5.23's hybrid sliding-window memory on kvpool, on CPU: its ``SWAKVPool`` (full and
SWA K/V), the full -> SWA mapping and the request table in one daemon pool, and its
``SWATokenToKVPoolAllocator`` running on kvpool's paged allocator (``kv`` and ``swa`` pages of
one lease).

- ``test_swa_pools``: gpt-oss's real config class (``GptOssForCausalLM``, a tiny geometry: 4
  layers, sliding = even ids, 2 KV heads of 16, window 8), whose engine SGLang refuses on CPU
  (gpt-oss needs triton / trtllm / FA attention; the torch-native backend has no attention
  sinks), so the pool and allocator are built with SGLang's constructor arguments
  (``tests/sglang/swa_run.py``) and one fixed call sequence (prefill of 2 requests, 6 decode
  steps, a window slide, a free) runs on them, once on kvpool and once on SGLang's own
  classes: the same sizes after every call and the same K values read back through SGLang's
  pools; this process, attached to the daemon pool, reads every value written through
  SGLang's tensors and SGLang's mapping from the daemon's buffers; the lease holds exactly
  the pages in use plus those cached, in both spaces; all back after the binding ends.
- ``test_swa_engine``: SGLang's real ``Engine`` on a tiny random Llama that opts in to SGLang's
  hybrid-SWA memory (``is_hybrid_swa`` with ``hybrid_layer_pattern`` [1, 0, 1, 0], window 16:
  SGLang's ``SWAKVPool``, ``SWATokenToKVPoolAllocator`` and SWA radix cache, the only hybrid
  SWA path its CPU torch-native backend runs; prompts shorter than window + eviction interval,
  so SGLang evicts nothing); the same greedy tokens as SGLang's own pools (the radix cache
  hits); while it holds,
  the lease holds ``kv`` and ``swa`` pages and the daemon's ``full_to_swa`` and
  ``req_to_token`` hold what the scheduler wrote; after shutdown the lease ends and every page
  is back.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.clients.client import KVPoolClient
from tests.conftest import REPO, DaemonProcess, temp_dir
from tests.integration.sglang.test_engine import (
    ENGINE_START_S,
    HARNESS,
    MODELS,
    Harness,
    assert_all_back,
    harness,
    kvpool_env,
    lease_of,
    without_kvpool_env,
)
from tests.integration.side_venv import SGLANG_DIR, sglang_env

SWA_HARNESS = SGLANG_DIR / "swa_run.py"
PAGE = 4
FULL, SWA = 80, 64  # SGLang's counts; the daemon's plan: 80 full, int(80 * 0.8) = 64 SWA
SWA_LAYERS, FULL_LAYERS = [0, 2], [1, 3]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    with temp_dir("kvp-sgl-swa-") as d:
        yield d


def tiny_gpt_oss(work: Path) -> Path:
    """gpt-oss-20b's config.json at a tiny geometry (the daemon plans from it)."""
    config = json.loads((MODELS / "gpt-oss-20b.json").read_text())
    config.update(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                  num_key_value_heads=2, num_attention_heads=4, head_dim=16, hidden_size=64,
                  sliding_window=8, max_position_embeddings=256, vocab_size=256)
    directory = work / "tiny-gpt-oss"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def value(layer: int, pos: int, req: int) -> float:
    """What swa_run.py writes as K of a token (V is 0.5 more)."""
    return (1.0 if req == 0 else -1.0) * (1000 * (layer + 1) + pos)


def swa_job(model: Path, pool: str, **extra: Any) -> str:
    return json.dumps({"model": str(model), "pool": pool, "full": FULL, "swa": SWA,
                       "page_size": PAGE, "head_num": 2, "head_dim": 16,
                       "swa_layers": SWA_LAYERS, "full_layers": FULL_LAYERS, **extra})


class SwaHarness(Harness):
    """``swa_run.py`` held open (the engine harness's event reader, another script); its
    ``step`` events are kept in ``steps``."""

    def __init__(self, python: Path, env: dict[str, str], log: Path, job: str) -> None:
        self.log = log
        self.steps: list[dict[str, Any]] = []
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [str(python), str(SWA_HARNESS)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, env=env, cwd=REPO, text=True,
                start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.send(job)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("HARNESS "):
                event = json.loads(line[len("HARNESS "):])
                if event["event"] == "step":
                    self.steps.append(event)
                self._events.put(event)
        self._events.put(None)


@contextlib.contextmanager
def swa_harness(python: Path, env: dict[str, str], log: Path, job: str) -> Iterator[SwaHarness]:
    """A running ``swa_run.py``; on failure its log's tail is printed; always ended."""
    h = SwaHarness(python, env, log, job)
    try:
        yield h
    except BaseException:
        print(f"--- {log.name} (last lines) ---\n{h.log_tail()}")
        raise
    finally:
        h.close()


def run_swa_harness(python: Path, env: dict[str, str], log: Path, job: str) -> dict[str, Any]:
    """One harness run without holding: its events by name (steps as a list)."""
    out = subprocess.run([str(python), str(SWA_HARNESS)], input=job + "\n", env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    log.write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stderr[-4000:]
    return events_of(out.stdout)


def events_of(stdout: str) -> dict[str, Any]:
    events: dict[str, Any] = {"step": []}
    for line in stdout.splitlines():
        if line.startswith("HARNESS "):
            event = json.loads(line[len("HARNESS "):])
            if event["event"] == "step":
                events["step"].append(event)
            else:
                events[event["event"]] = event
    return events


def test_swa_pools(sglang_python: Path, sglang_daemon: DaemonProcess, work: Path) -> None:
    """gpt-oss's SWA pool and allocator built with SGLang's arguments on kvpool: the same
    results as on SGLang's own classes, every value in the daemon, pages held by the lease,
    all back after."""
    model = tiny_gpt_oss(work)
    pool = "sgl-swa"
    # The binding closes its lease at the end: a long TTL, so a busy machine never lets the
    # harness's lease expire between two keep-alives.
    env = sglang_env(KVPOOL_TARGET=sglang_daemon.target, SGLANG_PLATFORM="kvpool",
                     KVPOOL_LEASE_TTL_S="60")
    base = run_swa_harness(sglang_python, env, work / "swa-base.log",
                           swa_job(model, "", baseline=True))
    assert base["built"]["ok"], base["built"]
    assert base["built"]["pool"] == "MHATokenToKVPool"
    assert base["built"]["inner"] == "PagedTokenToKVPoolAllocator"

    with swa_harness(sglang_python, env, work / "swa-kvpool.log",
                     swa_job(model, pool, hold=True)) as h:
        built = h.wait_for("built", 300)
        assert built["ok"], built
        assert built["pool"] == "KVPoolMHATokenToKVPool"
        assert built["inner"] == "PagedAllocator"
        assert built["spaces"] == ["kv", "swa"]
        assert built["mapping_in_daemon"] is True
        assert built["mapping_len"] == FULL + PAGE + 1
        state = h.wait_for("state", 60)
        holding = h.wait_for("holding", 60)
        with KVPoolClient(sglang_daemon.target) as client:
            stats = client.stats()
            lease = lease_of(stats, holding["lease_id"])
            assert lease is not None
            for space, want in holding["held"].items():
                assert lease.held[pool][space] == want["in_use"] + want["cached"], space
            # Prefill 11 + 5 tokens, 6 decode steps: 17 and 11 tokens, 5 + 3 full pages; the
            # SWA side the same less the 2 + 1 pages the windows slid past.
            assert holding["held"]["kv"]["in_use"] == 8
            assert holding["held"]["swa"]["in_use"] == 5
            p = stats.pool(pool)
            assert p.architecture == "hybrid_swa"
            assert p.spaces["swa"].follows == ""
            with client.attach(pool) as region:
                mapping = region["full_to_swa"]
                assert mapping.tolist() == state["mapping"]
                assert mapping[-1].item() == -1
                for req, (full_slots, swa_slots) in enumerate(
                        zip(state["slots"], state["swa_slots"], strict=True)):
                    for pos, (f, s) in enumerate(zip(full_slots, swa_slots, strict=True)):
                        for layer in SWA_LAYERS + FULL_LAYERS:
                            slot = s if layer in SWA_LAYERS else f
                            if slot == 0:  # the window slid past it: SWA side freed
                                assert layer in SWA_LAYERS and pos < (2 - req) * PAGE
                                continue
                            k = region[f"k.{layer}"][slot]
                            v = region[f"v.{layer}"][slot]
                            assert torch.equal(k, torch.full_like(k, value(layer, pos, req)))
                            assert torch.equal(v, k + 0.5)
        h.send("\n")
        h.wait_for("closed", 60)
        assert h.close() == 0

    kvpool = {"step": h.steps}
    assert [(s["name"], s["ok"], s["available"], s["full"], s["swa"]) for s in kvpool["step"]] \
        == [(s["name"], s["ok"], s["available"], s["full"], s["swa"]) for s in base["step"]]
    assert state["reads"] == base["state"]["reads"]
    with KVPoolClient(sglang_daemon.target) as client:
        p = client.stats().pool(pool)
        assert p.attached == 0
        assert all(s.used == 0 for s in p.spaces.values()), p.spaces

    # SGLang sizing its SWA side apart from the plan (64 SWA tokens): refused, both named.
    bad = run_swa_harness(sglang_python, env, work / "swa-bad.log",
                          swa_job(model, pool, swa=48))
    assert not bad["built"]["ok"]
    assert bad["built"]["error"].startswith("PoolMismatch: swa_full_tokens_ratio: SGLang sized "
                                            "the SWA side of its hybrid SWA pool at 48 tokens")
    assert "plans 64" in bad["built"]["error"]


# -- the engine -----------------------------------------------------------------------------------

# Shorter than the window (16) plus SGLang's SWA eviction interval (128): nothing is evicted.
# The opt-in Llama attends over every position, so once SGLang evicts SWA slots its tokens
# depend on what the evicted positions read (see docs/sglang.md, status).
PROMPTS = [list(range(5, 16)), list(range(20, 25))]
BATCHES = [PROMPTS, [PROMPTS[0]]]


@pytest.fixture(scope="module")
def swa_llama(sglang_python: Path, work: Path) -> Path:
    """A tiny random Llama (4 layers) opting in to SGLang's hybrid-SWA memory."""
    model = work / "swa-llama"
    env = {**sglang_env(), "PYTHONPATH": ""}
    out = subprocess.run([str(sglang_python), str(HARNESS), "make-model", str(model),
                          "--layers", "4"], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    config = json.loads((model / "config.json").read_text())
    config.update(is_hybrid_swa=True, hybrid_layer_pattern=[1, 0, 1, 0], sliding_window=16)
    (model / "config.json").write_text(json.dumps(config))
    return model


def engine_job(model: Path, **extra: Any) -> str:
    return json.dumps({"model": str(model), "page_size": PAGE, "max_total_tokens": 512,
                       "max_new_tokens": 8, "batches": BATCHES, **extra})


def test_swa_engine(sglang_python: Path, sglang_daemon: DaemonProcess, swa_llama: Path,
                    work: Path) -> None:
    """SGLang's engine with hybrid-SWA memory on kvpool: SGLang's own tokens, both spaces
    held by the lease, the mapping and the request table in the daemon, all back after."""
    env = {**without_kvpool_env(), "SGLANG_PLATFORM": "kvpool"}
    with harness(sglang_python, ["engine"], env, work / "swa-engine-base.log",
                 engine_job(swa_llama, baseline=True)) as h:
        h.wait_for("started", ENGINE_START_S)
        expected = h.wait_for("generated", 120)["outputs"]
        h.wait_for("shutdown", 120)
    assert expected[2]["cached_tokens"] > 0  # SGLang's SWA radix cache hit

    pool = "sgl-swa-engine"
    with harness(sglang_python, ["engine"], kvpool_env(sglang_daemon, pool),
                 work / "swa-engine.log", engine_job(swa_llama, hold=True)) as h:
        started = h.wait_for("started", ENGINE_START_S)
        outputs = h.wait_for("generated", 120)["outputs"]
        h.wait_for("holding", 60)
        with KVPoolClient(sglang_daemon.target) as client:
            stats = client.stats()
            p = stats.pool(pool)
            assert p.architecture == "hybrid_swa" and p.attached == 1
            leases = [x for x in stats.leases if x.held.get(pool)]
            assert len(leases) == 1
            lease = leases[0]
            assert lease.held[pool]["kv"] > 0 and lease.held[pool]["swa"] > 0, lease.held
            with client.attach(pool) as region:
                mapping = region["full_to_swa"]
                assert mapping.shape[0] == 512 + PAGE + 1 and mapping[-1].item() == -1
                mapped = torch.nonzero(mapping[:-1]).reshape(-1)
                # The radix cache keeps the prompts' pages, SWA side included.
                assert mapped.numel() >= 8, mapping
                swa_slots = mapping[mapped]
                assert torch.count_nonzero(region["k.0"][swa_slots].reshape(
                    swa_slots.numel(), -1).abs().sum(1)) == swa_slots.numel()
                table = region["req_to_token"]
                # SGLang wrote the first request's slots into row 1 of the daemon's table.
                assert set(table[:, :11].reshape(-1).tolist()) - {0}, "request table empty"
        since = time.monotonic()
        h.send("\n")
        h.wait_for("shutdown", 120)
        assert h.close() == 0
        lease_id = lease.lease_id
    assert outputs == expected
    print(f"  engine started in {started['seconds']} s; tokens equal SGLang's own pools")
    with KVPoolClient(sglang_daemon.target) as client:
        assert_all_back(client, pool, lease_id, since)

"""``bench/vllm_engine.py`` at tiny settings: two real vLLM 0.32 engines on CPU (``AsyncLLM``),
one with kvpool (``KVPoolConnector`` for its KV memory, ``KVPoolScheduler`` for its blocks,
against a real daemon) and one plain, the same trace through both; outcomes only (never
figures): every request of every round makes all its tokens, both engines give the same
greedy tokens in every round, the kvpool engine's leases held blocks while it ran (the prefix
cache's in use), and after the engines shut down the leases are gone and every block is back.

Skipped (with the reason) without the vLLM side venv; fails instead under
``KVPOOL_REQUIRE_VLLM=1``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env
from tests.integration.vllm_venv import vllm_python_or_skip


@pytest.mark.timeout(900)
def test_kvpool_and_baseline_engines_run_the_same_trace(tmp_path: Path) -> None:
    python = vllm_python_or_skip()
    out = tmp_path / "engine.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "vllm_engine.py"), "--quick", "--rounds", "1",
         "--requests", "16", "--json", str(out)],
        cwd=REPO, env=subprocess_env(KVPOOL_VLLM_VENV=str(python.parent.parent)),
        capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    rounds = got["rounds"]
    assert sorted(r["variant"] for r in rounds) == ["baseline", "kvpool"]
    assert all(r["complete"] and r["tokens"] > 0 for r in rounds)
    assert got["same_tokens"] == got["requests"] == 16
    assert got["same_tokens_every_round"] is True
    kvpool = next(r for r in rounds if r["variant"] == "kvpool")
    # After a round vLLM's prefix cache keeps the round's full blocks: the engine core's
    # lease holds them, in use; the worker's lease has the pool attached (mapped), and so has
    # the engine core's (unmapped: the fence of the blocks it seals).
    assert kvpool["kvpool"]["leases"] == 2 and kvpool["kvpool"]["attached"] == 2
    assert kvpool["kvpool"]["held"] >= kvpool["kvpool"]["in_use"] > 0
    after = got["kvpool_after_shutdown"]
    # every block back but the sealed ones the pool keeps for the next engine
    assert after == {"held": 0, "in_use": 0, "used": 0, "leases": 0, "attached": 0,
                     "kept": after["kept"]}
    assert after["kept"] > 0


@pytest.mark.timeout(900)
def test_sealing_on_and_off_run_the_same_trace(tmp_path: Path) -> None:
    """``--compare seal``: kvpool's engine sealing its blocks against one sealing none
    (``KVPOOL_SEAL=0``), the same trace: the same tokens; the sealing engine's pool keeps its
    sealed blocks after shutdown, every other block back."""
    python = vllm_python_or_skip()
    out = tmp_path / "seal.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "vllm_engine.py"), "--quick", "--rounds", "1",
         "--requests", "16", "--compare", "seal", "--json", str(out)],
        cwd=REPO, env=subprocess_env(KVPOOL_VLLM_VENV=str(python.parent.parent)),
        capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert sorted(r["variant"] for r in got["rounds"]) == ["noseal", "seal"]
    assert all(r["complete"] and r["tokens"] > 0 for r in got["rounds"])
    assert got["same_tokens_every_round"] is True
    after = got["kvpool_after_shutdown"]
    assert after["used"] == after["leases"] == after["attached"] == 0 and after["kept"] > 0

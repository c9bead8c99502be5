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
    # lease holds them, in use; the worker's lease has the pool attached.
    assert kvpool["kvpool"]["leases"] == 2 and kvpool["kvpool"]["attached"] == 1
    assert kvpool["kvpool"]["held"] >= kvpool["kvpool"]["in_use"] > 0
    assert got["kvpool_after_shutdown"] == {"held": 0, "in_use": 0, "used": 0, "leases": 0,
                                            "attached": 0}

"""``bench/sglang_engine.py`` at tiny settings: two real SGLang 0.5.23 engines on CPU, one with
kvpool's plugin and one with SGLang's own KV memory, the same trace through both; outcomes only
(never figures): every request of every round makes all its tokens, both engines give the same
greedy tokens, the plugin's lease held the pages while its engine ran, and every page is back
after the engines shut down (but the sealed pages the pool's directory keeps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env


@pytest.mark.timeout(900)
def test_plugin_and_baseline_engines_run_the_same_trace(sglang_python: Path,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "sglang_engine.py"), "--quick", "--rounds", "1",
         "--requests", "24", "--json", str(out)],
        cwd=REPO, env=subprocess_env(KVPOOL_SGLANG_VENV=str(sglang_python.parent.parent)),
        capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    rounds = got["rounds"]
    assert sorted(r["variant"] for r in rounds) == ["baseline", "plugin"]
    assert all(r["complete"] and r["tokens"] > 0 for r in rounds)
    assert got["same_tokens"] == got["requests"] == 24
    plugin = next(r for r in rounds if r["variant"] == "plugin")
    # After a round the radix cache keeps the round's pages: the plugin's lease holds them.
    assert plugin["kvpool"]["leases"] == 1 and plugin["kvpool"]["held"] > 0
    after = got["kvpool_after_shutdown"]
    # Every page back, but the sealed ones the pool's directory keeps for the next engine.
    assert after["held"] == after["leases"] == 0 and after["used"] == after["kept"]


@pytest.mark.timeout(900)
def test_restart_bench_restarted_engine_hits_the_dead_engines_pages(sglang_python: Path,
                                                                    tmp_path: Path) -> None:
    """``bench/restart.py --quick`` at tiny settings (outcomes only, never figures): the engine
    restarted on the pool adopts every page the killed one left sealed, its first probe is
    served from them (cached tokens as the never-killed engine's), the cold engine's from
    nothing, and all three give the same tokens."""
    out = tmp_path / "restart.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "restart.py"), "--quick", "--prefixes", "2",
         "--prefix-len", "64", "--json", str(out)],
        cwd=REPO, env=subprocess_env(KVPOOL_SGLANG_VENV=str(sglang_python.parent.parent)),
        capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (only,) = json.loads(out.read_text())["rounds"]
    assert only["kept"] > 0 and only["adopted"] == only["kept"]
    assert only["restarted"]["first_cached"] == only["live"]["first_cached"] > 0
    assert only["cold"]["cached"] == 0
    assert only["same_tokens"] == only["probes"] > 0

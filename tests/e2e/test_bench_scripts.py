"""Every script in ``bench/`` runs to completion on tiny settings (real daemons, real child
processes). No figures are asserted: the scripts print ratios for people; this only keeps them
runnable (a servicer change once broke ``bench/allocator.py`` unnoticed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPTS = {
    "allocator.py": ["--sizes", "1K", "--rounds", "1", "--seconds", "0.05"],
    "attach.py": ["--sizes-mib", "8", "--reps", "1"],
    "elastic.py": ["--rounds", "1", "--groups", "2", "--reclaims", "3"],
    "engine_step.py": ["--steps", "60", "--rounds", "1", "--requests", "16"],
    "hostile_free.py": ["--quick", "--frees", "1", "--window-s", "0.3"],
    "kv_events.py": ["--quick", "--pages", "2000", "--iters", "50", "--burst-s", "0.2"],
    "lease_expiry.py": ["--quick"],
    "page_cache.py": ["--calls", "200"],
    "plan_build.py": ["--runs", "1", "--build-runs", "1"],
    "rpc.py": ["--calls", "20", "--seconds", "0.05"],
    "scale.py": ["--seconds", "0.05"],
    "soak.py": ["--minutes", "0.15", "--workers", "2", "--kill-every-s", "4", "--sample-s", "2",
                "--baseline-s", "1", "--ttl-s", "1"],
    "stats_under_load.py": ["--leases", "200", "--seconds", "0.3"],
    "transfer.py": ["--rounds", "1", "--sizes", "1,4", "--control-calls", "2"],
    "transfer_fence.py": ["--runs", "1", "--kill-runs", "0"],
}


# Scripts run by a test of their own (they need the SGLang or vLLM side venv).
ELSEWHERE = {"sglang_engine.py": "tests/integration/sglang/test_sglang_engine_bench.py",
             "two_models.py": "tests/integration/sglang/test_two_models.py",
             "vllm_engine.py": "tests/integration/vllm/test_vllm_engine_bench.py",
             "restart_vllm.py": "tests/integration/vllm/test_restart.py",
             "restart.py": "tests/integration/sglang/test_sglang_engine_bench.py"}


def test_every_bench_script_is_listed() -> None:
    assert sorted(p.name for p in (REPO / "bench").glob("*.py")) == sorted(
        [*SCRIPTS, *ELSEWHERE])
    for test in ELSEWHERE.values():
        assert (REPO / test).exists(), test


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_bench_script_runs(script: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'client'}:{REPO / 'service'}")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *SCRIPTS[script]],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip(), "printed nothing"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]

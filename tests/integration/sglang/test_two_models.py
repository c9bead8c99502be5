"""Two real SGLang engines on one daemon's elastic pools (issue 24): ``bench/two_models.py`` at
tiny settings, kvpool's arbiter only, outcomes only (never figures): every request is served
(none aborted), the memory behind both pools never passes the daemon's budget, groups move
between the pools as the load turns, and a bursting engine holds more than it does while the
other bursts, and more than the static split's half."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env


@pytest.mark.timeout(900)
def test_two_engines_share_one_budget(sglang_python: Path, tmp_path: Path) -> None:
    out = tmp_path / "two.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "two_models.py"), "--quick", "--modes",
         "arbiter", "--burst", "64", "--phase-s", "6", "--json", str(out)],
        cwd=REPO, env=subprocess_env(KVPOOL_SGLANG_VENV=str(sglang_python.parent.parent)),
        capture_output=True, text=True, timeout=880)
    # stderr's tail holds the engines' and the daemon's last log lines (bench/two_models.py
    # prints them on a failure) before the traceback: keep enough of it to say why
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-20000:]
    # The phases say what they send, and the table comes with its legend.
    assert "[arbiter] phase a (6 s): engine a bursts (64 requests at once), engine b " \
        "trickles" in proc.stdout
    assert "[arbiter] phase both (6 s): engines a and b burst" in proc.stdout
    assert "legend, per mode, phase and engine" in proc.stdout
    assert "  held tok  most KV tokens" in proc.stdout and "why TTFT differs" in proc.stdout
    got = json.loads(out.read_text())
    run = got["modes"]["arbiter"]
    phases = run["phases"]
    assert sum(row["aborted"] for row in phases.values()) == 0
    assert all(row["requests"] > 0 for row in phases.values())
    assert 0 < run["peak_backed"] <= got["budget"]
    assert run["reclaims"] > 0  # groups went from one pool to the other
    assert phases["a/a"]["held"] > phases["a/b"]["held"]
    assert phases["b/b"]["held"] > phases["a/b"]["held"]
    # a burst needs more than half the budget (64 x 208 tokens of 8 KiB: 104 MiB of 128), so the
    # second burst takes groups from the first engine, and the bursting engine gets more
    # than the static split would give it
    assert phases["a/a"]["held"] > got["static_tokens"]["a"], (phases, got["static_tokens"])

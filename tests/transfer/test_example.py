"""examples/pd_disagg.py runs to the end: two daemons, a grant, a send, every byte checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, subprocess_env


@pytest.mark.timeout(300)
def test_pd_disagg_example_verifies_every_byte() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "pd_disagg.py"), "--pages",
                           "8"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "every byte verified" in proc.stdout

"""``kvpool demo`` run as a user would: a subprocess, its exit status and what it prints."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO, subprocess_env


def kvpool(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.tools.cli", *args], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout_s)


def test_demo_passes_and_cleans_up() -> None:
    """The default run: Qwen3-8B (36 layers, 8 KV heads of 128, bf16: 147,456 B per token) in
    32 MiB at page 16 is floor(33,554,432 / 147,456) = 227 tokens -> 14 pages, and the padding
    page 0 on top (15 pages of rows). The writer fills 8 pages of 72 K/V buffers: 72 x 8 x 16
    rows x 2,048 B = 18,874,368 B; the reader checks those and the other 7 pages' 72 x 7 x 16 x
    2,048 = 16,515,072 B of zeros. Stats show 2 attached and 8 pages used; everything is
    removed."""
    out = kvpool("demo")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "14 pages of 16 tokens" in text and "Qwen3ForCausalLM" in text
    assert "wrote 18,874,368 B into 72 K/V buffers" in text
    assert "verified 18,874,368 B byte for byte, 16,515,072 B of untouched pages are zero" in text
    assert "attached 2" in text  # the Stats table title while both workers are attached
    assert "dropped pool demo" in text
    assert "kvpoold stopped (exit 0); no kvpool-* file left in" in text
    assert text.rstrip().endswith("everything was cleaned up")
    shm_dir = Path(text.split("no kvpool-* file left in ")[1].split()[0])
    assert not shm_dir.exists()  # the demo's temporary shm dir is gone too


def test_demo_reports_an_unreachable_daemon() -> None:
    out = kvpool("demo", "--target", "unix:///nonexistent/kvpool.sock", timeout_s=60)
    assert out.returncode == 1
    assert "kvpool demo: FAILED:" in out.stdout and "is `kvpoold serve` running?" in out.stdout


def test_ctrl_c_is_one_line_130_and_leaves_nothing() -> None:
    """Ctrl-C (SIGINT to the demo's whole process group, as a terminal sends it) once its own
    daemon serves: one line on stderr, exit 130, and the clean-up of a finished run (no process
    of the group left, the daemon's socket directory and shared-memory directory gone)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.tools.cli", "demo"], cwd=REPO,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        for line in proc.stdout:  # the facts: the demo's own lines (EOF if it dies first)
            seen.append(line)
            if "kvpoold serving at" in line:
                break
        assert "kvpoold serving at" in seen[-1], "".join(seen)
        started = seen[0]  # "starting kvpoold (socket S, shared memory in D)"
        sock = Path(started.split("(socket ")[1].split(",")[0])
        shm = Path(started.split("shared memory in ")[1].rstrip(")\n"))
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["kvpool demo: interrupted (Ctrl-C); stopped what it "
                                        "started"], err
    assert "Traceback" not in out + err
    assert not sock.parent.exists() and not shm.exists()
    for _ in range(600):  # its children exit with it; a ceiling, not a deadline
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"processes of group {proc.pid} still run after the demo ended")

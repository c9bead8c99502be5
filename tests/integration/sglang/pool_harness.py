"""A side-venv script that builds SGLang pools and reports ``HARNESS {json}`` events on stdout
(``tests/sglang/hybrid_linear_run.py``, ``tests/sglang/fp4_run.py``): one line of JSON in, events
out, a line on stdin to let it end its binding."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import torch

from tests.conftest import REPO


class Run:
    """One harness process: its ``HARNESS`` events in order; SGLang's log in a file."""

    def __init__(self, python: Path, script: Path, job: dict[str, Any], env: dict[str, str],
                 log: Path) -> None:
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([str(python), str(script)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env, cwd=REPO,
                                         text=True)
        self.send(json.dumps(job))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def next_event(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("HARNESS "):
                return json.loads(line[len("HARNESS "):])
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
        raise AssertionError(f"the harness exited ({self.proc.wait()}):\n{tail}")

    def finish(self) -> None:
        """Let it end its binding and exit."""
        with contextlib.suppress(BrokenPipeError):  # it may have exited (after an error)
            self.send("")
        assert self.proc.wait(timeout=60) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_to_end(python: Path, script: Path, job: dict[str, Any], env: dict[str, str],
               log: Path, events: int = 2) -> list[dict[str, Any]]:
    """Run ``script`` with ``job`` to its end: its first ``events`` events, or only the first
    when that is ``error``."""
    run = Run(python, script, job, env, log)
    try:
        got = [run.next_event()]
        while got[0]["event"] != "error" and len(got) < events:
            got.append(run.next_event())
        run.finish()
        return got
    finally:
        run.kill()


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in row-major order (any dtype, any strides)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()

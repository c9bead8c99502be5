"""An engine child of a bench script: the script itself in ``engine`` mode under a side venv's
Python, in its own process group, sending events on stdout (``BENCH {json}`` lines) and
taking jobs on stdin (an empty line: shut down). Used by ``bench/sglang_engine.py`` and
``bench/vllm_engine.py``."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any


class EngineProcess:
    """One engine process; events from its stdout, the engine's log in ``log``.

    Args:
        name: for messages. script: the bench script (run as ``script engine``).
        python: the side venv's interpreter. job: the first line sent (as JSON).
        env: its environment. log: its stderr. cwd: its working directory.
        close_timeout_s: how long :meth:`close` waits after the empty line before it kills
            the process group.
    """

    def __init__(self, name: str, script: Path, python: Path, job: dict[str, Any],
                 env: dict[str, str], log: Path, cwd: Path, close_timeout_s: float) -> None:
        self.name = name
        self.log = log
        self.close_timeout_s = close_timeout_s
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [str(python), str(script.resolve()), "engine"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd,
                text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.send(json.dumps(job))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("BENCH "):
                self.events.put(json.loads(line[len("BENCH "):]))
        self.events.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, event: str, timeout_s: float) -> dict[str, Any]:
        """The next ``event`` (others skipped); RuntimeError with the log's tail when it does
        not come in time or the process exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.name} engine: no {event!r} in {timeout_s:.0f} s; "
                                   f"its log:\n{self.tail()}") from None
            if got is None:
                raise RuntimeError(f"{self.name} engine exited ({self.proc.wait()}) before "
                                   f"{event!r}; its log:\n{self.tail()}")
            if got["event"] == event:
                return got

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        """Shut the engine down (an empty line), then kill what is left of its group."""
        with contextlib.suppress(OSError, ValueError):
            self.send("")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=self.close_timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

"""Child Python processes for the tests: a script run with ``python -c``, JSON lines both ways.

The child plays an engine: it gets only plain values on stdin (a target and pool name, or a
handle and buffer layouts) and answers on stdout. Every script starts with :data:`PRELUDE`
(``send``, ``recv``, ``rss_bytes``) and the caller's own prelude (imports, helpers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.conftest import REPO, subprocess_env

# What every child has: the JSON-lines protocol and its resident memory.
PRELUDE = r"""
import json, sys

def send(obj):
    print(json.dumps(obj), flush=True)

def recv():
    return json.loads(sys.stdin.readline())

def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")
"""


class Child:
    """A child process speaking JSON lines; killed on exit if still running.

    Args:
        script: the child's code, run after :data:`PRELUDE` and ``prelude``.
        prelude: the caller's shared part of its scripts (imports, helpers).
        env: variables set on top of this environment (the repo already on PYTHONPATH).
        first: sent at once; None to send the first message later with :meth:`send`, so a
            child can start (and import torch) before its input is known.
        timeout_s: how long to wait for the child to exit once it has closed its stdout.
    """

    def __init__(self, script: str, *, prelude: str = "", env: Mapping[str, str] | None = None,
                 first: Any = None, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + prelude + script], cwd=REPO,
            env=subprocess_env(**(env or {})), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        if first is not None:
            self.send(first)

    def send(self, obj: Any) -> None:
        """Write ``obj`` as one JSON line to the child's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> Any:
        """The child's next JSON line.

        Raises:
            AssertionError: the child exited instead (with its status and stderr).
        """
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=self.timeout_s)
            raise AssertionError(f"child exited with {self.proc.returncode}: {self.stderr()}")
        return json.loads(line)

    def wait_ok(self) -> None:
        """Wait for the child to exit with status 0 (its stderr is the failure message)."""
        assert self.proc.wait(timeout=self.timeout_s) == 0, self.stderr()

    def stderr(self) -> str:
        """What the child wrote to stderr; read once it has exited."""
        return self.proc.stderr.read() if self.proc.stderr else ""

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=self.timeout_s)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


# A latency probe beside a load: its own lease doing Allocate(kv, 1) + Free in a loop until a
# second message says stop, then its figures (calls, errors, p50/p99/max in ms). First message:
# ``{"target", "pool"}`` and, for a TCP or token-checked listener, ``"token"``.
LATENCY_PROBE = r"""
import threading, time
from kvpool.clients.client import KVPoolClient
first = recv()
stop = threading.Event()
threading.Thread(target=lambda: (recv(), stop.set()), daemon=True).start()
samples, errors = [], []
with KVPoolClient(first["target"], token=first.get("token"), timeout_s=60) as client:
    lease = client.lease("probe", ttl_s=30)
    send({"ready": True})
    while not stop.is_set():
        t = time.perf_counter()
        try:
            lease.free(first["pool"], "kv", lease.allocate(first["pool"], "kv", 1))
        except Exception as exc:
            errors.append(repr(exc)[:200])
        samples.append(time.perf_counter() - t)
    lease.close()
samples.sort()
pick = lambda q: round(1e3 * samples[min(len(samples) - 1, int(q * len(samples)))], 2)
send({"calls": len(samples), "errors": errors, "p50_ms": pick(0.5), "p99_ms": pick(0.99),
      "max_ms": pick(1.0)})
"""


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def processes_naming(text: str) -> list[str]:
    """The command lines of running processes that contain ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and alive(int(proc.name)):
            found.append(f"{proc.name}: {cmdline}")
    return found


def with_default_sigint(argv: list[str]) -> list[str]:
    """``argv`` run with SIGINT at its default disposition, as a terminal's foreground job has
    it when Ctrl-C is pressed (a test runner started in the background may have SIGINT ignored,
    which its children inherit and a shell cannot trap)."""
    return [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
            "signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])", *argv]


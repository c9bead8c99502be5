"""The child processes of ``kvpool demo``: its own ``kvpoold serve`` and the two workers.

The daemon gets a temporary socket and shared-memory directory, both removed when it stops;
the workers (``python -m kvpool.tools.demo_worker ROLE``) talk JSON lines on stdin/stdout, read by a
thread into a queue so a silent worker times out instead of hanging the demo.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kvpool.contract.errors import KVPoolError
from kvpool.tools.demo_worker import DemoFailed

if TYPE_CHECKING:
    from kvpool.clients.client import KVPoolClient

STEP_TIMEOUT_S = 60.0


class Worker:
    """A worker child process; its JSON lines arrive on a queue read by a thread."""

    def __init__(self, role: str, env: dict[str, str], log_dir: Path) -> None:
        self.role = role
        self.stderr_path = log_dir / f"{role}.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvpool.tools.demo_worker", role], env=env, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def _pump(self, stream: IO[str] | None) -> None:
        for line in stream or ():
            self._lines.put(line)
        self._lines.put(None)

    def send(self, obj: object) -> None:
        """Write ``obj`` as one JSON line to the worker's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float = STEP_TIMEOUT_S) -> dict[str, Any]:
        """The worker's next JSON line.

        Raises:
            DemoFailed: the worker said nothing for ``timeout_s``, exited, or reported an error.
        """
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise DemoFailed(f"the {self.role} said nothing for {timeout_s:.0f} s") from None
        if line is None:
            code = self.proc.wait(10)
            raise DemoFailed(f"the {self.role} exited with {code}:\n{self.stderr_tail()}")
        msg = json.loads(line)
        if "error" in msg:
            raise DemoFailed(f"the {self.role} failed: {msg['error']}")
        return msg

    def stderr_tail(self, lines: int = 15) -> str:
        text = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def finish(self, timeout_s: float = 30.0) -> int:
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@dataclass
class OwnDaemon:
    """The ``kvpoold serve`` child the demo started, and its temporary directories."""

    proc: subprocess.Popen[bytes]
    socket: Path
    shm_dir: Path
    log: Path

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def log_tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in self.shm_dir.glob("kvpool-*"))


def child_env() -> dict[str, str]:
    """This environment, with the directories holding ``kvpool`` and ``kvpoold`` on PYTHONPATH
    so children import the same code (a source checkout as well as an installed package)."""
    roots = []
    for name in ("kvpool", "kvpoold"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            roots.append(str(Path(spec.origin).resolve().parent.parent))
    env = dict(os.environ)
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(roots + old))
    return env


def shm_parent() -> Path | None:
    """/dev/shm when it is a writable directory (the demo's shm dir goes under it)."""
    path = Path("/dev/shm")
    return path if path.is_dir() and os.access(path, os.W_OK) else None


@contextlib.contextmanager
def own_daemon(budget_bytes: int, env: dict[str, str], say: Any) -> Iterator[OwnDaemon]:
    """Start ``kvpoold serve`` on a temp socket and shm dir; always stop it and remove both."""
    work = Path(tempfile.mkdtemp(prefix="kvpooldemo-", dir="/tmp"))
    parent = shm_parent()
    shm_dir = Path(tempfile.mkdtemp(prefix="kvpooldemo-", dir=parent)) if parent else work
    sock, log = work / "kvpool.sock", work / "kvpoold.log"
    cmd = [sys.executable, "-m", "kvpoold.main", "serve", "--listen", f"unix://{sock}",
           "--budget", str(budget_bytes), "--shm-dir", str(shm_dir)]
    say(f"starting kvpoold (socket {sock}, shared memory in {shm_dir})")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    daemon = OwnDaemon(proc, sock, shm_dir, log)
    try:
        yield daemon
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)
        if shm_dir != work:
            shutil.rmtree(shm_dir, ignore_errors=True)


def wait_listening(daemon: OwnDaemon, timeout_s: float) -> None:
    """Wait until the daemon's socket accepts connections.

    Done before the first RPC because a gRPC channel whose first connect fails backs off for
    a second or more before it tries again.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon.proc.poll() is not None:
            raise DemoFailed(f"kvpoold exited with {daemon.proc.returncode} before serving:\n"
                             f"{daemon.log_tail()}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(daemon.socket))
                return
            except OSError:
                pass
        time.sleep(0.02)
    raise DemoFailed(f"kvpoold did not listen on {daemon.socket} within {timeout_s:.0f} s:\n"
                     f"{daemon.log_tail()}")


def wait_serving(client: KVPoolClient, daemon: OwnDaemon | None, timeout_s: float) -> None:
    """Poll the health service until SERVING (the daemon imports torch first: a second or two)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if daemon is not None and daemon.proc.poll() is not None:
            raise DemoFailed(f"kvpoold exited with {daemon.proc.returncode} before serving:\n"
                             f"{daemon.log_tail()}")
        try:
            if client.health() == "SERVING":
                return
        except KVPoolError as exc:
            last = str(exc)
            if daemon is None:
                raise DemoFailed(str(exc)) from None
        time.sleep(0.05)
    raise DemoFailed(f"kvpoold at {client.target} is not serving after {timeout_s:.0f} s: {last}")


def start_workers(stack: contextlib.ExitStack, env: dict[str, str], log_dir: Path
                  ) -> dict[str, Worker]:
    """Start the writer and the reader; ``stack`` kills them if they are still running."""
    workers = {role: Worker(role, env, log_dir) for role in ("writer", "reader")}
    for w in workers.values():
        stack.callback(w.kill)
    return workers

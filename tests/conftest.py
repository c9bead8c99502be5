"""Shared pytest setup: ``tests.factories`` importable; temp socket dirs, a tiny model, a
``kvpoold serve`` launcher."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings

REPO = Path(__file__).resolve().parents[1]
PYTHONPATH = os.pathsep.join(str(REPO / p) for p in ("client", "service"))

# A tiny MHA model: 2 layers, 2 KV heads of 16, bf16. One token costs
# 2 layers * 2 (K, V) * 2 heads * 16 * 2 B = 256 B, a 16-token page 4096 B, so a 1 MiB budget
# holds 1 MiB / 4 KiB = 256 pages, and the padding page 0 comes on top (as in SGLang).
TINY_SPEC: dict[str, Any] = {
    "num_layers": 2,
    "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
    "context_length": 256,
}
TINY_OPTIONS: dict[str, Any] = {"budget_bytes": 1 << 20, "page_size": 16,
                                "max_running_requests": 8}
TINY_PAGES = 256


def stateful_settings(examples: int, steps: int) -> settings:
    """Settings for the model-based (hypothesis stateful) tests: derandomized, so every run
    explores the same programs. No shrinking: minimizing a failing program of dozens of steps
    takes hypothesis minutes; a failure is reported in seconds, and adding Phase.shrink locally
    minimizes it."""
    return settings(max_examples=examples, stateful_step_count=steps, derandomize=True,
                    database=None, deadline=None,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate))


@pytest.fixture
def tiny_spec() -> dict[str, Any]:
    return dict(TINY_SPEC)


@contextlib.contextmanager
def temp_dir(prefix: str = "kvp-", parent: str = "/tmp") -> Iterator[Path]:
    """A fresh directory under ``parent``, always removed with everything in it.

    The default is short, for Unix sockets (``sun_path`` holds 108 bytes); module-scoped
    fixtures use this directly, tests take :func:`socket_dir`.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short temp dir for Unix sockets (paths must stay under ~100 bytes)."""
    with temp_dir() as path:
        yield path


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory on /dev/shm (tmpfs), so parallel tests never see each other."""
    with temp_dir(prefix="kvpooltest-", parent="/dev/shm") as path:
        yield path


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: the repo's client and service on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHONPATH + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                      else "")
    env.update(extra)
    return env


def _unix_path(target: str) -> str | None:
    """The socket path of a ``unix://`` / ``unix:`` target; None for anything else."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            return target[len(prefix):]
    return None


def _accepts(path: str) -> bool:
    """Whether a Unix socket at ``path`` accepts a connection now (bound and listening)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def wait_serving(target: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
                 token: str | None = None) -> None:
    """Poll the health service until SERVING.

    A Unix socket is first probed with a plain ``connect`` until it accepts: a gRPC channel
    whose first connect fails backs off for a second or more before it tries again, which cost
    each daemon start that much. Each health check then uses a fresh channel, so no backoff
    carries over between attempts.

    Raises:
        RuntimeError: the process exited or the timeout passed.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s

    def check_alive() -> None:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"kvpoold exited with {proc.returncode} before serving")

    path = _unix_path(target)
    while path is not None and not _accepts(path):
        check_alive()
        if time.monotonic() >= deadline:
            raise RuntimeError(f"kvpoold at {target} not listening after {timeout_s} s")
        time.sleep(0.02)
    while time.monotonic() < deadline:
        check_alive()
        with grpc.insecure_channel(target) as channel:
            try:
                grpc.channel_ready_future(channel).result(
                    timeout=max(0.01, min(0.5, deadline - time.monotonic())))
                resp = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=0.5)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass
        time.sleep(0.02)
    raise RuntimeError(f"kvpoold at {target} not serving after {timeout_s} s")


@dataclass
class DaemonProcess:
    """A ``kvpoold serve`` child process and where it listens."""

    proc: subprocess.Popen[bytes]
    socket: Path
    log: Path

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


@contextlib.contextmanager
def run_daemon(socket_dir: Path, *args: str, budget: str = "64MiB",
               extra_listen: Sequence[str] = (), timeout_s: float = 30.0,
               preexec_fn: Callable[[], None] | None = None) -> Iterator[DaemonProcess]:
    """Start ``kvpoold serve`` on ``socket_dir/kvpool.sock``, wait until it serves, yield it,
    and always stop it (SIGTERM, then SIGKILL). ``preexec_fn`` runs in the child before it
    starts (a lowered RLIMIT_NOFILE)."""
    sock = socket_dir / "kvpool.sock"
    log = socket_dir / "kvpoold.log"
    cmd = [sys.executable, "-m", "kvpoold.main", "serve", "--listen", f"unix://{sock}",
           "--budget", budget, *(a for x in extra_listen for a in ("--listen", x)), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO, preexec_fn=preexec_fn)
    daemon = DaemonProcess(proc, sock, log)
    try:
        wait_serving(daemon.target, timeout_s, proc)
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture
def kvpoold(socket_dir: Path) -> Iterator[DaemonProcess]:
    """A ``kvpoold serve`` process with a 64 MiB budget on a temp Unix socket."""
    with run_daemon(socket_dir) as daemon:
        yield daemon


# The quick tier (``pytest -m "not slow"``, README): the rooms whose tests start engines, real
# daemons in child processes, NIXL agents or GPUs are "slow"; unit and in-process service tests
# are not. One place decides it, by directory, so a new test lands in its tier by where it lives.
SLOW_ROOMS = ("integration", "transfer", "e2e", "gpu", "sglang", "vllm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    for item in items:
        try:
            room = Path(str(item.fspath)).resolve().relative_to(tests).parts[0]
        except ValueError:
            continue
        if room in SLOW_ROOMS:
            item.add_marker(pytest.mark.slow)


"""Channel errors reach callers as their own classes: ``Unavailable`` from a daemon that never
started or has stopped (also when leaving a lease's ``with`` block), ``DeadlineExceeded`` from a
call whose deadline passes, and the CLI's exit status and message for both."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import DeadlineExceeded, KVPoolError, Unavailable
from kvpool.clients.aio import AsyncKVPoolClient
from kvpool.clients.client import KVPoolClient
from kvpool.v1 import kvpool_pb2 as pb
from tests.conftest import (
    REPO,
    TINY_OPTIONS,
    TINY_SPEC,
    DaemonProcess,
    run_daemon,
    subprocess_env,
    temp_dir,
)

NOT_RUNNING = "is `kvpoold serve` running?"


@pytest.fixture(scope="module")
def shared_daemon() -> Iterator[DaemonProcess]:
    """One daemon for the tests that do not stop it."""
    with temp_dir() as path, run_daemon(path, budget="8MiB") as daemon:
        yield daemon


@pytest.fixture
def nothing_listening(socket_dir: Path) -> str:
    """A Unix socket target where no daemon ever listened."""
    return f"unix://{socket_dir}/kvpool.sock"


def test_a_daemon_that_never_started_is_unavailable(nothing_listening: str) -> None:
    with KVPoolClient(nothing_listening, timeout_s=5.0) as client:
        with pytest.raises(Unavailable) as info:
            client.stats()
        assert info.value.code == info.value.code_name == "UNAVAILABLE"
        assert str(info.value).startswith(f"cannot reach kvpoold at {nothing_listening} (")
        assert NOT_RUNNING in str(info.value)
        with pytest.raises(Unavailable):
            client.lease("engine")
        with pytest.raises(Unavailable):
            client.health()


async def test_async_client_to_a_daemon_that_never_started(nothing_listening: str) -> None:
    async with AsyncKVPoolClient(nothing_listening, timeout_s=5.0) as client:
        with pytest.raises(Unavailable, match="is `kvpoold serve` running"):
            await client.stats()
        with pytest.raises(Unavailable):
            await client.lease("engine")
        with pytest.raises(Unavailable):
            async for _ in client.watch_stats(interval_s=0.1):
                pass


def test_cli_says_the_daemon_is_not_running(nothing_listening: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvpool.tools.cli", "stats", "--target",
                           nothing_listening], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("kvpool stats: error (UNAVAILABLE): cannot reach kvpoold at "
                                  f"{nothing_listening}")
    assert NOT_RUNNING in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_leaving_a_lease_after_the_daemon_stopped_raises_unavailable(
        socket_dir: Path, sig: signal.Signals) -> None:
    with run_daemon(socket_dir, budget="8MiB") as daemon, KVPoolClient(daemon.target) as client:
        client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        with pytest.raises(Unavailable) as info:  # noqa: SIM117 (the raise is on leaving)
            with client.lease("engine", ttl_s=0.3) as lease:
                assert len(lease.allocate("tiny", "kv", 4)) == 4
                daemon.stop(sig)
        assert NOT_RUNNING in str(info.value)
        # the keep-alive thread saw the stream end or fail; never a base KVPoolError
        assert lease.error is None or isinstance(lease.error, Unavailable), repr(lease.error)


async def test_async_lease_after_the_daemon_stopped_raises_unavailable(
        socket_dir: Path) -> None:
    with run_daemon(socket_dir, budget="8MiB") as daemon:
        async with AsyncKVPoolClient(daemon.target) as client:
            await client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
            lease = await client.lease("engine", ttl_s=0.3)
            with pytest.raises(Unavailable):
                async with lease:
                    assert len(await lease.allocate("tiny", "kv", 4)) == 4
                    await asyncio.to_thread(daemon.stop, signal.SIGKILL)
                    await asyncio.sleep(0.3)  # renewals fail in between
            assert isinstance(lease.error, Unavailable), repr(lease.error)


@contextlib.contextmanager
def stopped(daemon: DaemonProcess) -> Iterator[None]:
    """The daemon's process paused (SIGSTOP): its socket still accepts, nothing answers."""
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        daemon.proc.send_signal(signal.SIGCONT)


def test_a_passed_deadline_is_deadline_exceeded(shared_daemon: DaemonProcess) -> None:
    """A call to a daemon that cannot answer (paused) fails when its deadline passes."""
    with KVPoolClient(shared_daemon.target) as client:
        client.stats()  # connected: the failures below are the deadline, not the channel
        with stopped(shared_daemon):
            client.timeout_s = 0.2
            with pytest.raises(DeadlineExceeded) as info:
                client.stats()
            assert info.value.code == info.value.code_name == "DEADLINE_EXCEEDED"
            with pytest.raises(DeadlineExceeded):
                client.configure("late", spec=TINY_SPEC, dry_run=True, timeout_s=0.2,
                                 **TINY_OPTIONS)
        client.timeout_s = 30.0
        assert client.stats().daemon.uptime_seconds > 0  # it answers again


async def test_async_deadline_exceeded(shared_daemon: DaemonProcess) -> None:
    async with AsyncKVPoolClient(shared_daemon.target) as client:
        await client.stats()
        with stopped(shared_daemon):
            client.timeout_s = 0.2
            with pytest.raises(DeadlineExceeded):
                await client.stats()
            with pytest.raises(DeadlineExceeded):
                await client.call("Stats", pb.StatsRequest(), timeout_s=0.1)
        client.timeout_s = 30.0
        await client.stats()


def test_no_channel_error_is_a_bare_kvpool_error(nothing_listening: str) -> None:
    """What used to come back as ``KVPoolError`` with code INTERNAL now has its class."""
    with KVPoolClient(nothing_listening, timeout_s=5.0) as client:
        try:
            client.stats()
        except KVPoolError as exc:
            assert type(exc) is not KVPoolError
            assert exc.code != "INTERNAL"
        else:
            raise AssertionError("stats() with nothing listening did not fail")

"""``kvpoold serve`` as a separate process driven by client processes and the ``kvpool`` CLI:
crash reclaim by lease expiry, eight concurrent clients, clean shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.clients.aio import AsyncKVPoolClient
from kvpool.clients.client import KVPoolClient
from kvpool.contract.errors import Unavailable
from tests.conftest import (
    REPO,
    TINY_OPTIONS,
    TINY_PAGES,
    TINY_SPEC,
    DaemonProcess,
    run_daemon,
    subprocess_env,
    temp_dir,
)


@pytest.fixture(scope="module")
def shared_daemon() -> Iterator[DaemonProcess]:
    """One daemon for the tests that do not stop it (each uses its own pool)."""
    with temp_dir() as path, run_daemon(path) as daemon:
        yield daemon


def start_client(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.e2e.clients", *args], cwd=REPO,
                            env=subprocess_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def read_json(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> dict:
    line = proc.stdout.readline() if proc.stdout else ""
    assert line, f"client exited with {proc.wait(timeout_s)} before reporting"
    return json.loads(line)


def kvpool_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.tools.cli", *args], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)


def test_sigkilled_client_loses_its_pages_within_ttl_plus_1s(
        shared_daemon: DaemonProcess) -> None:
    """A client holding 20 pages under a 1 s lease is SIGKILLed: the daemon's sweeper (every
    0.2 s) sees the lease expire at most 1 s after its last renewal, so Stats shows the pages
    free again within TTL + 1 s = 2 s of the kill."""
    target = shared_daemon.target
    with KVPoolClient(target) as client:
        client.configure("crash", spec=TINY_SPEC, **TINY_OPTIONS)
        proc = start_client("hold", target, "crash", "20", "1.0")
        try:
            report = read_json(proc)
            assert len(report["ids"]) == 20
            assert client.stats("crash").pool("crash").spaces["kv"].used == 20
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            proc.wait(10)
            while client.stats("crash").pool("crash").spaces["kv"].used:
                assert time.monotonic() - killed < 60.0, "pages never came back"
                time.sleep(0.05)
        finally:
            proc.kill()
            proc.wait()
        stats = client.stats()
        assert stats.daemon.leases_expired >= 1
        assert all(x.lease_id != report["lease_id"] for x in stats.leases)
        client.drop("crash")
    assert "event=lease_expired" in shared_daemon.log_text()


def test_eight_clients_at_random_then_every_invariant_holds(
        shared_daemon: DaemonProcess) -> None:
    """Eight processes allocate (1..16 pages) and free at random on one 256-page pool for
    3 s. Afterwards: what each says it holds is what Stats says its lease holds, no page is
    held twice, used == sum over leases == allocs - frees, used + free == capacity; after they
    close their leases everything is free."""
    target = shared_daemon.target
    with KVPoolClient(target) as client:
        client.configure("churn", spec=TINY_SPEC, **TINY_OPTIONS)
        procs = [start_client("churn", target, "churn", "3", str(seed)) for seed in range(8)]
        try:
            reports = [read_json(p) for p in procs]
            stats = client.stats("churn")
            kv = stats.pool("churn").spaces["kv"]
            by_lease = {x.lease_id: x.held.get("churn", {}).get("kv", 0) for x in stats.leases}
            for r in reports:
                assert by_lease[r["lease_id"]] == len(r["held"])
            all_held = [i for r in reports for i in r["held"]]
            assert len(all_held) == len(set(all_held)), "a page is held by two leases"
            assert all(1 <= i <= TINY_PAGES for i in all_held)
            assert kv.used == len(all_held) == sum(by_lease.values())
            assert kv.used + kv.free == kv.capacity == TINY_PAGES
            assert kv.allocs - kv.frees == kv.used
            assert kv.allocs == sum(r["allocs"] for r in reports)
            assert sum(r["allocs"] for r in reports) > 100  # they really churned
            for p in procs:
                p.communicate("done\n", timeout=30)
                assert p.returncode == 0
        finally:
            for p in procs:
                p.kill()
                p.wait()
        kv = client.stats("churn").pool("churn").spaces["kv"]
        assert (kv.used, kv.free) == (0, TINY_PAGES)
        client.drop("churn")


def test_cli_configure_stats_leases_drop(shared_daemon: DaemonProcess, tmp_path: Path) -> None:
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps(TINY_SPEC))
    target = ["--target", shared_daemon.target]
    out = kvpool_cli("configure", "cli", "--spec", str(spec), "--budget", "1MiB",
                     "--page-size", "16", "--max-running-requests", "8", *target)
    assert out.returncode == 0, out.stderr
    assert "pool cli: created" in out.stdout and "256 pages" in out.stdout
    out = kvpool_cli("stats", "--json", *target)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) == {"daemon", "pools", "leases", "peers"}
    assert data["peers"] == []  # no transfer with another daemon yet
    assert data["daemon"]["device"] == "cpu" and data["daemon"]["budget_bytes"] == 64 << 20
    (pool,) = [p for p in data["pools"] if p["name"] == "cli"]
    # a kv page: 2 layers x (K, V) x 2 heads x 16 x 2 B x 16 tokens; a req row: 4 x (256 + 4)
    # the record as on the wire: free and allocs follow from it, so neither is printed
    assert pool["spaces"]["kv"] == {"capacity": 256, "used": 0, "high_water": 0, "frees": 0,
                                    "failed_allocs": 0, "unit": "pages",
                                    "bytes_per_unit": 4096, "follows": "", "pinned": 0,
                                    "quarantined": 0}
    assert pool["spaces"]["req"]["capacity"] == 8 and pool["attached"] == 0
    assert pool["spaces"]["req"]["bytes_per_unit"] == 1040
    out = kvpool_cli("leases", *target)
    assert out.returncode == 0, out.stderr
    out = kvpool_cli("configure", "cli", "--spec", str(spec), "--budget", "1MiB",
                     "--page-size", "32", *target)
    assert out.returncode == 1 and "ALREADY_EXISTS" in out.stderr
    out = kvpool_cli("configure", "BAD", "--spec", str(spec), "--budget", "1MiB", *target)
    assert out.returncode == 2 and "pool name" in out.stderr
    out = kvpool_cli("drop", "cli", *target)
    assert out.returncode == 0 and "dropped cli" in out.stdout, out.stderr


def test_cli_json_writes_lease_ids_as_exact_strings(shared_daemon: DaemonProcess) -> None:
    """``kvpool leases --json`` and ``kvpool stats --json``: each lease id is a decimal string
    that round-trips exactly (a random 63-bit id is almost always over 2**53, where a JSON
    number loses digits in jq); jq (docs/operations.md's recipe) hands back every digit."""
    import shutil

    target = ["--target", shared_daemon.target]
    with KVPoolClient(shared_daemon.target) as client, \
            client.lease("json-ids", ttl_s=30) as lease:
        out = kvpool_cli("leases", "--json", *target)
        assert out.returncode == 0, out.stderr
        (listed,) = [x for x in json.loads(out.stdout) if x["name"] == "json-ids"]
        assert isinstance(listed["lease_id"], str) and int(listed["lease_id"]) == lease.lease_id
        assert str(lease.lease_id) in out.stdout
        out = kvpool_cli("stats", "--json", *target)
        assert out.returncode == 0, out.stderr
        (listed,) = [x for x in json.loads(out.stdout)["leases"] if x["name"] == "json-ids"]
        assert listed["lease_id"] == str(lease.lease_id)
        assert isinstance(json.loads(out.stdout)["daemon"]["budget_bytes"], int)  # only ids
        assert isinstance(client.stats().leases[0].lease_id, int)  # the Python API keeps ints
        jq = shutil.which("jq")
        if jq is None:
            pytest.skip("no jq on PATH")
        got = subprocess.run([jq, "-r", '.[] | select(.name == "json-ids") | .lease_id'],
                             input=kvpool_cli("leases", "--json", *target).stdout,
                             capture_output=True, text=True, timeout=30, check=True)
        assert int(got.stdout) == lease.lease_id


@pytest.mark.parametrize(("argv", "code"), [
    (("-c", "import kvpool.tools.cli"), 0),
    (("-m", "kvpool.tools.cli", "stats", "--help"), 0),
    (("-m", "kvpool.tools.cli", "leases", "--help"), 0),
    (("-m", "kvpool.tools.cli", "top", "--help"), 0),
    (("-m", "kvpoold.main", "serve", "--budget", "12XB"), 2),
    (("-m", "kvpoold.main", "serve", "--grace-seconds", "-1"), 2),
    (("-m", "kvpoold.main", "serve", "--socket-group", "no-such-group-kvp"), 2),
])
def test_cli_does_not_import_torch(argv: tuple[str, ...], code: int) -> None:
    """The client CLI never needs torch; ``kvpoold serve`` refuses a bad setting before it
    imports torch (the server does), so the error comes back at once."""
    out = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=REPO,
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == code, out.stderr
    assert " torch" not in out.stderr


def test_sigterm_shuts_down_cleanly(socket_dir: Path) -> None:
    """A daemon with a pool, a lease kept alive by a client and a watcher stream: SIGTERM
    ends it with status 0 well within its grace, and the socket file is gone."""
    # a grace far past the ceiling below: open streams that held it could not pass
    with run_daemon(socket_dir, "--grace-seconds", "300") as daemon:
        assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
        with KVPoolClient(daemon.target) as client:
            client.configure("bye", spec=TINY_SPEC, **TINY_OPTIONS)
            lease = client.lease("engine", ttl_s=5.0)
            lease.allocate("bye", "kv", 3)
            watcher = client.watch_stats(interval_s=0.1)
            next(watcher)
            started = time.monotonic()
            assert daemon.stop(signal.SIGTERM, timeout_s=120.0) == 0
            assert time.monotonic() - started < 120.0  # the open streams did not hold the grace
            lease._stop.set()
            watcher.close()
        assert not daemon.socket.exists()
    log = daemon.log_text()
    assert "event=shutdown" in log and "event=stopped" in log


def test_second_daemon_on_the_same_socket_is_refused(shared_daemon: DaemonProcess) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpoold.main", "serve", "--listen", shared_daemon.target],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert "another daemon is serving" in out.stderr
    with KVPoolClient(shared_daemon.target) as client:
        assert client.health() == "SERVING"


def test_kvpool_target_is_the_default_target(shared_daemon: DaemonProcess) -> None:
    """``KVPOOL_TARGET`` names the daemon for the CLI and for clients built without a
    target; ``--target`` still wins."""
    env = {**subprocess_env(), "KVPOOL_TARGET": shared_daemon.target}
    out = subprocess.run([sys.executable, "-m", "kvpool.tools.cli", "stats", "--json"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["daemon"]["device"] == "cpu"
    code = ("from kvpool import KVPoolClient\n"
            "with KVPoolClient() as c: print(c.target, c.health())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0].endswith(shared_daemon.target.removeprefix("unix://"))
    env["KVPOOL_TARGET"] = "unix:///nonexistent/kvpool.sock"
    out = subprocess.run([sys.executable, "-m", "kvpool.tools.cli", "stats", "--json", "--target",
                          shared_daemon.target], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-m", "kvpool.tools.cli", "stats", "--json"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "/nonexistent/kvpool.sock" in out.stderr


def test_wait_serving_waits_for_a_daemon_that_is_starting() -> None:
    """``client.wait_serving`` right after the daemon process is spawned (the socket does not
    exist yet, and the daemon still imports torch) returns once it answers SERVING; with no
    daemon at all it raises Unavailable naming the target after its timeout."""
    with temp_dir() as tmp:
        sock = tmp / "kvpool.sock"
        target = f"unix://{sock}"
        with KVPoolClient(target, timeout_s=1.0) as client:
            with pytest.raises(Unavailable, match=r"not serving after 0\.3 s"):
                client.wait_serving(0.3)
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvpoold.main", "serve", "--listen", target,
                 "--log-level", "warning"], cwd=REPO, env=subprocess_env())
            try:
                assert not sock.exists()  # asked before the daemon listens
                client.wait_serving(60.0)
                assert client.health() == "SERVING"

                async def wait_async() -> str:  # the asyncio client runs the same polls
                    async with AsyncKVPoolClient(target, timeout_s=1.0) as aclient:
                        await aclient.wait_serving(5.0)
                        return await aclient.health()

                assert asyncio.run(wait_async()) == "SERVING"
            finally:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0

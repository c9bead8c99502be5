"""``kvpoold serve --metrics-port``: /metrics scraped from a real daemon during allocations,
parsed with prometheus_client's parser and checked against Stats, hand-worked numbers and
docs/operations.md."""

from __future__ import annotations

import itertools
import json
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvpool.clients.client import KVPoolClient
from kvpool.contract import wire
from kvpool.contract.errors import FailedPrecondition, KVPoolError, ResourceExhausted
from kvpool.contract.records import Stats
from kvpool.v1 import kvpool_pb2 as pb
from tests.conftest import REPO, TINY_OPTIONS, TINY_PAGES, TINY_SPEC, run_daemon, temp_dir

OPERATIONS = REPO / "docs" / "operations.md"
CHURN_CYCLES = 50


def metrics_url(log_path: Path, timeout_s: float = 60.0) -> str:
    """The URL the daemon logged when it bound ``--metrics-port 0`` (``--log-format json``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if line.startswith("{") and json.loads(line).get("event") == "metrics_serving":
                return json.loads(line)["url"]
        time.sleep(0.05)
    raise AssertionError(f"no metrics_serving line in {log_path}:\n{log_path.read_text()}")


@dataclass
class Scrape:
    """One /metrics answer: families by name, and sample values by (name, labels)."""

    families: dict[str, Any]
    values: dict[tuple[str, frozenset[tuple[str, str]]], float]

    def get(self, name: str, **labels: str) -> float:
        return self.values[(name, frozenset(labels.items()))]

    def samples(self, name: str) -> list[Sample]:
        return [s for f in self.families.values() for s in f.samples if s.name == name]


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    values = {(s.name, frozenset(s.labels.items())): s.value
              for f in families.values() for s in f.samples}
    return Scrape(families, values)


@dataclass
class Scenario:
    """What the module's daemon went through, recorded before it was stopped."""

    during: list[Scrape]  # taken while another thread allocated and freed
    final: Scrape
    stats: Stats
    url: str
    errors: dict[str, KVPoolError]
    exit_code: int
    refused_after_stop: bool


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    """A daemon (64 MiB budget, ``--metrics-port 0``) with pool ``tiny`` (256 kv pages, 8 req
    rows), driven through churn, allocations, two bad requests and a lease expiry, then stopped.

    1. Lease ``churn`` allocates 3 and frees 3 pages 50 times while this thread scrapes; closed.
    2. Lease A (kept alive) allocates kv 20 + req 2 in one call.
    3. Lease ``short`` (TTL 0.5 s, never renewed) allocates kv 7: used 27.
    4. A frees 5 of its pages: used 22.
    5. A asks for 1000 pages: RESOURCE_EXHAUSTED, nothing allocated.
    6. A frees a page it freed in 4: FAILED_PRECONDITION.
    7. ``short`` expires; its 7 pages are reclaimed: used 15. Renewing it afterwards fails on
       the KeepAlive stream with NOT_FOUND.
    8. A client attaches to ``tiny``.
    9. The daemon is paused (SIGSTOP) for 1.2 s: its loop stalls once.
    """
    errors: dict[str, KVPoolError] = {}
    during: list[Scrape] = []
    with temp_dir() as sock_dir, \
            run_daemon(sock_dir, "--metrics-port", "0", "--log-format", "json") as daemon:
        url = metrics_url(daemon.log)
        with KVPoolClient(daemon.target) as client:
            client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
            churn = client.lease("churn", ttl_s=30)

            def work() -> None:
                for _ in range(CHURN_CYCLES):
                    churn.free("tiny", "kv", churn.allocate("tiny", "kv", 3))

            worker = threading.Thread(target=work)
            worker.start()
            while worker.is_alive() or not during:
                during.append(scrape(url))
            worker.join()
            churn.close()

            lease = client.lease("engine-a", ttl_s=30)
            kv, _req = lease.allocate_batch("tiny", [("kv", 20), ("req", 2)])
            short = client.call("OpenLease", pb.OpenLeaseRequest(name="short", ttl_seconds=0.5))
            short_key = wire.LeaseKey(short.lease_id, short.lease_secret)
            client.call("Allocate", wire.allocate_request("tiny", short_key, [("kv", 7)]))
            lease.free("tiny", "kv", kv[:5])
            with pytest.raises(ResourceExhausted) as exhausted:
                lease.allocate("tiny", "kv", 1000)
            errors["Allocate"] = exhausted.value
            with pytest.raises(FailedPrecondition) as not_held:
                lease.free("tiny", "kv", kv[:1])
            errors["Free"] = not_held.value
            deadline = time.monotonic() + 5
            while client.stats().daemon.leases_expired < 1:
                assert time.monotonic() < deadline, "the short lease never expired"
                time.sleep(0.05)
            renew = client.keep_alive_stream(iter([pb.KeepAliveRequest(
                lease_id=short.lease_id, lease_secret=short.lease_secret)]))
            with pytest.raises(grpc.RpcError) as expired:
                list(renew)
            errors["KeepAlive"] = wire.error_from_rpc(expired.value)
            client.attach_raw("tiny")
            daemon.proc.send_signal(signal.SIGSTOP)
            time.sleep(1.2)
            daemon.proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 5
            while client.stats().daemon.loop_stalls < 1:  # the ticker folds it in <= 50 ms
                assert time.monotonic() < deadline, "the daemon never counted its stall"
                time.sleep(0.05)
            final = scrape(url)
            stats = client.stats()
            lease._stop.set()  # the daemon goes away under it; do not try to close it
        exit_code = daemon.stop()
    try:
        urllib.request.urlopen(url, timeout=2)
        refused = False
    except urllib.error.URLError:
        refused = True
    yield Scenario(during, final, stats, url, errors, exit_code, refused)


def test_gauges_and_counters_equal_stats(scenario: Scenario) -> None:
    """Every per-pool, per-kind and per-device series equals the Stats taken right after.

    By hand, kv: allocs 50 x 3 + 20 + 7 = 177, frees 50 x 3 + 5 + 7 = 162, used 177 - 162 = 15,
    free 256 - 15 = 241, high water 20 + 7 = 27 (churn peaked at 3), one refused allocation;
    req: 2 allocated, none freed. Pool bytes: 257 pages x 4 KiB = 1,052,672 B of KV plus the
    request table, 9 rows x (256 + 4) int32 = 9,360 B: 1,062,032 B, all the daemon uses of its
    64 MiB budget. One lease open (A), one expired, one client attached.
    """
    m, stats = scenario.final, scenario.stats
    (pool,) = stats.pools
    for space, k in pool.spaces.items():
        labels = {"device": "cpu", "pool": "tiny", "space": space, "unit": k.unit}
        assert m.get("kvpool_pool_capacity", **labels) == k.capacity
        assert m.get("kvpool_pool_used", **labels) == k.used
        assert m.get("kvpool_pool_free", **labels) == k.free
        assert m.get("kvpool_pool_high_water", **labels) == k.high_water
        assert m.get("kvpool_allocated_ids_total", **labels) == k.allocs
        assert m.get("kvpool_freed_ids_total", **labels) == k.frees
        calls = {"device": "cpu", "pool": "tiny", "space": space}
        assert m.get("kvpool_allocation_refusals_total", **calls) == k.failed_allocs
    kv = {"device": "cpu", "pool": "tiny", "space": "kv", "unit": "pages"}
    assert m.get("kvpool_pool_capacity", **kv) == TINY_PAGES == 256
    assert m.get("kvpool_allocated_ids_total", **kv) == 177
    assert m.get("kvpool_freed_ids_total", **kv) == 162
    assert m.get("kvpool_pool_used", **kv) == 15
    assert m.get("kvpool_pool_free", **kv) == 241
    assert m.get("kvpool_pool_high_water", **kv) == 27
    # one refused call, of 1000 pages: refusals count calls, not ids
    assert m.get("kvpool_allocation_refusals_total", device="cpu", pool="tiny", space="kv") == 1
    req = {"device": "cpu", "pool": "tiny", "space": "req", "unit": "rows"}
    assert (m.get("kvpool_pool_used", **req), m.get("kvpool_pool_capacity", **req)) == (2, 8)
    assert m.get("kvpool_allocated_ids_total", **req) == 2

    assert m.get("kvpool_pool_bytes", device="cpu", pool="tiny") == pool.backing_bytes \
        == 1_062_032
    assert m.get("kvpool_attached_clients", device="cpu", pool="tiny") == pool.attached == 1
    d = stats.daemon
    assert m.get("kvpool_device_budget_bytes", device="cpu") == d.budget_bytes == 64 << 20
    assert m.get("kvpool_device_used_bytes", device="cpu") == d.used_bytes == 1_062_032
    assert m.get("kvpool_leases_open", device="cpu") == d.num_leases == 1
    assert m.get("kvpool_lease_expiries_total", device="cpu") == d.leases_expired == 1
    # The 1.2 s SIGSTOP: one stall of about that length (the ticker counts lateness past
    # 100 ms; on a busy machine a scheduling hiccup may add another, short one).
    assert m.get("kvpool_loop_stalls_total", device="cpu") == d.loop_stalls >= 1
    assert m.get("kvpool_loop_longest_stall_seconds", device="cpu") \
        == d.loop_longest_stall_seconds
    assert 1.0 <= d.loop_longest_stall_seconds <= d.loop_stalled_seconds < 5.0
    assert m.get("kvpool_loop_stalled_seconds_total", device="cpu") == d.loop_stalled_seconds


def test_scrapes_during_allocations_are_consistent(scenario: Scenario) -> None:
    """While churn allocated and freed, each scrape saw one instant of the pool: used + free ==
    capacity and allocations - frees == used, used in 0..3, totals never going back."""
    kv = {"device": "cpu", "pool": "tiny", "space": "kv", "unit": "pages"}
    previous = 0.0
    for m in scenario.during:
        used = m.get("kvpool_pool_used", **kv)
        assert used + m.get("kvpool_pool_free", **kv) == m.get("kvpool_pool_capacity", **kv)
        allocs = m.get("kvpool_allocated_ids_total", **kv)
        assert allocs - m.get("kvpool_freed_ids_total", **kv) == used
        assert 0 <= used <= 3
        assert allocs >= previous
        previous = allocs


def test_id_series_carry_their_unit_and_sum_by_unit(scenario: Scenario) -> None:
    """Every series that counts ids has a ``unit`` label equal to the space's unit in Stats
    (kv pages, req rows); ``sum by (unit)`` over the scrape gives one sum per unit, matching
    Stats: used 15 pages and 2 rows, never 17 of nothing."""
    m, stats = scenario.final, scenario.stats
    (pool,) = stats.pools
    units = {space: k.unit for space, k in pool.spaces.items()}
    assert units == {"kv": "pages", "req": "rows"}
    for name in ("kvpool_pool_capacity", "kvpool_pool_used", "kvpool_pool_free",
                 "kvpool_pool_high_water", "kvpool_pool_pinned", "kvpool_pool_quarantined",
                 "kvpool_lease_cached_ids", "kvpool_allocated_ids_total",
                 "kvpool_freed_ids_total"):
        samples = scenario.final.samples(name)
        assert {s.labels["space"]: s.labels["unit"] for s in samples} == units, name
    (refusals,) = {frozenset(s.labels) for s in m.samples("kvpool_allocation_refusals_total")}
    assert refusals == {"device", "pool", "space"}, "refusals count calls: no unit"
    by_unit: dict[str, float] = {}
    for s in m.samples("kvpool_pool_used"):
        by_unit[s.labels["unit"]] = by_unit.get(s.labels["unit"], 0) + s.value
    assert by_unit == {"pages": 15, "rows": 2}


def test_build_info_names_what_the_daemon_runs(scenario: Scenario) -> None:
    """``kvpool_build_info`` is one gauge of value 1 whose labels are the daemon's version, the
    wire contract --version prints, and the Python, torch and NIXL versions installed."""
    import importlib.metadata
    import platform

    from kvpool import WIRE_CONTRACT, __version__

    (sample,) = scenario.final.samples("kvpool_build_info")
    assert sample.value == 1
    labels = dict(sample.labels)
    nixl = "none"
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            nixl = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    assert labels == {"device": "cpu", "version": __version__, "contract": WIRE_CONTRACT,
                      "python": platform.python_version(),
                      "torch": importlib.metadata.version("torch"), "nixl": nixl}
    assert labels["contract"] == "kvpool.v1 1.0" and labels["version"] == "1.0.0"
    assert scenario.final.families["kvpool_build_info"].type == "gauge"


def test_rpc_latency_histogram_and_failures_by_code(scenario: Scenario) -> None:
    """Allocate ran 50 (churn) + 1 (A) + 1 (short) + 1 (refused) = 53 times, Free 50 + 1 + 1
    (refused) = 52; the refusals are counted under their status codes and nowhere else. The
    KeepAlive stream's failure is counted; streams are not timed."""
    m = scenario.final
    allocate = {"device": "cpu", "method": "Allocate"}
    assert m.get("kvpool_rpc_duration_seconds_count", **allocate) == 53
    assert m.get("kvpool_rpc_duration_seconds_count", device="cpu", method="Free") == 52
    buckets = sorted(
        ((float(s.labels["le"]), s.value) for s in m.samples("kvpool_rpc_duration_seconds_bucket")
         if s.labels["method"] == "Allocate"),
    )
    assert [le for le, _ in buckets][:2] == [0.0001, 0.00025]
    assert buckets[-1] == (float("inf"), 53)
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(buckets))
    assert 0 < m.get("kvpool_rpc_duration_seconds_sum", **allocate) < 53 * 1.0
    assert m.families["kvpool_rpc_duration_seconds"].type == "histogram"

    assert scenario.errors["Allocate"].code == "RESOURCE_EXHAUSTED"
    assert scenario.errors["Free"].code == "FAILED_PRECONDITION"
    assert scenario.errors["KeepAlive"].code == "NOT_FOUND"
    failures = {(s.labels["method"], s.labels["code"]): s.value
                for s in m.samples("kvpool_rpc_failures_total")}
    assert failures == {("Allocate", "RESOURCE_EXHAUSTED"): 1, ("Free", "FAILED_PRECONDITION"): 1,
                        ("KeepAlive", "NOT_FOUND"): 1}
    timed = {s.labels["method"] for s in m.samples("kvpool_rpc_duration_seconds_count")}
    assert {"Configure", "OpenLease", "Allocate", "Free", "CloseLease", "Stats"} <= timed
    assert not timed & {"KeepAlive", "WatchStats"}


def test_metrics_server_stops_with_the_daemon(scenario: Scenario) -> None:
    assert scenario.url.startswith("http://127.0.0.1:"), "loopback unless --metrics-host"
    assert scenario.exit_code == 0
    assert scenario.refused_after_stop


def test_operations_doc_table_is_what_is_exported(scenario: Scenario) -> None:
    """docs/operations.md's metrics table: same names, types and labels as the scrape."""
    rows = re.findall(r"^\| `(kvpool_[a-z0-9_]+)` \| (\w+) \| ([a-z, ]+) \|",
                      OPERATIONS.read_text(), flags=re.M)
    documented = {name: (kind, frozenset(x.strip() for x in labels.split(",")))
                  for name, kind, labels in rows}
    exported = {}
    for family in scenario.final.families.values():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels} - {"le"}
        # A family with no sample yet (no transfer with a peer in this scenario) shows no
        # labels to compare: its name and type still must be documented.
        exported[name] = (family.type, frozenset(labels) if family.samples
                          else documented.get(name, ("", frozenset()))[1])
    assert documented == exported


def test_port_in_use_fails_start_and_leaves_nothing_behind(socket_dir: Path) -> None:
    """The daemon's run() with a taken --metrics-port: FailedPrecondition naming the address
    and the flags to change (``kvpoold serve`` exits 1 with it); the gRPC socket it had bound
    is removed."""
    import asyncio

    from kvpoold.server.run import run
    from kvpoold.settings import resolve

    sock = socket_dir / "kvpool.sock"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = resolve({"listen": [f"unix://{sock}"], "metrics_port": str(port),
                            "shm_dir": str(socket_dir)}, None)
        with pytest.raises(FailedPrecondition) as exc:
            asyncio.run(run(settings))
    message = str(exc.value)
    assert f"cannot serve metrics on 127.0.0.1:{port}" in message
    assert "--metrics-port" in message and exc.value.field == "metrics_port"
    assert not sock.exists()


def test_bad_metrics_flags_are_refused() -> None:
    """Out-of-range or malformed values: InvalidArgument naming the setting (``kvpoold`` exits
    2 with it); the host defaults to loopback."""
    from kvpool.contract.errors import InvalidArgument
    from kvpoold.settings import resolve

    settings = resolve({"metrics_port": "9490", "metrics_host": "0.0.0.0"}, None)
    assert (settings.metrics_port, settings.metrics_host) == (9490, "0.0.0.0")
    assert resolve({}, None).metrics_port is None
    assert resolve({"metrics_port": "0"}, None).metrics_host == "127.0.0.1"
    for flags, field in (({"metrics_port": "70000"}, "metrics_port"),
                         ({"metrics_port": "-1"}, "metrics_port"),
                         ({"metrics_port": "9490", "metrics_host": "http://0.0.0.0"},
                          "metrics_host")):
        with pytest.raises(InvalidArgument) as exc:
            resolve(flags, None)
        assert exc.value.field == field
    with pytest.raises(InvalidArgument, match=r"metrics_port 'x': give a TCP port 0\.\.65535"):
        resolve({"metrics_port": "x"}, None)


def test_two_daemons_in_one_process_have_their_own_registries() -> None:
    """Each DaemonMetrics registers the same names in its own registry: no clash, and each
    exposition carries only its daemon's device and pools."""
    import asyncio

    import torch
    from prometheus_client import generate_latest

    from kvpoold.access import LOCAL_ADMIN
    from kvpoold.metrics import DaemonMetrics, loop_snapshot
    from kvpoold.server.args import ConfigureArgs
    from kvpoold.server.daemon import Daemon
    from kvpoold.sharing.base import PlainBackingFactory

    async def main() -> tuple[str, str]:
        loop = asyncio.get_running_loop()
        daemons = [Daemon(dev, 8 << 20, PlainBackingFactory(torch.device("cpu")))
                   for dev in ("cpu", "cuda:7")]
        metrics = [DaemonMetrics(loop_snapshot(d.snapshot, loop), d.device) for d in daemons]
        try:
            await daemons[1].configure(LOCAL_ADMIN, ConfigureArgs("other", spec=TINY_SPEC,
                                                                  options=dict(TINY_OPTIONS)))
            metrics[0].rpc.observe("Allocate", 0.0002)
            # scraped from another thread, as the HTTP server does: the snapshot hops to the loop
            return tuple(await asyncio.gather(*(asyncio.to_thread(
                lambda m=m: generate_latest(m.registry).decode()) for m in metrics)))
        finally:
            for d in daemons:
                d.close()

    first, second = asyncio.run(main())
    assert 'kvpool_device_budget_bytes{device="cpu"} 8.388608e+06' in first
    assert "cuda:7" not in first and 'pool="other"' not in first
    assert 'kvpool_rpc_duration_seconds_count{device="cpu",method="Allocate"} 1.0' in first
    assert ('kvpool_pool_capacity{device="cuda:7",pool="other",space="kv",unit="pages"} 256.0'
            in second)
    assert "kvpool_rpc_duration_seconds_count" not in second

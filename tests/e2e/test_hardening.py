"""Issue 15 ("Hardening") against real daemon processes: hostile requests are refused by bounds
and cost a renewing lease nothing, a dropped pool's memory is unmapped at once whatever was
refused on it before, malformed input is INVALID_ARGUMENT with bounded messages and bounded
logs, /metrics answers only /metrics, and a Lease dropped without close() stops renewing.

No timed asserts: what is asserted is the outcome (codes, leases kept, mappings gone, log lines
counted); waits poll up to generous deadlines.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvpool import (
    AsyncKVPoolClient,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from kvpool.clients.client import KVPoolClient
from kvpool.contract import wire
from kvpool.contract.limits import MAX_ITEMS_PER_CALL, MAX_LAYERS, MAX_REQUEST_BYTES
from kvpool.v1 import kvpool_pb2 as pb
from tests.conftest import TINY_OPTIONS, TINY_SPEC, DaemonProcess, run_daemon, temp_dir
from tests.e2e.test_metrics import metrics_url


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """One daemon (JSON logs, metrics on a free port) for the tests of this module."""
    with temp_dir() as path, run_daemon(path, "--metrics-port", "0", "--log-format", "json",
                                        budget="256MiB") as d:
        yield d


def log_events(d: DaemonProcess, since: int = 0) -> list[dict[str, Any]]:
    """The daemon's JSON log lines after the first ``since`` characters."""
    return [json.loads(line) for line in d.log_text()[since:].splitlines()
            if line.startswith("{")]


def shm_mappings(pid: int, pool: str) -> list[str]:
    """Lines of /proc/<pid>/maps that map pool ``pool``'s shared-memory file."""
    with open(f"/proc/{pid}/maps") as maps:
        return [line for line in maps if f"-{pool}-" in line and "kvpool-" in line]


def spec_with_layers(n: int) -> dict[str, Any]:
    return {**TINY_SPEC, "num_layers": n}


def configure_raw(client: KVPoolClient, pool: str, num_layers: int) -> Any:
    """Configure the tiny model with ``num_layers`` set on the wire (the client's own spec check
    would refuse it before sending)."""
    req = wire.configure_request(pool, spec=TINY_SPEC, **TINY_OPTIONS)
    req.spec.num_layers = num_layers
    return client.call("Configure", req)


def raw_unary(client: KVPoolClient, method: str) -> Any:
    """A unary method that sends bytes as they are (no serializer)."""
    return client._channel.unary_unary(f"/kvpool.v1.KVPool/{method}", request_serializer=None,
                                       response_deserializer=None)


# -- finding 1: hostile requests beside a renewing lease ------------------------------------------

def test_hostile_requests_are_refused_and_a_renewing_lease_keeps_its_pages(
        daemon: DaemonProcess) -> None:
    """A victim lease (TTL 1 s) renews while hostile requests (600k layers as spec and as HF
    config, 2M Allocate items) and legitimately large Configures (MAX_LAYERS layers) run beside
    it: the hostile ones are INVALID_ARGUMENT, the large ones succeed, and the victim keeps its
    lease and its pages throughout."""
    # Built before the victim exists: 2M items take this process's GIL for a second or more,
    # which would starve the victim's own keep-alive thread here (the test's artifact, not the
    # daemon's; a hostile client is another process).
    two_million = pb.AllocateRequest(pool="victim", lease_id=1, items=[
        pb.AllocateItem(space="kv", count=0)] * 2_000_000).SerializeToString()
    with KVPoolClient(daemon.target, timeout_s=60) as client, \
            KVPoolClient(daemon.target, timeout_s=60) as hostile:
        client.configure("victim", spec=TINY_SPEC, **TINY_OPTIONS)
        expired_before = client.stats().daemon.leases_expired
        victim = client.lease("victim", ttl_s=1.0)
        pages = victim.allocate("victim", "kv", 8)
        outcomes: dict[str, Any] = {}

        def hostile_spec() -> None:
            try:
                configure_raw(hostile, "hostile", 600_000)
            except InvalidArgument as exc:
                outcomes["spec"] = exc

        def hostile_hf() -> None:
            config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 600_000,
                      "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256,
                      "max_position_embeddings": 256}
            try:
                hostile.configure("hostile-hf", hf_config=config, **TINY_OPTIONS)
            except InvalidArgument as exc:
                outcomes["hf"] = exc

        def hostile_allocate() -> None:
            try:
                raw_unary(hostile, "Allocate")(two_million, timeout=60)
            except grpc.RpcError as exc:
                outcomes["allocate"] = exc

        def large_configures() -> None:
            for i in range(3):  # the largest model allowed: planned off the loop
                result = client.configure(f"large-{i}", spec=spec_with_layers(MAX_LAYERS),
                                          budget_bytes=4 << 20, page_size=16, dry_run=i < 2)
                outcomes[f"large-{i}"] = result

        threads = [threading.Thread(target=f) for f in
                   (hostile_spec, hostile_hf, hostile_allocate, large_configures)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        # 3 more TTLs of renewing after it all
        time.sleep(3.0)
        stats = client.stats()
        assert "num_layers" in str(outcomes["spec"]) and str(MAX_LAYERS) in str(outcomes["spec"])
        assert "num_hidden_layers" in str(outcomes["hf"])
        assert outcomes["allocate"].code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {MAX_REQUEST_BYTES['Allocate']:,} B for Allocate" in \
            outcomes["allocate"].details()
        assert outcomes["large-2"].created
        assert victim.error is None
        assert stats.daemon.leases_expired == expired_before
        mine = [x for x in stats.leases if x.lease_id == victim.lease_id]
        assert mine and mine[0].held == {"victim": {"kv": 8}}
        assert victim.free("victim", "kv", pages) == 8
        victim.close()
        for name in ("victim", "large-2"):
            client.drop(name)


def test_items_per_call_bound(daemon: DaemonProcess) -> None:
    with KVPoolClient(daemon.target) as client:
        client.configure("items", spec=TINY_SPEC, **{**TINY_OPTIONS, "budget_bytes": None,
                                                      "max_total_tokens": 16 * 8192})
        with client.lease("items") as lease:
            with pytest.raises(InvalidArgument,
                               match=f"at most {MAX_ITEMS_PER_CALL:,} per call"):
                lease.allocate_batch("items", [("kv", 1)] * (MAX_ITEMS_PER_CALL + 1))
            got = lease.allocate_batch("items", [("kv", 1)] * MAX_ITEMS_PER_CALL)
            assert len(got) == MAX_ITEMS_PER_CALL
        client.drop("items")


# -- finding 2: Drop unmaps at once after a refused request ----------------------------------------

REFUSALS = ("drop", "attach", "allocate", "free")


@pytest.mark.parametrize("refusal", REFUSALS)
def test_drop_after_a_refused_request_unmaps_the_pool(daemon: DaemonProcess,
                                                      refusal: str) -> None:
    """After a refused request on a pool, Drop unmaps its shared-memory file from the daemon
    at once (no garbage collection needed: no reference cycle keeps the pool)."""
    pool = f"refused-{refusal}"
    pid = daemon.proc.pid
    with KVPoolClient(daemon.target) as client:
        client.configure(pool, spec=TINY_SPEC, **TINY_OPTIONS)
        assert len(shm_mappings(pid, pool)) == 1
        with client.lease("refuser") as lease:
            held = lease.allocate(pool, "kv", 2)
            if refusal == "drop":
                with pytest.raises(FailedPrecondition, match=f"lease {lease.lease_id}, 2 ids"):
                    client.drop(pool)
            elif refusal == "attach":
                with pytest.raises(FailedPrecondition):
                    client.attach_raw(pool, expected_fingerprint="0" * 32)
            elif refusal == "allocate":
                with pytest.raises(ResourceExhausted):
                    lease.allocate(pool, "kv", 10_000)
            else:
                with pytest.raises(FailedPrecondition):
                    lease.free(pool, "kv", [int(held.max()) + 1])
        client.drop(pool)
        assert shm_mappings(pid, pool) == []


# -- finding 3 and 8: errors and their log lines ---------------------------------------------------

def test_deep_json_is_invalid_argument(daemon: DaemonProcess) -> None:
    deep = '{"architectures": ["LlamaForCausalLM"], "x": ' + "[" * 1000 + "]" * 1000 + "}"
    with KVPoolClient(daemon.target) as client, \
            pytest.raises(InvalidArgument, match="nests too deep") as info:
        client.configure("deep", hf_config=deep, budget_bytes=1 << 20)
    assert info.value.field == "hf_config_json"


def test_long_pool_name_is_invalid_argument_with_a_bounded_message(
        daemon: DaemonProcess) -> None:
    with KVPoolClient(daemon.target) as client:
        with pytest.raises(InvalidArgument) as info:
            client.configure("a" * 10_000, spec=TINY_SPEC, **TINY_OPTIONS)
        assert "(10,000 chars)" in str(info.value) and len(str(info.value)) < 400
        with pytest.raises(InvalidArgument) as info:
            client.drop("b" * 500)
        assert "(500 chars)" in str(info.value) and len(str(info.value)) < 400
        with pytest.raises(InvalidArgument) as info:  # over Drop's request bound: not parsed
            client.drop("b" * 10_000)
        assert "at most 1,024 B for Drop" in str(info.value) and len(str(info.value)) < 400


def test_undecodable_messages_are_invalid_argument_and_logged_once(
        daemon: DaemonProcess) -> None:
    since = len(daemon.log_text())
    with KVPoolClient(daemon.target) as client:
        keep_alive = client._channel.stream_stream(
            "/kvpool.v1.KVPool/KeepAlive", request_serializer=None, response_deserializer=None)
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as info:
                list(keep_alive(iter([b"\xff\xff\xff"]), timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid protobuf message" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            raw_unary(client, "Stats")(b"\xff\xff\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    time.sleep(0.2)
    events = log_events(daemon, since)
    refused = [e for e in events if e.get("event") == "request_refused"]
    assert [e["method"] for e in refused].count("KeepAlive") == 1
    assert not [e for e in events if e.get("event") == "rpc_error" or "exc" in e]


def test_requests_over_their_method_bound_are_refused_before_parsing(
        daemon: DaemonProcess) -> None:
    with KVPoolClient(daemon.target) as client, pytest.raises(grpc.RpcError) as info:
        raw_unary(client, "Stats")(b"\x0a\x80\x08" + b"x" * 1024, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 1,024 B for Stats" in info.value.details()


def test_refused_configure_and_drop_log_one_line_each(daemon: DaemonProcess) -> None:
    since = len(daemon.log_text())
    with KVPoolClient(daemon.target) as client:
        with pytest.raises(InvalidArgument):
            configure_raw(client, "refused-cfg", MAX_LAYERS + 1)
        with pytest.raises(Exception, match="no pool"):
            client.drop("never-made")
    time.sleep(0.2)
    events = [e for e in log_events(daemon, since)
              if e.get("event") in ("configure_refused", "drop_refused")]
    assert [(e["event"], e["code"]) for e in events] == [
        ("configure_refused", "INVALID_ARGUMENT"), ("drop_refused", "NOT_FOUND")]


# -- finding 8: /metrics only ---------------------------------------------------------------------

def test_metrics_answers_only_its_path(daemon: DaemonProcess) -> None:
    url = metrics_url(Path(daemon.log))
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200 and b"kvpool_device_budget_bytes" in resp.read()
    root = url.rpartition("/metrics")[0]
    with urllib.request.urlopen(root + "/", timeout=5) as resp:
        assert resp.status == 200 and b"/metrics" in resp.read()
    for path in ("/foo", "/metrics/x", "/favicon.ico"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(root + path, timeout=5)
        assert info.value.code == 404


# -- finding 7: a dropped Lease stops renewing ---------------------------------------------------

def test_a_lease_dropped_without_close_stops_renewing_and_expires(
        daemon: DaemonProcess) -> None:
    with KVPoolClient(daemon.target) as client:
        client.configure("orphan", spec=TINY_SPEC, **TINY_OPTIONS)
        lease = client.lease("orphan", ttl_s=1.0)
        lease.allocate("orphan", "kv", 5)
        lease_id, thread = lease.lease_id, lease._thread
        del lease
        gc.collect()
        thread.join(10)
        assert not thread.is_alive()
        deadline = time.monotonic() + 30  # the assert is the expiry, not its timing
        while any(x.lease_id == lease_id for x in client.stats().leases):
            assert time.monotonic() < deadline, "the dropped lease was never reclaimed"
            time.sleep(0.1)
        assert client.stats("orphan").pools[0].spaces["kv"].used == 0
        client.drop("orphan")


async def test_an_async_lease_dropped_without_close_stops_renewing_and_expires(
        daemon: DaemonProcess) -> None:
    """The asyncio twin: the renewal task holds the lease weakly, ends once it is garbage, and
    the daemon reclaims the lease's ids by expiry."""
    async with AsyncKVPoolClient(daemon.target) as client:
        await client.configure("aorphan", spec=TINY_SPEC, **TINY_OPTIONS)
        lease = await client.lease("aorphan", ttl_s=1.0)
        await lease.allocate("aorphan", "kv", 5)
        lease_id, task = lease.lease_id, lease._task
        del lease
        gc.collect()
        await asyncio.wait_for(task, 10)  # ends at its next renewal (every TTL/3)
        deadline = time.monotonic() + 30  # the assert is the expiry, not its timing
        while any(x.lease_id == lease_id for x in (await client.stats()).leases):
            assert time.monotonic() < deadline, "the dropped lease was never reclaimed"
            await asyncio.sleep(0.1)
        assert (await client.stats("aorphan")).pools[0].spaces["kv"].used == 0
        await client.drop("aorphan")


def test_json_log_holds_json_objects_only(daemon: DaemonProcess) -> None:
    """With ``--log-format json`` every line the daemon writes (stdout and stderr together,
    NIXL's own log lines included where NIXL is installed) is one JSON object, stamped in ISO
    8601 UTC as the text format is."""
    lines = [line for line in daemon.log_text().splitlines() if line.strip()]
    assert lines
    events = [json.loads(line) for line in lines]  # raises on any plain-text line
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", e["ts"]) for e in events)
    assert any(e.get("event") == "serving" for e in events)

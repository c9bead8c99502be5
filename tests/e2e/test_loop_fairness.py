"""Issue 20 ("no client can stall or steer the daemon") against real daemon processes: what one
client sends costs the event loop O(its own request) at most, so an innocent client beside it
keeps being served.

Each test runs a latency probe in its own process (a lease doing Allocate(kv, 1) + Free in a
loop) beside the hostile calls. No timed asserts: the outcomes are asserted (the refusals are
the right ones, every probe call succeeded, the daemon changed nothing); the probe's figures are
printed (``pytest -s``). The Stats and WatchStats loads are measured at scale, against a
baseline of the same run, by ``bench/stats_under_load.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from kvpool.clients.client import KVPoolClient
from kvpool.contract.limits import MAX_REQUEST_MESSAGE_BYTES, MESSAGE_SIZE_OPTIONS
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc
from tests.conftest import DaemonProcess, run_daemon, temp_dir
from tests.procs import LATENCY_PROBE, Child

POOL = "fair"
SPEC = {"num_layers": 2, "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
        "context_length": 1024}
# 1 KiB pages: 4,096 of them.
OPTIONS = {"max_total_tokens": 4096 * 16, "page_size": 16, "max_running_requests": 64}

@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with temp_dir() as path, run_daemon(path, "--sharing", "none", "--log-format", "json",
                                        budget="256MiB") as d:
        with KVPoolClient(d.target) as client:
            client.configure(POOL, spec=SPEC, **OPTIONS)
        yield d


class Probe:
    """The probe process, started (its lease open) on entry, its figures read on stop()."""

    def __init__(self, target: str) -> None:
        self.child = Child(LATENCY_PROBE, first={"target": target, "pool": POOL}, timeout_s=60)
        assert self.child.recv() == {"ready": True}

    def stop(self) -> dict[str, Any]:
        self.child.send("stop")
        figures = self.child.recv()
        self.child.wait_ok()
        print(f"probe: {json.dumps(figures)}")
        return figures

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.child.__exit__(*exc)


def stub(d: DaemonProcess) -> tuple[grpc.Channel, kvpool_pb2_grpc.KVPoolStub]:
    channel = grpc.insecure_channel(d.target, options=list(MESSAGE_SIZE_OPTIONS))
    return channel, kvpool_pb2_grpc.KVPoolStub(channel)


def test_refused_60mb_frees_beside_a_probe(daemon: DaemonProcess) -> None:
    """Ten Frees of 15M ids (60 MB) are refused by gRPC itself, over every request bound; ten of
    4M ids (16 MB, under gRPC's limit) by their size, over what the pool's ids explain; and
    Frees the pool's size allows, by a lease holding nothing and by a lease holding one page
    sending it over and over, are refused naming the first bad id (position 0, then 1). Nothing
    changes, and every probe call beside them succeeds."""
    channel, raw = stub(daemon)
    with channel, KVPoolClient(daemon.target) as client, Probe(daemon.target) as probe:
        empty = raw.OpenLease(pb.OpenLeaseRequest(name="empty", ttl_seconds=60))
        one = raw.OpenLease(pb.OpenLeaseRequest(name="one", ttl_seconds=60))
        page = int(np.frombuffer(raw.Allocate(pb.AllocateRequest(
            pool=POOL, lease_id=one.lease_id, lease_secret=one.lease_secret,
            items=[pb.AllocateItem(space="kv", count=1)])).items[0].ids, "<i4")[0])
        free = channel.unary_unary("/kvpool.v1.KVPool/Free", request_serializer=None,
                                   response_deserializer=None)
        within = 16_000  # ids: a message under the pool's bound (4,096 pages and the rest)
        cases = [
            (empty, np.arange(1, 15_000_001, dtype="<i4"), grpc.StatusCode.RESOURCE_EXHAUSTED,
             f"Received message larger than max (60000048 vs. {MAX_REQUEST_MESSAGE_BYTES})"),
            (empty, np.arange(1, 4_000_001, dtype="<i4"), grpc.StatusCode.INVALID_ARGUMENT,
             "B for Free: the largest live pool has"),
            (empty, np.arange(1, within + 1, dtype="<i4")[::-1], grpc.StatusCode.INVALID_ARGUMENT,
             f"items[0].ids[0]={within}: out of range"),
            (one, np.full(within, page, dtype="<i4"), grpc.StatusCode.INVALID_ARGUMENT,
             f"items[0].ids[1]={page}: repeated (also at items[0].ids[0])"),
        ]
        for lease, ids, code, text in cases:
            request = pb.FreeRequest(pool=POOL, lease_id=lease.lease_id,
                                     lease_secret=lease.lease_secret,
                                     items=[pb.IdList(space="kv", ids=ids.tobytes())]
                                     ).SerializeToString()
            for _ in range(10):
                with pytest.raises(grpc.RpcError) as info:
                    free(request, timeout=120)
                assert info.value.code() == code
                assert text in info.value.details()
        figures = probe.stop()
        assert figures["errors"] == [] and figures["calls"] > 0
        stats = client.stats(POOL)
        assert stats.pool(POOL).spaces["kv"].used == 1  # the probe closed its lease
        held = {x.name: x.held for x in stats.leases}
        assert held["one"] == {POOL: {"kv": 1}} and held["empty"] == {}


def test_oversized_strings_cost_no_log_and_no_memory(daemon: DaemonProcess) -> None:
    """Finding 8: twelve PeerReceive calls with a 6 MiB sender (and PeerDone with a 6 MiB
    message, Send with a 6 MiB peer) are refused by their request bounds before parsing: the
    daemon's log grows by a few lines, not by what they carried, and admin Stats still
    answers."""
    channel, raw = stub(daemon)
    big = "x" * (6 << 20)
    log_before = len(daemon.log_text())
    with channel:
        calls = [lambda: raw.PeerReceive(pb.PeerReceiveRequest(token=b"t", sender=big)),
                 lambda: raw.PeerDone(pb.PeerDoneRequest(token=b"t", message=big)),
                 lambda: raw.Send(pb.SendRequest(pool=POOL, peer=big, token=b"t"))]
        for call in calls:
            for _ in range(12):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "B, at most" in info.value.details()
        with KVPoolClient(daemon.target) as client:
            assert client.stats().pool(POOL).name == POOL
    assert len(daemon.log_text()) - log_before < 4096

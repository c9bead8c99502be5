"""Issue 20 item 7 against a real daemon process: with 10,000 leases open, admin and tenant Stats
loops and WatchStats streams (asking for 0.05 s) run beside a latency probe in its own process
(a tenant's lease doing Allocate(kv, 1) + Free in a loop).

No timed asserts: the outcomes are asserted (every probe call succeeded; the fifth admin stream
is refused with RESOURCE_EXHAUSTED naming the cap and its knob, the four before it and the
tenant's are served; a tenant's Stats lists only its own leases and counts the others; an
admin's lists every lease). The probe's p50/p99 are printed (``pytest -s``) and measured against
a no-load baseline by ``bench/stats_under_load.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

# The bench's token-file writer and lease opener, so the two cannot drift.
from bench.stats_under_load import open_leases, write_tokens
from kvpool.clients.client import KVPoolClient
from kvpool.contract.limits import MESSAGE_SIZE_OPTIONS
from kvpool.v1 import kvpool_pb2 as pb
from tests.conftest import DaemonProcess, run_daemon, temp_dir
from tests.procs import LATENCY_PROBE, Child

POOL = "busy"
LEASES = 10_000
SPEC = {"num_layers": 2, "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
        "context_length": 1024}
# 1 KiB pages: room for a page per lease and the tenant's and probe's.
OPTIONS = {"max_total_tokens": (LEASES + 4096) * 16, "page_size": 16,
           "max_running_requests": 64}
SECRETS = {"ops": "ops-secret-0123456789abcdef", "tenant": "tenant-secret-0123456789abcdef",
           "probe": "probe-secret-0123456789abcdef"}
LOAD_S = 4.0
STREAM_CAP = 4  # --max-watch-streams-per-identity, the default

def metadata(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {SECRETS[who]}"),)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with temp_dir() as path, run_daemon(path, "--sharing", "none", "--log-format", "json",
                                        "--max-leases-per-identity", str(LEASES + 16),
                                        "--unix-auth", "token", "--tokens-file",
                                        str(write_tokens(path, SECRETS, POOL)),
                                        budget="256MiB") as d:
        with KVPoolClient(d.target, token=SECRETS["ops"]) as client:
            client.configure(POOL, spec=SPEC, **OPTIONS)
        started = time.perf_counter()
        asyncio.run(open_leases(d.target, LEASES, POOL, SECRETS["ops"]))
        print(f"{LEASES:,} leases opened in {time.perf_counter() - started:.1f} s")
        yield d


class Load:
    """Stats loops and WatchStats streams on one raw channel, replies read as bytes (what they
    cost is the daemon's), until :meth:`stop`."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target, options=list(MESSAGE_SIZE_OPTIONS))
        self._stats = self.channel.unary_unary("/kvpool.v1.KVPool/Stats",
                                               request_serializer=None,
                                               response_deserializer=None)
        self._watch = self.channel.unary_stream("/kvpool.v1.KVPool/WatchStats",
                                                request_serializer=None,
                                                response_deserializer=None)
        self.got: Counter[str] = Counter()
        self.refusals: list[tuple[str, grpc.StatusCode, str]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._streams: list[Any] = []

    def stats_loop(self, who: str) -> None:
        def loop() -> None:
            request = pb.StatsRequest().SerializeToString()
            while not self._stop.is_set():
                self._stats(request, metadata=metadata(who), timeout=60)
                with self._lock:
                    self.got[f"stats {who}"] += 1

        self._start(loop)

    def watch(self, who: str, interval_s: float) -> Any:
        """A stream; its first message (or refusal) is awaited here."""
        request = pb.WatchStatsRequest(interval_seconds=interval_s).SerializeToString()
        stream = self._watch(request, metadata=metadata(who))
        self._streams.append(stream)
        first = threading.Event()

        def read() -> None:
            try:
                for _message in stream:
                    with self._lock:
                        self.got[f"watch {who}"] += 1
                    first.set()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                    self.refusals.append((who, exc.code(), exc.details()))  # type: ignore[attr-defined]
            finally:
                first.set()

        self._start(read)
        assert first.wait(60)
        return stream

    def _start(self, body: Any) -> None:
        thread = threading.Thread(target=body)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for stream in self._streams:
            stream.cancel()
        for thread in self._threads:
            thread.join(60)
        self.channel.close()


@pytest.mark.timeout(300)
def test_stats_loops_and_watch_streams_beside_a_probe(daemon: DaemonProcess) -> None:
    with KVPoolClient(daemon.target, token=SECRETS["tenant"]) as tenant, \
            KVPoolClient(daemon.target, token=SECRETS["ops"]) as ops, \
            Child(LATENCY_PROBE, first={"target": daemon.target, "pool": POOL,
                                "token": SECRETS["probe"]}, timeout_s=60) as probe:
        assert probe.recv() == {"ready": True}
        mine = [tenant.lease(f"tenant-{i}", ttl_s=60) for i in range(3)]
        for lease in mine:
            lease.allocate(POOL, "kv", 2)
        load = Load(daemon.target)
        try:
            for who in ("ops", "ops", "tenant", "tenant"):
                load.stats_loop(who)
            for _ in range(STREAM_CAP + 1):
                load.watch("ops", 0.05)  # under the minimum: served at it
            load.watch("tenant", 0.05)
            time.sleep(LOAD_S)
        finally:
            load.stop()
        probe.send("stop")
        figures = probe.recv()
        probe.wait_ok()
        stalls = ops.stats(POOL).daemon
        print(f"probe beside the load: {json.dumps(figures)}; load got {dict(load.got)}; the "
              f"daemon's loop stalled {stalls.loop_stalls} times (longest "
              f"{stalls.loop_longest_stall_seconds:.3f} s, {stalls.loop_stalled_seconds:.2f} s "
              "in all, lease setup included)")
        assert figures["errors"] == [] and figures["calls"] > 0
        # The fifth admin stream was refused; the four before it and the tenant's were served.
        assert [(who, code) for who, code, _ in load.refusals] == [
            ("ops", grpc.StatusCode.RESOURCE_EXHAUSTED)]
        details = load.refusals[0][2]
        assert (f"identity 'ops' asks for a WatchStats stream and has {STREAM_CAP} open, the "
                f"cap per identity is {STREAM_CAP} (max_watch_streams_per_identity, "
                "--max-watch-streams-per-identity)") in details
        assert load.got["watch ops"] >= STREAM_CAP and load.got["watch tenant"] >= 1
        assert load.got["stats ops"] > 0 and load.got["stats tenant"] > 0
        seen = tenant.stats()
        assert [x.name for x in seen.leases] == ["tenant-0", "tenant-1", "tenant-2"]
        assert all(x.held == {POOL: {"kv": 2}} for x in seen.leases)
        assert seen.daemon.num_leases == LEASES + 3  # the probe closed its lease
        assert seen.daemon.other_leases == LEASES
        everything = ops.stats(POOL)
        assert len(everything.leases) == LEASES + 3
        assert everything.pool(POOL).spaces["kv"].used == LEASES + 6
        for lease in mine:
            lease.close()

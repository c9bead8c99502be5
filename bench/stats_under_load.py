"""Benchmark: an innocent Allocate+Free probe beside Stats and WatchStats load, 10k leases open.

Issue 20 item 7: Stats reads every lease, so with many leases open a caller asking for Stats in
a loop (or holding WatchStats streams at a short interval) could hold the daemon's event loop
for everyone. This measures what that costs an innocent client:

1. A ``kvpoold serve`` child on a temporary Unix socket, every caller with a token
   (``--unix-auth token``): ``ops`` (admin), ``tenant`` and ``probe`` (scoped to the pool).
   ``ops`` opens ``--leases`` leases holding one page each.
2. The probe, a child process of its own (identity ``probe``, its own lease): Allocate(kv, 1)
   + Free in a loop, each pair timed.
3. Scenarios, ``--seconds`` each, the probe's p50/p99 read over the window: no load (the
   baseline), then a load child running admin Stats loops, tenant Stats loops (a tenant sees only
   its own leases), and admin WatchStats streams asking for a 0.05 s interval. Load calls read
   the reply as bytes (no decoding): what they cost is the daemon's.
4. Per scenario: the probe's p50/p99/max and their ratio to the baseline's (measured in this run),
   what the load got (calls, messages, refusals by status code), and how long the daemon's event
   loop stalled meanwhile (its own counter, ``loop_stalled_seconds``).

Runs against whichever daemon the checkout has, with only flags every version knows (run it on
an older commit for the figures before a change).

Run from the repository root:

    PYTHONPATH=client:service python bench/stats_under_load.py [--leases 10000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc import aio

from kvpool import KVPoolClient
from kvpool.contract.limits import MESSAGE_SIZE_OPTIONS

REPO = Path(__file__).resolve().parents[1]
POOL = "load"
# 2 layers, 2 KV heads of 16, page 16: 1 KiB per page.
SPEC = {"num_layers": 2, "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
        "context_length": 1024}
TOKENS = {"ops": "ops-secret-0123456789abcdef", "tenant": "tenant-secret-0123456789abcdef",
          "probe": "probe-secret-0123456789abcdef"}
WATCH_INTERVAL_S = 0.05
# (name, what the load child runs, token, how many)
SCENARIOS = (
    ("no load (baseline)", "none", "ops", 0),
    ("1 admin Stats loop", "stats", "ops", 1),
    ("4 admin Stats loops", "stats", "ops", 4),
    ("4 tenant Stats loops", "stats", "tenant", 4),
    (f"20 admin WatchStats @{WATCH_INTERVAL_S:g}s", "watch", "ops", 20),
)


def write_tokens(directory: Path, tokens: dict[str, str] = TOKENS, pool: str = POOL) -> Path:
    """Secret files (0600) and the tokens file naming them: ``ops`` is admin, the others are
    scoped to ``pool``. (``tests/e2e/test_stats_under_load.py`` uses it too.)"""
    lines = []
    for name, secret in tokens.items():
        path = directory / f"{name}.token"
        path.write_text(secret + "\n")
        os.chmod(path, 0o600)
        scope = "admin = true" if name == "ops" else f'pools = ["{pool}"]'
        lines += [f"[tokens.{name}]", f'secret_file = "{path}"', scope, ""]
    tokens = directory / "tokens.toml"
    tokens.write_text("\n".join(lines))
    os.chmod(tokens, 0o600)
    return tokens


@contextlib.contextmanager
def serving_daemon(leases: int) -> Iterator[str]:
    """A ``kvpoold serve`` child that admits ``leases`` leases for one identity; yields its
    target, stops it and removes its directory after."""
    tmp = Path(tempfile.mkdtemp(prefix="kvp-sl-", dir="/tmp"))
    sock = tmp / "kvpool.sock"
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'client'}:{REPO / 'service'}")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvpoold.main", "serve", "--listen", f"unix://{sock}",
         "--budget", "256MiB", "--sharing", "none", "--log-level", "warning",
         "--unix-auth", "token", "--tokens-file", str(write_tokens(tmp)),
         "--max-leases-per-identity", str(leases + 16)],
        env=env, cwd=REPO)
    target = f"unix://{sock}"
    try:
        with KVPoolClient(target, token=TOKENS["ops"]) as client:
            client.wait_serving()
        yield target
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)


async def open_leases(target: str, count: int, pool: str = POOL,
                      token: str = TOKENS["ops"]) -> None:
    """``count`` leases of ``token``'s identity holding one page of ``pool`` each, opened on
    a raw channel (no KeepAlive: their TTL outlasts the run), 64 calls in flight."""
    from kvpool.v1 import kvpool_pb2 as pb
    from kvpool.v1 import kvpool_pb2_grpc

    metadata = (("authorization", f"Bearer {token}"),)
    async with aio.insecure_channel(target, options=list(MESSAGE_SIZE_OPTIONS)) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)

        async def one(i: int) -> None:
            lease = await stub.OpenLease(pb.OpenLeaseRequest(name=f"engine-{i}",
                                                             ttl_seconds=3600.0),
                                         metadata=metadata)
            await stub.Allocate(pb.AllocateRequest(
                pool=pool, lease_id=lease.lease_id, lease_secret=lease.lease_secret,
                items=[pb.AllocateItem(space="kv", count=1)]), metadata=metadata)

        for start in range(0, count, 64):
            await asyncio.gather(*(one(i) for i in range(start, min(count, start + 64))))


def child(role: str, target: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'client'}:{REPO / 'service'}")
    return subprocess.Popen([sys.executable, __file__, "--role", role, "--target", target,
                             *args], env=env, cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def ask(proc: subprocess.Popen[str], line: str) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


# -- the children ---------------------------------------------------------------------------------

def run_probe(target: str) -> None:
    """Allocate+Free pairs until stdin closes; each line read answers the figures since the last
    one (and starts a new window)."""
    samples: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def loop() -> None:
        with KVPoolClient(target, token=TOKENS["probe"], timeout_s=120) as client, \
                client.lease("probe", ttl_s=120) as lease:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    lease.free(POOL, "kv", lease.allocate(POOL, "kv", 1))
                except Exception as exc:  # every failure is reported, none stops the probe
                    with lock:
                        errors.append(repr(exc)[:200])
                with lock:
                    samples.append(time.perf_counter() - t)

    worker = threading.Thread(target=loop)
    worker.start()
    print(json.dumps({"ready": True}), flush=True)
    for _line in sys.stdin:
        with lock:
            window, samples[:] = list(samples), []
            failed, errors[:] = list(errors), []
        arr = np.asarray(window or [0.0]) * 1e3
        print(json.dumps({"calls": len(window), "errors": failed[:5],
                          "p50_ms": float(np.percentile(arr, 50)),
                          "p99_ms": float(np.percentile(arr, 99)),
                          "max_ms": float(arr.max())}), flush=True)
    stop.set()
    worker.join()


def run_load(target: str, kind: str, token: str, count: int) -> None:
    """``count`` threads of Stats loops or WatchStats streams until stdin closes, then what they
    got: calls or messages, and failures by status code."""
    stop = threading.Event()
    got = Counter[str]()
    lock = threading.Lock()
    metadata = (("authorization", f"Bearer {TOKENS[token]}"),)
    channel = grpc.insecure_channel(target, options=list(MESSAGE_SIZE_OPTIONS))
    stats = channel.unary_unary("/kvpool.v1.KVPool/Stats", request_serializer=None,
                                response_deserializer=None)
    watch = channel.unary_stream("/kvpool.v1.KVPool/WatchStats", request_serializer=None,
                                 response_deserializer=None)
    from kvpool.v1 import kvpool_pb2 as pb

    stats_request = pb.StatsRequest().SerializeToString()
    watch_request = pb.WatchStatsRequest(interval_seconds=WATCH_INTERVAL_S).SerializeToString()
    streams: list[Any] = []

    def count_one(key: str) -> None:
        with lock:
            got[key] += 1

    def stats_loop() -> None:
        while not stop.is_set():
            try:
                stats(stats_request, metadata=metadata, timeout=120)
                count_one("calls")
            except grpc.RpcError as exc:
                count_one(exc.code().name)  # type: ignore[attr-defined]

    def watch_one() -> None:
        stream = watch(watch_request, metadata=metadata)
        with lock:
            streams.append(stream)
        try:
            for _msg in stream:
                count_one("messages")
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if code != grpc.StatusCode.CANCELLED:
                count_one(code.name)

    body = stats_loop if kind == "stats" else watch_one
    threads = [threading.Thread(target=body) for _ in range(count)]
    for t in threads:
        t.start()
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    stop.set()
    with lock:
        for stream in streams:
            stream.cancel()
    for t in threads:
        t.join()
    channel.close()
    print(json.dumps(dict(got)), flush=True)


# -- the run --------------------------------------------------------------------------------------

def stalled_seconds(target: str) -> float:
    """The daemon's loop stalls so far, read by the probe's identity (its Stats lists one lease
    where the daemon answers a tenant with its own leases only)."""
    with KVPoolClient(target, token=TOKENS["probe"], timeout_s=120) as client:
        return client.stats(POOL).daemon.loop_stalled_seconds


def run(leases: int, seconds: float) -> None:
    with serving_daemon(leases) as target:
        with KVPoolClient(target, token=TOKENS["ops"]) as client:
            client.configure(POOL, spec=SPEC, max_total_tokens=(leases + 4096) * 16,
                             page_size=16, max_running_requests=64)
        started = time.perf_counter()
        asyncio.run(open_leases(target, leases))
        print(f"{leases:,} leases of one page each opened in "
              f"{time.perf_counter() - started:.1f} s; {seconds:g} s per scenario")
        probe = child("probe", target)
        try:
            assert probe.stdout is not None
            assert json.loads(probe.stdout.readline()) == {"ready": True}
            rows = [scenario(target, probe, *s, seconds=seconds) for s in SCENARIOS]
            rows.append(scenario(target, probe, "no load (again)", "none", "ops", 0,
                                 seconds=seconds))
        finally:
            if probe.stdin is not None:
                probe.stdin.close()
            probe.wait(60)
    # Here, not at the top: tests import this module as ``bench.stats_under_load``, where
    # ``benchlib`` is not a top-level package (run as a script, bench/ is on the path).
    from benchlib.probe_table import print_probe_table

    print_probe_table(rows, "scenario", extra=("load got", lambda row: str(row["load"])))


def scenario(target: str, probe: subprocess.Popen[str], name: str, kind: str, token: str,
             count: int, *, seconds: float) -> dict[str, Any]:
    """The probe's figures over ``seconds`` beside ``count`` loads of ``kind``."""
    stalled = stalled_seconds(target)
    load = None if kind == "none" else child("load", target, "--kind", kind, "--token", token,
                                            "--count", str(count))
    got: dict[str, Any] = {}
    try:
        if load is not None:
            assert load.stdout is not None
            assert json.loads(load.stdout.readline()) == {"ready": True}
        time.sleep(min(1.0, seconds / 4))  # the load starts up
        ask(probe, "window")  # drop what came before
        time.sleep(seconds)
        figures = ask(probe, "window")
    finally:
        if load is not None:
            got = ask(load, "stop")
            load.wait(60)
    return {"name": name, "probe": figures, "load": got,
            "stalled_s": stalled_seconds(target) - stalled}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=10_000, help="leases open beside the probe")
    parser.add_argument("--seconds", type=float, default=5.0, help="per scenario")
    parser.add_argument("--role", choices=("probe", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=("stats", "watch"), help=argparse.SUPPRESS)
    parser.add_argument("--token", choices=sorted(TOKENS), help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "probe":
        run_probe(args.target)
    elif args.role == "load":
        run_load(args.target, args.kind, args.token, args.count)
    else:
        run(args.leases, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

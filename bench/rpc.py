"""Benchmark: Allocate/Free latency against the transport floor, and batched pages per second.

What it measures, from this process (the client) against ``kvpoold serve`` running in another
process on a Unix socket (started here unless ``--target`` names a running one):

1. The floor: p50/p99 of the grpc.health.v1 ``Check`` RPC on the client's own channel, a
   minimal Python unary call through the same server.
2. Allocate(1 page) and Free(1 page) through ``KVPoolClient`` (request building, the int32
   bytes, error mapping included), each call timed alone; p50/p99 and the ratio of the p50 to
   the floor's p50 (target <= 1.3x for a single page). Calls alternate Check, Allocate, Free so
   all three see the same machine noise.
3. Throughput: pages per second with Allocate of 1, 64 and 1024 pages per call, each followed
   by a Free of the same pages (the pair is what an engine does; both are counted in the time).

Run from the repository root:

    PYTHONPATH=client:service python bench/rpc.py [--calls 3000] [--seconds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np
from grpc_health.v1 import health_pb2

from kvpool.clients.client import KVPoolClient, Lease

REPO = Path(__file__).resolve().parents[1]
# A 2-layer model with 2 KV heads of 16: 256 B per token. page_size 1 and a 4 MiB budget give
# 16,383 token slots, room for the 1024-page batches.
SPEC = {"num_layers": 2, "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
        "context_length": 256}
POOL = "bench"


def start_daemon(sock: Path, budget: str = "64MiB", extra: Sequence[str] = (),
                 log: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """``kvpoold serve`` on ``sock`` with ``budget`` and ``extra`` flags (not yet ready), its
    log on ``log`` (default: this process's stderr)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'client'}:{REPO / 'service'}")
    return subprocess.Popen(
        [sys.executable, "-m", "kvpoold.main", "serve", "--listen", f"unix://{sock}",
         "--budget", budget, "--log-level", "warning", *extra],
        env=env, cwd=REPO, stderr=log,
    )


@contextlib.contextmanager
def serving_daemon(prefix: str = "kvp-bench-", budget: str = "64MiB",
                   extra: Sequence[str] = (), *, log_file: bool = False) -> Iterator[str]:
    """A ``kvpoold serve`` on a Unix socket in a fresh temporary directory (``extra``: more
    flags; ``log_file``: its log into a file there, not this process's stderr), ready to
    serve: yields its target; stops it and removes the directory after."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    log = (tmp / "daemon.log").open("wb") if log_file else None
    daemon = start_daemon(tmp / "kvpool.sock", budget, extra, log)
    target = f"unix://{tmp / 'kvpool.sock'}"
    try:
        with KVPoolClient(target) as client:
            client.wait_serving()
        yield target
    finally:
        daemon.terminate()
        daemon.wait(30)
        if log is not None:
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def percentiles(samples_ns: list[int]) -> tuple[float, float]:
    """(p50, p99) in microseconds."""
    arr = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def latency(client: KVPoolClient, lease: Lease, calls: int) -> dict[str, list[int]]:
    """Interleaved Check / Allocate(1) / Free(1), each timed alone."""
    check = client._health.Check  # the same channel the client's calls use
    request = health_pb2.HealthCheckRequest()
    out: dict[str, list[int]] = {"check": [], "allocate": [], "free": []}
    clock = time.perf_counter_ns
    for i in range(calls):
        t0 = clock()
        check(request)
        t1 = clock()
        ids = lease.allocate(POOL, "kv", 1)
        t2 = clock()
        lease.free(POOL, "kv", ids)
        t3 = clock()
        if i >= calls // 10:  # the first tenth warms up
            out["check"].append(t1 - t0)
            out["allocate"].append(t2 - t1)
            out["free"].append(t3 - t2)
    return out


def throughput(lease: Lease, pages: int, seconds: float) -> tuple[float, float]:
    """(pages/s, calls/s) of Allocate(pages) + Free(pages) pairs for ``seconds``."""
    done = 0
    pairs = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        ids = lease.allocate(POOL, "kv", pages)
        lease.free(POOL, "kv", ids)
        done += pages
        pairs += 1
    return done / elapsed, pairs / elapsed


def run(target: str, calls: int, seconds: float) -> None:
    with KVPoolClient(target) as client:
        client.wait_serving()
        plan = client.configure(POOL, spec=SPEC, budget_bytes=4 << 20, page_size=1,
                                max_running_requests=8).plan
        print(f"pool {POOL}: {plan.num_pages:,} slots; {calls:,} interleaved calls each, "
              f"first tenth discarded")
        with client.lease("bench", ttl_s=30.0) as lease:
            lat = latency(client, lease, calls)
            floor50, floor99 = percentiles(lat["check"])
            print(f"{'call':<22} {'p50 us':>8} {'p99 us':>8} {'p50/floor':>10}")
            print(f"{'health Check (floor)':<22} {floor50:8.1f} {floor99:8.1f} {1.0:10.2f}")
            for name in ("allocate", "free"):
                p50, p99 = percentiles(lat[name])
                label = "Allocate(1 page)" if name == "allocate" else "Free(1 page)"
                print(f"{label:<22} {p50:8.1f} {p99:8.1f} {p50 / floor50:10.2f}")
            pair = [a + f for a, f in zip(lat["allocate"], lat["free"], strict=True)]
            p50, p99 = percentiles(pair)
            print(f"{'Allocate+Free pair':<22} {p50:8.1f} {p99:8.1f} {p50 / floor50:10.2f}"
                  f"   (two calls: {p50 / (2 * floor50):.2f}x the floor per call)")
            print()
            print(f"{'pages per Allocate':<20} {'pages/s':>12} {'pairs/s':>10} "
                  f"{'us per pair':>12}")
            for pages in (1, 64, 1024):
                rate, pairs = throughput(lease, pages, seconds)
                print(f"{pages:<20} {rate:12,.0f} {pairs:10,.0f} {1e6 / pairs:12.1f}")
        client.drop(POOL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="a running daemon (default: start one)")
    parser.add_argument("--calls", type=int, default=3000, help="latency samples per call")
    parser.add_argument("--seconds", type=float, default=2.0, help="per throughput point")
    args = parser.parse_args()
    if args.target:
        run(args.target, args.calls, args.seconds)
        return 0
    with serving_daemon() as target:
        run(target, args.calls, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

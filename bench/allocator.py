"""Benchmark: the daemon's allocator through its real entry point, against one RPC.

What it measures, all in one run so machine noise hits every figure alike:

1. The floor: p50 of the grpc.health.v1 ``Check`` RPC from this process to ``kvpoold serve``
   running in another process on a Unix socket (the cheapest call an engine could make).
2. The entry point: ``KVPoolServicer.Allocate`` and ``.Free`` called in this process with real
   request messages (edge parsing, the daemon's pool and lease lookups, the id spaces, the
   reply's int32 bytes, the error decorator), driven to completion without an event loop turn
   (neither awaits). Targets: an Allocate(1)+Free(1) pair <= 5 % of one RPC; Allocate(1024)+
   Free(1024) >= 1M pages/s.
3. Flatness: the pair's cost for pools of 1K ... 16M pages, each about half held by another
   lease while measured; the cost must not grow with the pool (printed as a ratio to 1K).

Ratios are medians over rounds of each round's own ratio (the floor is re-measured every
round). Run from the repository root:

    PYTHONPATH=client:service python bench/allocator.py [--rounds 7] [--sizes 1K,...]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from grpc_health.v1 import health_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rpc import serving_daemon

from kvpool.clients.client import KVPoolClient
from kvpool.contract.sizes import format_size, parse_size
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.access import LOCAL_ADMIN
from kvpoold.server.args import ConfigureArgs, LeaseRef
from kvpoold.server.daemon import Daemon
from kvpoold.server.servicer import KVPoolServicer
from kvpoold.sharing.base import PlainBackingFactory

# One layer, one KV head of 1 element, page size 1: 4 B per token, so a 16M-page pool is
# 64 MiB and the allocator, not memory, is what is measured.
SPEC = {"num_layers": 1, "attention": {"type": "mha", "num_kv_heads": 1, "head_dim": 1},
        "context_length": 16}
FLOOR_CALLS = 300
TARGET_PAIR_SHARE = 0.05
TARGET_PAGES_PER_S = 1_000_000


class CallContext:
    """What the servicer asks of a gRPC call's context, for a call made in process: no
    deadline; an abort raises (the bench expects none)."""

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()  # no token: the local identity, as on the Unix socket

    async def abort(self, code: Any, details: str, metadata: Any = ()) -> None:
        raise RuntimeError(f"{code}: {details}")


CONTEXT = CallContext()


def drive(coro: Any) -> Any:
    """Run a coroutine that never suspends to its result (a servicer call in this process)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the servicer call awaited; it cannot be timed in-process")


class EntryPoint:
    """One pool of ``pages`` pages in an in-process daemon, called through its servicer."""

    def __init__(self, pages: int) -> None:
        self.daemon = Daemon("cpu", 1 << 40, PlainBackingFactory(torch.device("cpu")))
        self.servicer = KVPoolServicer(self.daemon)
        self.pool = f"p{pages}"
        args = ConfigureArgs(pool=self.pool, spec=SPEC, options={
            "max_total_tokens": pages, "page_size": 1, "max_running_requests": 8})
        plan = asyncio.run(self.daemon.configure(LOCAL_ADMIN, args)).plan
        assert plan.num_pages == pages, (plan.num_pages, pages)
        lease = self.daemon.open_lease(LOCAL_ADMIN, "bench", 86_400.0)
        self.lease = LeaseRef(lease.lease_id, lease.secret)
        # Another lease holds about half the pool (1,024 pages stay free even in a 1K pool):
        # the free stack's head is mid-pool and the owner array is mixed.
        other = self.daemon.open_lease(LOCAL_ADMIN, "ballast", 86_400.0)
        self.daemon.allocate(LOCAL_ADMIN, self.pool, LeaseRef(other.lease_id, other.secret),
                             [("kv", (pages - 1024) // 2)])

    def pair(self, count: int) -> Callable[[], None]:
        """A function doing one Allocate(count) + Free of those ids through the servicer."""
        allocate = self.servicer.Allocate
        free = self.servicer.Free
        lease_id, secret = self.lease.lease_id, self.lease.secret
        request = pb.AllocateRequest(pool=self.pool, lease_id=lease_id, lease_secret=secret,
                                     items=[pb.AllocateItem(space="kv", count=count)])
        pool = self.pool

        def run() -> None:
            reply = drive(allocate(request, CONTEXT))
            drive(free(pb.FreeRequest(pool=pool, lease_id=lease_id, lease_secret=secret, items=[
                pb.IdList(space="kv", ids=reply.items[0].ids)]), CONTEXT))

        return run

    def close(self) -> None:
        self.daemon.close()


def per_call_us(fn: Callable[[], None], seconds: float) -> float:
    """Median microseconds per call of ``fn`` over blocks filling about ``seconds``."""
    fn()
    start = time.perf_counter()
    n = 0
    while time.perf_counter() - start < 0.02:
        fn()
        n += 1
    block = max(1, n // 4)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        for _ in range(block):
            fn()
        times.append((time.perf_counter() - t0) / block)
    return statistics.median(times) * 1e6


def floor_us(client: KVPoolClient) -> float:
    """p50 microseconds of a health Check from this process to the daemon process."""
    check = client._health.Check  # the client's own channel
    request = health_pb2.HealthCheckRequest()
    samples = []
    for _ in range(FLOOR_CALLS):
        t0 = time.perf_counter_ns()
        check(request)
        samples.append(time.perf_counter_ns() - t0)
    return float(np.percentile(samples, 50)) / 1e3


def run(client: KVPoolClient, rounds: int, sizes: list[int], seconds: float) -> int:
    main_pages = 1 << 20
    entry = EntryPoint(main_pages)
    pair1, pair1024 = entry.pair(1), entry.pair(1024)
    floors, shares, rates, p1s, p1024s = [], [], [], [], []
    for _ in range(rounds):
        floor = floor_us(client)
        p1 = per_call_us(pair1, seconds)
        p1024 = per_call_us(pair1024, seconds)
        floors.append(floor)
        p1s.append(p1)
        p1024s.append(p1024)
        shares.append(p1 / floor)
        rates.append(1024 / (p1024 / 1e6))
    entry.close()
    share, rate = statistics.median(shares), statistics.median(rates)
    print(f"entry point: KVPoolServicer.Allocate + .Free in-process, pool of {main_pages:,} "
          f"pages (about half held by another lease); {rounds} rounds, medians")
    print(f"  health Check RPC (floor)        p50 {statistics.median(floors):9.1f} us")
    print(f"  Allocate(1) + Free(1)           {statistics.median(p1s):13.1f} us   "
          f"{share:.2%} of one RPC   target <= {TARGET_PAIR_SHARE:.0%}: "
          f"{'met' if share <= TARGET_PAIR_SHARE else 'MISSED'}")
    print(f"  Allocate(1024) + Free(1024)     {statistics.median(p1024s):13.1f} us   "
          f"{rate:,.0f} pages/s          target >= {TARGET_PAGES_PER_S:,}: "
          f"{'met' if rate >= TARGET_PAGES_PER_S else 'MISSED'}")
    print()
    print("cost per pair vs pool size (about half of each pool held by another lease)")
    print(f"{'pages':>12} {'backing':>10} {'pair(1) us':>11} {'x 1K':>6} {'pair(1024) us':>14} "
          f"{'x 1K':>6}")
    base: tuple[float, float] | None = None
    worst = 1.0
    for pages in sizes:
        point = EntryPoint(pages)
        one = statistics.median(per_call_us(point.pair(1), seconds / 2) for _ in range(3))
        many = statistics.median(per_call_us(point.pair(1024), seconds / 2)
                                 for _ in range(3))
        backing = point.daemon.pool(point.pool).plan.backing_bytes
        point.close()
        if base is None:
            base = (one, many)
        r1, r1024 = one / base[0], many / base[1]
        worst = max(worst, r1, r1024)
        print(f"{pages:>12,} {format_size(backing):>10} {one:11.1f} {r1:6.2f} {many:14.1f} "
              f"{r1024:6.2f}")
    print(f"largest ratio to the 1K pool: {worst:.2f}x (flat: about 1)")
    # Figures are for people ("met"/"MISSED" above): a busy machine must not fail a run.
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of floor + entry point")
    parser.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    parser.add_argument("--sizes", default="1K,16K,256K,1M,4M,16M",
                        help="pool sizes in pages for the flatness table (K = 1024)")
    args = parser.parse_args()
    sizes = [parse_size(s.replace("K", "KiB").replace("M", "MiB")) for s in
             args.sizes.split(",")]
    with serving_daemon() as target, KVPoolClient(target) as client:
        return run(client, args.rounds, sizes, args.seconds)


if __name__ == "__main__":
    sys.exit(main())

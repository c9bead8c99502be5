"""Benchmark: alloc(1) + free(1) through the client page cache against one Allocate + one Free.

From this process (the client) against ``kvpoold serve`` in another process on a Unix socket
(started here unless ``--target`` names a running one), interleaved so both see the same noise:

1. ``lease.allocate(pool, "kv", 1)`` then ``lease.free(pool, "kv", ids)``: two gRPC calls.
2. ``cache.alloc(1)`` then ``cache.free(ids)`` on a ``PageCache`` (low 64, high 512): served
   locally; the RPC count during the run is printed (0 in steady state). Once
   interleaved with series 1 (each right after an RPC pair: gRPC's threads still hold the GIL
   then, which is what an engine mixing RPCs and cache calls sees) and once alone (what an
   engine that allocates only through the cache sees).
3. The same through ``AsyncPageCache`` (``await``; no suspension on a hit), on its own loop.
4. Engine-shaped churn through the sync cache: 600 allocs of 1 page, then 600 frees, with a
   0.2 ms pause that releases the GIL (a forward pass, untimed) every 16 calls, so the cache
   crosses both watermarks and the worker refills and returns in the background; p50/p99 of
   each alloc and free, and how many allocs waited. (Without pauses a pure-Python loop holds
   the GIL and the worker thread runs only at the interpreter's 5 ms switch interval.)

p50/p99 are per call (microseconds), the first tenth of each series discarded as warm-up.

    PYTHONPATH=client:service python bench/page_cache.py [--calls 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np
from rpc import SPEC, percentiles, serving_daemon

from kvpool.clients.aio import AsyncKVPoolClient
from kvpool.clients.client import KVPoolClient

POOL = "pcbench"
clock = time.perf_counter_ns
STEP_S = 0.0002  # the churn series' stand-in for a forward pass (releases the GIL)


def trimmed(samples: list[int]) -> list[int]:
    return samples[len(samples) // 10:]


def row(label: str, samples: list[int], base: float | None = None) -> float:
    p50, p99 = percentiles(trimmed(samples))
    ratio = f"{base / p50:10.0f}x" if base else f"{'':>11}"
    print(f"{label:<34} {p50:9.2f} {p99:9.2f} {ratio}")
    return p50


def sync_series(client: KVPoolClient, calls: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {k: [] for k in ("rpc_alloc", "rpc_free", "rpc_pair",
                                                 "pc_alloc", "pc_free", "pc_pair", "timer",
                                                 "alone_alloc", "alone_free", "alone_pair")}
    # The RPC rows use a lease of their own: a page cache is its lease's only path to kv.
    with client.lease("bench", ttl_s=30.0) as cache_lease, \
            client.lease("bench-rpc", ttl_s=30.0) as lease, \
            cache_lease.page_cache(POOL) as cache:
        cache.settle(30)
        calls0 = cache.core.rpc_calls
        for _ in range(calls):
            t0 = clock()
            ids = cache.alloc(1)
            t1 = clock()
            cache.free(ids)
            t2 = clock()
            out["alone_alloc"].append(t1 - t0)
            out["alone_free"].append(t2 - t1)
            out["alone_pair"].append(t2 - t0)
        for _ in range(calls):
            t0 = clock()
            ids = lease.allocate(POOL, "kv", 1)
            t1 = clock()
            lease.free(POOL, "kv", ids)
            t2 = clock()
            ids = cache.alloc(1)
            t3 = clock()
            cache.free(ids)
            t4 = clock()
            t5 = clock()
            out["rpc_alloc"].append(t1 - t0)
            out["rpc_free"].append(t2 - t1)
            out["rpc_pair"].append(t2 - t0)
            out["pc_alloc"].append(t3 - t2)
            out["pc_free"].append(t4 - t3)
            out["pc_pair"].append(t4 - t2)
            out["timer"].append(t5 - t4)
        print(f"sync cache: {cache.core.rpc_calls - calls0} RPCs during {2 * calls:,} "
              f"alloc+free pairs, {cache.core.waits} waits ({cache!r})")
    return out


def churn_series(client: KVPoolClient, rounds: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"alloc": [], "free": []}
    with client.lease("bench-churn", ttl_s=30.0) as lease, lease.page_cache(POOL) as cache:
        cache.settle(30)
        for _ in range(rounds):
            held = []
            for i in range(600):
                if i % 16 == 0:
                    time.sleep(STEP_S)
                t0 = clock()
                held.append(cache.alloc(1))
                out["alloc"].append(clock() - t0)
            for i, ids in enumerate(held):
                if i % 16 == 0:
                    time.sleep(STEP_S)
                t0 = clock()
                cache.free(ids)
                out["free"].append(clock() - t0)
        c = cache.counters()
        print(f"churn: {rounds} rounds of 600 allocs then 600 frees: {c.refills} refills, "
              f"{c.returns} returns, {c.waits} allocs waited on an RPC")
    return out


async def async_series(target: str, calls: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"alloc": [], "free": [], "pair": []}
    async with AsyncKVPoolClient(target) as client, \
            await client.lease("bench-aio", ttl_s=30.0) as lease, \
            await lease.page_cache(POOL) as cache:
        await cache.settle()
        for _ in range(calls):
            t0 = clock()
            ids = await cache.alloc(1)
            t1 = clock()
            await cache.free(ids)
            t2 = clock()
            out["alloc"].append(t1 - t0)
            out["free"].append(t2 - t1)
            out["pair"].append(t2 - t0)
        print(f"async cache: {cache.core.waits} waits, {cache.core.rpc_calls} RPCs in all")
    return out


def run(target: str, calls: int) -> None:
    with KVPoolClient(target) as client:
        client.wait_serving()
        plan = client.configure(POOL, spec=SPEC, budget_bytes=4 << 20, page_size=1,
                                max_running_requests=8).plan
        print(f"pool {POOL}: {plan.num_pages:,} slots; {calls:,} calls per series")
        lat = sync_series(client, calls)
        aio = asyncio.run(async_series(target, calls))
        churn = churn_series(client, max(1, calls // 600))
        print()
        print(f"{'per call':<34} {'p50 us':>9} {'p99 us':>9} {'RPC/cache':>11}")
        rpc_alloc = row("Allocate(1) RPC", lat["rpc_alloc"])
        rpc_free = row("Free(1) RPC", lat["rpc_free"])
        rpc_pair = row("Allocate+Free RPC pair", lat["rpc_pair"])
        row("PageCache.alloc(1)", lat["alone_alloc"], rpc_alloc)
        row("PageCache.free(1)", lat["alone_free"], rpc_free)
        row("PageCache alloc+free pair", lat["alone_pair"], rpc_pair)
        row("interleaved: PageCache.alloc(1)", lat["pc_alloc"], rpc_alloc)
        row("interleaved: PageCache.free(1)", lat["pc_free"], rpc_free)
        row("interleaved: PageCache pair", lat["pc_pair"], rpc_pair)
        row("AsyncPageCache.alloc(1)", aio["alloc"], rpc_alloc)
        row("AsyncPageCache.free(1)", aio["free"], rpc_free)
        row("AsyncPageCache alloc+free pair", aio["pair"], rpc_pair)
        row("churn: PageCache.alloc(1)", churn["alloc"], rpc_alloc)
        row("churn: PageCache.free(1)", churn["free"], rpc_free)
        row("(timer: perf_counter_ns pair)", lat["timer"])
        print(f"max churn alloc: {max(churn['alloc']) / 1e3:.1f} us, "
              f"max churn free: {max(churn['free']) / 1e3:.1f} us; "
              f"{np.count_nonzero(np.asarray(churn['alloc']) > 100_000)} allocs over 100 us")
        client.drop(POOL, force=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="a running daemon (default: start one)")
    parser.add_argument("--calls", type=int, default=5000, help="samples per series")
    args = parser.parse_args()
    if args.target:
        run(args.target, args.calls)
        return 0
    with serving_daemon() as target:
        run(target, args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())

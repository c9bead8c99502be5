"""Benchmark: how the daemon's costs grow with its size, printed as tables.

Three curves, each against its own first row (a ratio of 1 everywhere means flat):

1. Allocate(1)+Free(1) through ``KVPoolServicer`` in-process vs pool size (1K ... 16M pages),
   each pool about half held by another lease (``bench/allocator.py`` has the same table next
   to the RPC floor).
2. ``Stats`` (the daemon's snapshot plus its proto encoding) and the lease sweep
   (``Daemon.expire_leases`` with nothing due, and with 1% of the leases due) vs the number of
   open leases (1 ... 10k), each lease holding one page.
3. The daemon's memory per million pages: the resident-set growth of building a pool's id
   spaces, minus the pool's backing region, i.e. what the allocator costs per page.

Run from the repository root:

    PYTHONPATH=client:service python bench/scale.py [--seconds 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allocator import SPEC, EntryPoint, per_call_us

from kvpool.contract import codec
from kvpool.contract.sizes import format_size
from kvpool.contract.spec import decode_spec
from kvpoold.access import LOCAL_ADMIN
from kvpoold.ids import PoolIds
from kvpoold.server.args import ConfigureArgs, LeaseRef
from kvpoold.server.daemon import Daemon
from kvpoold.settings import MAX_LEASES
from kvpoold.sharing.base import PlainBackingFactory
from kvpoold.sizing import make_options, plan

KiB, MiB = 1 << 10, 1 << 20
LEASE_COUNTS = (1, 10, 100, 1_000, 10_000)
POOL_SIZES = (KiB, 16 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB)


class Clock:
    """A clock the sweep benchmark moves by hand."""

    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def median_us(fn: Callable[[], object], repeats: int = 7) -> float:
    """Median microseconds of ``repeats`` timed calls of ``fn`` (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def allocate_curve(seconds: float) -> None:
    print("1. Allocate(1) + Free(1) through the servicer vs pool size")
    print(f"{'pages':>12} {'us per pair':>12} {'x first':>8}")
    first = None
    for pages in POOL_SIZES:
        point = EntryPoint(pages)
        us = statistics.median(per_call_us(point.pair(1), seconds) for _ in range(3))
        point.close()
        first = first or us
        print(f"{pages:>12,} {us:12.1f} {us / first:8.2f}")
    print()


def leases_curve() -> None:
    print("2. Stats and the lease sweep vs open leases (each holding one page)")
    print(f"{'leases':>8} {'Stats us':>10} {'x first':>8} {'sweep, none due us':>19} "
          f"{'x first':>8} {'sweep, 1% due us':>17}")
    first: tuple[float, float] | None = None
    for count in LEASE_COUNTS:
        clock = Clock()
        daemon = Daemon("cpu", 1 << 40, PlainBackingFactory(torch.device("cpu")), clock=clock,
                        max_leases_per_identity=MAX_LEASES)  # one identity opens them all
        args = ConfigureArgs(pool="p", spec=SPEC, options={
            "max_total_tokens": 2 * count + 1024, "page_size": 1, "max_running_requests": 8})
        asyncio.run(daemon.configure(LOCAL_ADMIN, args))
        short = max(1, count // 100)
        for i in range(count):
            lease = daemon.open_lease(LOCAL_ADMIN, f"engine-{i}", 1.0 if i < short else 86_400.0)
            daemon.allocate(LOCAL_ADMIN, "p", LeaseRef(lease.lease_id, lease.secret), [("kv", 1)])
        stats_us = median_us(lambda d=daemon: codec.stats_to_pb(d.stats(LOCAL_ADMIN)))
        sweep_none = median_us(daemon.expire_leases, repeats=21)
        clock.t += 2.0  # the short leases are now due
        t0 = time.perf_counter()
        expired = daemon.expire_leases()
        sweep_due = (time.perf_counter() - t0) * 1e6
        assert len(expired) == short, (len(expired), short)
        daemon.close()
        first = first or (stats_us, sweep_none)
        print(f"{count:>8,} {stats_us:10.1f} {stats_us / first[0]:8.2f} {sweep_none:19.2f} "
              f"{sweep_none / first[1]:8.2f} {sweep_due:17.1f}  ({short} due)")
    print("   Stats is O(leases) by nature (it lists them); the sweep with nothing due is O(1).")
    print()


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def memory_curve() -> None:
    print("3. Allocator memory per million pages (RSS growth of a pool's id spaces, half the "
          "pages held by one lease)")
    print(f"{'pages':>12} {'RSS growth':>12} {'B per page':>11}")
    grown_at = {}
    for pages in (MiB, 4 * MiB, 16 * MiB):
        p = plan(decode_spec(SPEC),
                 make_options(max_total_tokens=pages, page_size=1, max_running_requests=8))
        gc.collect()
        before = rss_bytes()
        ids = PoolIds("p", p.id_spaces, {})
        ids.space("kv", "f").take(1, pages // 2)  # a lease holds half
        grown_at[pages] = grown = rss_bytes() - before
        print(f"{pages:>12,} {format_size(grown):>12} {grown / pages:11.1f}")
        del ids
    marginal = (grown_at[16 * MiB] - grown_at[4 * MiB]) / (12 * MiB)
    print(f"   marginal cost 4M -> 16M pages: {marginal:.1f} B per page = "
          f"{format_size(int(marginal * MiB))} per million pages (free stack, owner and slot "
          "arrays: 12 B per page; the held set 4 B per held page, with room to grow)")


def main() -> int:
    logging.disable(logging.WARNING)  # the sweep logs every expired lease
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.3, help="per allocate measurement")
    args = parser.parse_args()
    allocate_curve(args.seconds)
    leases_curve()
    memory_curve()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: granting and releasing a group of an elastic pool (issue 23), against the raw
commit and punch of the same chunks measured in the same run.

A Llama-3.1-8B layout (64 K/V views of 2 KiB per token; a group is 1,024 tokens, 64 chunks of
2 MiB, 128 MiB) in one sparse memfd. Per round, for each group in turn:

1. raw: ``fallocate`` commit of the group's 64 chunks, then their punch (the floor: what the
   kernel costs);
2. kvpool: the arbiter's decision (``Arbiter.want`` of one group) and ``SparseBacking.grant``,
   then ``SparseBacking.release`` and the arbiter's ``released``.

Target: grant / raw commit and release / raw punch p50 <= 1.5x. Ratios are medians of each
round's own ratio. Not measured here yet: the reclaim latency under pressure (request to free
budget, p99 <= 100 ms) and Allocate/Free over an elastic pool, which need the daemon's elastic
path (the next parts of the issue). Run from the repository root:

    PYTHONPATH=client:service python bench/elastic.py [--rounds 5] [--groups 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from kvpool.mapping.sparse import backed_bytes, commit, punch
from kvpoold.elastic.arbiter import Arbiter, Share
from kvpoold.elastic.groups import SparseBacking, group_geometry

VIEWS = 64
ROW_BYTES = 2048  # 8 KV heads x 128 x bf16


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--groups", type=int, default=8, help="groups in the virtual range")
    args = ap.parse_args()

    geo = group_geometry((ROW_BYTES,) * VIEWS, page_size=16, capacity_tokens=1024 * args.groups)
    offsets, at = [], 0
    for size in geo.view_bytes:
        offsets.append(at)
        at += size
    fd = os.memfd_create("kvpool-bench-elastic", os.MFD_CLOEXEC)
    os.ftruncate(fd, at)
    backing = SparseBacking(fd, geo, tuple(offsets))
    arb = Arbiter(budget_bytes=geo.bytes * args.groups)
    arb.admit(Share("bench", group_bytes=geo.bytes, groups=geo.groups, floor=0, cap=geo.groups))
    print(f"layout: {VIEWS} views, group {geo.tokens:,} tokens = {len(offsets)} chunks = "
          f"{geo.bytes >> 20} MiB; {geo.groups} groups, {at / (1 << 30):.2f} GiB virtual")

    ratios: dict[str, list[float]] = {"grant": [], "release": []}
    last: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        t: dict[str, list[float]] = {"commit": [], "punch": [], "grant": [], "release": []}
        for g in range(geo.groups):
            ranges = backing.ranges(g)
            t0 = time.perf_counter()
            for off, length in ranges:
                commit(fd, off, length)
            t1 = time.perf_counter()
            for off, length in ranges:
                punch(fd, off, length)
            t2 = time.perf_counter()
            arb.want("bench", 1)
            backing.grant(g)
            t3 = time.perf_counter()
            backing.release(g)
            arb.give_up("bench", 1)
            t4 = time.perf_counter()
            t["commit"].append(t1 - t0)
            t["punch"].append(t2 - t1)
            t["grant"].append(t3 - t2)
            t["release"].append(t4 - t3)
        assert backed_bytes(fd) == 0, "a group stayed backed"
        ratios["grant"].append(statistics.median(t["grant"]) / statistics.median(t["commit"]))
        ratios["release"].append(statistics.median(t["release"])
                                 / statistics.median(t["punch"]))
        last = t
    print(f"{'per 128 MiB group':<24}{'p50 ms':>10}{'p99 ms':>10}")
    for name in ("commit", "grant", "punch", "release"):
        print(f"{name:<24}{pct(last[name], 0.5) * 1e3:>10.2f}{pct(last[name], 0.99) * 1e3:>10.2f}")
    for name, base in (("grant", "raw commit"), ("release", "raw punch")):
        r = statistics.median(ratios[name])
        print(f"{name} / {base} p50 {r:6.2f}x  [{min(ratios[name]):.2f} .. "
              f"{max(ratios[name]):.2f}]  target <= 1.5x  {'met' if r <= 1.5 else 'NOT met'}")
    print("reclaim latency under pressure, Allocate/Free over an elastic pool: not measured "
          "(the daemon's elastic path is not built yet)")
    os.close(fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

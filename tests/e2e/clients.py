"""Client programs the e2e tests start as separate processes (``python -m tests.e2e.clients``).

Each prints one JSON line when it has done its part and then waits for a line on stdin
(``hold`` waits forever: the test SIGKILLs it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import numpy as np

from kvpool.clients.client import KVPoolClient
from kvpool.contract.errors import FailedPrecondition, InvalidArgument, ResourceExhausted


def send(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def hold(target: str, pool: str, count: int, ttl: float) -> None:
    """Open a lease, take ``count`` pages, report them, then sleep until killed."""
    client = KVPoolClient(target)
    lease = client.lease("holder", ttl_s=ttl)
    ids = lease.allocate(pool, "kv", count)
    send({"lease_id": lease.lease_id, "ids": ids.tolist()})
    while True:
        time.sleep(60)


def churn(target: str, pool: str, seconds: float, seed: int) -> None:
    """Allocate and free at random for ``seconds``, checking what the daemon hands out.

    Every allocation must be new to this process; a free of an id it does not hold must be
    refused (and change nothing). Reports what it holds, waits for a line, closes the lease.
    """
    rng = random.Random(seed)
    client = KVPoolClient(target)
    lease = client.lease(f"churn-{seed}", ttl_s=2.0)
    held: set[int] = set()
    counts = {"allocs": 0, "frees": 0, "exhausted": 0, "refused": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        roll = rng.random()
        if roll < 0.5 or not held:
            try:
                ids = lease.allocate(pool, "kv", rng.randint(1, 16))
            except ResourceExhausted:
                counts["exhausted"] += 1
                continue
            new = set(ids.tolist())
            assert len(new) == len(ids) and not new & held, "an id was handed out twice"
            held |= new
            counts["allocs"] += len(ids)
        elif roll < 0.95:
            ids = rng.sample(sorted(held), rng.randint(1, len(held)))
            assert lease.free(pool, "kv", np.asarray(ids, dtype=np.int32)) == len(ids)
            held -= set(ids)
            counts["frees"] += len(ids)
        else:
            # a page this process holds plus one it does not: refused as a whole
            mine = rng.choice(sorted(held))
            other = next(i for i in range(1, 1 << 20) if i not in held)
            try:
                lease.free(pool, "kv", [mine, other])
            except (FailedPrecondition, InvalidArgument):  # InvalidArgument: past the pool
                counts["refused"] += 1
            else:
                raise AssertionError(f"freeing id {other} not held by this lease was accepted")
    send({"lease_id": lease.lease_id, "held": sorted(held), **counts})
    sys.stdin.readline()
    lease.close()
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("hold")
    p.add_argument("target")
    p.add_argument("pool")
    p.add_argument("count", type=int)
    p.add_argument("ttl", type=float)
    p = sub.add_parser("churn")
    p.add_argument("target")
    p.add_argument("pool")
    p.add_argument("seconds", type=float)
    p.add_argument("seed", type=int)
    args = parser.parse_args()
    if args.mode == "hold":
        hold(args.target, args.pool, args.count, args.ttl)
    else:
        churn(args.target, args.pool, args.seconds, args.seed)


if __name__ == "__main__":
    main()

"""Benchmark: the daemon's KV events (issue 41): Allocate/Free with events on vs off, events/s.

What it measures, in this process, on the daemon's own objects (no gRPC: the event loop's
work is what the events could slow, and a gRPC round trip's noise would hide it):

1. Three daemons, each with one pool of ``--pages`` pages (1,000,000 by default; 512 B pages of a
   one-layer model, so the pool is 512 MiB), both filled the same way: one lease allocates
   every page, seals them in Seal calls of 16,384 pages (chains of 32 pages, as engines seal a
   request's full pages), and frees them: the pool's directory keeps all of them, and it has no
   free page left. "off" publishes nothing; "loop" numbers and encodes every batch on the
   loop and drops it (the loop's own share of the cost); "on" publishes its KV events
   (``KvEvents`` and the real publisher process, ZMQ PUB and ROUTER on ipc endpoints) to a
   subscriber in a child process that decodes every batch (what a router does). On a host
   with few cores, "on" also measures the CPU its two processes take from the loop.
2. The probe, ``--rounds`` rounds of ``--iters`` steps on each daemon in turn (each first in
   turn: drift of a shared machine falls on all): a step is an Allocate of 1 page (the pool
   is full, so the directory gives back its oldest page: a BlockRemoved), a Seal of it (a
   BlockStored) and a Free (the directory keeps it: the pool stays at ``--pages`` sealed
   pages). Allocate and Free are timed alone (``perf_counter_ns`` around the daemon's call, on
   the loop as gRPC would call it); the Seal, which hops to a worker thread for its checksum,
   is timed too but reported beside. p50/p99 per variant over all rounds, and the p99 ratios
   to off (target: on/off <= 1.05x).
3. A router that starts late, on the "on" daemon: a replay from 0, a snapshot of every sealed
   page; how long until its end marker, and the loop's longest stall meanwhile (a 1 ms ticker
   task), against the same ticker on the idle loop.
4. Events/s sustained: on the "on" daemon, for ``--burst-s`` seconds, cycles as fast as the
   loop can go of an Allocate of 4,096 pages (4,096 evicted: one BlockRemoved of 4,096
   hashes), a Seal of them as 4,096 one-page sequences (4,096 BlockStored events: the worst
   case, one event per page) and a Free; then how long the publisher takes to send what is
   queued. Events (vLLM's count: BlockStored / BlockRemoved entries) and blocks per second
   numbered by the loop and decoded by the subscriber; batches dropped.

Run from the repository root:

    PYTHONPATH=client:service python bench/kv_events.py [--pages 1000000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from kvpoold.access import DAEMON_CALLER
from kvpoold.server.args import ConfigureArgs, LeaseRef
from kvpoold.server.daemon import Daemon
from kvpoold.server.kv_process import PublisherProcess
from kvpoold.server.kv_stream import KvEvents
from kvpoold.settings import KvEventsConfig
from kvpoold.sharing.base import PlainBackingFactory

POOL = "bench"
PAGE = 16
# One layer, one KV head of 8 dims, fp16, page 16: 2 x 8 x 2 x 16 = 512 B a page.
SPEC = {"num_layers": 1, "attention": {"type": "mha", "num_kv_heads": 1, "head_dim": 8},
        "context_length": 4096, "dtype": "float16"}
PAGE_BYTES = 512
SEAL_CHUNK = 16_384  # pages a Seal call (about 2 MiB of keys, parents and tokens)
CHAIN = 32  # pages a sequence
BURST_PAGES = 4096
LAYOUT = "bench/1 sha256 tp0"
TARGET = 1.05
QUICK = {"pages": 20_000, "rounds": 2, "iters": 300, "burst_s": 0.5}
FULL = {"pages": 1_000_000, "rounds": 6, "iters": 3000, "burst_s": 5.0}

# The subscriber: counts what it decodes until its stdin closes, then prints the counts.
SUBSCRIBER = r"""
import os, sys, threading, time, zmq
from kvpool.contract.kv_events import decode_batch, BlockStored, BlockRemoved
os.nice(19)  # a router elsewhere: on a small host it must not take the daemon's CPU
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.RCVHWM, 0)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
batches = events = blocks = gaps = 0
last = -1
first_at = last_at = 0.0
print("ready", flush=True)
while not stop.is_set():
    if not sub.poll(100):
        continue
    _, raw, payload = sub.recv_multipart()
    last_at = time.perf_counter()
    first_at = first_at or last_at
    seq = int.from_bytes(raw, "big")
    gaps += last >= 0 and seq != last + 1
    last = seq
    batch = decode_batch(payload)
    batches += 1
    events += len(batch.events)
    blocks += sum(len(e.block_hashes) for e in batch.events
                  if isinstance(e, (BlockStored, BlockRemoved)))
print(batches, events, blocks, gaps, first_at, last_at, flush=True)
"""


class Discard:
    """The loop's side alone: each batch numbered, encoded as it is for the publisher, and
    dropped here (no process, no socket)."""

    endpoint = replay_endpoint = ""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def offer(self, msg: Any) -> bool:
        self._encoder.encode(msg)
        return True

    async def deliver(self, msg: Any) -> None:
        self._encoder.encode(msg)


class Variant:
    """One daemon, its pool filled with sealed pages, and its probe's samples; ``events``:
    "off", "loop" (numbered and encoded on the loop, then dropped: :class:`Discard`) or "on"
    (the publisher process, a subscriber)."""

    def __init__(self, name: str, events: str, tmp: Path) -> None:
        self.name = name
        self.publisher: PublisherProcess | None = None
        self.events: KvEvents | None = None
        cfg = KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp}/pub",
                             replay_endpoint=f"ipc://{tmp}/replay")
        if events == "on":
            self.publisher = PublisherProcess(cfg)
            self.events = KvEvents(cfg, self.publisher)
        elif events == "loop":
            self.events = KvEvents(cfg, Discard())
        self.d = Daemon("cpu", 4 << 30, PlainBackingFactory(torch.device("cpu")),
                        kv_events=self.events)
        self.alloc_ns: list[int] = []
        self.free_ns: list[int] = []
        self.seal_ns: list[int] = []
        self.n = 0  # keys made so far
        self.ref: LeaseRef | None = None
        self.capacity = 0

    async def fill(self, pages: int) -> tuple[int, float]:
        """Configure the pool for ``pages`` and seal all of it; its capacity and seconds."""
        await self.d.configure(DAEMON_CALLER, ConfigureArgs(POOL, spec=dict(SPEC), options={
            "budget_bytes": pages * PAGE_BYTES, "page_size": PAGE, "max_running_requests": 8}))
        lease = self.d.open_lease(DAEMON_CALLER, "filler", 3600.0)
        self.ref = LeaseRef(lease.lease_id, lease.secret)
        capacity = self.capacity = self.d.pools[POOL].ids.space("kv", "kv").num_free
        t = time.perf_counter()
        for start in range(0, capacity, SEAL_CHUNK):
            n = min(SEAL_CHUNK, capacity - start)
            ids = self.allocate(n)
            await self.seal(ids, chain=CHAIN)
            self.d.free(DAEMON_CALLER, POOL, self.ref, [("kv", ids)])
        return capacity, time.perf_counter() - t

    def allocate(self, n: int) -> np.ndarray:
        assert self.ref is not None
        got = self.d.allocate(DAEMON_CALLER, POOL, self.ref, [("kv", n)])
        return got[0][1].ids  # type: ignore[no-any-return]

    async def seal(self, ids: np.ndarray, chain: int) -> None:
        """Seal ``ids`` as sequences of ``chain`` pages (fresh keys, sha256 over parent and
        tokens as engines hash)."""
        assert self.ref is not None
        n = ids.shape[0]
        tokens = (np.arange(n * PAGE, dtype=np.int64) % 100_000).astype(np.int32)
        keys, parents = [], []
        parent = bytes(32)
        for i in range(n):
            if i % chain == 0:
                parent = bytes(32)
            self.n += 1
            key = hashlib.sha256(parent + self.n.to_bytes(8, "little")).digest()
            keys.append(key)
            parents.append(parent)
            parent = key
        done = await self.d.sealing.seal(DAEMON_CALLER, POOL, self.ref, LAYOUT, ids,
                                         b"".join(keys), b"".join(parents), tokens)
        assert done == n, (done, n)

    async def probe(self, iters: int) -> None:
        """``iters`` steps of Allocate(1) (evicts one), Seal, Free (kept), each timed."""
        assert self.ref is not None
        clock = time.perf_counter_ns
        for _ in range(iters):
            t0 = clock()
            ids = self.allocate(1)
            t1 = clock()
            await self.seal(ids, chain=1)
            t2 = clock()
            self.d.free(DAEMON_CALLER, POOL, self.ref, [("kv", ids)])
            t3 = clock()
            self.alloc_ns.append(t1 - t0)
            self.seal_ns.append(t2 - t1)
            self.free_ns.append(t3 - t2)

    async def close(self) -> None:
        self.d.close()
        if self.publisher is not None:
            await self.publisher.close()


def pct(samples: list[int], q: float) -> float:
    """The ``q`` percentile in microseconds."""
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q)) / 1e3


async def burst(v: Variant, seconds: float) -> dict[str, float]:
    """Events/s sustained on the "on" daemon (see the module's docstring, 3)."""
    assert v.events is not None
    numbered0, dropped0 = v.events.numbered, v.events.dropped
    pages = min(BURST_PAGES, v.capacity // 2)
    cycles = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ids = v.allocate(pages)  # the directory gives back its oldest
        await v.seal(ids, chain=1)
        v.d.free(DAEMON_CALLER, POOL, v.ref, [("kv", ids)])  # type: ignore[list-item]
        cycles += 1
    return {"cycles": cycles, "batches": v.events.numbered - numbered0,
            "events": cycles * (pages + 1), "blocks": cycles * 2 * pages, "pages": pages,
            "loop_s": time.perf_counter() - t0, "started": t0,
            "dropped": v.events.dropped - dropped0}


async def longest_stall(work: Any) -> tuple[Any, float]:
    """``await work`` while a 1 ms ticker measures the loop's longest stall (seconds late)."""
    done = False
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - t - 0.001)

    ticker = asyncio.ensure_future(tick())
    try:
        return await work, worst
    finally:
        done = True
        await ticker


async def snapshot_cost(v: Variant) -> dict[str, float]:
    """A router that starts late: a replay from 0 is a snapshot of the whole directory. How
    long until its end marker, how much it is, and the loop's longest stall meanwhile (against
    the same ticker on an idle loop)."""
    import zmq

    assert v.publisher is not None
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(v.publisher.replay_endpoint)

    def ask() -> tuple[float, int, int]:
        t0 = time.perf_counter()
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        batches = size = 0
        while True:
            assert dealer.poll(600_000), "no snapshot in 10 minutes"
            _, _topic, _seq, payload = dealer.recv_multipart()
            if not payload:
                return time.perf_counter() - t0, batches, size
            batches += 1
            size += len(payload)

    try:
        _, idle = await longest_stall(asyncio.sleep(1.0))
        (took, batches, size), stall = await longest_stall(asyncio.to_thread(ask))
    finally:
        ctx.destroy(0)
    return {"took": took, "batches": batches, "bytes": size, "stall": stall, "idle": idle}


async def main_async(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kvp-bev-"))
    off, loop, on = (Variant("off", "off", tmp), Variant("loop", "loop", tmp),
                     Variant("on", "on", tmp))
    sub: subprocess.Popen[str] | None = None
    try:
        assert on.events is not None and on.publisher is not None
        await on.publisher.start(on.events.snapshot, lambda: on.events.numbered)  # type: ignore[union-attr]
        if not args.no_subscriber:
            sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, on.publisher.endpoint],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert sub.stdout is not None and sub.stdout.readline().strip() == "ready"
            await asyncio.sleep(0.3)  # its subscription reaches the PUB socket
        variants = (off, loop, on)
        for v in variants:
            capacity, took = await v.fill(args.pages)
            print(f"{v.name:>4}: {capacity:,} pages sealed and kept in {took:.1f} s "
                  f"({capacity / took:,.0f} pages/s)", flush=True)
        gc.collect()
        gc.freeze()  # the directories' millions of objects: out of the collector's way
        for r in range(args.rounds):
            for v in variants[r % 3:] + variants[:r % 3]:  # each goes first in turn
                await v.probe(args.iters)
        print(f"\nprobe: {args.rounds} rounds x {args.iters} steps each (Allocate 1 page: the "
              f"directory evicts one; Seal it; Free: kept), {capacity:,} sealed pages; off: no "
              "events; loop: numbered and encoded on the loop, not sent; on: the publisher "
              "process and a subscriber")
        print(f"{'':>6} {'off p50':>9} {'p99':>9} {'loop p50':>9} {'p99':>9} {'on p50':>9} "
              f"{'p99':>9}  p99 loop/off  on/off")
        ratios = {}
        for what in ("alloc_ns", "free_ns", "seal_ns"):
            a, b, c = getattr(off, what), getattr(loop, what), getattr(on, what)
            ratios[what] = pct(c, 99) / pct(a, 99)
            print(f"{what[:-3]:>6} {pct(a, 50):>7.1f}us {pct(a, 99):>7.1f}us "
                  f"{pct(b, 50):>7.1f}us {pct(b, 99):>7.1f}us {pct(c, 50):>7.1f}us "
                  f"{pct(c, 99):>7.1f}us  {pct(b, 99) / pct(a, 99):>11.3f}x "
                  f"{ratios[what]:>6.3f}x")
        snap = await snapshot_cost(on)
        print(f"\nsnapshot of {capacity:,} sealed pages (a replay from 0): {snap['batches']:,.0f} "
              f"batches, {snap['bytes'] / 2**20:,.1f} MiB, end marker after {snap['took']:.2f} s; "
              f"the loop's longest stall meanwhile {1e3 * snap['stall']:.1f} ms (idle: "
              f"{1e3 * snap['idle']:.1f} ms)")
        before = on.events.numbered
        b = await burst(on, args.burst_s)
        got: list[float] = [0, 0, 0, 0, 0, 0]
        if sub is not None:
            await asyncio.sleep(1.0)  # what is still on its way arrives
            sub.stdin.close()  # type: ignore[union-attr]
            got = [float(x) for x in sub.stdout.readline().split()]  # type: ignore[union-attr]
            sub.wait(30)
        print(f"\nevents/s sustained ({b['cycles']} cycles in {b['loop_s']:.2f} s: Allocate "
              f"{b['pages']:,.0f} evicting as many, Seal them as one-page sequences, Free)")
        print(f"  loop numbered  {b['events'] / b['loop_s']:>12,.0f} events/s "
              f"({b['blocks'] / b['loop_s']:,.0f} blocks/s, {b['batches']:.0f} batches)")
        batches, events, blocks, gaps, _first_at, last_at = got
        if sub is not None:
            took = last_at - b["started"]
            print(f"  subscriber     {b['events'] / took:>12,.0f} events/s decoded (the "
                  f"burst's last batch {took - b['loop_s']:.2f} s after the loop's; "
                  f"dropped {b['dropped']:.0f}; in all {batches:,.0f} batches, "
                  f"{events:,.0f} events, {blocks:,.0f} blocks, {gaps:.0f} gaps, the last "
                  f"seq {before + b['batches'] - 1:,.0f})")
        ok = ratios["alloc_ns"] <= TARGET and ratios["free_ns"] <= TARGET
        print(f"\ntarget Allocate/Free p99 on/off <= {TARGET}x: "
              f"{'met' if ok else 'NOT met'} (Allocate {ratios['alloc_ns']:.3f}x, Free "
              f"{ratios['free_ns']:.3f}x)")
        return 0
    finally:
        if sub is not None and sub.poll() is None:
            sub.kill()
        for v in (off, loop, on):
            await v.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"small settings: {QUICK}")
    parser.add_argument("--pages", type=int, help=f"sealed pages (default {FULL['pages']:,})")
    parser.add_argument("--rounds", type=int, help=f"probe rounds (default {FULL['rounds']})")
    parser.add_argument("--iters", type=int, help=f"steps a round (default {FULL['iters']})")
    parser.add_argument("--no-subscriber", action="store_true",
                        help="publish to no one (the subscriber's process takes a core)")
    parser.add_argument("--burst-s", type=float,
                        help=f"seconds of the events/s burst (default {FULL['burst_s']})")
    args = parser.parse_args()
    base = QUICK if args.quick else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())

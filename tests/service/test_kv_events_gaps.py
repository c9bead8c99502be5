"""The KV events publisher process (``kvpoold.server.kv_publisher``, real ZMQ sockets) under an
in-process daemon: batches the loop drops while the publisher is stopped (SIGSTOP: its queue
fills) are a gap every subscriber sees, and a replay from before it is answered with a snapshot
that puts the subscriber's index right; a replay still buffered is the batches themselves; a
publisher that dies is started again; Drop and shutdown clear the pools.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvpool.contract.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    decode_batch,
    seq_from_bytes,
    seq_to_bytes,
)
from kvpoold.access import DAEMON_CALLER
from kvpoold.server.args import ConfigureArgs, LeaseRef
from kvpoold.server.daemon import Daemon
from kvpoold.server.kv_stream import KvEvents
from kvpoold.settings import KvEventsConfig
from kvpoold.sharing.base import PlainBackingFactory
from tests.conftest import TINY_OPTIONS, TINY_SPEC

zmq = pytest.importorskip("zmq")
from kvpoold.server.kv_process import PublisherProcess  # noqa: E402  (needs pyzmq)

LAYOUT = "test/1 sha256 tp0"
WAIT_MS = 30_000  # a ceiling for a hang only


class Peer:
    """A subscriber's two sockets, used from worker threads (the daemon's loop keeps running)."""

    def __init__(self, ctx: Any, endpoint: str, replay: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(replay)

    async def next(self) -> tuple[int, KVEventBatch]:
        def recv() -> tuple[int, KVEventBatch]:
            assert self.sub.poll(WAIT_MS), "no batch"
            _topic, raw, payload = self.sub.recv_multipart()
            return seq_from_bytes(raw), decode_batch(payload)
        return await asyncio.to_thread(recv)

    async def replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        def ask() -> list[tuple[int, KVEventBatch]]:
            self.dealer.send_multipart((b"", seq_to_bytes(start)))
            out = []
            while True:
                assert self.dealer.poll(WAIT_MS), "no replay"
                _, _topic, raw, payload = self.dealer.recv_multipart()
                if raw == END_SEQ and not payload:
                    return out
                out.append((seq_from_bytes(raw), decode_batch(payload)))
        return await asyncio.to_thread(ask)


def config(tmp: Path, **kw: Any) -> KvEventsConfig:
    return KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp}/pub",
                          replay_endpoint=f"ipc://{tmp}/replay", **kw)


async def seal(d: Daemon, ref: LeaseRef, pool: str, n: int, salt: int) -> list[bytes]:
    """``n`` pages allocated (the directory's oldest give way when the pool is full), sealed
    (one sequence each) and freed (kept by the directory): their keys."""
    ids = d.allocate(DAEMON_CALLER, pool, ref, [("kv", n)])[0][1].ids
    keys = [hashlib.sha256(f"{salt}:{i}".encode()).digest() for i in range(n)]
    tokens = np.zeros(n * TINY_OPTIONS["page_size"], dtype=np.int32)
    assert await d.sealing.seal(DAEMON_CALLER, pool, ref, LAYOUT, ids, b"".join(keys),
                                bytes(32 * n), tokens) == n
    d.free(DAEMON_CALLER, pool, ref, [("kv", ids)])
    return keys


def directory(d: Daemon, pool: str) -> set[bytes]:
    """The blocks ``pool``'s directory holds now: what every router must end up with."""
    sealed = d.pools[pool].sealed
    assert sealed is not None
    return {e.key for e in sealed.entries.values()}


def index(batches: list[tuple[int, KVEventBatch]], into: dict[int, set[bytes]] | None = None
          ) -> dict[int, set[bytes]]:
    """A router's index after applying ``batches`` in order."""
    out = into if into is not None else {}
    for _seq, batch in batches:
        blocks = out.setdefault(batch.data_parallel_rank or 0, set())
        for e in batch.events:
            if isinstance(e, BlockStored):
                blocks |= {bytes(h) for h in e.block_hashes}  # type: ignore[arg-type]
            elif isinstance(e, AllBlocksCleared):
                blocks.clear()
            else:
                blocks -= set(e.block_hashes)  # type: ignore[arg-type]
    return out


async def events_daemon(cfg: KvEventsConfig) -> tuple[Daemon, PublisherProcess, KvEvents]:
    publisher = PublisherProcess(cfg)
    events = KvEvents(cfg, publisher, first_seq=0)
    await publisher.start(events.snapshot, lambda: events.numbered)
    d = Daemon("cpu", 64 << 20, PlainBackingFactory(torch.device("cpu")), kv_events=events)
    return d, publisher, events


async def test_batches_dropped_at_a_full_queue_are_a_gap_a_snapshot_repairs(
        tmp_path: Path) -> None:
    cfg = config(tmp_path, max_queue_size=8)
    d, publisher, events = await events_daemon(cfg)
    ctx = zmq.Context()
    try:
        await d.configure(DAEMON_CALLER, ConfigureArgs("p", spec=dict(TINY_SPEC),
                                                       options=dict(TINY_OPTIONS)))
        lease = d.open_lease(DAEMON_CALLER, "engine", 30.0)
        ref = LeaseRef(lease.lease_id, lease.secret)
        peer = Peer(ctx, cfg.endpoint, str(cfg.replay_endpoint))
        await asyncio.sleep(0.3)  # the subscription reaches the PUB socket
        await seal(d, ref, "p", 2, salt=0)
        seq, first = await peer.next()
        assert seq == 0
        got = index([(seq, first)])
        # the publisher stops reading: its queue fills (the pipe's buffers, then one batch)
        assert publisher.pid is not None
        os.kill(publisher.pid, signal.SIGSTOP)
        try:
            salt = 1
            while events.dropped < 2:
                await seal(d, ref, "p", 1, salt=salt)
                salt += 1
                assert salt < 100_000, "the queue never filled"
        finally:
            os.kill(publisher.pid, signal.SIGCONT)
        sent = events.numbered - events.dropped
        assert d.stats(DAEMON_CALLER).daemon.kv_events_dropped == events.dropped >= 2
        seqs = [seq]
        while len(seqs) < sent:  # what was queued arrives, in order
            s, b = await peer.next()
            assert s > seqs[-1]
            seqs.append(s)
            index([(s, b)], got)
        missing = sorted(set(range(events.numbered)) - set(seqs))
        assert len(missing) == events.dropped  # the gaps show (or will, at the next batch)
        truth = directory(d, "p")
        assert got[0] != truth
        # a replay from the first missing cannot be the batches: a snapshot as of the last
        # number given
        snap = await peer.replay(missing[0])
        assert {s for s, _ in snap} == {events.numbered - 1}
        assert isinstance(snap[0][1].events[0], AllBlocksCleared)
        assert index(snap, got) == {0: truth}
        await seal(d, ref, "p", 1, salt=-1)
        seq, batch = await peer.next()
        while seq < events.numbered - 1:  # an eviction's batch, then the seal's
            seq, batch = await peer.next()
        # a replay still buffered: the batches themselves
        again = await peer.replay(seq)
        assert [(s, b.events) for s, b in again] == [(seq, batch.events)]
        assert d.sealing.sealed(DAEMON_CALLER, "p").events_rank == 0
        # a Drop clears the pool
        dropped = events.dropped
        await d.drop(DAEMON_CALLER, "p", force=True)
        assert events.dropped == dropped
        seq, batch = await peer.next()
        assert seq == events.numbered - 1 and isinstance(batch.events[0], AllBlocksCleared)
    finally:
        d.close()
        await publisher.close()
        ctx.destroy(0)


async def test_a_publisher_that_dies_is_started_again_and_shutdown_clears_every_pool(
        tmp_path: Path) -> None:
    cfg = config(tmp_path)
    d, publisher, events = await events_daemon(cfg)
    ctx = zmq.Context()
    try:
        peer = Peer(ctx, cfg.endpoint, str(cfg.replay_endpoint))
        await asyncio.sleep(0.3)
        for pool in ("a", "b"):
            await d.configure(DAEMON_CALLER, ConfigureArgs(pool, spec=dict(TINY_SPEC),
                                                           options=dict(TINY_OPTIONS)))
        lease = d.open_lease(DAEMON_CALLER, "engine", 30.0)
        ref = LeaseRef(lease.lease_id, lease.secret)
        a = await seal(d, ref, "a", 1, salt=0)
        b = await seal(d, ref, "b", 1, salt=1)
        got = [await peer.next(), await peer.next()]
        assert [b.data_parallel_rank for _, b in got] == [0, 1]  # a rank per pool
        old = publisher.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        while publisher.pid == old or not publisher.endpoint:  # the watchdog: ~1 s
            await asyncio.sleep(0.05)
        b += await seal(d, ref, "b", 1, salt=2)  # to the new publisher (or dropped)
        snap = await peer.replay(0)  # a new publisher: no history, a snapshot
        assert index(snap) == {0: set(a), 1: set(b)}
        assert {s for s, _ in snap} == {events.numbered - 1}
        for salt in range(3, 1000):  # until the subscriber is connected to the new PUB socket
            await seal(d, ref, "b", 1, salt=salt)
            if await asyncio.to_thread(peer.sub.poll, 200):
                break
        while peer.sub.poll(200):
            peer.sub.recv_multipart()
        d.close()
        await publisher.close()  # sends what is queued first
        cleared = [await peer.next(), await peer.next()]
        assert sorted(b.data_parallel_rank or 0 for _, b in cleared) == [0, 1]
        assert all(isinstance(b.events[0], AllBlocksCleared) for _, b in cleared)
    finally:
        d.close()
        await publisher.close()
        ctx.destroy(0)

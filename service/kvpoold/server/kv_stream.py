"""The daemon's KV events, on the event loop: each sealed-page directory's changes, numbered.

Every pool's :class:`~kvpoold.pools.sealed.SealedDirectory` tells its :class:`PoolSink` what it
sealed and what left it (``kvpoold.pools.sealed.DirectorySink``); the sink numbers one batch per
change (at most :data:`BLOCKS_PER_BATCH` blocks) and offers its raw content (keys, parents and
tokens, joined: C-speed) to the publisher process (``kvpoold.server.kv_process``), which builds,
encodes and sends the events. The loop does nothing else for the stream.

Never on the hot path, never unbounded: the queue to the publisher holds ``max_queue_size``
batches; when it is full (the publisher is slow, stopped or restarting), the batch is dropped
here, its number spent, so every subscriber sees the gap; a replay from before a gap is answered
with a snapshot (:meth:`KvEvents.snapshot`: every directory's sealed set as of one sequence
number), never with a stream that skips it.

Identity: one stream serves every pool of the daemon. Each pool has a **rank**, a small number
given in the order pools first sealed a page and kept for the daemon's life (a pool dropped and
built again under the same name keeps its rank): every batch of a pool carries it as vLLM's
``data_parallel_rank``, the field routers (NVIDIA Dynamo's KV router among them) key an
engine's KV cache by. Its topic is the configured ``topic`` with ``{pool}`` replaced by the
pool's name (``"kv@node-1@{pool}"``): a router that reads the topic (llm-d's indexer) or
subscribes to one pool filters by it. See docs/kv-events.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Protocol

import numpy as np

from kvpool.contract.kv_events import MEDIUM_CPU, MEDIUM_GPU
from kvpoold.pools.sealed import Entry, SealedDirectory
from kvpoold.server.kv_messages import (
    CLEARED,
    REMOVED,
    STORED,
    Change,
    Channel,
    Mark,
    SnapshotEnd,
    SnapshotPart,
)
from kvpoold.settings import KvEventsConfig

log = logging.getLogger("kvpoold.events")

# The most blocks one batch carries: a Seal of more (up to 8 MiB a call), an eviction of the
# whole directory, a pool's part of a snapshot, are several batches (one number each, but a
# snapshot's).
BLOCKS_PER_BATCH = 4096
# Dropped batches are logged at most this often (the count is in Stats).
DROP_LOG_INTERVAL_S = 10.0
MARK_RETRY_S = 0.005


class Outbox(Protocol):
    """The publisher's side the loop uses: its endpoints as bound, and its queue."""

    endpoint: str
    replay_endpoint: str  # "" = no replay socket

    def offer(self, msg: Change | Mark) -> bool:
        """Queue a batch (or a mark) now; False when the queue is full (it is dropped)."""

    def deliver(self, msg: SnapshotPart | SnapshotEnd) -> Awaitable[None]:
        """Queue a snapshot message, waiting for room (a snapshot is never cut short)."""


def topic_of(template: str, pool: str) -> bytes:
    """A pool's topic frame: ``template`` with ``{pool}`` replaced by its name."""
    return template.replace("{pool}", pool).encode()


class PoolSink:
    """One directory's :class:`~kvpoold.pools.sealed.DirectorySink`: its changes as numbered
    batches of at most :data:`BLOCKS_PER_BATCH` blocks."""

    def __init__(self, events: KvEvents, channel: Channel) -> None:
        self._events = events
        self.channel = channel

    def stored(self, layout: str, keys: list[bytes], parents: list[bytes],
               tokens: np.ndarray) -> None:
        for a in range(0, len(keys), BLOCKS_PER_BATCH):
            b = a + BLOCKS_PER_BATCH
            self._events.emit(self.channel, STORED, layout, b"".join(keys[a:b]),
                              b"".join(parents[a:b]),
                              np.ascontiguousarray(tokens[a:b], dtype=np.int32).tobytes())

    def removed(self, keys: list[bytes]) -> None:
        for a in range(0, len(keys), BLOCKS_PER_BATCH):
            self._events.emit(self.channel, REMOVED, "", b"".join(keys[a:a + BLOCKS_PER_BATCH]))

    def cleared(self) -> None:
        self._events.emit(self.channel, CLEARED)
        self._events.forget(self.channel.pool)


class KvEvents:
    """The stream's numbering, pools and snapshots; every method on the event loop.

    Args:
        config: the checked ``--kv-events-config``.
        outbox: the publisher's queue.
        clock: seconds since the epoch (each batch's ``ts``).
        first_seq: the first sequence number; default the microseconds since the epoch now,
            so that a daemon started again numbers on from above its predecessor's last batch
            (a router that followed it sees a gap, asks a replay and gets a snapshot of the
            new daemon's directories: docs/kv-events.md).
    """

    def __init__(self, config: KvEventsConfig, outbox: Outbox,
                 clock: Callable[[], float] = time.time, first_seq: int | None = None) -> None:
        self.config = config
        self._outbox = outbox
        self._clock = clock
        self._next_seq = time.time_ns() // 1000 if first_seq is None else first_seq
        self._first_seq = self._next_seq
        self._channels: dict[str, Channel] = {}  # every pool that ever sealed, by name
        self._live: dict[str, SealedDirectory] = {}  # the directories told now
        self.dropped = 0
        self._dropped_logged = -DROP_LOG_INTERVAL_S
        self._snaps = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._marking = False

    @property
    def numbered(self) -> int:
        """Batches numbered so far (offered or dropped): the next sequence number."""
        return self._next_seq

    @property
    def first_seq(self) -> int:
        """The first batch's number."""
        return self._first_seq

    def stats_fields(self) -> dict[str, str | int]:
        """DaemonStats' kv_events fields."""
        return {"kv_events_endpoint": self._outbox.endpoint,
                "kv_events_replay_endpoint": self._outbox.replay_endpoint,
                "kv_events_topic": self.config.topic,
                "kv_events_published": self._next_seq - self._first_seq - self.dropped,
                "kv_events_dropped": self.dropped, "kv_events_last_seq": self._next_seq - 1}

    def attach(self, pool: str, device_type: str, directory: SealedDirectory) -> None:
        """Publish the changes of ``pool``'s new ``directory`` from now on."""
        channel = self._channels.get(pool)
        if channel is None:
            channel = Channel(len(self._channels), topic_of(self.config.topic, pool),
                              MEDIUM_GPU if device_type == "cuda" else MEDIUM_CPU,
                              directory.page_size, pool)
            self._channels[pool] = channel
            log.info("kv events pool", extra={"fields": {
                "event": "kv_events_pool", "pool": pool, "rank": channel.rank,
                "topic": channel.topic.decode()}})
        self._live[pool] = directory
        directory.attach_sink(PoolSink(self, channel))

    def rank_of(self, pool: str) -> int | None:
        """``pool``'s rank on the stream (None: it never sealed a page)."""
        channel = self._channels.get(pool)
        return None if channel is None else channel.rank

    def forget(self, pool: str) -> None:
        """``pool``'s directory is gone (its AllBlocksCleared was numbered)."""
        self._live.pop(pool, None)

    def emit(self, channel: Channel, kind: int, layout: str = "", keys: bytes = b"",
             parents: bytes = b"", tokens: bytes = b"") -> None:
        """Number one batch and offer it, or drop it (its number spent: a gap every
        subscriber sees) when the publisher's queue is full."""
        seq = self._next_seq
        self._next_seq += 1
        if self._outbox.offer(Change(seq, self._clock(), channel, kind, layout, keys, parents,
                                     tokens)):
            return
        self.dropped += 1
        if not self._marking:
            self._marking = True
            self._spawn(self._mark())
        now = time.monotonic()
        if now - self._dropped_logged >= DROP_LOG_INTERVAL_S:
            self._dropped_logged = now
            log.warning("kv events dropped: the publisher's queue is full (a replay from "
                        "before the gap gets a snapshot)", extra={"fields": {
                            "event": "kv_events_dropped", "seq": seq, "dropped": self.dropped,
                            "max_queue_size": self.config.max_queue_size}})

    def snapshot(self) -> None:
        """The publisher asked for a snapshot: every pool's sealed set as of the last number
        given, captured now (a list of references per pool, O(pages) in C), then handed over
        in parts of :data:`BLOCKS_PER_BATCH` pages, the loop serving others between parts."""
        self._snaps += 1
        seq = self._next_seq - 1
        pools = [(channel, d.stored_entries() if (d := self._live.get(name)) is not None
                  else []) for name, channel in self._channels.items()]
        self._spawn(self._hand_over(self._snaps, seq, self._clock(), pools))

    def _spawn(self, work: Coroutine[None, None, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _mark(self) -> None:
        """After a drop: tell the publisher the last number given, as soon as its queue has
        room (so that a replay from after what it received finds the dropped ones missing,
        and answers with a snapshot, even when no batch follows them)."""
        try:
            while not self._outbox.offer(Mark(self._next_seq - 1)):
                await asyncio.sleep(MARK_RETRY_S)
        finally:
            self._marking = False

    async def _hand_over(self, snap: int, seq: int, ts: float,
                         pools: list[tuple[Channel, list[Entry]]]) -> None:
        try:
            for channel, entries in pools:
                for a in range(0, len(entries), BLOCKS_PER_BATCH):
                    await self._outbox.deliver(snapshot_part(snap, channel,
                                                             entries[a:a + BLOCKS_PER_BATCH]))
                    await asyncio.sleep(0)
            await self._outbox.deliver(SnapshotEnd(snap, seq, ts, [c for c, _ in pools]))
        except Exception:
            log.exception("kv events snapshot", extra={"fields": {
                "event": "kv_events_snapshot_error", "seq": seq}})


def snapshot_part(snap: int, channel: Channel, entries: list[Entry]) -> SnapshotPart:
    """Entries as a snapshot part: their pages in runs of one layout."""
    layouts: list[tuple[str, int]] = []
    for e in entries:
        if layouts and layouts[-1][0] == e.layout:
            layouts[-1] = (e.layout, layouts[-1][1] + 1)
        else:
            layouts.append((e.layout, 1))
    return SnapshotPart(snap, channel, layouts, b"".join([e.key for e in entries]),
                        b"".join([e.parent for e in entries]),
                        np.stack([e.tokens for e in entries]).astype(np.int32).tobytes())

"""The daemon's KV events, on the event loop: each sealed-page directory's changes, numbered.

Every pool's :class:`~kvpoold.pools.sealed.SealedDirectory` tells its :class:`PoolSink` what it
sealed and what left it (``kvpoold.pools.sealed.DirectorySink``); the sink hands the publisher
thread (``kvpoold.server.kv_publisher``) a :class:`Change` per batch, numbered here, in the
order of the directory's changes. The loop only numbers and hands over references (O(1) a
batch, O(pages) in C to slice a large one): building, encoding and sending happen in the thread.

Never on the hot path, never unbounded: when the thread's queue holds ``max_queue_size``
batches, the next is dropped here, its number spent, so every subscriber sees the gap; a replay
from before a gap is answered with a snapshot (:meth:`KvEvents.take_snapshot`: every
directory's sealed set as of one sequence number), never with a stream that skips it.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from kvpool.contract.kv_events import MEDIUM_CPU, MEDIUM_GPU
from kvpoold.pools.sealed import Entry, SealedDirectory
from kvpoold.settings import KvEventsConfig

log = logging.getLogger("kvpoold.events")

# The most blocks one batch carries: a Seal of more (up to 8 MiB a call), an eviction of the
# whole directory, a snapshot, are several batches (several sequence numbers, one per batch).
BLOCKS_PER_BATCH = 4096
STORED, REMOVED, CLEARED = 0, 1, 2
# Dropped batches are logged at most this often (the count is in Stats).
DROP_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class Channel:
    """One pool on the stream: its rank (``data_parallel_rank``), topic frame, medium and block
    size."""

    pool: str
    rank: int
    topic: bytes
    medium: str
    block_size: int


class Change(NamedTuple):
    """One batch for the publisher thread: ``seq``, when, whose, what (its pages' keys,
    parents and tokens for STORED; keys for REMOVED; nothing for CLEARED)."""

    seq: int
    ts: float
    channel: Channel
    kind: int
    layout: str
    keys: list[bytes]
    parents: list[bytes]
    tokens: np.ndarray | None


class Snapshot(NamedTuple):
    """Every directory's sealed set as of sequence number ``seq`` (every batch up to it, sent
    or dropped, applied), for the replay clients waiting: each known pool's entries (none for
    a pool dropped since)."""

    seq: int
    ts: float
    pools: list[tuple[Channel, list[Entry]]]


class Outbox(Protocol):
    """The publisher thread's side the loop uses: its queue, and what Stats shows."""

    endpoint: str  # as bound
    replay_endpoint: str  # "" = no replay socket
    published: int  # batches sent

    def put(self, item: Change | Snapshot) -> None: ...

    def backlog(self) -> int: ...

    def start(self, ask_snapshot: Callable[[], None]) -> None: ...


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
            self._events.emit(self.channel, STORED, layout, keys[a:b], parents[a:b],
                              tokens[a:b])

    def removed(self, keys: list[bytes]) -> None:
        for a in range(0, len(keys), BLOCKS_PER_BATCH):
            self._events.emit(self.channel, REMOVED, "", keys[a:a + BLOCKS_PER_BATCH])

    def cleared(self) -> None:
        self._events.emit(self.channel, CLEARED)
        self._events.forget(self.channel.pool)


class KvEvents:
    """The stream's numbering, pools and snapshots; every method on the event loop but
    :meth:`ask_snapshot` (the publisher thread's).

    Args:
        config: the checked ``--kv-events-config``.
        outbox: the publisher thread's queue.
        clock: seconds since the epoch (each batch's ``ts``).
    """

    def __init__(self, config: KvEventsConfig, outbox: Outbox,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._outbox = outbox
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_seq = 0
        self._channels: dict[str, Channel] = {}  # every pool that ever sealed, by name
        self._live: dict[str, SealedDirectory] = {}  # the directories told now
        self.dropped = 0
        self._dropped_logged = 0.0

    def stats_fields(self) -> dict[str, str | int]:
        """DaemonStats' kv_events fields."""
        out = self._outbox
        return {"kv_events_endpoint": out.endpoint,
                "kv_events_replay_endpoint": out.replay_endpoint,
                "kv_events_topic": self.config.topic, "kv_events_published": out.published,
                "kv_events_dropped": self.dropped}

    @property
    def numbered(self) -> int:
        """Batches numbered so far (sent or dropped): the next sequence number."""
        return self._next_seq

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the publisher thread; ``loop`` (this one) takes the snapshots it asks for."""
        self._loop = loop
        self._outbox.start(self.ask_snapshot)

    def attach(self, pool: str, device_type: str, directory: SealedDirectory) -> None:
        """Publish the changes of ``pool``'s new ``directory`` from now on."""
        channel = self._channels.get(pool)
        if channel is None:
            channel = Channel(pool, len(self._channels), topic_of(self.config.topic, pool),
                              MEDIUM_GPU if device_type == "cuda" else MEDIUM_CPU,
                              directory.page_size)
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

    def emit(self, channel: Channel, kind: int, layout: str = "", keys: list[bytes] | None = None,
             parents: list[bytes] | None = None, tokens: np.ndarray | None = None) -> None:
        """Number one batch and hand it to the thread, or drop it (its number spent: a gap
        every subscriber sees) when the thread's queue is full."""
        seq = self._next_seq
        self._next_seq += 1
        if self._outbox.backlog() >= self.config.max_queue_size:
            self.dropped += 1
            now = time.monotonic()
            if now - self._dropped_logged >= DROP_LOG_INTERVAL_S:
                self._dropped_logged = now
                log.warning("kv events dropped: the publisher's queue is full (a replay from "
                            "before the gap gets a snapshot)", extra={"fields": {
                                "event": "kv_events_dropped", "seq": seq,
                                "dropped": self.dropped,
                                "max_queue_size": self.config.max_queue_size}})
            return
        self._outbox.put(Change(seq, self._clock(), channel, kind, layout, keys or [],
                                parents or [], tokens))

    def ask_snapshot(self) -> None:
        """From the publisher thread: a replay client needs a snapshot; taken on the loop."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.take_snapshot)
            except RuntimeError:  # the loop is closed: the daemon is stopping
                pass

    def take_snapshot(self) -> None:
        """Every pool's sealed set now, as of the last number given, to the thread (after the
        batches before it, so it is sent in order). O(pages) in C: references only."""
        pools = [(channel, d.stored_entries() if (d := self._live.get(name)) is not None
                  else []) for name, channel in self._channels.items()]
        self._outbox.put(Snapshot(self._next_seq - 1, self._clock(), pools))

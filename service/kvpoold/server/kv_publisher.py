"""The KV events publisher thread: vLLM 0.32's ZMQ wire, off the event loop.

One thread owns the sockets: a PUB socket (``endpoint``) sending every batch as ``[topic, seq
(8 bytes big-endian), msgpack KVEventBatch]``, and with ``replay_endpoint`` a ROUTER socket
answering replay requests (8 bytes: the first sequence number wanted). The loop hands it
numbered batches (``kvpoold.server.kv_stream.Change``) through an unbounded queue the loop
bounds (``max_queue_size``); it builds the events, encodes them, sends, and keeps the last
``buffer_steps`` encoded batches for replay.

A PUB socket never blocks its sender: a subscriber whose pipe holds ``hwm`` messages misses
the next ones (the gap shows in the sequence numbers), and the daemon goes on. A replay from a
number still buffered, with no gap after it, gets the batches from there exactly as they were
sent; a replay from older (a router that starts late, or one that missed a dropped batch) gets
a **snapshot**: for every pool, ``AllBlocksCleared`` then its sealed set as ``BlockStored``
batches, all numbered with the sequence number the snapshot is as of, then the end marker.
docs/kv-events.md says how a router uses it.

pyzmq is imported here only: ``kvpool[events]``.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import zmq

from kvpool.contract.errors import FailedPrecondition
from kvpool.contract.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    seq_to_bytes,
)
from kvpool.contract.limits import KEY_BYTES
from kvpoold.pools.sealed import Entry
from kvpoold.server.kv_stream import (
    BLOCKS_PER_BATCH,
    REMOVED,
    STORED,
    Change,
    Channel,
    Snapshot,
)
from kvpoold.settings import KvEventsConfig

log = logging.getLogger("kvpoold.events")

NO_PARENT = bytes(KEY_BYTES)
# How long the idle thread waits on its queue before it looks at the replay socket again.
POLL_S = 0.05
# How long shutdown waits for the queue to drain and the sockets to flush.
CLOSE_S = 2.0


def binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds ``endpoint`` (a wildcard host, ``::``, ipc) or connects
    to it (a router's XSUB proxy): the daemon does the same."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")


@functools.lru_cache(maxsize=256)
def lora_of(layout: str) -> tuple[int | None, str | None]:
    """The LoRA adapter a layout names (``lora_id=N``, ``lora_name=S`` among its words,
    docs/kv-events.md); ``(None, None)`` for none."""
    lora_id: int | None = None
    lora_name: str | None = None
    for word in layout.replace(",", " ").replace(";", " ").split():
        key, _, value = word.partition("=")
        if key == "lora_id" and value.isdigit():
            lora_id = int(value)
        elif key == "lora_name" and value:
            lora_name = value
    return lora_id, lora_name


def stored_events(channel: Channel, layout: str, keys: Sequence[bytes],
                  parents: Sequence[bytes], tokens: np.ndarray) -> list[Event]:
    """``BlockStored`` events of pages sealed together: one per run of a hash chain (each
    page's parent the page before it), as vLLM groups a request's new blocks."""
    lora_id, lora_name = lora_of(layout)
    out: list[Event] = []
    start, n = 0, len(keys)
    for i in range(1, n + 1):
        if i < n and parents[i] == keys[i - 1]:
            continue
        parent = parents[start]
        out.append(BlockStored(
            block_hashes=list(keys[start:i]),
            parent_block_hash=None if parent == NO_PARENT else parent,
            token_ids=tokens[start:i].ravel().tolist(), block_size=channel.block_size,
            lora_id=lora_id, medium=channel.medium, lora_name=lora_name))
        start = i
    return out


def snapshot_batches(channel: Channel, entries: list[Entry], ts: float) -> list[KVEventBatch]:
    """A pool's sealed set as batches: ``AllBlocksCleared``, then its pages as ``BlockStored``
    events, at most :data:`BLOCKS_PER_BATCH` blocks a batch."""
    rank = channel.rank
    out = [KVEventBatch(ts=ts, events=[AllBlocksCleared()], data_parallel_rank=rank)]
    for a in range(0, len(entries), BLOCKS_PER_BATCH):
        chunk = entries[a:a + BLOCKS_PER_BATCH]
        events: list[Event] = []
        start = 0
        for i in range(1, len(chunk) + 1):  # runs of one layout
            if i < len(chunk) and chunk[i].layout == chunk[start].layout:
                continue
            run = chunk[start:i]
            events += stored_events(channel, run[0].layout, [e.key for e in run],
                                    [e.parent for e in run], np.stack([e.tokens for e in run]))
            start = i
        out.append(KVEventBatch(ts=ts, events=events, data_parallel_rank=rank))
    return out


class Publisher:
    """The sockets and the thread (started by :meth:`start`, stopped by :meth:`close`).

    Args:
        config: the checked ``--kv-events-config`` (publishing).

    Raises:
        FailedPrecondition: an endpoint cannot be bound (in use, a bad address or path).
    """

    def __init__(self, config: KvEventsConfig) -> None:
        self._config = config
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, int(CLOSE_S * 1000))
            self.endpoint = self._open(self._pub, config.endpoint, "endpoint",
                                       bind=binds(config.endpoint))
            self.replay_endpoint = ""
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A replay is never cut short (a ROUTER drops what exceeds its high-water
                # mark, the end marker with it): what it queues are references to the
                # buffered payloads, shared by every client asking.
                self._replay.setsockopt(zmq.SNDHWM, 0)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._open(self._replay, config.replay_endpoint,
                                                  "replay_endpoint", bind=True)
        except BaseException:
            self._close_sockets()
            raise
        self._queue: queue.SimpleQueue[Change | Snapshot | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self.published = 0  # batches sent
        self.snapshots = 0  # snapshots sent (one per waiting client)
        self.last_seq = -1  # the last number sent
        self._exact_from = 0  # replays from before it need a snapshot (a batch was dropped)
        self._waiting: list[bytes] = []  # replay clients waiting for a snapshot
        self._asked = False
        self._ask_snapshot: Callable[[], None] = lambda: None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def _open(self, sock: zmq.Socket[bytes], endpoint: str, key: str, *, bind: bool) -> str:
        try:
            if not bind:
                sock.connect(endpoint)
                return endpoint
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise FailedPrecondition(
                f"kv_events_config {key} {endpoint!r} cannot be {'bound' if bind else 'used'}: "
                f"{exc}; give a free port or another path", field="kv_events_config") from None
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else str(last)

    # -- the loop's side (kvpoold.server.kv_stream.Outbox) ---------------------------------

    def put(self, item: Change | Snapshot) -> None:
        self._queue.put(item)

    def backlog(self) -> int:
        return self._queue.qsize()

    def start(self, ask_snapshot: Callable[[], None]) -> None:
        """Start the thread; ``ask_snapshot`` (thread-safe) gets a snapshot queued."""
        self._ask_snapshot = ask_snapshot
        self._thread.start()

    def close(self) -> None:
        """Send what is queued (up to :data:`CLOSE_S`), stop the thread, close the sockets."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(CLOSE_S)
            if self._thread.is_alive():
                log.warning("kv events publisher did not stop in time", extra={"fields": {
                    "event": "kv_events_close_timeout", "queued": self._queue.qsize()}})
                return  # its sockets are the thread's still; the process is exiting
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._ctx.term()

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                while self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                if isinstance(item, Snapshot):
                    self._send_snapshot(item)
                else:
                    self._publish(item)
            except Exception:
                log.exception("kv events publisher", extra={"fields": {
                    "event": "kv_events_error"}})

    def _publish(self, change: Change) -> None:
        channel = change.channel
        if change.kind == STORED:
            assert change.tokens is not None
            events = stored_events(channel, change.layout, change.keys, change.parents,
                                   change.tokens)
        elif change.kind == REMOVED:
            events = [BlockRemoved(block_hashes=change.keys, medium=channel.medium)]
        else:
            events = [AllBlocksCleared()]
        payload = self._encoder.encode(KVEventBatch(ts=change.ts, events=events,
                                                    data_parallel_rank=channel.rank))
        seq = change.seq
        if seq != self.last_seq + 1:  # batches were dropped before it: replay cannot bridge
            self._exact_from = seq
        self._pub.send_multipart((channel.topic, seq_to_bytes(seq), payload), copy=False)
        self._buffer.append((seq, channel.topic, payload))
        self.last_seq = seq
        self.published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a replay request is not [identity, b'', 8-byte seq]",
                        extra={"fields": {"event": "kv_events_bad_replay",
                                          "frames": len(frames)}})
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        first = self._buffer[0][0] if self._buffer else self.last_seq + 1
        if start > self.last_seq or start >= max(first, self._exact_from):
            for seq, topic, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((client, b"", topic, seq_to_bytes(seq), payload),
                                                copy=False)
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
            return
        self._waiting.append(client)  # answered by the next snapshot, in order
        if not self._asked:
            self._asked = True
            self._ask_snapshot()

    def _send_snapshot(self, snap: Snapshot) -> None:
        clients, self._waiting, self._asked = self._waiting, [], False
        if self._replay is None or not clients:
            return
        seq = seq_to_bytes(max(snap.seq, 0))
        for channel, entries in snap.pools:
            for batch in snapshot_batches(channel, entries, snap.ts):
                payload = self._encoder.encode(batch)
                for client in clients:
                    self._replay.send_multipart((client, b"", channel.topic, seq, payload),
                                                copy=False)
        for client in clients:
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        self.snapshots += len(clients)
        log.info("kv events snapshot sent", extra={"fields": {
            "event": "kv_events_snapshot", "seq": snap.seq, "clients": len(clients),
            "pages": sum(len(e) for _, e in snap.pools)}})

"""The KV events publisher: a process of its own, vLLM 0.32's ZMQ wire (docs/kv-events.md).

``kvpoold serve --kv-events-config`` starts it (``kvpoold.server.kv_process``) and hands it
every numbered batch's raw content (``kvpoold.server.kv_messages``); all the work of the stream
is here, in another interpreter, so none of it competes with the daemon's event loop for its
GIL (a thread did: the loop's Free p99 rose 2-5x on 2 cores while it encoded). Its sockets:

- PUB (``endpoint``): each batch as ``[topic, seq (8 bytes big-endian), msgpack
  KVEventBatch]``. A PUB socket never blocks: a subscriber whose pipe holds ``hwm`` messages
  misses the next ones, and sees the gap in the sequence numbers.
- ROUTER (``replay_endpoint``): a request (8 bytes: the first sequence number wanted) is
  answered with the buffered batches from there (the last ``buffer_steps``), exactly as sent,
  then vLLM's end marker; when they are gone, or a batch in between was dropped (the daemon's
  queue to this process was full), with a **snapshot**: for every pool, ``AllBlocksCleared``
  then its sealed set as ``BlockStored`` batches, all numbered with the sequence number the
  snapshot is as of, then the end marker. The snapshot is taken by the daemon when asked.

It exits when told, or when the daemon is gone.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import Sequence

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
from kvpoold.server.kv_messages import (
    REMOVED,
    STORED,
    Change,
    Channel,
    Down,
    Failed,
    Mark,
    NeedSnapshot,
    Ready,
    SnapshotEnd,
    SnapshotPart,
    Stop,
    Up,
    split_keys,
)
from kvpoold.server.logs import configure_logging
from kvpoold.settings import KvEventsConfig, LogFormat, LogLevel

log = logging.getLogger("kvpoold.events")

NO_PARENT = bytes(KEY_BYTES)
# How long shutdown lets the PUB socket flush what it holds.
LINGER_MS = 2000
# The poll's longest wait: how soon it notices the daemon is gone.
POLL_MS = 1000
# Publishing is background work: on a busy host the daemon's event loop gets the CPU first (a
# publisher that falls behind fills its queue: batches dropped, gaps a replay repairs).
NICE = 10


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
    page's parent the page before it), as vLLM groups a request's new blocks; ``tokens`` one
    row a page."""
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


def pages_of(channel: Channel, layouts: list[tuple[str, int]], keys: bytes, parents: bytes,
             tokens: bytes) -> list[Event]:
    """The ``BlockStored`` events of raw pages in runs of one layout."""
    k, p = split_keys(keys), split_keys(parents)
    rows = np.frombuffer(tokens, dtype=np.int32).reshape(len(k), -1) if k else None
    out: list[Event] = []
    start = 0
    for layout, count in layouts:
        assert rows is not None
        out += stored_events(channel, layout, k[start:start + count], p[start:start + count],
                             rows[start:start + count])
        start += count
    return out


class Publisher:
    """The sockets, the replay buffer and the snapshot being assembled.

    Args:
        config: the checked ``--kv-events-config`` (publishing).
        ctx: the zmq context.

    Raises:
        FailedPrecondition: an endpoint cannot be bound (in use, a bad address or path).
    """

    def __init__(self, config: KvEventsConfig, ctx: zmq.Context[zmq.Socket[bytes]],
                 first_seq: int = 0) -> None:
        self._pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, LINGER_MS)
        self.replay: zmq.Socket[bytes] | None = None
        self.endpoint = self._open(self._pub, config.endpoint, "endpoint",
                                   bind=binds(config.endpoint))
        self.replay_endpoint = ""
        if config.replay_endpoint is not None:
            self.replay = ctx.socket(zmq.ROUTER)
            # A replay is never cut short (a ROUTER drops what exceeds its high-water mark,
            # the end marker with it): what it queues are the buffered payloads, shared.
            self.replay.setsockopt(zmq.SNDHWM, 0)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._open(self.replay, config.replay_endpoint,
                                              "replay_endpoint", bind=True)
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self.published = 0
        # the last number sent or known dropped: a publisher started again after batches
        # were numbered (``first_seq``) has none of them: a replay from before needs a snapshot
        self.last_seq = first_seq - 1
        self._exact_from = first_seq  # replays from before it need a snapshot
        self._waiting: list[bytes] = []  # replay clients waiting for the snapshot asked
        self._asked = False
        self._parts: dict[int, list[SnapshotPart]] = {}  # the snapshot coming, by rank

    @staticmethod
    def _open(sock: zmq.Socket[bytes], endpoint: str, key: str, *, bind: bool) -> str:
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

    def close(self) -> None:
        self._pub.close()  # lingers while it sends what it holds
        if self.replay is not None:
            self.replay.close()

    # -- the stream ------------------------------------------------------------------------

    def publish(self, change: Change) -> None:
        channel = change.channel
        if change.kind == STORED:
            keys = split_keys(change.keys)
            rows = np.frombuffer(change.tokens, dtype=np.int32).reshape(len(keys), -1)
            events = stored_events(channel, change.layout, keys, split_keys(change.parents),
                                   rows)
        elif change.kind == REMOVED:
            events = [BlockRemoved(block_hashes=list(split_keys(change.keys)),
                                   medium=channel.medium)]
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

    def mark(self, mark: Mark) -> None:
        """Batches up to ``mark.seq`` not received were dropped: replays across them need a
        snapshot, and a replay from after the last one received finds them missing."""
        if mark.seq > self.last_seq:
            self.last_seq = mark.seq
            self._exact_from = mark.seq + 1

    # -- replay ----------------------------------------------------------------------------

    def serve_replay(self, push: zmq.Socket[bytes]) -> None:
        """Answer one replay request: the buffered batches, or (asked of the daemon) a
        snapshot."""
        assert self.replay is not None
        frames = self.replay.recv_multipart()
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
                    self.replay.send_multipart((client, b"", topic, seq_to_bytes(seq), payload),
                                               copy=False)
            self.replay.send_multipart((client, b"", b"", END_SEQ, b""))
            return
        self._waiting.append(client)  # answered by the snapshot asked (one for all waiting)
        if not self._asked:
            self._asked = True
            push.send(msgspec.msgpack.encode(NeedSnapshot()))

    def snapshot_part(self, part: SnapshotPart) -> None:
        self._parts.setdefault(part.channel.rank, []).append(part)

    def snapshot_end(self, end: SnapshotEnd) -> None:
        """Send the snapshot to every client waiting: per pool AllBlocksCleared, then its
        pages (a batch per part), all numbered ``end.seq``; then the end marker."""
        parts, self._parts = self._parts, {}
        clients, self._waiting, self._asked = self._waiting, [], False
        if self.replay is None or not clients:
            return
        seq = seq_to_bytes(max(end.seq, 0))
        pages = 0
        for channel in end.channels:
            batches = [KVEventBatch(ts=end.ts, events=[AllBlocksCleared()],
                                    data_parallel_rank=channel.rank)]
            for part in parts.get(channel.rank, []):
                batches.append(KVEventBatch(
                    ts=end.ts, data_parallel_rank=channel.rank,
                    events=pages_of(channel, part.layouts, part.keys, part.parents,
                                    part.tokens)))
                pages += len(part.keys) // KEY_BYTES
            for batch in batches:
                payload = self._encoder.encode(batch)
                for client in clients:
                    self.replay.send_multipart((client, b"", channel.topic, seq, payload),
                                               copy=False)
        for client in clients:
            self.replay.send_multipart((client, b"", b"", END_SEQ, b""))
        log.info("kv events snapshot sent", extra={"fields": {
            "event": "kv_events_snapshot", "seq": end.seq, "clients": len(clients),
            "pages": pages}})

    # -- the process's loop ----------------------------------------------------------------

    def run(self, pull: zmq.Socket[bytes], push: zmq.Socket[bytes], parent: int) -> None:
        """Serve until told to stop, or until the daemon (``parent``) is gone."""
        decoder = msgspec.msgpack.Decoder(Down)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(POLL_MS))
            if not ready and os.getppid() != parent:
                log.warning("kv events publisher: the daemon is gone; exiting",
                            extra={"fields": {"event": "kv_events_orphan"}})
                return
            while self.replay is not None and self.replay.poll(0):
                self.serve_replay(push)
            while pull.poll(0):
                msg = decoder.decode(pull.recv())
                if isinstance(msg, Change):
                    self.publish(msg)
                elif isinstance(msg, SnapshotPart):
                    self.snapshot_part(msg)
                elif isinstance(msg, SnapshotEnd):
                    self.snapshot_end(msg)
                elif isinstance(msg, Mark):
                    self.mark(msg)
                else:
                    assert isinstance(msg, Stop)
                    return


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvpoold.server.kv_publisher CONFIG UP DOWN LEVEL FORMAT FIRST_SEQ``: what
    ``kvpoold.server.kv_process`` runs."""
    parser = argparse.ArgumentParser(prog="kvpoold-events")
    parser.add_argument("config", help="the --kv-events-config, as JSON")
    parser.add_argument("up", help="where to tell the daemon (its PULL)")
    parser.add_argument("down", help="where the daemon's batches come from (its PUSH)")
    parser.add_argument("level")
    parser.add_argument("format")
    parser.add_argument("first_seq", type=int, help="the next number the daemon gives")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon; it stops us
    os.nice(NICE)
    level: LogLevel = args.level
    fmt: LogFormat = args.format
    configure_logging(level, fmt)
    config = msgspec.json.decode(args.config, type=KvEventsConfig)
    parent = os.getppid()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, LINGER_MS)
    push.connect(args.up)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.connect(args.down)
    try:
        publisher = Publisher(config, ctx, args.first_seq)
    except FailedPrecondition as exc:
        push.send(msgspec.msgpack.encode(Failed(str(exc))))
        push.close()
        ctx.term()
        return 1
    hello: Up = Ready(publisher.endpoint, publisher.replay_endpoint)
    push.send(msgspec.msgpack.encode(hello))
    try:
        publisher.run(pull, push, parent)
    finally:
        publisher.close()
        pull.close()
        push.close(0)
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())

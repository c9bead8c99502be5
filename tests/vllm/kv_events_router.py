"""A KV-aware router's index, fed by kvpool's KV events and decoded by vLLM's own types.

Run with the vLLM side venv's python (tests/e2e/test_kv_events.py starts it). It does what
docs/kv-events.md tells a router to do, with nothing of kvpool imported: SUB to the stream,
DEALER to the replay socket, ``vllm.distributed.kv_events.KVEventBatch`` to decode. It applies
each batch to a set of block hashes per ``data_parallel_rank``; a sequence gap is repaired by a
replay from the first missing number (every batch the replay returns is applied, in order: the
buffered batches, numbered on from the number asked, or a snapshot, which replaces the whole
index: batches numbered alike, or not from the number asked); ``since`` replays first (a
router that starts late); after a second without a batch it asks a replay from its last + 1
(what it missed at the end of a burst shows at no next batch).

Arguments: ENDPOINT REPLAY_ENDPOINT. JSON lines on stdin, answers on stdout:

- ``{"op": "start", "since": null | N, "rcvhwm": N}``: connect and follow (answers
  ``{"started": true}`` once subscribed and, with ``since``, replayed);
- ``{"op": "pause"}`` / ``{"op": "resume"}``: stop reading the SUB socket (a slow subscriber);
- ``{"op": "state", "until": N}``: once the last batch applied is N or later: the sets, the
  last number, gaps and replays;
- ``{"op": "log"}``: every event applied so far, decoded;
- ``{"op": "quit"}``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
IDLE_SYNC_S = 1.0  # a replay from the last batch + 1 after this long without one


def send(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def hexed(h: bytes | int | None) -> str | int | None:
    return h.hex() if isinstance(h, bytes) else h


class Router:
    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.endpoint = endpoint
        self.replay_endpoint = replay
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.sets: dict[int, set[str]] = {}
        self.log: list[dict[str, object]] = []
        self.last = -1
        self.gaps = 0
        self.replays = 0
        self.replayed = 0  # batches a replay gave
        self.snapshots = 0
        self.lock = threading.Lock()
        self.paused = threading.Event()
        self.stop = threading.Event()
        self.started = threading.Event()

    def apply(self, seq: int, topic: bytes, batch: KVEventBatch) -> None:
        rank = batch.data_parallel_rank
        assert rank is not None
        blocks = self.sets.setdefault(rank, set())
        for e in batch.events:
            entry: dict[str, object] = {"seq": seq, "rank": rank, "topic": topic.decode(),
                                        "type": type(e).__name__, "ts": batch.ts}
            if isinstance(e, BlockStored):
                blocks.update(hexed(h) for h in e.block_hashes)  # type: ignore[misc]
                entry.update(hashes=[hexed(h) for h in e.block_hashes],
                             parent=hexed(e.parent_block_hash), token_ids=e.token_ids,
                             block_size=e.block_size, lora_id=e.lora_id, medium=e.medium,
                             lora_name=e.lora_name)
            elif isinstance(e, BlockRemoved):
                blocks.difference_update(hexed(h) for h in e.block_hashes)  # type: ignore[misc]
                entry.update(hashes=[hexed(h) for h in e.block_hashes], medium=e.medium)
            else:
                assert isinstance(e, AllBlocksCleared)
                blocks.clear()
            self.log.append(entry)

    def replay(self, dealer: zmq.Socket, start: int) -> None:
        """Every batch from ``start`` (or a snapshot), applied in order, then the end marker."""
        self.replays += 1
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        reply: list[tuple[int, bytes, KVEventBatch]] = []
        while True:
            if not dealer.poll(30_000):
                raise RuntimeError(f"replay from {start}: no answer in 30 s")
            _, topic, raw, payload = dealer.recv_multipart()
            if raw == END_SEQ and not payload:
                break
            seq = int.from_bytes(raw, "big", signed=True)
            if reply and seq < reply[-1][0]:
                raise RuntimeError(f"replay from {start} sent {seq} after {reply[-1][0]}")
            reply.append((seq, topic, self.decoder.decode(payload)))
        seqs = [seq for seq, _, _ in reply]
        # the buffered batches are numbered start, start + 1, ...; a snapshot's all alike
        snapshot = bool(reply) and seqs != list(range(start, start + len(seqs)))
        with self.lock:
            if snapshot:  # the whole index, as of its number
                self.snapshots += 1
                self.sets.clear()
            for seq, topic, batch in reply:
                self.apply(seq, topic, batch)
                self.last = max(self.last, seq)
            self.replayed += len(reply)

    def run(self, since: int | None, rcvhwm: int) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        time.sleep(0.5)  # the subscription reaches the publisher (a miss is a gap, repaired)
        if since is not None:
            self.replay(dealer, since)
        self.started.set()
        idle = time.monotonic()
        while not self.stop.is_set():
            if self.paused.is_set():
                time.sleep(0.01)
                continue
            if not sub.poll(50):
                # what was missed at the end shows at no next batch: ask now and then
                if self.last >= 0 and time.monotonic() - idle >= IDLE_SYNC_S:
                    self.replay(dealer, self.last + 1)
                    idle = time.monotonic()
                continue
            idle = time.monotonic()
            topic, raw, payload = sub.recv_multipart()
            seq = int.from_bytes(raw, "big")
            if seq <= self.last:
                continue
            if self.last >= 0 and seq > self.last + 1:
                self.gaps += 1
                self.replay(dealer, self.last + 1)
                if seq <= self.last:
                    continue
            batch = self.decoder.decode(payload)
            with self.lock:
                self.apply(seq, topic, batch)
                self.last = seq
        sub.close(0)
        dealer.close(0)

    def state(self) -> dict[str, object]:
        with self.lock:
            return {"last": self.last, "gaps": self.gaps, "replays": self.replays,
                    "replayed": self.replayed,
                    "snapshots": self.snapshots,
                    "sets": {str(r): sorted(s) for r, s in self.sets.items()}}


def main() -> None:
    router = Router(sys.argv[1], sys.argv[2])
    thread: threading.Thread | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "start":
            thread = threading.Thread(target=router.run, args=(cmd.get("since"),
                                                               cmd.get("rcvhwm", 1000)),
                                      daemon=True)
            thread.start()
            while not router.started.wait(0.1):
                if not thread.is_alive():
                    raise RuntimeError("the router thread died")
            send({"started": True})
        elif op == "pause":
            router.paused.set()
            send({"paused": True})
        elif op == "resume":
            router.paused.clear()
            send({"resumed": True})
        elif op == "state":
            deadline = time.monotonic() + cmd.get("timeout_s", 120)
            while router.last < cmd.get("until", -1) and time.monotonic() < deadline:
                if thread is not None and not thread.is_alive():
                    raise RuntimeError("the router thread died")
                time.sleep(0.02)
            send(router.state())
        elif op == "log":
            with router.lock:
                send(router.log)
        elif op == "quit":
            router.stop.set()
            if thread is not None:
                thread.join(10)
            send({"bye": True})
            return


if __name__ == "__main__":
    main()

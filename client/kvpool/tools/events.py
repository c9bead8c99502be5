"""``kvpool events``: tail a daemon's KV events stream (docs/kv-events.md).

The daemon's Stats name its PUB and replay endpoints; this subscribes (SUB), prints each batch
as lines of text or JSON, and, like a router, repairs a gap in the sequence numbers by a replay
(when the daemon has a replay endpoint). ``--since 0`` first prints a snapshot of every pool's
sealed blocks (the directory now); ``--since N`` the buffered batches from N. Any publisher in
vLLM's format can be tailed with ``--endpoint`` (a vLLM engine's own ``kv_events_config``
stream too).
pyzmq is needed (``kvpool[events]``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from kvpool.clients.targets import channel_target, default_target, is_unix
from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.kv_events import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    seq_from_bytes,
    seq_to_bytes,
)
from kvpool.tools.cli_common import client_from

NEED_PYZMQ = ("kvpool events needs pyzmq: pip install -e '.[events]' from the repository root "
              "(or the wheel's [events] extra)")
# How long a replay may stay silent before it is given up (the daemon answers at once).
REPLAY_TIMEOUT_S = 10.0
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")
# After this long without a batch, a replay from the last one + 1 (nothing when nothing is
# missing): what a subscriber missed at the end of a burst shows at no next batch.
IDLE_SYNC_S = 1.0


def add_events(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "events", parents=[common], help="tail the KV events stream",
        description="Tail the daemon's KV events (BlockStored, BlockRemoved, AllBlocksCleared of "
                    "its sealed-page directories, in vLLM's ZMQ format; docs/kv-events.md). The "
                    "endpoints come from the daemon's Stats unless --endpoint is given. A gap in "
                    "the sequence numbers is repaired by a replay. Ctrl-C stops.")
    p.set_defaults(func=run_events)
    p.add_argument("--endpoint", metavar="EP",
                   help="subscribe here instead of asking the daemon (tcp://host:port, "
                        "ipc:///path): any publisher in vLLM's format")
    p.add_argument("--replay-endpoint", metavar="EP",
                   help="with --endpoint: its replay (ROUTER) endpoint, for --since and gaps")
    p.add_argument("--topic", default="", help="only topics that start with this (default all)")
    p.add_argument("--since", type=int, default=None, metavar="SEQ",
                   help="first replay from SEQ (the buffered batches from there; when they are "
                        "gone, and from 0, a snapshot: every pool's sealed blocks now), then "
                        "follow")
    p.add_argument("--count", type=int, default=None, metavar="N",
                   help="exit after N batches (replayed ones included)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per batch: seq, topic, pool, rank, ts, events (hashes "
                        "in hex)")
    return p


def connectable(endpoint: str, target: str) -> str:
    """A bound endpoint as a subscriber reaches it: a wildcard host becomes the daemon's host
    (127.0.0.1 over a Unix socket)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host in WILDCARD_HOSTS:
        addr = channel_target(target)
        host = "127.0.0.1" if is_unix(addr) else addr.rpartition(":")[0]
    return f"tcp://{host}:{port}"


def _endpoints(args: argparse.Namespace) -> tuple[str, str, Names]:
    """``(endpoint, replay_endpoint, pool names)``: the flags', or the daemon's."""
    if args.endpoint:
        return args.endpoint, args.replay_endpoint or "", Names(None)
    if args.replay_endpoint:
        raise InvalidArgument("--replay-endpoint goes with --endpoint", field="replay_endpoint")
    target = args.target or default_target()
    with client_from(args) as client:
        daemon = client.stats().daemon
        if not daemon.kv_events_endpoint:
            raise FailedPrecondition(
                f"the daemon at {target} publishes no KV events: start it with "
                "--kv-events-config '{\"enable_kv_cache_events\": true, \"replay_endpoint\": "
                "\"tcp://*:5558\"}' (docs/kv-events.md), or give --endpoint")
    names = Names(args)
    replay = daemon.kv_events_replay_endpoint
    return (connectable(daemon.kv_events_endpoint, target),
            connectable(replay, target) if replay else "", names)


class Names:
    """The pools' names by rank, asked of the daemon (Stats: each pool's sealed directory
    names its rank) at the first batch of a rank not known yet, at most once a second."""

    def __init__(self, args: argparse.Namespace | None) -> None:
        self._args = args
        self._names: dict[int, str] = {}
        self._asked = -1.0

    def get(self, rank: int | None) -> str | None:
        if rank is None:
            return None
        if rank not in self._names and self._args is not None \
                and time.monotonic() - self._asked >= 1.0:
            self._asked = time.monotonic()
            with client_from(self._args) as client:
                for pool in client.stats().pools:
                    if pool.sealed is not None and pool.sealed.events_rank is not None:
                        self._names[pool.sealed.events_rank] = pool.name
        return self._names.get(rank)


def run_events(args: argparse.Namespace) -> int:
    try:
        import zmq
    except ModuleNotFoundError:
        raise FailedPrecondition(NEED_PYZMQ) from None
    if args.count is not None and args.count < 1:
        raise InvalidArgument(f"--count {args.count}: give 1 or more", field="count")
    if args.since is not None and args.since < 0:
        raise InvalidArgument(f"--since {args.since}: give 0 or more", field="since")
    endpoint, replay, names = _endpoints(args)
    ctx = zmq.Context()
    try:
        tail = Tail(ctx, endpoint, replay, args.topic)
        for shown, (seq, topic, batch) in enumerate(tail.batches(args.since), 1):
            print_batch(seq, topic, batch, names, as_json=args.json)
            if args.count is not None and shown >= args.count:
                break
    finally:
        ctx.destroy(linger=0)
    return 0


class Tail:
    """A subscriber that repairs its gaps: SUB for the stream, a DEALER for replays.

    Args:
        ctx: the zmq context.
        endpoint: the PUB endpoint.
        replay: the ROUTER endpoint ("" = none: gaps are reported, not repaired).
        topic: the subscription prefix.
    """

    def __init__(self, ctx: Any, endpoint: str, replay: str, topic: str) -> None:
        import zmq

        self._zmq = zmq
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay = None
        if replay:
            self._replay = ctx.socket(zmq.DEALER)
            self._replay.connect(replay)
        self._topic = topic.encode()
        self.last = -1  # the last sequence number applied
        self.gaps = 0

    def batches(self, since: int | None) -> Iterator[tuple[int, bytes, KVEventBatch]]:
        """``(seq, topic, batch)`` in order, forever: first the replay from ``since``, then
        the stream; a gap is filled by a replay (or reported on stderr without one), and so
        is a loss found by the replay asked after :data:`IDLE_SYNC_S` without a batch."""
        if since is not None:
            self._wait_subscribed()
            yield from self._replayed(since)
        while True:
            if not self._sub.poll(int(IDLE_SYNC_S * 1000)):
                # a loss at the end of a burst shows at no next batch: ask now and then
                if self._replay is not None and self.last >= 0:
                    yield from self._replayed(self.last + 1)
                continue
            topic, raw, payload = self._sub.recv_multipart()
            seq = seq_from_bytes(raw)
            if seq <= self.last:
                continue  # a replay gave it already
            if self.last >= 0 and seq > self.last + 1:
                self.gaps += 1
                if self._replay is None:
                    print(f"kvpool events: missed {seq - self.last - 1} batches "
                          f"({self.last + 1}..{seq - 1}); no replay endpoint to repair it",
                          file=sys.stderr)
                else:
                    yield from self._replayed(self.last + 1)
                    if seq <= self.last:
                        continue
            self.last = seq
            yield seq, topic, decode_batch(payload)

    def _wait_subscribed(self) -> None:
        """Give the SUB socket's subscription time to reach the publisher, so that nothing
        published after the replay's end is missed (slow joiner: a PUB drops what it sends
        before it knows the subscriber). A gap would be repaired anyway."""
        time.sleep(0.2)

    def _replayed(self, start: int) -> Iterator[tuple[int, bytes, KVEventBatch]]:
        """A replay from ``start``: the daemon's buffered batches, or its snapshot (all at
        the snapshot's number), then the end marker."""
        if self._replay is None:
            print("kvpool events: --since needs a replay endpoint (the daemon's "
                  "replay_endpoint, or --replay-endpoint)", file=sys.stderr)
            return
        self._replay.send_multipart((b"", seq_to_bytes(start)))
        while True:
            if not self._replay.poll(int(REPLAY_TIMEOUT_S * 1000)):
                print(f"kvpool events: the replay from {start} went silent for "
                      f"{REPLAY_TIMEOUT_S:g} s; following the stream", file=sys.stderr)
                return
            frames = self._replay.recv_multipart()
            _, topic, raw, payload = frames
            if raw == END_SEQ and not payload:
                return
            seq = seq_from_bytes(raw)
            if not topic.startswith(self._topic):
                self.last = max(self.last, seq)
                continue
            self.last = max(self.last, seq)
            yield seq, topic, decode_batch(payload)


def _hex(value: bytes | int | None) -> str | int | None:
    return value.hex() if isinstance(value, bytes) else value


def batch_json(seq: int, topic: bytes, batch: KVEventBatch, pool: str | None) -> dict[str, Any]:
    """A batch as JSON builtins: the events as vLLM's fields, hashes in hex."""
    events = []
    for e in batch.events:
        d = msgspec.to_builtins(e)
        if isinstance(e, BlockStored | BlockRemoved):
            d["block_hashes"] = [_hex(h) for h in e.block_hashes]
        if isinstance(e, BlockStored):
            d["parent_block_hash"] = _hex(e.parent_block_hash)
        events.append(d)
    return {"seq": seq, "topic": topic.decode(errors="replace"), "pool": pool,
            "rank": batch.data_parallel_rank, "ts": batch.ts, "events": events}


def print_batch(seq: int, topic: bytes, batch: KVEventBatch, names: Names, *,
                as_json: bool) -> None:
    rank = batch.data_parallel_rank
    pool = names.get(rank)
    if as_json:
        sys.stdout.write(msgspec.json.encode(batch_json(seq, topic, batch, pool)).decode() + "\n")
        sys.stdout.flush()
        return
    who = f"pool {pool} (rank {rank})" if pool else f"rank {rank}"
    when = time.strftime("%H:%M:%S", time.localtime(batch.ts))
    head = f"#{seq} {when} {who}" + (f" topic {topic.decode(errors='replace')}" if topic else "")
    for e in batch.events:
        if isinstance(e, BlockStored):
            parent = _short(e.parent_block_hash) if e.parent_block_hash is not None else "-"
            print(f"{head}: stored {len(e.block_hashes)} blocks {_hashes(e.block_hashes)} "
                  f"after {parent}, {len(e.token_ids)} tokens, block {e.block_size}, "
                  f"{e.medium}" + (f", lora {e.lora_name or e.lora_id}"
                                   if e.lora_id is not None or e.lora_name else ""))
        elif isinstance(e, BlockRemoved):
            print(f"{head}: removed {len(e.block_hashes)} blocks {_hashes(e.block_hashes)}, "
                  f"{e.medium}")
        else:
            print(f"{head}: all blocks cleared")
    sys.stdout.flush()


def _short(h: bytes | int) -> str:
    return h.hex()[:12] if isinstance(h, bytes) else str(h)


def _hashes(hashes: list[bytes | int], most: int = 3) -> str:
    shown = ", ".join(_short(h) for h in hashes[:most])
    return f"[{shown}{', ...' if len(hashes) > most else ''}]"

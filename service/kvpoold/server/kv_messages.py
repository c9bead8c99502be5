"""What the daemon and its KV events publisher process say to each other (msgpack, tagged).

Down (daemon -> publisher, in the order of the directories' changes): each numbered batch's raw
content (:class:`Change`: the pages' keys, parents and tokens as the directory has them; the
publisher builds and encodes the events), the last number given after batches were dropped
(:class:`Mark`), the parts of a snapshot and its end, and the stop.
Up (publisher -> daemon): ready (its endpoints as bound) or failed, and "a replay client needs
a snapshot". Neither side imports torch: the publisher starts in a fraction of a second.
"""

from __future__ import annotations

import msgspec

from kvpool.contract.limits import KEY_BYTES


class Channel(msgspec.Struct, frozen=True, array_like=True):
    """One pool on the stream: its rank (``data_parallel_rank``), topic frame, medium, block
    size and name."""

    rank: int
    topic: bytes
    medium: str
    block_size: int
    pool: str


class Change(msgspec.Struct, array_like=True, tag=1):
    """One batch: STORED (keys, parents: 32 bytes a page, joined; tokens: int32 bytes, one
    row a page), REMOVED (keys) or CLEARED."""

    seq: int
    ts: float
    channel: Channel
    kind: int
    layout: str = ""
    keys: bytes = b""
    parents: bytes = b""
    tokens: bytes = b""


class SnapshotPart(msgspec.Struct, array_like=True, tag=2):
    """Part of one pool's sealed set for snapshot ``snap``: its pages in runs of one layout
    (``layouts``: (layout, pages) in order), keys, parents and tokens as in :class:`Change`."""

    snap: int
    channel: Channel
    layouts: list[tuple[str, int]]
    keys: bytes
    parents: bytes
    tokens: bytes


class SnapshotEnd(msgspec.Struct, array_like=True, tag=3):
    """Snapshot ``snap`` is complete: every batch up to ``seq`` applied; ``channels`` are every
    pool ever on the stream (each starts with AllBlocksCleared)."""

    snap: int
    seq: int
    ts: float
    channels: list[Channel]


class Stop(msgspec.Struct, array_like=True, tag=4):
    """Send what is queued, then exit."""


class Mark(msgspec.Struct, array_like=True, tag=5):
    """Every batch up to ``seq`` was numbered: those not received before this were dropped
    (sent once the queue has room again after a drop)."""

    seq: int


class Ready(msgspec.Struct, array_like=True, tag=11):
    endpoint: str
    replay_endpoint: str


class Failed(msgspec.Struct, array_like=True, tag=12):
    message: str


class NeedSnapshot(msgspec.Struct, array_like=True, tag=13):
    """A replay client asked for batches the publisher no longer has (or never had)."""


Down = Change | SnapshotPart | SnapshotEnd | Stop | Mark
Up = Ready | Failed | NeedSnapshot

STORED, REMOVED, CLEARED = 0, 1, 2


def split_keys(raw: bytes) -> list[bytes]:
    """Joined 32-byte keys (or parents), one a page."""
    return [raw[i:i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]

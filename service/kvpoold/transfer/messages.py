"""The transfer RPCs' typed arguments, and the peer protocol's messages: what PeerReceive asks
and answers, what PeerDone says.

The edge (``kvpoold.server.edge``) makes every value here from a request, checked and bounded
once (GrantReceive, Send, WaitTransfer from engines; PeerReceive and PeerDone from peers), and
encodes :class:`Acceptance` as this daemon's answer; ``peers`` makes the peer messages into the
requests this daemon sends and decodes a peer's answer into an :class:`Acceptance`. The wire
form lives in those two places only: nothing else in the transfer wing sees request bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.transfer.liveness import ProcessId


@dataclass(frozen=True)
class GrantArgs:
    """A GrantReceive request: the pool, the kv page ids to grant (1..MAX_GRANT_PAGES, each
    once, as int32), the grant's TTL (the wire's 0 already made the default)."""

    pool: str
    pages: np.ndarray
    ttl_s: float


@dataclass(frozen=True)
class SendArgs:
    """A Send request: the pool, the kv page ids to send (1..MAX_GRANT_PAGES, each once, as
    int32), the receiving daemon as a gRPC target, the grant's token; whether to only hold
    the peer's acceptance (post later: :class:`PostArgs`), how long to wait for the write's
    end before answering (0..MAX_WAIT_S; 0 with hold)."""

    pool: str
    pages: np.ndarray
    peer: str
    token: bytes = field(repr=False)
    hold: bool = False
    wait_s: float = 0.0


@dataclass(frozen=True)
class PostArgs:
    """A Send request posting a held send: its ``transfer_id``, how long to wait for the
    write's end before answering (0..MAX_WAIT_S)."""

    transfer_id: int
    wait_s: float = 0.0


@dataclass(frozen=True)
class WaitArgs:
    """A WaitTransfer request: a send of this daemon (``transfer_id``) or a grant of it
    (``token``), exactly one; how long to wait (0..MAX_WAIT_S)."""

    transfer_id: int
    token: bytes = field(repr=False)
    timeout_s: float = 0.0


@dataclass(frozen=True)
class PeerReceiveArgs:
    """A PeerReceive request, bounded: the grant's token, the sender's page layout (compared
    with the pool's as the wire message), its page count and SWA mask, the registrations of
    the receiving daemon it already knows, its NIXL agent name, and its process (None: not
    named, or not valid)."""

    token: bytes = field(repr=False)
    layout: pb.PageLayout
    pages: int
    swa_mask: bytes
    known_agent: str
    known_generations: frozenset[int]
    sender: str
    writer: ProcessId | None = None


@dataclass(frozen=True)
class PeerDoneArgs:
    """A PeerDone request: the grant's token, whether the sender's write succeeded, why not."""

    token: bytes = field(repr=False)
    ok: bool
    message: str


@dataclass(frozen=True)
class Acceptance:
    """What PeerReceive answers an accepted sender: where to write and by when."""

    agent: str
    generation: int
    metadata: bytes  # the granted pool's registration only; empty when the sender has it
    buffer_addresses: list[int]
    pages: np.ndarray
    swa_pages: np.ndarray
    notification: bytes
    memory: str
    device: int
    write_deadline_s: float

"""The peer protocol's typed messages: what PeerReceive asks and answers, what PeerDone says.

The edge makes :class:`PeerReceiveArgs` and :class:`PeerDoneArgs` from a peer's requests and
encodes :class:`Acceptance` as this daemon's answer; ``peers`` makes the same values into the
requests this daemon sends and decodes a peer's answer into an :class:`Acceptance`. The wire
form lives in those two places only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.transfer.liveness import ProcessId


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

"""Outbound calls to peer daemons: one client per peer, the PeerReceive and PeerDone messages
this daemon sends (the only place the transfer wing builds them), and the per-peer counters.

A peer's refusal comes back as the same error type, prefixed with the peer's address; a peer
that cannot be reached is ``Unavailable`` naming the ``peer`` field. A peer's answer is made
typed here, once: an optional field it left unset takes its documented default (the proto's
comments; :data:`DEFAULT_WRITE_DEADLINE_S`), and an answer this daemon cannot use is refused and
the peer told at once (``PeerDone``), so the grant it accepted is not left fenced. At most
:data:`MAX_PEERS` clients are kept (least recently used closed first), and counters past that
many peers go to ``other`` (a bounded label set for Stats and /metrics).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import msgspec

from kvpool.clients.targets import channel_target
from kvpool.contract import codec
from kvpool.contract.errors import (
    Internal,
    InvalidArgument,
    KVPoolError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvpool.contract.records import PeerStats
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.transfer.messages import Acceptance, PeerReceiveArgs

if TYPE_CHECKING:
    from kvpool.clients.aio import AsyncKVPoolClient

MAX_PEER_CHARS = 512
MAX_MESSAGE_CHARS = 1024
MAX_PEERS = 256
PEER_TIMEOUT_S = 10.0
# The longest write deadline a peer may give (an answer beyond it is refused).
MAX_WRITE_DEADLINE_S = 3600.0
# The write deadline of a peer's answer that names none (unset, 0): the window a receiver
# gives a grant of the default TTL (kvpoold.transfer.grants.DEFAULT_GRANT_TTL_S).
DEFAULT_WRITE_DEADLINE_S = 60.0

Spawn = Callable[[Coroutine[Any, Any, Any]], None]


def check_peer(peer: str) -> str:
    """A peer daemon's address as a gRPC target.

    Raises:
        InvalidArgument: empty or over MAX_PEER_CHARS, or not an address.
    """
    if not peer or len(peer) > MAX_PEER_CHARS:
        raise InvalidArgument(
            f"peer is {len(peer)} characters; give the receiving daemon's address "
            f"(unix:///path.sock or host:port, at most {MAX_PEER_CHARS})", field="peer")
    return channel_target(peer)


def _ids(data: bytes, target: str, field: str) -> Any:
    if len(data) % 4:
        raise Internal(f"peer {target} answered {field} of {len(data)} bytes, not whole int32 "
                       "page ids")
    return codec.ids_from_bytes(data)


def _acceptance(target: str, resp: pb.PeerReceiveResponse) -> Acceptance:
    """A peer's PeerReceive answer as typed values: unset optional fields take their
    defaults (memory DRAM, device 0, no SWA pages, no metadata, a write deadline of
    DEFAULT_WRITE_DEADLINE_S).

    Raises:
        Internal: a malformed answer (page ids, memory type, a negative or too long write
            deadline).
    """
    if resp.memory not in ("", "DRAM", "VRAM"):
        raise Internal(f"peer {target} answered memory type {resp.memory!r}")
    deadline = resp.write_deadline_seconds or DEFAULT_WRITE_DEADLINE_S
    if not 0 < deadline <= MAX_WRITE_DEADLINE_S:
        raise Internal(f"peer {target} answered a write deadline of "
                       f"{resp.write_deadline_seconds} s (0 < it <= {MAX_WRITE_DEADLINE_S:g})")
    return Acceptance(
        agent=resp.agent, generation=resp.generation, metadata=resp.agent_metadata,
        buffer_addresses=list(resp.buffer_addresses), pages=_ids(resp.pages, target, "pages"),
        swa_pages=_ids(resp.swa_pages, target, "swa_pages"), notification=resp.notification,
        memory=resp.memory or "DRAM", device=resp.device, write_deadline_s=deadline)


class Peers:
    """This daemon's side of its peers: their clients, what it asks them, what it counts.

    Args:
        token: the bearer token sent to peers (their TCP listeners need it).
        spawn: runs a coroutine in the background (closing a client that was let go).

    Attributes:
        stats: per peer (the address sent to, or the agent received from), what Stats shows.
    """

    def __init__(self, token: str | None, spawn: Spawn) -> None:
        self._token = token
        self._spawn = spawn
        self._clients: OrderedDict[str, AsyncKVPoolClient] = OrderedDict()
        self._agents: dict[str, str] = {}  # peer target -> its agent, as last answered
        self.stats: dict[str, PeerStats] = {}

    def agent_of(self, target: str) -> str:
        """The NIXL agent ``target`` last answered with ("" if none yet)."""
        return self._agents.get(target, "")

    def answered(self, target: str, agent: str) -> None:
        """Remember ``target``'s agent (its metadata is loaded here)."""
        self._agents[target] = agent

    async def ask_receive(self, target: str, args: PeerReceiveArgs) -> Acceptance:
        """Call ``target``'s PeerReceive.

        Returns:
            Its acceptance: where to write, by when.

        Raises:
            Unavailable: the peer cannot be reached. Any KVPoolError the peer answered, its
                message prefixed with the peer's address (with how peer tokens work when it
                refused this daemon's token). Internal: a malformed answer (the peer is told
                nothing will be written, so its grant does not stay fenced).
        """
        req = pb.PeerReceiveRequest(
            token=args.token, layout=args.layout, pages=args.pages, swa_mask=args.swa_mask,
            known_agent=args.known_agent, known_generations=sorted(args.known_generations),
            sender=args.sender, sender_process=None if args.writer is None else
            pb.SenderProcess(boot_id=args.writer.boot_id, pid_namespace=args.writer.pid_namespace,
                             pid=args.writer.pid, start_ticks=args.writer.start_ticks))
        try:
            resp = await self._client(target).call("PeerReceive", req, timeout_s=PEER_TIMEOUT_S)
        except Unavailable as exc:
            raise Unavailable(
                f"peer daemon {target} cannot be reached (check the peer address given to "
                f"Send): {exc.message}", field="peer") from None
        except KVPoolError as exc:
            hint = ("; a daemon presents its --peer-token-file (else --token-file) secret "
                    "to its peers, so each peer must accept it as an admin or peer token "
                    "(the same --token-file on both, or that secret as a `peer = true` "
                    "token in the peer's --tokens-file)"
                    if isinstance(exc, Unauthenticated | PermissionDenied) else "")
            raise type(exc)(f"peer {target} refused the transfer: {exc.message}{hint}",
                            field=exc.field) from None
        try:
            return _acceptance(target, resp)
        except KVPoolError as exc:  # the peer accepted: its pages stay fenced until told
            self._spawn(self.tell_done(target, args.token, False,
                                       f"the sender could not use the answer: {exc.message}"))
            raise

    async def tell_done(self, target: str, token: bytes, ok: bool, message: str) -> None:
        """Call ``target``'s PeerDone; a failure to tell is ignored (the peer's pages then stay
        fenced until this daemon's process exits)."""
        with contextlib.suppress(KVPoolError):
            await self._client(target).call(
                "PeerDone", pb.PeerDoneRequest(token=token, ok=ok,
                                               message=message[:MAX_MESSAGE_CHARS]),
                timeout_s=PEER_TIMEOUT_S)

    def count(self, peer: str, **add: int) -> None:
        """Add to ``peer``'s counters: a new frozen PeerStats (once per transfer, not a hot
        path); past MAX_PEERS peers, new ones count as ``other`` (a bounded label set)."""
        if peer not in self.stats and len(self.stats) >= MAX_PEERS:
            peer = "other"
        old = self.stats.get(peer) or PeerStats(peer=peer)
        self.stats[peer] = msgspec.structs.replace(
            old, **{name: getattr(old, name) + n for name, n in add.items()})

    def _client(self, target: str) -> AsyncKVPoolClient:
        client = self._clients.get(target)
        if client is None:
            from kvpool.clients.aio import AsyncKVPoolClient

            client = AsyncKVPoolClient(target, token=self._token, timeout_s=PEER_TIMEOUT_S)
            self._clients[target] = client
            while len(self._clients) > MAX_PEERS:
                _, old = self._clients.popitem(last=False)
                self._spawn(old.close())
        else:
            self._clients.move_to_end(target)
        return client

    async def close(self) -> None:
        """Close every peer client."""
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()

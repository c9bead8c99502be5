"""Transfers between daemons: receive grants, sends over NIXL, completion on both sides.

The flow (docs/pd-transfer.md):

1. The decode engine's lease grants pages it holds (:meth:`Transfers.grant`) and hands the
   token to the prefill engine.
2. The prefill engine asks its daemon to send pages its lease holds (:meth:`Transfers.send`):
   this daemon calls the peer's ``PeerReceive`` with the token and its page layout; the peer
   checks the grant and the layout and answers the granted pages' addresses, a write deadline,
   and the NIXL metadata of the granted pool's registration when this daemon has not loaded it
   (once per peer and registration; never the metadata of another pool).
3. This daemon posts one NIXL WRITE of every page of every buffer, carrying the notification
   the peer asked for, and watches it until it ends or its deadline passes (then it is
   cancelled); the peer's daemon watches for the notification.
4. Both sides end their record: ``done``, or ``failed`` with the reason (a failed write is
   also told to the peer with ``PeerDone``). Engines wait with WaitTransfer.

Pages stay owned as they were whatever happens: a transfer never frees or allocates. Every
page a transfer moves is **pinned in the ledger** (``IdSpace.pin``) on both sides for as long
as bytes may move: the grant's pages from GrantReceive until its write window closes (see
``grants``), a send's pages from Send until its write's handle is released. A Free of a pinned
page is refused, and a lease's end quarantines its pinned pages (no other lease can be handed
them) until the last unpin frees them. Nothing outside the ledger is consulted by Free.

Only peer daemons call PeerReceive and PeerDone (the servicer checks the caller); a self-send is
refused before anything is posted.

All state is owned by the daemon's event loop; NIXL calls are made on it too (microseconds
each; registration of a new pool runs in Configure's worker thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvpool.clients.targets import channel_target
from kvpool.contract import codec
from kvpool.contract.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KVPoolError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvpool.contract.plan import PoolPlan
from kvpool.contract.records import PeerStats, TransferState, TransferStatus
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.ids import IdSpace
from kvpoold.ids.space import distinct
from kvpoold.transfer.grants import (
    DEFAULT_GRANT_TTL_S,
    MAX_GRANT_PAGES,
    GrantTable,
    ReceiveGrant,
    TransferRecord,
    check_token,
)
from kvpoold.transfer.nixl_agent import NIXL_MISSING, NixlAgent, mem_type
from kvpoold.transfer.page_layout import (
    KV_SPACE,
    SWA_SPACE,
    layout_mismatch,
    page_buffers,
    page_layout,
)

if TYPE_CHECKING:
    from kvpool.clients.aio import AsyncKVPoolClient
    from kvpoold.pools.pool import Pool
    from kvpoold.server.args import PeerReceiveArgs
    from kvpoold.server.leases import LeaseTable

log = logging.getLogger("kvpoold.transfer")

MAX_PEER_CHARS = 512
MAX_MESSAGE_CHARS = 1024
MAX_PEERS = 256
PEER_TIMEOUT_S = 10.0
MAX_WAIT_S = 3600.0
MAX_ENDED_SENDS = 4096
# Completion polling. The agent has no progress thread (see nixl_agent), so a write moves
# only as fast as its sender polls it: for SPIN_S after posting the loop checks on every turn
# (other calls still run in between), then at most MAX_POLL_S apart, so a write whose peer is
# gone does not keep a core busy. The receiver only waits for the notification of a one-sided
# write: it reads notifications every RECEIVER_POLL_S (spinning there too took the sender's
# core on a small machine: 256 pages went from 1.16x to 1.46x raw NIXL in bench/transfer.py).
SPIN_S = 0.5
MAX_POLL_S = 0.001
RECEIVER_POLL_S = 0.001



@dataclass(frozen=True)
class Acceptance:
    """What PeerReceive answers an accepted sender (``edge.peer_receive_response``)."""

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


@dataclass(eq=False)
class Outgoing(TransferRecord):
    """One send of this daemon."""

    transfer_id: int
    peer: str
    pool: str
    owner: int
    pages: np.ndarray
    token: bytes
    descriptors: int = 0
    peer_agent: str = ""
    identity: str = ""  # the caller identity of the sending lease: only it may WaitTransfer
    swa_pages: np.ndarray | None = None  # the SWA pairs of ``pages`` it sends (hybrid SWA)
    posted_at: float = 0.0
    deadline: float = 0.0  # time.monotonic() by which the write must end (from the peer)
    handle: Any = None
    # Gives the pages' pins back (exactly once): when nothing was posted, or once the posted
    # write's handle is released. None after.
    unpin: Any = None
    # The pool while its write may be reading it: a forced Drop meanwhile must not unmap the
    # memory under NIXL (the views keep the mapping; dropped when the write ends).
    source: Any = None

    def status(self, now: float) -> TransferStatus:
        return self.status_since(self.posted_at, self.peer_agent or self.peer,
                                 int(self.pages.shape[0]), now)


def check_pages(data: bytes, field: str) -> np.ndarray:
    """Page ids as sent: whole little-endian int32, 1..MAX_GRANT_PAGES of them, each once.

    Raises:
        InvalidArgument: otherwise.
    """
    if len(data) % 4:
        raise InvalidArgument(f"{field} has {len(data)} bytes, not a whole number of "
                              "little-endian int32 page ids", field=field)
    n = len(data) // 4
    if not 1 <= n <= MAX_GRANT_PAGES:
        raise InvalidArgument(f"{field} has {n} page ids; a transfer moves 1..{MAX_GRANT_PAGES}",
                              field=field)
    pages = codec.ids_from_bytes(data)
    if not distinct(pages):
        raise InvalidArgument(f"{field} lists a page twice; list each page once", field=field)
    return pages


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


def _descriptors(addresses: np.ndarray, page_bytes: np.ndarray, ids: list[np.ndarray],
                 device: int) -> np.ndarray:
    """NIXL rows ``(address, length, device)``: per buffer b, one row per id in ``ids[b]`` at
    ``addresses[b] + id * page_bytes[b]``, buffers in order. O(buffers x pages)."""
    counts = [int(x.shape[0]) for x in ids]
    total = sum(counts)
    rows = np.empty((total, 3), dtype=np.uint64)
    at = 0
    for b, x in enumerate(ids):
        n = counts[b]
        if not n:
            continue
        rows[at:at + n, 0] = addresses[b] + x.astype(np.uint64) * page_bytes[b]
        rows[at:at + n, 1] = page_bytes[b]
        at += n
    rows[:, 2] = device
    return rows


class Transfers:
    """Grants, sends and receives of one daemon.

    Args:
        pool: the daemon's pool lookup (raises NotFound / InvalidArgument).
        leases: the daemon's lease table.
        clock: the daemon's monotonic clock.
        agent: the NIXL agent, or None (every transfer RPC then fails with ``why_off``).
        why_off: what to tell callers when ``agent`` is None.
        peer_token: the bearer token sent to peers (their TCP listeners need it).
        on_freed: called when unpinning freed quarantined ids (Allocates waiting for ids).
    """

    def __init__(self, pool: Callable[[str], Pool], leases: LeaseTable,
                 clock: Callable[[], float], agent: NixlAgent | None = None,
                 why_off: str = NIXL_MISSING, peer_token: str | None = None,
                 on_freed: Callable[[], None] | None = None) -> None:
        self._pool = pool
        self._leases = leases
        self._clock = clock
        self.agent = agent
        self._why_off = why_off
        self._peer_token = peer_token
        self._on_freed = on_freed
        self.grants = GrantTable(clock, self._grant_ended)
        self._sends: dict[int, Outgoing] = {}
        self._ended_sends: deque[Outgoing] = deque()
        self._sending: dict[int, list[Outgoing]] = {}  # owner -> its sends in flight
        self._ids = itertools.count(1)
        self._clients: OrderedDict[str, AsyncKVPoolClient] = OrderedDict()
        self._peer_agent: dict[str, str] = {}  # peer target -> its agent, as last answered
        self._layouts: dict[tuple[str, str], pb.PageLayout] = {}
        # Per peer (the address sent to, or the agent received from), what Stats shows.
        self.peers: dict[str, PeerStats] = {}
        self._poller: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- availability and pools ------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.agent is not None

    def _need_agent(self) -> NixlAgent:
        if self.agent is None:
            raise FailedPrecondition(self._why_off)
        return self.agent

    def register_pool(self, entry: Pool) -> None:
        """Register a new pool's backing with NIXL (no-op without an agent). Blocking: called
        from Configure's worker thread."""
        if self.agent is not None:
            self.agent.register(entry.name, entry.backing.tensor)

    def pool_gone(self, name: str) -> None:
        """A pool is being dropped: its grants end, its sends fail. Pins of writes that may
        still move bytes in it (an accepted grant's window, a posted send) keep holding a use
        of the pool (:meth:`Pool.acquire`), so its memory is released only when the last one
        ends: a late write lands in memory that is still the dropped pool's, never in a new
        one."""
        why = f"pool {name!r} was dropped"
        self.grants.revoke_pool(name, why)
        for out in [o for o in self._sends.values() if o.pool == name]:
            self._end_send(out, TransferState.failed, why)
        self._layouts = {k: v for k, v in self._layouts.items() if k[0] != name}

    def deregister(self, name: str) -> None:
        """A pool's region is released: its NIXL registration goes (no-op without an
        agent). A failure is logged: the region is gone either way."""
        if self.agent is not None:
            try:
                self.agent.deregister(name)
            except Exception:
                log.exception("NIXL deregistration of pool %s failed", name)

    def _pin(self, entry: Pool, pages: np.ndarray, swa: np.ndarray | None
             ) -> Callable[[], None]:
        """Pin ``pages`` (kv) and ``swa`` pages of ``entry`` in its ledger, holding a use of
        the pool; returns what unpins them, once (it frees pages quarantined meanwhile, and
        gives the use back: a pool dropped meanwhile closes with its last use)."""
        kv = entry.ids.space(KV_SPACE, "pages")
        swa_space = (entry.ids.space(SWA_SPACE, "pages")
                     if swa is not None and swa.shape[0] else None)
        kv_idx = pages.astype(np.intp)
        swa_idx = None if swa_space is None or swa is None else swa.astype(np.intp)
        kv.pin(kv_idx)
        if swa_space is not None and swa_idx is not None:
            swa_space.pin(swa_idx)
        release = entry.acquire("transfer")
        done = False

        def unpin() -> None:
            nonlocal done
            if done:
                return
            done = True
            try:
                freed = kv.unpin(kv_idx)
                if swa_space is not None and swa_idx is not None:
                    freed += swa_space.unpin(swa_idx)
            finally:
                release()
            if freed and self._on_freed is not None:
                self._on_freed()

        return unpin

    def _layout(self, entry: Pool) -> pb.PageLayout:
        key = (entry.name, entry.fingerprint)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = page_layout(entry.plan)
        return layout

    @staticmethod
    def _has_swa(plan: PoolPlan) -> bool:
        return any(s.name == SWA_SPACE and s.follows == KV_SPACE for s in plan.id_spaces)

    @staticmethod
    def _held(entry: Pool, owner: int, lease_id: int, pages: np.ndarray,
              field: str) -> IdSpace:
        """The kv space, after checking ``owner`` holds every page.

        Raises:
            FailedPrecondition: a page it does not hold. InvalidArgument: one out of range.
        """
        space = entry.ids.space(KV_SPACE, field)
        bad = space.owner_of(pages) != owner
        if bad.any():
            pos = int(bad.argmax())
            raise FailedPrecondition(
                f"{field}[{pos}]={int(pages[pos])} of pool {entry.name!r} is not held by lease "
                f"{lease_id} ({int(bad.sum())} of {pages.shape[0]} pages are not); allocate "
                "the pages with this lease first", field=f"{field}[{pos}]")
        return space

    # -- decode side: grants -----------------------------------------------------------------

    def grant(self, lease_id: int, pool: str, pages_bytes: bytes, ttl_s: float) -> ReceiveGrant:
        """Let one transfer write into ``pages`` (held by the lease) until ``ttl_s`` passes.

        Raises:
            FailedPrecondition: no NIXL, or a page not held by the lease.
            InvalidArgument, NotFound, ResourceExhausted: see GrantTable.add and the checks.
        """
        pages = check_pages(pages_bytes, "pages")
        self._need_agent()
        entry = self._pool(pool)
        lease = self._leases.get(lease_id)
        kv = self._held(entry, lease.owner, lease_id, pages, "pages")
        busy = kv.pinned_of(pages.astype(np.intp))
        if busy.any():
            pos = int(busy.argmax())
            raise FailedPrecondition(
                f"pages[{pos}]={int(pages[pos])} of pool {pool!r} is pinned by a transfer (a "
                "live receive grant or a send); a page takes one transfer at a time (wait for "
                "it to end, or grant other pages)", field=f"pages[{pos}]")
        swa = entry.ids.paired_of(KV_SPACE, pages) if self._has_swa(entry.plan) else None
        linked = None if swa is None else swa[swa != 0]
        grant = self.grants.add(pool, lease_id, lease.owner, pages, swa,
                                ttl_s or DEFAULT_GRANT_TTL_S,
                                lambda: self._pin(entry, pages, linked))
        log.info("receive granted", extra={"fields": {
            "event": "grant", "pool": pool, "lease_id": lease_id, "pages": int(pages.shape[0]),
            "ttl_s": grant.expires_at - grant.created_at}})
        return grant

    def peer_receive(self, args: PeerReceiveArgs) -> Acceptance:
        """A peer daemon asks where to write: check the grant, the layout and the pages,
        accept it, and answer what its write needs (``edge.peer_receive_response``).

        Raises:
            NotFound: no grant for the token. FailedPrecondition: no NIXL, a sender that is
            this daemon itself, the grant ended or is used, the layouts differ, or the lease
            that granted the pages has ended. InvalidArgument: a page count or mask that does
            not match the grant.
        """
        agent = self._need_agent()
        if args.sender == agent.name:
            raise FailedPrecondition(
                "the sender is this daemon itself: a daemon cannot send pages to its own pools "
                "over NIXL; send to another daemon's address, or copy the pages in the engine",
                field="peer")
        grant = self.grants.find(args.token)
        if grant.state != TransferState.pending:
            raise FailedPrecondition(grant.ended_text(), field="token")
        entry = self._pool(grant.pool)
        why = layout_mismatch(self._layout(entry), args.layout)
        if why is not None:
            raise FailedPrecondition(f"pool {grant.pool!r} cannot take these pages: {why}",
                                     field="layout")
        n = int(grant.pages.shape[0])
        if args.pages != n:
            raise InvalidArgument(f"the sender sends {args.pages} pages, the grant covers {n}; "
                                  "send exactly the granted count", field="pages")
        # Pinned since the grant: still held by its lease unless the lease ended (quarantined).
        self._held(entry, grant.owner, grant.lease_id, grant.pages, "pages")
        swa_out = np.empty(0, dtype=np.int32)
        if grant.swa_pages is not None:
            if len(args.swa_mask) != n:
                raise InvalidArgument(f"swa_mask has {len(args.swa_mask)} bytes, the grant "
                                      f"{n} pages", field="swa_mask")
            mask = np.frombuffer(args.swa_mask, dtype=np.uint8) != 0
            lost = mask & (grant.swa_pages == 0)
            if lost.any():
                pos = int(lost.argmax())
                raise FailedPrecondition(
                    f"page {int(grant.pages[pos])} had no SWA page when granted; the sender "
                    "has one for it", field="swa_mask")
            swa_out = grant.swa_pages[mask]
        elif args.swa_mask:
            raise InvalidArgument("swa_mask given for a pool without SWA pages",
                                  field="swa_mask")
        backing = entry.backing.tensor
        base = backing.data_ptr()
        memory, device = mem_type(backing)
        bufs = page_buffers(entry.plan)
        nbytes = sum(b.page_bytes * (n if b.id_space == KV_SPACE else int(swa_out.shape[0]))
                     for b in bufs)
        notification = self.grants.accept(grant, args.sender, nbytes)
        self._ensure_poller()
        generation = agent.generation(grant.pool)
        stale = args.known_agent != agent.name or generation not in args.known_generations
        log.info("receive accepted", extra={"fields": {
            "event": "receive", "pool": grant.pool, "lease_id": grant.lease_id,
            "pages": n, "bytes": nbytes, "peer": grant.peer, "write_s": grant.write_s}})
        return Acceptance(
            agent=agent.name, generation=generation,
            metadata=agent.pool_metadata(grant.pool) if stale else b"",
            buffer_addresses=[base + b.offset_bytes for b in bufs], pages=grant.pages,
            swa_pages=swa_out, notification=notification, memory=memory, device=device,
            write_deadline_s=grant.write_s)

    def peer_done(self, token: bytes, ok: bool, message: str) -> None:
        """The sender's word on its write: ``ok = False`` (it cancelled or lost it) ends the
        grant as failed and gives its pages back; ``ok = True`` ends nothing (only the write's
        own notification makes a grant done). No-op for a grant no sender was accepted into.

        Raises:
            NotFound: no grant for the token.
        """
        grant = self.grants.find(token)
        if not grant.receiving or ok:
            return
        self.grants.close_window(grant, TransferState.failed,
                                 f"the sender's write failed: {message}")

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_notifications())

    async def _poll_notifications(self) -> None:
        """Read completion notifications while an accepted grant's write window is open."""
        agent = self.agent
        assert agent is not None
        while self.grants.receiving:
            try:
                notes = agent.notifications()
            except Exception:
                log.exception("reading NIXL notifications failed")
                notes = {}
            for messages in notes.values():
                for message in messages:
                    grant = self.grants.by_notification(bytes(message))
                    if grant is not None:
                        self.grants.close_window(grant, TransferState.done, "")
            await asyncio.sleep(RECEIVER_POLL_S)

    def _grant_ended(self, grant: ReceiveGrant) -> None:
        if not grant.receiving:
            return
        if grant.state == TransferState.done:
            self._count(grant.peer, received=1, received_bytes=grant.nbytes)
        else:
            self._count(grant.peer, receive_failures=1)
        log.info("receive ended", extra={"fields": {
            "event": "receive_end", "pool": grant.pool, "state": grant.state.value,
            "message": grant.message, "bytes": grant.nbytes, "peer": grant.peer,
            "seconds": round(grant.ended_at - grant.accepted_at, 6)}})

    # -- prefill side: sends -----------------------------------------------------------------

    async def send(self, lease_id: int, pool: str, pages_bytes: bytes, peer: str,
                   token: bytes) -> Outgoing:
        """Write ``pages`` (held by the lease) into the peer's pages granted by ``token``.

        Returns once the peer accepted and the write is posted; the record ends by itself.

        Raises:
            FailedPrecondition: no NIXL, a page not held, or the peer refused (grant ended,
                layouts differ...: the peer's message, prefixed with its address).
            Unavailable: the peer cannot be reached. NotFound: pool, lease or (at the peer)
                grant unknown. InvalidArgument: malformed pages, peer or token.
        """
        pages = check_pages(pages_bytes, "pages")
        target = check_peer(peer)
        check_token(token)
        agent = self._need_agent()
        entry = self._pool(pool)
        lease = self._leases.get(lease_id)
        self._held(entry, lease.owner, lease_id, pages, "pages")
        mask = np.empty(0, dtype=np.uint8)
        swa_src = np.empty(0, dtype=np.int32)
        if self._has_swa(entry.plan):
            paired = entry.ids.paired_of(KV_SPACE, pages)
            mask = (paired != 0).astype(np.uint8)
            swa_src = paired[paired != 0]
        out = Outgoing(next(self._ids), target, pool, lease.owner, pages, token,
                       identity=lease.identity, swa_pages=swa_src)
        # Pinned from here until nothing can read them any more: a Free is refused, and the
        # lease's end quarantines them, so no other lease's bytes are ever shipped.
        out.unpin = self._pin(entry, pages, swa_src)
        self._sends[out.transfer_id] = out
        self._sending.setdefault(out.owner, []).append(out)
        try:
            known = self._peer_agent.get(target, "")
            req = pb.PeerReceiveRequest(
                token=token, layout=self._layout(entry), pages=int(pages.shape[0]),
                swa_mask=mask.tobytes(), known_agent=known,
                known_generations=agent.known_generations(known) if known else [],
                sender=agent.name)
            asked_at = time.monotonic()  # the write deadline counts from here
            try:
                resp = await self._client(target).call("PeerReceive", req,
                                                       timeout_s=PEER_TIMEOUT_S)
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
            if out.state != TransferState.pending:  # the pool or the lease went meanwhile
                await self._tell_peer(target, token, False, out.message)
                raise FailedPrecondition(f"transfer {out.transfer_id}: {out.message}",
                                         field="pages")
            if resp.agent == agent.name:
                raise FailedPrecondition(
                    f"peer {target} is this daemon itself: a daemon cannot send pages to its "
                    "own pools over NIXL", field="peer")
            self._post(agent, entry, out, resp, swa_src, asked_at)
        except BaseException as exc:
            msg = exc.message if isinstance(exc, KVPoolError) else f"{type(exc).__name__}: {exc}"
            out.source = None  # nothing was posted
            self._end_send(out, TransferState.failed, msg)
            self._unpin_send(out)
            raise
        self._spawn(self._watch(agent, out))
        return out

    def _post(self, agent: NixlAgent, entry: Pool, out: Outgoing,
              resp: pb.PeerReceiveResponse, swa_src: np.ndarray, asked_at: float) -> None:
        """Load the peer's metadata if it came, build both descriptor lists, post the WRITE
        with the deadline the peer gave (from ``asked_at``)."""
        bufs = page_buffers(entry.plan)
        dst_pages = codec.ids_from_bytes(resp.pages)
        dst_swa = codec.ids_from_bytes(resp.swa_pages)
        if (len(resp.buffer_addresses) != len(bufs) or dst_pages.shape != out.pages.shape
                or dst_swa.shape != swa_src.shape):
            raise Internal(
                f"peer {out.peer} answered {len(resp.buffer_addresses)} buffers, "
                f"{dst_pages.shape[0]} pages and {dst_swa.shape[0]} SWA pages for "
                f"{len(bufs)} buffers, {out.pages.shape[0]} pages and {swa_src.shape[0]} SWA "
                "pages")
        if resp.memory not in ("", "DRAM", "VRAM"):
            raise Internal(f"peer {out.peer} answered memory type {resp.memory!r}")
        if not 0 < resp.write_deadline_seconds <= MAX_WAIT_S:
            raise Internal(f"peer {out.peer} answered a write deadline of "
                           f"{resp.write_deadline_seconds} s")
        if resp.agent_metadata:
            agent.add_peer(resp.agent_metadata, resp.generation)
        elif resp.generation not in agent.known_generations(resp.agent):
            raise Internal(f"peer {out.peer}: agent {resp.agent} registration "
                           f"{resp.generation} sent without its metadata")
        self._peer_agent[out.peer] = resp.agent
        out.peer_agent = resp.agent
        backing = entry.backing.tensor
        kind, device = mem_type(backing)
        page_bytes = np.array([b.page_bytes for b in bufs], dtype=np.uint64)
        local_ids = [out.pages if b.id_space == KV_SPACE else swa_src for b in bufs]
        remote_ids = [dst_pages if b.id_space == KV_SPACE else dst_swa for b in bufs]
        base = backing.data_ptr()
        local = _descriptors(np.array([base + b.offset_bytes for b in bufs], dtype=np.uint64),
                             page_bytes, local_ids, device)
        remote = _descriptors(np.array(resp.buffer_addresses, dtype=np.uint64), page_bytes,
                              remote_ids, resp.device)
        out.nbytes = int(local[:, 1].sum())
        out.descriptors = int(local.shape[0])
        out.posted_at = self._clock()
        out.deadline = asked_at + resp.write_deadline_seconds
        out.source = entry.buffers
        out.handle, state = agent.post_write(local, kind, remote, resp.memory or "DRAM",
                                             resp.agent, resp.notification, out.deadline)
        if state == "ERR":
            handle, out.handle = out.handle, None
            if not agent.release(handle):
                out.handle = handle  # still NIXL's: the watcher waits until it lets go
                self._spawn(self._watch(agent, out))
            raise Internal(f"NIXL could not post the write to {out.peer} ({resp.agent})")

    async def _watch(self, agent: NixlAgent, out: Outgoing) -> None:
        """Poll the posted write until it ends (the agent cancels it at its deadline); release
        its handle, then its pins; tell the peer about a failure."""
        state = "PROC"
        start = time.monotonic()
        while out.handle is not None:
            state = agent.state(out.handle)
            if state != "PROC":
                if agent.release(out.handle):
                    out.handle = None
                    break
                state = "ERR"  # NIXL could not let go of it yet: keep it pinned, retry
            waited = time.monotonic() - start
            await asyncio.sleep(0.0 if waited < SPIN_S and state == "PROC" else MAX_POLL_S)
        out.source = None
        self._unpin_send(out)
        if state == "DONE":
            self._end_send(out, TransferState.done, "")
            return
        why = (f"the write did not complete within its {out.deadline - start:.3g} s deadline "
               "and was cancelled" if state == "TIMEOUT"
               else out.message or f"NIXL reported an error writing to {out.peer_agent} at "
               f"{out.peer} (the peer daemon died or its memory went away)")
        self._end_send(out, TransferState.failed, why)
        await self._tell_peer(out.peer, out.token, False, why)

    def _unpin_send(self, out: Outgoing) -> None:
        unpin, out.unpin = out.unpin, None
        if unpin is not None:
            unpin()

    async def _tell_peer(self, target: str, token: bytes, ok: bool, message: str) -> None:
        with contextlib.suppress(KVPoolError):
            await self._client(target).call(
                "PeerDone", pb.PeerDoneRequest(token=token, ok=ok,
                                               message=message[:MAX_MESSAGE_CHARS]),
                timeout_s=PEER_TIMEOUT_S)

    def _end_send(self, out: Outgoing, state: TransferState, message: str) -> None:
        """End a send's record (its pins go with its handle, :meth:`_unpin_send`)."""
        if not out.finish(state, message, self._clock()):
            return
        busy = self._sending.get(out.owner)
        if busy is not None and out in busy:
            busy.remove(out)
            if not busy:
                del self._sending[out.owner]
        self._ended_sends.append(out)
        while len(self._ended_sends) > MAX_ENDED_SENDS:
            self._sends.pop(self._ended_sends.popleft().transfer_id, None)
        if state == TransferState.done:
            self._count(out.peer, sent=1, sent_bytes=out.nbytes)
        else:
            self._count(out.peer, send_failures=1)
        log.info("send ended", extra={"fields": {
            "event": "send_end", "pool": out.pool, "transfer_id": out.transfer_id,
            "state": state.value, "message": message, "bytes": out.nbytes, "peer": out.peer,
            "seconds": round(out.ended_at - out.posted_at, 6) if out.posted_at else 0.0}})

    def _client(self, target: str) -> AsyncKVPoolClient:
        client = self._clients.get(target)
        if client is None:
            from kvpool.clients.aio import AsyncKVPoolClient

            client = AsyncKVPoolClient(target, token=self._peer_token, timeout_s=PEER_TIMEOUT_S)
            self._clients[target] = client
            while len(self._clients) > MAX_PEERS:
                _, old = self._clients.popitem(last=False)
                self._spawn(old.close())
        else:
            self._clients.move_to_end(target)
        return client

    def _count(self, peer: str, **add: int) -> None:
        """Add to ``peer``'s counters: a new frozen PeerStats (once per transfer, not a hot
        path); past MAX_PEERS peers, new ones count as ``other`` (a bounded label set)."""
        if peer not in self.peers and len(self.peers) >= MAX_PEERS:
            peer = "other"
        old = self.peers.get(peer) or PeerStats(peer=peer)
        self.peers[peer] = msgspec.structs.replace(
            old, **{name: getattr(old, name) + n for name, n in add.items()})

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- either side ---------------------------------------------------------------------------

    async def wait(self, transfer_id: int, token: bytes, timeout_s: float,
                   identity: str | None = None) -> TransferStatus:
        """The status of a send (``transfer_id``) or a grant (``token``), after waiting up to
        ``timeout_s`` for it to end. A send is shown only to ``identity``, the caller identity
        of its lease (None: any caller, an admin); a grant to whoever has its token.

        Raises:
            InvalidArgument: neither or both given, or a timeout outside 0..MAX_WAIT_S.
            NotFound: unknown (or long ended) transfer or grant, or another identity's send.
        """
        if bool(transfer_id) == bool(token):
            raise InvalidArgument("give transfer_id (a Send of this daemon) or token (a "
                                  "grant of this daemon), one of them", field="transfer_id")
        if not 0 <= timeout_s <= MAX_WAIT_S:
            raise InvalidArgument(f"timeout_seconds {timeout_s} is outside 0..{MAX_WAIT_S:g}",
                                  field="timeout_seconds")
        record: Outgoing | ReceiveGrant
        if transfer_id:
            found = self._sends.get(transfer_id)
            if found is None or identity not in (None, found.identity):
                raise NotFound(f"no transfer {transfer_id} on this daemon (never sent here, or "
                               f"one of over {MAX_ENDED_SENDS} ended since)",
                               field="transfer_id")
            record = found
        else:
            record = self.grants.find(token)
        if record.state == TransferState.pending and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.ended.wait(), timeout_s)
        return record.status(self._clock())

    # -- hooks from the daemon -----------------------------------------------------------------

    def lease_gone(self, owner: int, why: str) -> None:
        """A lease closed or expired: its grants end and its sends are marked failed. A write
        in flight keeps its pages pinned (the lease's reclaim quarantines them) until it ends:
        a posted send until its handle is released, an accepted grant until its window
        closes."""
        self.grants.revoke_owner(owner, why)
        for out in list(self._sending.get(owner, ())):
            if out.handle is None:  # not posted yet: send() sees it and stops
                self._end_send(out, TransferState.failed, why)

    def expire(self) -> None:
        self.grants.expire()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._poller is not None:
            self._poller.cancel()
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()

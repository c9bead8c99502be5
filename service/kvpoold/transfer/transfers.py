"""Transfers between daemons: receive grants, sends over NIXL, completion on both sides.

The flow (docs/pd-transfer.md):

1. The decode engine's lease grants pages it holds (:meth:`Transfers.grant`) and hands the
   token to the prefill engine.
2. The prefill engine asks its daemon to send pages its lease holds (:meth:`Transfers.send`):
   this daemon calls the peer's ``PeerReceive`` with the token and its page layout; the peer
   checks the grant and the layout and answers the granted pages' addresses (and its NIXL
   agent metadata when this daemon's copy is stale: once per peer and registration change).
3. This daemon posts one NIXL WRITE of every page of every buffer, carrying the notification
   the peer asked for, and watches it; the peer's daemon watches for the notification.
4. Both sides end their record: ``done``, or ``failed`` with the reason (a failed write is
   also told to the peer with ``PeerDone``). Engines wait with WaitTransfer.

Pages stay owned as they were whatever happens: a transfer never frees or allocates. While
a write is in flight its pages are busy on both sides: a Free of them is refused.

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

from kvpool import codec
from kvpool.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KVPoolError,
    NotFound,
    Unauthenticated,
)
from kvpool.plan import PoolPlan
from kvpool.records import PeerStats, TransferState, TransferStatus
from kvpool.targets import channel_target
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.transfer.grants import (
    DEFAULT_GRANT_TTL_S,
    MAX_GRANT_PAGES,
    GrantTable,
    ReceiveGrant,
    TransferRecord,
    check_token,
)
from kvpoold.transfer.layout import KV_SPACE, SWA_SPACE, layout_mismatch, page_buffers, page_layout
from kvpoold.transfer.marks import PageMarks
from kvpoold.transfer.nixl_agent import NIXL_MISSING, NixlAgent, mem_type

if TYPE_CHECKING:
    from kvpool.aio import AsyncKVPoolClient
    from kvpoold.server.leases import LeaseTable
    from kvpoold.server.live_pools import LivePool

log = logging.getLogger("kvpoold.transfer")

MAX_PEER_CHARS = 512
MAX_PEERS = 256
PEER_TIMEOUT_S = 10.0
# A posted write still in progress after this long is cancelled and reported failed.
MAX_WRITE_S = 300.0
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
    handle: Any = None
    # The pool while its write may be reading it: a forced Drop meanwhile must not unmap the
    # memory under NIXL (the views keep the mapping; dropped when the write ends).
    source: Any = None

    def status(self, now: float) -> TransferStatus:
        return self.status_since(self.posted_at, self.peer_agent or self.peer,
                                 int(self.pages.shape[0]), now)


def check_pages(data: bytes, field: str) -> np.ndarray:
    """Page ids as sent: whole little-endian int32, 1..MAX_GRANT_PAGES of them.

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
    return codec.ids_from_bytes(data)


def check_peer(peer: str) -> str:
    """A peer daemon's address as a gRPC target.

    Raises:
        InvalidArgument: empty or over MAX_PEER_CHARS.
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
    """

    def __init__(self, pool: Callable[[str], LivePool], leases: LeaseTable,
                 clock: Callable[[], float], agent: NixlAgent | None = None,
                 why_off: str = NIXL_MISSING, peer_token: str | None = None) -> None:
        self._pool = pool
        self._leases = leases
        self._clock = clock
        self.agent = agent
        self._why_off = why_off
        self._peer_token = peer_token
        self.grants = GrantTable(clock, self._grant_ended)
        self._sends: dict[int, Outgoing] = {}
        self._ended_sends: deque[Outgoing] = deque()
        self._sending: dict[int, list[Outgoing]] = {}  # owner -> its sends in flight
        self._marks: dict[str, PageMarks] = {}  # pool -> its pages' grants and transfers
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

    def register_pool(self, entry: LivePool) -> None:
        """Register a new pool's backing with NIXL (no-op without an agent). Blocking: called
        from Configure's worker thread."""
        if self.agent is not None:
            self.agent.register(entry.name, entry.backing.tensor)

    def pool_gone(self, name: str) -> None:
        """A pool is being dropped: its grants end, its sends fail, NIXL forgets its region."""
        self.grants.revoke_pool(name, f"pool {name!r} was dropped")
        for out in [o for o in self._sends.values() if o.pool == name]:
            self._end_send(out, TransferState.failed, f"pool {name!r} was dropped")
        self._layouts = {k: v for k, v in self._layouts.items() if k[0] != name}
        self._marks.pop(name, None)
        if self.agent is not None:
            try:
                self.agent.deregister(name)
            except Exception:
                log.exception("NIXL deregistration of pool %s failed", name)

    def _layout(self, entry: LivePool) -> pb.PageLayout:
        key = (entry.name, entry.fingerprint)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = page_layout(entry.plan)
        return layout

    def _marks_of(self, entry: LivePool) -> PageMarks:
        """The pool's page marks, made at its first grant or send."""
        marks = self._marks.get(entry.name)
        if marks is None:
            capacity = entry.ids.space(KV_SPACE, "pool", allocating=False).capacity
            swa = (entry.ids.space(SWA_SPACE, "pool", allocating=False).capacity
                   if self._has_swa(entry.plan) else 0)
            marks = self._marks[entry.name] = PageMarks(entry.name, capacity, swa)
        return marks

    @staticmethod
    def _has_swa(plan: PoolPlan) -> bool:
        return any(s.name == SWA_SPACE and s.follows == KV_SPACE for s in plan.id_spaces)

    @staticmethod
    def _held(entry: LivePool, owner: int, lease_id: int, pages: np.ndarray,
              field: str) -> None:
        """Raises FailedPrecondition unless ``owner`` holds every page (InvalidArgument for an
        id out of range)."""
        owners = entry.ids.space(KV_SPACE, field, allocating=False).owner_of(pages)
        bad = owners != owner
        if bad.any():
            pos = int(bad.argmax())
            raise FailedPrecondition(
                f"{field}[{pos}]={int(pages[pos])} of pool {entry.name!r} is not held by lease "
                f"{lease_id} ({int(bad.sum())} of {pages.shape[0]} pages are not); allocate "
                "the pages with this lease first", field=f"{field}[{pos}]")

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
        self._held(entry, lease.owner, lease_id, pages, "pages")
        marks = self._marks_of(entry)
        marks.check_ungranted(pages, "pages")
        swa = entry.ids.paired_of(KV_SPACE, pages) if self._has_swa(entry.plan) else None
        grant = self.grants.add(pool, lease_id, lease.owner, pages, swa,
                                ttl_s or DEFAULT_GRANT_TTL_S)
        marks.add_grant(grant)
        log.info("receive granted", extra={"fields": {
            "event": "grant", "pool": pool, "lease_id": lease_id, "pages": int(pages.shape[0]),
            "ttl_s": grant.expires_at - grant.created_at}})
        return grant

    def peer_receive(self, req: pb.PeerReceiveRequest) -> pb.PeerReceiveResponse:
        """A sender asks where to write: check the grant, the layout and the pages, accept.

        Raises:
            NotFound: no grant for the token. FailedPrecondition: no NIXL, the grant ended or
            is used, the layouts differ, or a page is no longer held. InvalidArgument: a page
            count or mask that does not match the grant.
        """
        check_token(req.token)
        agent = self._need_agent()
        grant = self.grants.find(req.token)
        if grant.state != TransferState.pending:
            raise FailedPrecondition(grant.ended_text(), field="token")
        entry = self._pool(grant.pool)
        mine = self._layout(entry)
        why = layout_mismatch(mine, req.layout)
        if why is not None:
            raise FailedPrecondition(f"pool {grant.pool!r} cannot take these pages: {why}",
                                     field="layout")
        n = int(grant.pages.shape[0])
        if req.pages != n:
            raise InvalidArgument(f"the sender sends {req.pages} pages, the grant covers {n}; "
                                  "send exactly the granted count", field="pages")
        self._held(entry, grant.owner, grant.lease_id, grant.pages, "pages")
        swa_out = np.empty(0, dtype=np.int32)
        if grant.swa_pages is not None:
            if len(req.swa_mask) != n:
                raise InvalidArgument(f"swa_mask has {len(req.swa_mask)} bytes, the grant "
                                      f"{n} pages", field="swa_mask")
            mask = np.frombuffer(req.swa_mask, dtype=np.uint8) != 0
            now = entry.ids.paired_of(KV_SPACE, grant.pages)
            lost = mask & ((now == 0) | (now != grant.swa_pages))
            if lost.any():
                pos = int(lost.argmax())
                raise FailedPrecondition(
                    f"page {int(grant.pages[pos])} no longer has the SWA page it had when "
                    "granted (released since); the sender has one for it", field="swa_mask")
            swa_out = grant.swa_pages[mask]
        elif req.swa_mask:
            raise InvalidArgument("swa_mask given for a pool without SWA pages",
                                  field="swa_mask")
        backing = entry.backing.tensor
        base = backing.data_ptr()
        memory, device = mem_type(backing)
        bufs = page_buffers(entry.plan)
        nbytes = sum(b.page_bytes * (n if b.id_space == KV_SPACE else int(swa_out.shape[0]))
                     for b in bufs)
        notification = self.grants.accept(grant, req.sender or "?", nbytes)
        grant.swa_written = swa_out
        self._marks_of(entry).moving(grant.pages, swa_out, +1)
        self._ensure_poller()
        resp = pb.PeerReceiveResponse(
            agent=agent.name, generation=agent.generation,
            buffer_addresses=[base + b.offset_bytes for b in bufs],
            pages=codec.ids_to_bytes(grant.pages), swa_pages=codec.ids_to_bytes(swa_out),
            notification=notification, memory=memory, device=device)
        if req.known_agent != agent.name or req.known_generation != agent.generation:
            resp.agent_metadata = agent.metadata()
        log.info("receive accepted", extra={"fields": {
            "event": "receive", "pool": grant.pool, "lease_id": grant.lease_id,
            "pages": n, "bytes": nbytes, "peer": grant.peer}})
        return resp

    def peer_done(self, token: bytes, ok: bool, message: str) -> None:
        """The sender says how its write ended (a failure, or success as a fallback to the
        notification). No-op for a grant already ended.

        Raises:
            NotFound: no grant for the token.
        """
        grant = self.grants.find(token)
        if grant.state != TransferState.pending or not grant.receiving:
            return
        if ok:
            self.grants.end(grant, TransferState.done, "")
        else:
            self.grants.end(grant, TransferState.failed,
                            f"the sender's write failed: {message[:1000]}")

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_notifications())

    async def _poll_notifications(self) -> None:
        """Read completion notifications while a grant is receiving."""
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
                        self.grants.end(grant, TransferState.done, "")
            await asyncio.sleep(RECEIVER_POLL_S)

    def _grant_ended(self, grant: ReceiveGrant) -> None:
        marks = self._marks.get(grant.pool)  # None once the pool was dropped
        if marks is not None:
            marks.end_grant(grant)
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
        self._sends[out.transfer_id] = out
        self._sending.setdefault(out.owner, []).append(out)
        self._marks_of(entry).moving(pages, swa_src, +1)  # busy from here: Free refuses
        try:
            known = self._peer_agent.get(target, "")
            req = pb.PeerReceiveRequest(
                token=token, layout=self._layout(entry), pages=int(pages.shape[0]),
                swa_mask=mask.tobytes(), known_agent=known,
                known_generation=agent.peer_generation(known) if known else 0,
                sender=agent.name)
            try:
                resp = await self._client(target).call("PeerReceive", req,
                                                       timeout_s=PEER_TIMEOUT_S)
            except KVPoolError as exc:
                hint = ("; a daemon presents its own --token-file secret to its peers, so "
                        "each peer must accept it (the same --token-file on both, or that "
                        "secret as a token in the peer's --tokens-file)"
                        if isinstance(exc, Unauthenticated) else "")
                raise type(exc)(f"peer {target} refused the transfer: {exc.message}{hint}",
                                field=exc.field) from None
            if out.state != TransferState.pending:  # the pool or the lease went meanwhile
                await self._tell_peer(target, token, False, out.message)
                raise FailedPrecondition(f"transfer {out.transfer_id}: {out.message}",
                                         field="pages")
            self._post(agent, entry, out, resp, swa_src)
        except BaseException as exc:
            msg = exc.message if isinstance(exc, KVPoolError) else f"{type(exc).__name__}: {exc}"
            out.source = None  # nothing was posted
            self._end_send(out, TransferState.failed, msg)
            raise
        self._spawn(self._watch(agent, out))
        return out

    def _post(self, agent: NixlAgent, entry: LivePool, out: Outgoing,
              resp: pb.PeerReceiveResponse, swa_src: np.ndarray) -> None:
        """Load the peer's metadata if it came, build both descriptor lists, post the WRITE."""
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
        if resp.agent_metadata:
            agent.add_peer(resp.agent_metadata, resp.generation)
        elif agent.peer_generation(resp.agent) != resp.generation:
            raise Internal(f"peer {out.peer}: agent {resp.agent} generation "
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
        out.source = entry.buffers
        out.handle, state = agent.post_write(local, kind, remote, resp.memory or "DRAM",
                                             resp.agent, resp.notification)
        if state == "ERR":
            handle, out.handle = out.handle, None
            agent.release(handle)
            raise Internal(f"NIXL could not post the write to {out.peer} ({resp.agent})")

    async def _watch(self, agent: NixlAgent, out: Outgoing) -> None:
        """Poll the posted write until it ends; tell the peer about a failure."""
        state = "PROC"
        start = time.monotonic()
        while out.state == TransferState.pending:
            state = agent.state(out.handle)
            if state != "PROC":
                break
            waited = time.monotonic() - start
            if waited > MAX_WRITE_S:
                state = "TIMEOUT"
                break
            await asyncio.sleep(0.0 if waited < SPIN_S else MAX_POLL_S)
        handle, out.handle = out.handle, None
        if handle is not None:
            agent.release(handle)
        out.source = None
        if state == "DONE":
            self._end_send(out, TransferState.done, "")
            return
        why = (f"the write was still in progress after {MAX_WRITE_S:g} s" if state == "TIMEOUT"
               else out.message or f"NIXL reported an error writing to {out.peer_agent} at "
               f"{out.peer} (the peer daemon died or its memory went away)")
        self._end_send(out, TransferState.failed, why)
        await self._tell_peer(out.peer, out.token, False, why)

    async def _tell_peer(self, target: str, token: bytes, ok: bool, message: str) -> None:
        with contextlib.suppress(KVPoolError):
            await self._client(target).call(
                "PeerDone", pb.PeerDoneRequest(token=token, ok=ok, message=message),
                timeout_s=PEER_TIMEOUT_S)

    def _end_send(self, out: Outgoing, state: TransferState, message: str) -> None:
        if not out.finish(state, message, self._clock()):
            return
        busy = self._sending.get(out.owner)
        if busy is not None and out in busy:
            busy.remove(out)
            if not busy:
                del self._sending[out.owner]
        marks = self._marks.get(out.pool)  # None once the pool was dropped
        if marks is not None:
            marks.moving(out.pages, out.swa_pages, -1)
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
            from kvpool.aio import AsyncKVPoolClient

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

    def before_free(self, owner: int, pool: str, ids: np.ndarray, swa: bool = False) -> None:
        """Refuse a Free of pages (KV, or with ``swa`` SWA) a transfer is reading or writing:
        O(len(ids)), nothing at all for a pool that never had a grant or a send.

        Raises:
            FailedPrecondition: naming the first busy page.
        """
        marks = self._marks.get(pool)
        if marks is None:
            return
        busy = marks.busy_of(marks.in_range(ids, swa), swa)
        if busy.shape[0]:
            # Only the lease's own pages: another's are refused by the Free itself (not held),
            # which says nothing about that lease's transfers.
            space = self._pool(pool).ids.space(SWA_SPACE if swa else KV_SPACE, "items",
                                               allocating=False)
            busy = busy[space.owner_of(busy) == owner]
        if busy.shape[0]:
            raise FailedPrecondition(
                f"{'SWA ' if swa else ''}page {int(busy[0])} of pool {pool!r} is in a "
                "transfer in flight; free it "
                "once WaitTransfer says the transfer ended (nothing was freed)",
                field="items")

    def after_free(self, pool: str, ids: np.ndarray) -> None:
        """Revoke the grants covering a freed kv page (they were the freeing lease's: a grant
        covers only pages its lease holds). O(len(ids))."""
        marks = self._marks.get(pool)
        if marks is None:
            return
        for grant in marks.grants_of(marks.in_range(ids)):
            self.grants.end(grant, TransferState.failed,
                            "a granted page was freed before any transfer wrote it")

    def lease_gone(self, owner: int, why: str) -> None:
        """A lease closed or expired: its grants end and its sends are marked failed (a
        posted write still runs to its end; the record does not wait for it)."""
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

"""The sending side of transfers: Send, posting the NIXL WRITE, watching it, ending its record.

A send asks the peer where to write (``peers``), posts one WRITE of every page of every buffer
carrying the notification the peer asked for, and watches it until it has *ended*: nothing of
it can land any more (NIXL reported it done or failed, or it was cancelled and the flush probe
after the cancel completed: ``nixl_agent``). It is cancelled at its deadline, and when its lease
ends or its pool is dropped. A write that did not end done is told to the peer with
``PeerDone(ok=false)`` only then, and the peer gives its pages back on that word. The send's
pages are pinned from Send until its write has ended (``pages``). A *held* send (``hold``) stops
after the peer's acceptance with its write prepared (descriptors built, metadata loaded), and a
later Send naming it only posts it: the peer's round trip happens ahead of the hot path, and a
held send not posted by its write deadline ends failed (the peer told, nothing posted). The
agent's progress thread watches a posted write; this side only awaits its end
(``NixlAgent.ended``), never polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.contract.errors import FailedPrecondition, Internal, KVPoolError, NotFound
from kvpool.contract.records import TransferState, TransferStatus
from kvpoold.transfer.descriptors import Layouts, page_memory, write_rows
from kvpoold.transfer.grants import TransferRecord
from kvpoold.transfer.liveness import this_process
from kvpoold.transfer.messages import Acceptance, PeerReceiveArgs, PostArgs, SendArgs
from kvpoold.transfer.nixl_agent import NixlAgent, Write, XferState
from kvpoold.transfer.page_layout import KV_SPACE
from kvpoold.transfer.pages import LeaseLookup, Pins, has_swa, held_space
from kvpoold.transfer.peers import Peers, Spawn

if TYPE_CHECKING:
    from kvpoold.pools.pool import Pool

log = logging.getLogger("kvpoold.transfer")

MAX_ENDED_SENDS = 4096


@dataclass(frozen=True, eq=False)
class Prepared:
    """A write ready to post: both descriptor lists and memory types, the notification the
    peer asked for, and the source pool's buffers (kept while the write may read them)."""

    local: np.ndarray
    local_kind: str
    remote: np.ndarray
    remote_kind: str
    notification: bytes
    source: Any


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
    write_s: float = 0.0  # the write deadline the peer gave, from its PeerReceive request
    deadline: float = 0.0  # time.monotonic() by which the write must end (from the peer)
    write: Write | None = None  # the posted write, until it ended
    held: Prepared | None = None  # the write prepared and not posted yet (a held send)
    expiry: asyncio.TimerHandle | None = None  # a held send's end at its write deadline
    # Gives the pages' pins back (exactly once): when nothing was posted, or once the posted
    # write has ended. None after.
    unpin: Any = None
    # The pool while its write may be reading it: a forced Drop meanwhile must not unmap the
    # memory under NIXL (the views keep the mapping; dropped when the write ends).
    source: Any = None

    def status(self, now: float) -> TransferStatus:
        return self.status_since(self.posted_at, self.peer_agent or self.peer,
                                 int(self.pages.shape[0]), now)


class Sends:
    """The sends of one daemon, in flight and recently ended.

    Args:
        pool: the daemon's pool lookup (raises NotFound / InvalidArgument).
        leases: the daemon's lease table.
        clock: the daemon's monotonic clock.
        need_agent: the NIXL agent (raises FailedPrecondition without one).
        layouts: the pools' page layouts.
        pins: pins the sent pages.
        peers: the peer clients and counters.
        spawn: runs a coroutine in the background (each posted write's watcher).
    """

    def __init__(self, pool: Callable[[str], Pool], leases: LeaseLookup,
                 clock: Callable[[], float], need_agent: Callable[[], NixlAgent],
                 layouts: Layouts, pins: Pins, peers: Peers, spawn: Spawn) -> None:
        self._pool = pool
        self._leases = leases
        self._clock = clock
        self._need_agent = need_agent
        self._layouts = layouts
        self._pins = pins
        self._peers = peers
        self._spawn = spawn
        self._sends: dict[int, Outgoing] = {}
        self._ended: deque[Outgoing] = deque()
        self._sending: dict[int, list[Outgoing]] = {}  # owner -> its sends in flight
        self._ids = itertools.count(1)

    async def send(self, lease_id: int, args: SendArgs) -> Outgoing:
        """Write ``args.pages`` (held by the lease) into the peer's pages granted by
        ``args.token``.

        Returns once the peer accepted and the write is posted (with ``args.wait_s``: once it
        ended, or that long after); with ``args.hold``, once the peer accepted: the write is
        ready, and :meth:`post` posts it. The record ends by itself.

        Raises:
            FailedPrecondition: no NIXL, a page not held, or the peer refused (grant ended,
                layouts differ...: the peer's message, prefixed with its address).
            Unavailable: the peer cannot be reached. NotFound: pool, lease or (at the peer)
                grant unknown. InvalidArgument: (at the peer) a page count not granted.
        """
        pool, pages, target, token = args.pool, args.pages, args.peer, args.token
        agent = self._need_agent()
        entry = self._pool(pool)
        lease = self._leases.get(lease_id)
        held_space(entry, lease.owner, lease_id, pages, "pages")
        mask = np.empty(0, dtype=np.uint8)
        swa_src = np.empty(0, dtype=np.int32)
        if has_swa(entry.plan):
            paired = entry.ids.paired_of(KV_SPACE, pages)
            mask = (paired != 0).astype(np.uint8)
            swa_src = paired[paired != 0]
        out = Outgoing(next(self._ids), target, pool, lease.owner, pages, token,
                       identity=lease.identity, swa_pages=swa_src)
        # Pinned from here until nothing can read them any more: a Free is refused, and the
        # lease's end quarantines them, so no other lease's bytes are ever shipped.
        out.unpin = self._pins.hold(entry, pages, swa_src)
        self._sends[out.transfer_id] = out
        self._sending.setdefault(out.owner, []).append(out)
        accepted = False
        try:
            known = self._peers.agent_of(target)
            ask = PeerReceiveArgs(
                token=token, layout=self._layouts.of(entry), pages=int(pages.shape[0]),
                swa_mask=mask.tobytes(), known_agent=known,
                known_generations=frozenset(agent.known_generations(known) if known else ()),
                sender=agent.name, writer=this_process())
            asked_at = time.monotonic()  # the write deadline counts from here
            acc = await self._peers.ask_receive(target, ask)
            accepted = True
            if out.state != TransferState.pending:  # the pool or the lease went meanwhile
                raise FailedPrecondition(f"transfer {out.transfer_id}: {out.message}",
                                         field="pages")
            if acc.agent == agent.name:
                raise FailedPrecondition(
                    f"peer {target} is this daemon itself: a daemon cannot send pages to its "
                    "own pools over NIXL", field="peer")
            self._prepare(agent, entry, out, acc, swa_src, asked_at)
            if args.hold:
                out.expiry = asyncio.get_running_loop().call_later(
                    max(0.0, out.deadline - time.monotonic()), self._held_expired, out)
                return out
            self._start(agent, out)
        except BaseException as exc:
            self._failed(agent, out, exc, accepted)
            raise
        await self._waited(out, args.wait_s)
        return out

    async def post(self, owner: int, args: PostArgs) -> Outgoing:
        """Post the held send ``args.transfer_id`` of the lease ``owner`` (see :meth:`send`):
        its write was prepared when the peer accepted, so this is the NIXL post alone.

        Returns:
            The send, once posted (with ``args.wait_s``: once it ended, or that long after).

        Raises:
            NotFound: no send of this lease with that id. FailedPrecondition: no NIXL, or the
                send was not held, is posted already, or has ended (its deadline passed, its
                lease or pool went).
        """
        agent = self._need_agent()
        out = self._sends.get(args.transfer_id)
        if out is None or out.owner != owner:
            raise NotFound(f"no send {args.transfer_id} of this lease on this daemon (held "
                           "sends are posted by the lease that made them)",
                           field="transfer_id")
        if out.state != TransferState.pending:
            raise FailedPrecondition(f"transfer {out.transfer_id} has ended: {out.message}",
                                     field="transfer_id")
        if out.held is None:
            raise FailedPrecondition(f"transfer {out.transfer_id} is not a held send waiting "
                                     "to be posted (posted already, or sent without hold)",
                                     field="transfer_id")
        try:
            self._start(agent, out)
        except BaseException as exc:
            self._failed(agent, out, exc, True)
            raise
        await self._waited(out, args.wait_s)
        return out

    @staticmethod
    async def _waited(out: Outgoing, wait_s: float) -> None:
        """Wait up to ``wait_s`` for a posted send's record to end."""
        if wait_s <= 0 or out.state != TransferState.pending:
            return
        if out.write is None:  # not posted (failed before): its record's end
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(out.ended.wait(), wait_s)
            return
        # Woken by the write's own future (its end callback, registered first, ends the
        # record before this wakes) or the timer, whichever first: no task, shield or
        # wait_for in between on the hot path (each is a loop pass more per post).
        ended = out.write.done
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake(_: object = None) -> None:
            if not woken.done():
                woken.set_result(None)

        ended.add_done_callback(wake)
        timer = loop.call_later(wait_s, wake)
        try:
            await woken
        finally:
            timer.cancel()
            ended.remove_done_callback(wake)

    def _failed(self, agent: NixlAgent, out: Outgoing, exc: BaseException,
                accepted: bool) -> None:
        """A send failed before or while posting: end its record, and give its pins back
        and tell the peer once nothing of it is in flight."""
        msg = exc.message if isinstance(exc, KVPoolError) else f"{type(exc).__name__}: {exc}"
        self._end(out, TransferState.failed, msg)
        self._forget_held(out)
        if out.write is not None and out.write.ended is None:
            self._watch(agent, out)  # it tells the peer once the write ended
        else:
            out.source = None  # nothing of it is in flight
            self._unpin(out)
            if accepted:  # the peer keeps the grant's pages fenced until told
                self._spawn(self._peers.tell_done(out.peer, out.token, False, msg))

    def _prepare(self, agent: NixlAgent, entry: Pool, out: Outgoing, acc: Acceptance,
                 swa_src: np.ndarray, asked_at: float) -> None:
        """Load the peer's metadata if it came, build both descriptor lists, with the
        deadline the peer gave (from ``asked_at``): everything of the write but its post."""
        mine = page_memory(entry)
        if (len(acc.buffer_addresses) != len(mine.buffers) or acc.pages.shape != out.pages.shape
                or acc.swa_pages.shape != swa_src.shape):
            raise Internal(
                f"peer {out.peer} answered {len(acc.buffer_addresses)} buffers, "
                f"{acc.pages.shape[0]} pages and {acc.swa_pages.shape[0]} SWA pages for "
                f"{len(mine.buffers)} buffers, {out.pages.shape[0]} pages and "
                f"{swa_src.shape[0]} SWA pages")
        if acc.metadata:
            agent.add_peer(acc.metadata, acc.generation)
        elif acc.generation not in agent.known_generations(acc.agent):
            raise Internal(f"peer {out.peer}: agent {acc.agent} registration "
                           f"{acc.generation} sent without its metadata")
        self._peers.answered(out.peer, acc.agent)
        out.peer_agent = acc.agent
        local, remote = write_rows(mine, out.pages, swa_src, acc)
        out.nbytes = int(local[:, 1].sum())
        out.descriptors = int(local.shape[0])
        out.write_s = acc.write_deadline_s
        out.deadline = asked_at + acc.write_deadline_s
        out.held = Prepared(local, mine.memory, remote, acc.memory, acc.notification,
                            entry.buffers)

    def _start(self, agent: NixlAgent, out: Outgoing) -> None:
        """Post the prepared write; end the record at once if it already ended (a small
        write over shared memory), else watch it."""
        held = out.held
        assert held is not None
        self._forget_held(out)
        out.posted_at = self._clock()
        out.source = held.source
        out.write = agent.post_write(held.local, held.local_kind, held.remote, held.remote_kind,
                                     out.peer_agent, held.notification, out.deadline)
        if out.write.ended == "ERR":
            raise Internal(f"NIXL could not post the write to {out.peer} ({out.peer_agent})")
        if out.write.ended is not None:
            self._written(out, out.write.ended)
        else:
            self._watch(agent, out)

    def _watch(self, agent: NixlAgent, out: Outgoing) -> None:
        """End the send once the posted write has ended (the agent cancels it at its
        deadline)."""
        write = out.write
        assert write is not None
        agent.ended(write).add_done_callback(
            lambda done: self._written(out, done.result()) if not done.cancelled() else None)

    def _written(self, out: Outgoing, state: XferState) -> None:
        """The posted write has ended: give its pins back, end the record, and tell the peer
        about a write that did not end done."""
        out.source = None
        self._unpin(out)
        if state == "DONE":
            self._end(out, TransferState.done, "")
            return
        # The deadline the peer gave counts from the PeerReceive request, not from this
        # watcher's start (which a stalled daemon can reach after the deadline passed).
        why = (out.message if out.state != TransferState.pending
               else f"the write did not complete within its {out.write_s:.3g} s deadline "
               "and was cancelled" if state == "CANCELLED"
               else f"NIXL reported an error writing to {out.peer_agent} at {out.peer} (the "
               "peer daemon died or its memory went away)")
        self._end(out, TransferState.failed, why)
        self._spawn(self._peers.tell_done(out.peer, out.token, False,
                                          f"{why}; nothing of it is in flight"))

    def _held_expired(self, out: Outgoing) -> None:
        out.expiry = None
        self._cancel(out, f"the held send was not posted within its {out.write_s:.3g} s "
                     "write deadline")

    @staticmethod
    def _forget_held(out: Outgoing) -> None:
        out.held = None
        if out.expiry is not None:
            out.expiry.cancel()
            out.expiry = None

    def _cancel(self, out: Outgoing, why: str) -> None:
        """End a send's record as failed and cancel its write (its pins stay until the write
        has ended: the watcher gives them back and tells the peer); a held send's write was
        never posted: its pins go now, and the peer is told."""
        self._end(out, TransferState.failed, why)
        if out.held is not None:
            self._forget_held(out)
            self._unpin(out)
            self._spawn(self._peers.tell_done(out.peer, out.token, False,
                                              f"{why}; the held write was never posted"))
        elif out.write is not None:
            self._need_agent().cancel(out.write)

    @staticmethod
    def _unpin(out: Outgoing) -> None:
        unpin, out.unpin = out.unpin, None
        if unpin is not None:
            unpin()

    def _end(self, out: Outgoing, state: TransferState, message: str) -> None:
        """End a send's record (its pins go with its handle, :meth:`_unpin`)."""
        if not out.finish(state, message, self._clock()):
            return
        busy = self._sending.get(out.owner)
        if busy is not None and out in busy:
            busy.remove(out)
            if not busy:
                del self._sending[out.owner]
        self._ended.append(out)
        while len(self._ended) > MAX_ENDED_SENDS:
            self._sends.pop(self._ended.popleft().transfer_id, None)
        if state == TransferState.done:
            self._peers.count(out.peer, sent=1, sent_bytes=out.nbytes)
        else:
            self._peers.count(out.peer, send_failures=1)
        # Per transfer: a failure at INFO, a success at DEBUG (the metrics count those).
        log.log(logging.DEBUG if state == TransferState.done else logging.INFO,
                "send ended", extra={"fields": {
            "event": "send_end", "pool": out.pool, "transfer_id": out.transfer_id,
            "state": state.value, "message": message, "bytes": out.nbytes, "peer": out.peer,
            "seconds": round(out.ended_at - out.posted_at, 6) if out.posted_at else 0.0}})

    def find(self, transfer_id: int, identity: str | None) -> Outgoing:
        """The send ``transfer_id``, shown only to ``identity`` (None: any caller).

        Raises:
            NotFound: unknown, long ended, or another identity's send.
        """
        found = self._sends.get(transfer_id)
        if found is None or identity not in (None, found.identity):
            raise NotFound(f"no transfer {transfer_id} on this daemon (never sent here, or "
                           f"one of over {MAX_ENDED_SENDS} ended since)", field="transfer_id")
        return found

    def lease_gone(self, owner: int, why: str) -> None:
        """A lease ended: its sends fail, and a posted write is cancelled (cancel-on-close);
        its pages stay pinned (quarantined) until the write has ended, and the peer keeps its
        own fenced until this daemon tells it so."""
        for out in list(self._sending.get(owner, ())):
            self._cancel(out, f"cancelled: {why}")

    def pool_gone(self, name: str, why: str) -> None:
        """A pool is being dropped: its sends fail and their writes are cancelled (a posted
        write's pins still hold a use of the pool until it has ended)."""
        for out in [o for o in self._sends.values()
                    if o.pool == name and o.state == TransferState.pending]:
            self._cancel(out, f"cancelled: {why}")

"""Transfers between daemons: the facade the daemon calls, composing receives, sends and peers.

The flow (docs/pd-transfer.md):

1. The decode engine's lease grants pages it holds (``receives``) and hands the
   token to the prefill engine.
2. The prefill engine asks its daemon to send pages its lease holds (``sends``):
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
as bytes may move: the grant's pages from GrantReceive until a fact closes its write window
(see ``grants``: never a clock), a send's pages from Send until its write has ended
(``nixl_agent``). A Free of a pinned
page is refused, and a lease's end quarantines its pinned pages (no other lease can be handed
them) until the last unpin frees them. Nothing outside the ledger is consulted by Free.

Only peer daemons call PeerReceive and PeerDone (the servicer checks the caller); a self-send is
refused before anything is posted. Every argument comes typed and bounded from the edge
(``messages``); nothing here reads request bytes.

All state is owned by the daemon's event loop. NIXL is progressed by the agent's own thread
(``nixl_agent``, ``progress``), which posts each write's end and the notifications to the loop:
the loop never spins or polls for a transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import msgspec

from kvpool.contract.errors import FailedPrecondition
from kvpool.contract.records import PeerStats, TransferState, TransferStatus
from kvpoold.transfer.descriptors import Layouts
from kvpoold.transfer.grants import GrantTable, ReceiveGrant
from kvpoold.transfer.liveness import ProcessWatch
from kvpoold.transfer.messages import (
    Acceptance,
    GrantArgs,
    PeerDoneArgs,
    PeerReceiveArgs,
    PostArgs,
    SendArgs,
    WaitArgs,
)
from kvpoold.transfer.nixl_agent import NixlAgent
from kvpoold.transfer.nixl_module import NIXL_MISSING
from kvpoold.transfer.pages import LeaseLookup, Pins
from kvpoold.transfer.peers import Peers
from kvpoold.transfer.receives import Receives
from kvpoold.transfer.sends import Outgoing, Sends

if TYPE_CHECKING:
    from kvpoold.pools.pool import Pool

log = logging.getLogger("kvpoold.transfer")

MAX_WAIT_S = 3600.0


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

    def __init__(self, pool: Callable[[str], Pool], leases: LeaseLookup,
                 clock: Callable[[], float], agent: NixlAgent | None = None,
                 why_off: str = NIXL_MISSING, peer_token: str | None = None,
                 on_freed: Callable[[], None] | None = None) -> None:
        self._clock = clock
        self.agent = agent
        self._why_off = why_off
        self._tasks: set[asyncio.Task[Any]] = set()
        self._layouts = Layouts()
        self._peers = Peers(peer_token, self._spawn)
        pins = self.pins = Pins(on_freed)  # the pins of every grant and send
        self.watch = ProcessWatch()  # the processes of senders writing into this daemon
        self._receives = Receives(pool, leases, clock, self._need_agent, self._layouts, pins,
                                  self._peers, self.watch)
        self._sends = Sends(pool, leases, clock, self._need_agent, self._layouts, pins,
                            self._peers, self._spawn)

    @property
    def enabled(self) -> bool:
        return self.agent is not None

    @property
    def grants(self) -> GrantTable:
        """The receive grants, live and recently ended."""
        return self._receives.grants

    @property
    def peers(self) -> dict[str, PeerStats]:
        """Per peer (the address sent to, or the agent received from), what Stats shows:
        the counters, and the writes and pages it holds fenced now (O(peers))."""
        fenced = self._receives.grants.fenced()
        if not fenced:
            return self._peers.stats
        out = dict(self._peers.stats)
        for peer, (writes, pages) in fenced.items():
            out[peer] = msgspec.structs.replace(out.get(peer) or PeerStats(peer=peer),
                                                fenced_writes=writes, fenced_pages=pages)
        return out

    def _need_agent(self) -> NixlAgent:
        if self.agent is None:
            raise FailedPrecondition(self._why_off)
        return self.agent

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- pools -------------------------------------------------------------------------------

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
        self._receives.grants.revoke_pool(name, why)
        self._sends.pool_gone(name, why)
        self._layouts.forget(name)

    def deregister(self, name: str) -> None:
        """A pool's region is released: its NIXL registration goes (no-op without an
        agent). A failure is logged: the region is gone either way."""
        if self.agent is not None:
            try:
                self.agent.deregister(name)
            except Exception:
                log.exception("NIXL deregistration of pool %s failed", name)

    # -- either side -------------------------------------------------------------------------

    def grant(self, lease_id: int, args: GrantArgs) -> ReceiveGrant:
        """See :meth:`Receives.grant`."""
        return self._receives.grant(lease_id, args)

    def peer_receive(self, args: PeerReceiveArgs) -> Acceptance:
        """See :meth:`Receives.peer_receive`."""
        return self._receives.peer_receive(args)

    def peer_done(self, args: PeerDoneArgs) -> None:
        """See :meth:`Receives.peer_done`."""
        self._receives.peer_done(args.token, args.ok, args.message)

    def notified(self, notes: dict[str, list[bytes]]) -> None:
        """See :meth:`Receives.notified` (the agent's progress thread posts them there)."""
        self._receives.notified(notes)

    def cancel_grant(self, owner: int, lease_id: int, token: bytes
                     ) -> tuple[TransferStatus, int, int]:
        """See :meth:`Receives.cancel`."""
        self._need_agent()
        return self._receives.cancel(owner, lease_id, token)

    async def send(self, lease_id: int, args: SendArgs) -> Outgoing:
        """See :meth:`Sends.send`."""
        return await self._sends.send(lease_id, args)

    async def post(self, owner: int, args: PostArgs) -> Outgoing:
        """See :meth:`Sends.post`."""
        return await self._sends.post(owner, args)

    async def wait(self, args: WaitArgs, identity: str | None = None) -> TransferStatus:
        """The status of a send (``args.transfer_id``) or a grant (``args.token``), after
        waiting up to ``args.timeout_s`` for it to end. A send is shown only to ``identity``,
        the caller identity of its lease (None: any caller, an admin); a grant to whoever has
        its token.

        Raises:
            NotFound: unknown (or long ended) transfer or grant, or another identity's send.
        """
        record: Outgoing | ReceiveGrant = (self._sends.find(args.transfer_id, identity)
                                           if args.transfer_id else self.grants.find(args.token))
        if record.state == TransferState.pending and args.timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.ended.wait(), args.timeout_s)
        return record.status(self._clock())

    # -- hooks from the daemon -----------------------------------------------------------------

    def lease_gone(self, owner: int, why: str) -> None:
        """A lease closed or expired: its grants end and its sends fail, their posted writes
        cancelled. A write in flight keeps its pages pinned (the lease's reclaim quarantines
        them) until it has ended: a posted send until NIXL (or the flush probe after its
        cancel) says so, an accepted grant until a fact closes its window."""
        self._receives.grants.revoke_owner(owner, why)
        self._sends.lease_gone(owner, why)

    def expire(self) -> None:
        """End expired grants and the records of writes past their deadline (their pages stay
        fenced)."""
        self._receives.grants.expire()

    async def close(self) -> None:
        """Stop every watcher and the agent's progress thread; close the peer clients."""
        for task in list(self._tasks):
            task.cancel()
        if self.agent is not None:
            self.agent.close()
        self.watch.close()
        await self._peers.close()

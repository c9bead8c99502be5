"""The receiving side of transfers: grants, a peer's PeerReceive and PeerDone, the write's
notification ending its grant.

A lease grants pages it holds (:meth:`Receives.grant`, pinned from here: see ``grants``); a peer
daemon presenting the token is checked (the grant, the page layout, the page count and SWA mask)
and accepted once (:meth:`Receives.peer_receive`); while an accepted grant's write window is
open the agent's progress thread reads NIXL's notifications (``NixlAgent.listen``) and posts
them here, and the write's own notification ends the grant ``done``. The sender's
``PeerDone(ok=false)`` (its write ended, nothing of it in flight) ends it ``failed``;
``ok=true`` ends nothing. The sender's process is watched (``liveness``) where it can be: its
exit closes the window too. The lease can cancel its grant (:meth:`Receives.cancel`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvpool.contract.errors import FailedPrecondition, InvalidArgument, NotFound
from kvpool.contract.records import TransferState, TransferStatus
from kvpoold.transfer.descriptors import Layouts, page_memory
from kvpoold.transfer.grants import GrantTable, ReceiveGrant
from kvpoold.transfer.liveness import ProcessWatch
from kvpoold.transfer.messages import Acceptance, GrantArgs, PeerReceiveArgs
from kvpoold.transfer.nixl_agent import NixlAgent, Notes
from kvpoold.transfer.page_layout import KV_SPACE, layout_mismatch
from kvpoold.transfer.pages import LeaseLookup, Pins, has_swa, held_space
from kvpoold.transfer.peers import Peers

if TYPE_CHECKING:
    from kvpoold.pools.pool import Pool

log = logging.getLogger("kvpoold.transfer")


class Receives:
    """The grants of one daemon and the writes peers make into them.

    Args:
        pool: the daemon's pool lookup (raises NotFound / InvalidArgument).
        leases: the daemon's lease table.
        clock: the daemon's monotonic clock.
        need_agent: the NIXL agent (raises FailedPrecondition without one).
        layouts: the pools' page layouts.
        pins: pins the granted pages.
        peers: the per-peer counters.
        watch: watches the senders' processes.
    """

    def __init__(self, pool: Callable[[str], Pool], leases: LeaseLookup,
                 clock: Callable[[], float], need_agent: Callable[[], NixlAgent],
                 layouts: Layouts, pins: Pins, peers: Peers, watch: ProcessWatch) -> None:
        self._clock = clock
        self._watch = watch
        self._pool = pool
        self._leases = leases
        self._need_agent = need_agent
        self._layouts = layouts
        self._pins = pins
        self._peers = peers
        self.grants = GrantTable(clock, self._grant_ended, on_windows=self._listen)

    def grant(self, lease_id: int, args: GrantArgs) -> ReceiveGrant:
        """Let one transfer write into ``args.pages`` (held by the lease) until
        ``args.ttl_s`` passes.

        Raises:
            FailedPrecondition: no NIXL, or a page not held by the lease or pinned.
            InvalidArgument, NotFound, ResourceExhausted: see GrantTable.add and the checks.
        """
        pool, pages = args.pool, args.pages
        self._need_agent()
        entry = self._pool(pool)
        lease = self._leases.get(lease_id)
        kv = held_space(entry, lease.owner, lease_id, pages, "pages")
        busy = kv.pinned_of(pages.astype(np.intp))
        if busy.any():
            pos = int(busy.argmax())
            raise FailedPrecondition(
                f"pages[{pos}]={int(pages[pos])} of pool {pool!r} is pinned by a transfer (a "
                "live receive grant or a send); a page takes one transfer at a time (wait for "
                "it to end, or grant other pages)", field=f"pages[{pos}]")
        swa = entry.ids.paired_of(KV_SPACE, pages) if has_swa(entry.plan) else None
        linked = None if swa is None else swa[swa != 0]
        grant = self.grants.add(pool, lease_id, lease.owner, pages, swa,
                                args.ttl_s,
                                lambda: self._pins.hold(entry, pages, linked))
        log.debug("receive granted", extra={"fields": {
            "event": "grant", "pool": pool, "lease_id": lease_id, "pages": int(pages.shape[0]),
            "ttl_s": grant.expires_at - grant.created_at}})
        return grant

    def peer_receive(self, args: PeerReceiveArgs) -> Acceptance:
        """A peer daemon asks where to write: check the grant, the layout and the pages,
        accept it, and answer what its write needs.

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
        why = layout_mismatch(self._layouts.of(entry), args.layout)
        if why is not None:
            raise FailedPrecondition(f"pool {grant.pool!r} cannot take these pages: {why}",
                                     field="layout")
        n = int(grant.pages.shape[0])
        if args.pages != n:
            raise InvalidArgument(f"the sender sends {args.pages} pages, the grant covers {n}; "
                                  "send exactly the granted count", field="pages")
        # Pinned since the grant: still held by its lease unless the lease ended (quarantined).
        held_space(entry, grant.owner, grant.lease_id, grant.pages, "pages")
        swa_out = self._swa_pages(grant, args.swa_mask)
        where = page_memory(entry)
        nbytes = where.nbytes(n, int(swa_out.shape[0]))
        notification = self.grants.accept(grant, args.sender, nbytes, args.writer)
        if args.writer is not None:
            grant.unwatch = self._watch.watch(args.writer, lambda: self._writer_exited(grant))
        generation = agent.generation(grant.pool)
        stale = args.known_agent != agent.name or generation not in args.known_generations
        log.debug("receive accepted", extra={"fields": {
            "event": "receive", "pool": grant.pool, "lease_id": grant.lease_id,
            "pages": n, "bytes": nbytes, "peer": grant.peer, "write_s": grant.write_s}})
        return Acceptance(
            agent=agent.name, generation=generation,
            metadata=agent.pool_metadata(grant.pool) if stale else b"",
            buffer_addresses=where.addresses, pages=grant.pages, swa_pages=swa_out,
            notification=notification, memory=where.memory, device=where.device,
            write_deadline_s=grant.write_s)

    @staticmethod
    def _swa_pages(grant: ReceiveGrant, swa_mask: bytes) -> np.ndarray:
        """The granted SWA pages the sender has a page for (``swa_mask``, one byte per page).

        Raises:
            InvalidArgument: a mask of another length, or one for a pool without SWA pages.
            FailedPrecondition: the sender has an SWA page where the grant had none.
        """
        n = int(grant.pages.shape[0])
        if grant.swa_pages is None:
            if swa_mask:
                raise InvalidArgument("swa_mask given for a pool without SWA pages",
                                      field="swa_mask")
            return np.empty(0, dtype=np.int32)
        if len(swa_mask) != n:
            raise InvalidArgument(f"swa_mask has {len(swa_mask)} bytes, the grant {n} pages",
                                  field="swa_mask")
        mask = np.frombuffer(swa_mask, dtype=np.uint8) != 0
        lost = mask & (grant.swa_pages == 0)
        if lost.any():
            pos = int(lost.argmax())
            raise FailedPrecondition(
                f"page {int(grant.pages[pos])} had no SWA page when granted; the sender "
                "has one for it", field="swa_mask")
        return grant.swa_pages[mask]

    def peer_done(self, token: bytes, ok: bool, message: str) -> None:
        """The sender's word on its write: ``ok = False`` says nothing of it can land any more
        (NIXL reported it ended, or a flush probe after its cancel completed, or it was never
        posted): the grant ends failed and its pages come back; ``ok = True`` ends nothing
        (only the write's own notification makes a grant done). No-op for a grant no sender
        was accepted into.

        Raises:
            NotFound: no grant for the token.
        """
        grant = self.grants.find(token)
        if not grant.receiving or ok:
            return
        self.grants.close_window(grant, TransferState.failed,
                                 f"the sender's write failed: {message}")

    def _writer_exited(self, grant: ReceiveGrant) -> None:
        grant.unwatch = None  # its pidfd is closed already
        pid = grant.writer.pid if grant.writer is not None else 0
        self.grants.close_window(grant, TransferState.failed, (
            f"the sending daemon {grant.peer} (process {pid}) exited before its write "
            "reported its end"))

    def cancel(self, owner: int, lease_id: int, token: bytes) -> tuple[TransferStatus, int, int]:
        """End a grant of the lease now (CancelGrant). Its pages are unpinned at once when no
        sender was accepted; else they stay fenced until the writer has ended.

        Returns:
            The grant's status, the pages unpinned by this call, the pages still fenced.

        Raises:
            NotFound: no grant for the token made by this lease.
        """
        grant = self.grants.find(token)
        if grant.owner != owner:
            raise NotFound(f"lease {lease_id} made no receive grant with this token; cancel a "
                           "grant with the lease that made it", field="token")
        was_pinned = grant.unpin is not None
        self.grants.end(grant, TransferState.failed, "the receive grant was cancelled by its "
                        "lease" + (f" while a write from {grant.peer} may still land"
                                   if grant.window_open else ""))
        n = int(grant.pages.shape[0])
        fenced = n if grant.window_open else 0
        freed = n if was_pinned and grant.unpin is None else 0
        return grant.status(self._clock()), freed, fenced

    def _listen(self) -> None:
        """Tell the agent what to read notifications for, whenever the open write windows
        change: live ones (often), only fenced ones (rarely), none (not at all)."""
        try:
            agent = self._need_agent()
        except FailedPrecondition:
            return  # no NIXL: no window ever opens
        receiving = self.grants.receiving
        agent.listen("off" if not receiving else "fenced"
                     if receiving <= self.grants.fenced_writes else "live", self.notified)

    def notified(self, notes: Notes) -> None:
        """Notifications the agent read (by sending agent): each write's own ends its grant
        ``done`` and gives its pages back; others are ignored."""
        for messages in notes.values():
            for message in messages:
                grant = self.grants.by_notification(bytes(message))
                if grant is not None:
                    self.grants.close_window(grant, TransferState.done, "")

    def _grant_ended(self, grant: ReceiveGrant) -> None:
        if not grant.receiving:
            return
        if grant.state == TransferState.done:
            self._peers.count(grant.peer, received=1, received_bytes=grant.nbytes)
        else:
            self._peers.count(grant.peer, receive_failures=1)
        # Per transfer: a failure at INFO, a success at DEBUG (the metrics count those).
        log.log(logging.DEBUG if grant.state == TransferState.done else logging.INFO,
                "receive ended", extra={"fields": {
            "event": "receive_end", "pool": grant.pool, "state": grant.state.value,
            "message": grant.message, "bytes": grant.nbytes, "peer": grant.peer,
            "seconds": round(grant.ended_at - grant.accepted_at, 6)}})

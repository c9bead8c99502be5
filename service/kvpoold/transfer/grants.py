"""Receive grants: which pages of which lease a peer daemon may write, once, until when.

A grant is made by the lease holding the pages (GrantReceive) and named by an opaque token of
:data:`TOKEN_BYTES` random bytes (``secrets.token_bytes``): whoever holds the token may have
one transfer written into those pages, and nothing else. The grant **pins** its pages in the
ledger from the start (``IdSpace.pin``: no Free, no second grant, and its lease's end
quarantines them) until its *write window* closes:

- before a sender is accepted, the window closes when the grant ends: it expired, or its lease
  ended or its pool was dropped (revoked);
- once a sender is accepted (PeerReceive), only a **fact** that its write can no longer land
  closes it, never a clock: the write's NIXL notification (``done``); the sender's PeerDone
  with ``ok = false``, which it sends only once NIXL reported the write ended (or a flush probe
  after its cancel completed: see ``nixl_agent``); or the sender's process exiting
  (``liveness``). At the write deadline (or a cancel, or its lease's end) the record ends
  ``failed`` but the pages stay pinned (quarantined once their lease ended): the grant is
  **fenced**. Fenced pages are counted per peer (Stats, /metrics), and a peer holding
  :data:`MAX_FENCED_PAGES_PER_PEER` fenced pages is refused new writes until a fact frees
  them.

Ended grants are kept :data:`ENDED_KEEP_S` (at most :data:`MAX_ENDED` of them) so the decode
side can still read how they ended. Every count is bounded: live grants per daemon and per
lease, pages per grant. All state is owned by the daemon's event loop (no locks).
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kvpool.contract.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvpool.contract.records import TransferState, TransferStatus
from kvpoold.deadlines import DeadlineHeap
from kvpoold.transfer.liveness import ProcessId

TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 64
MAX_GRANT_PAGES = 65536
MAX_GRANTS = 65536
MAX_GRANTS_PER_LEASE = 4096
DEFAULT_GRANT_TTL_S = 60.0
MIN_GRANT_TTL_S = 0.1
MAX_GRANT_TTL_S = 3600.0
ENDED_KEEP_S = 60.0
MAX_ENDED = 4096
# An accepted sender must finish its write within the grant's TTL (at least MIN_WRITE_S, at
# most MAX_WRITE_S) from its PeerReceive request, or cancel it; the grant's record ends failed
# then, its pages only when the writer has ended (a fact, never this clock).
MIN_WRITE_S = 1.0
MAX_WRITE_S = 300.0
# Pages one peer (a sending agent) may hold fenced; at the bound its next write is refused.
MAX_FENCED_PAGES_PER_PEER = 1 << 18


@dataclass(eq=False, kw_only=True)
class TransferRecord:
    """What a send (``Outgoing``) and a receive grant (``ReceiveGrant``) share: a state that
    ends once, why, when, and an event ``WaitTransfer`` waits on."""

    state: TransferState = TransferState.pending
    message: str = ""
    nbytes: int = 0
    ended_at: float = 0.0
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def finish(self, state: TransferState, message: str, now: float) -> bool:
        """End the record as ``state``; False (nothing changed) if it had already ended."""
        if self.state != TransferState.pending:
            return False
        self.state = state
        self.message = message
        self.ended_at = now
        self.ended.set()
        return True

    def status_since(self, started_at: float, peer: str, pages: int, now: float
                     ) -> TransferStatus:
        """The record as WaitTransfer answers it; seconds from ``started_at`` (0: not started)
        to its end, or to ``now`` while pending."""
        end = self.ended_at if self.state != TransferState.pending else now
        return TransferStatus(state=self.state, message=self.message, bytes=self.nbytes,
                              pages=pages, peer=peer,
                              seconds=max(0.0, end - started_at) if started_at else 0.0)


@dataclass(eq=False)
class ReceiveGrant(TransferRecord):
    """One grant. ``pages`` are kv page ids (int32) of ``pool`` held by ``owner``;
    ``swa_pages`` the SWA page paired with each at grant time (hybrid SWA pools, else None)."""

    token: bytes
    pool: str
    lease_id: int
    owner: int
    pages: np.ndarray
    swa_pages: np.ndarray | None
    created_at: float
    expires_at: float
    receiving: bool = False  # a sender was given the addresses; its write may be in flight
    peer: str = ""
    accepted_at: float = 0.0
    notification: bytes = b""
    write_s: float = 0.0  # the accepted sender's write deadline, from its request
    deadline_at: float = 0.0  # when the record ends failed if the write has not (pins stay)
    writer: ProcessId | None = None  # the sending daemon's process, as it named it
    fenced: bool = False  # the record ended while the write window is open
    # Gives the pages' pins back (exactly once); None once the window closed.
    unpin: Callable[[], None] | None = field(default=None, repr=False)
    # Stops watching the writer's process (its exit closes the window); None when not watched.
    unwatch: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def window_open(self) -> bool:
        """Whether an accepted sender's write may still land in the pages."""
        return self.receiving and self.unpin is not None

    def ended_text(self) -> str:
        """Why a grant takes no transfer now, for refusals."""
        if self.state == TransferState.done:
            return f"the receive grant was used: a transfer from {self.peer} completed into it"
        return f"the receive grant has ended: {self.message}"

    def status(self, now: float) -> TransferStatus:
        return self.status_since(self.accepted_at, self.peer, int(self.pages.shape[0]), now)


def check_token(token: bytes, field: str = "token") -> bytes:
    """A token as sent: 1..MAX_TOKEN_BYTES bytes.

    Raises:
        InvalidArgument: empty or longer.
    """
    if not token or len(token) > MAX_TOKEN_BYTES:
        raise InvalidArgument(
            f"{field} has {len(token)} bytes; pass the token GrantReceive returned (16 bytes)",
            field=field)
    return token


class GrantTable:
    """The live and recently ended grants of a daemon.

    Args:
        clock: the daemon's monotonic clock.
        on_end: called with each grant as it ends (for counters and logs).
        max_fenced_pages: fenced pages one peer may hold before its writes are refused.
        on_windows: called whenever the open write windows change (one opened, closed, or
            fenced): what the agent reads notifications for follows them.
    """

    def __init__(self, clock: Callable[[], float],
                 on_end: Callable[[ReceiveGrant], None] | None = None,
                 max_fenced_pages: int = MAX_FENCED_PAGES_PER_PEER,
                 on_windows: Callable[[], None] | None = None) -> None:
        self._clock = clock
        self._on_end = on_end
        self._on_windows = on_windows or (lambda: None)
        self.max_fenced_pages = max_fenced_pages
        # peer -> its fenced grants (record ended, write window open)
        self._fenced: dict[str, set[ReceiveGrant]] = {}
        self._fenced_pages: dict[str, int] = {}
        self._by_token: dict[bytes, ReceiveGrant] = {}
        self._by_owner: dict[int, list[ReceiveGrant]] = {}
        # Accepted grants whose write window is open, by the notification their write carries.
        self._by_notification: dict[bytes, ReceiveGrant] = {}
        self._ended: deque[ReceiveGrant] = deque()
        # (when, sequence, grant): each grant's expiry, and its fence once accepted. A sweep
        # pops what is due (O(due)) instead of scanning every grant.
        self._deadlines = DeadlineHeap[ReceiveGrant]()
        self.live = 0

    def __iter__(self) -> Iterator[ReceiveGrant]:
        return iter(list(self._by_token.values()))

    @property
    def receiving(self) -> int:
        """Accepted grants whose write window is still open."""
        return len(self._by_notification)

    @property
    def fenced_writes(self) -> int:
        """Fenced grants, all peers."""
        return sum(len(grants) for grants in self._fenced.values())

    def fenced(self) -> dict[str, tuple[int, int]]:
        """Per peer holding fenced pages: (fenced writes, fenced pages)."""
        return {peer: (len(grants), self._fenced_pages[peer])
                for peer, grants in self._fenced.items()}

    def fenced_grants(self, peer: str) -> list[ReceiveGrant]:
        """The fenced grants of ``peer`` (what an operator looks at)."""
        return list(self._fenced.get(peer, ()))

    def add(self, pool: str, lease_id: int, owner: int, pages: np.ndarray,
            swa_pages: np.ndarray | None, ttl_s: float,
            pin: Callable[[], Callable[[], None]]) -> ReceiveGrant:
        """A new grant (pages already checked as held by ``owner`` and unpinned); ``pin``
        pins them once every check passed and returns what unpins them.

        Raises:
            InvalidArgument: a TTL outside MIN..MAX_GRANT_TTL_S.
            ResourceExhausted: MAX_GRANTS live, or MAX_GRANTS_PER_LEASE for this lease.
        """
        if not MIN_GRANT_TTL_S <= ttl_s <= MAX_GRANT_TTL_S:
            raise InvalidArgument(
                f"ttl_seconds {ttl_s} is outside {MIN_GRANT_TTL_S}..{MAX_GRANT_TTL_S:g}",
                field="ttl_seconds")
        mine = self._by_owner.setdefault(owner, [])
        if len(mine) >= MAX_GRANTS_PER_LEASE:
            raise ResourceExhausted(
                f"lease {lease_id} has {len(mine)} live receive grants, at most "
                f"{MAX_GRANTS_PER_LEASE}; wait for transfers to end or let grants expire",
                field="lease_id")
        if self.live >= MAX_GRANTS:
            raise ResourceExhausted(
                f"the daemon has {self.live} live receive grants, at most {MAX_GRANTS}; wait "
                "for transfers to end or let grants expire", field="pages")
        now = self._clock()
        token = secrets.token_bytes(TOKEN_BYTES)
        grant = ReceiveGrant(token, pool, lease_id, owner, pages, swa_pages, now, now + ttl_s)
        grant.unpin = pin()
        self._by_token[token] = grant
        self._deadlines.push(grant.expires_at, grant)
        if len(self._deadlines) > 2 * (self.live + self.receiving) + 1024:
            self._deadlines.keep(lambda g: g.unpin is not None)  # mostly ended early
        mine.append(grant)
        self.live += 1
        return grant

    def find(self, token: bytes) -> ReceiveGrant:
        """The grant of ``token`` (live or recently ended).

        Raises:
            NotFound: no such grant here.
        """
        grant = self._by_token.get(check_token(token))
        if grant is None:
            raise NotFound(
                "no receive grant for this token on this daemon (never made here, or ended "
                f"over {ENDED_KEEP_S:g} s ago); the token comes from GrantReceive on the "
                "receiving daemon", field="token")
        return grant

    def of_owner(self, owner: int) -> list[ReceiveGrant]:
        """The live grants of a lease (an empty list costs one dict lookup)."""
        return self._by_owner.get(owner, [])

    def accept(self, grant: ReceiveGrant, peer: str, nbytes: int,
               writer: ProcessId | None = None) -> bytes:
        """Mark a pending grant as receiving from ``peer`` (its process ``writer``), with its
        write deadline (``grant.write_s``); returns the notification its write must carry.

        Raises:
            FailedPrecondition: it ended, or a sender was already accepted.
            ResourceExhausted: ``peer`` holds max_fenced_pages fenced pages already.
        """
        now = self._clock()
        held = self._fenced_pages.get(peer, 0)
        if held >= self.max_fenced_pages:
            raise ResourceExhausted(
                f"peer {peer} holds {held} fenced pages here (writes that passed their "
                f"deadline without the sender reporting their end), at most "
                f"{self.max_fenced_pages}; no new write is accepted from it until it reports "
                "its writes ended (a stopped sender resumed) or its process exits; `kvpool "
                "stats` lists fenced pages per peer", field="token")
        if grant.state != TransferState.pending:
            raise FailedPrecondition(grant.ended_text(), field="token")
        if now >= grant.expires_at:
            self.end(grant, TransferState.failed, "the receive grant expired "
                     f"{now - grant.expires_at:.3f} s ago")
            raise FailedPrecondition(f"{grant.ended_text()}; ask the receiving side for a new "
                                     "grant", field="token")
        if grant.receiving:
            raise FailedPrecondition(
                f"the receive grant is already used by a transfer from {grant.peer}; a grant "
                "takes one transfer", field="token")
        grant.receiving = True
        grant.peer = peer
        grant.nbytes = nbytes
        grant.accepted_at = now
        grant.write_s = min(MAX_WRITE_S, max(MIN_WRITE_S, grant.expires_at - grant.created_at))
        grant.deadline_at = now + grant.write_s
        grant.writer = writer
        grant.notification = b"kvpool1:" + secrets.token_hex(8).encode()
        self._by_notification[grant.notification] = grant
        self._deadlines.push(grant.deadline_at, grant)
        self._on_windows()
        return grant.notification

    def by_notification(self, message: bytes) -> ReceiveGrant | None:
        return self._by_notification.get(message)

    def end(self, grant: ReceiveGrant, state: TransferState, message: str) -> None:
        """End a live grant's record (no-op for one already ended). Its pages come back now
        unless a sender was accepted: then only when its write window closes
        (:meth:`close_window`), and until then the grant is fenced."""
        if not grant.receiving:
            self._unpin(grant)
        if not grant.finish(state, message, self._clock()):
            return
        if grant.window_open:
            grant.fenced = True
            self._fenced.setdefault(grant.peer, set()).add(grant)
            self._fenced_pages[grant.peer] = (self._fenced_pages.get(grant.peer, 0)
                                              + int(grant.pages.shape[0]))
            self._on_windows()
        self.live -= 1
        mine = self._by_owner.get(grant.owner)
        if mine is not None:
            mine.remove(grant)
            if not mine:
                del self._by_owner[grant.owner]
        self._ended.append(grant)
        while len(self._ended) > MAX_ENDED:
            self._by_token.pop(self._ended.popleft().token, None)
        if self._on_end is not None:
            self._on_end(grant)

    def close_window(self, grant: ReceiveGrant, state: TransferState, message: str) -> None:
        """A fact says the accepted write can no longer land (its notification came, the
        sender reported it ended, its process exited): end the record as ``state`` if it is
        still pending, give the pages back."""
        if not grant.window_open:
            return
        self.end(grant, state, message)
        if grant.fenced:
            grant.fenced = False
            mine = self._fenced[grant.peer]
            mine.discard(grant)
            self._fenced_pages[grant.peer] -= int(grant.pages.shape[0])
            if not mine:
                del self._fenced[grant.peer], self._fenced_pages[grant.peer]
        self._unpin(grant)

    def _unpin(self, grant: ReceiveGrant) -> None:
        unpin, grant.unpin = grant.unpin, None
        unwatch, grant.unwatch = grant.unwatch, None
        if grant.notification and self._by_notification.pop(grant.notification, None):
            self._on_windows()
        if unwatch is not None:
            unwatch()
        if unpin is not None:
            unpin()

    def revoke_owner(self, owner: int, why: str, pool: str | None = None) -> int:
        """End every live grant of ``owner`` (in ``pool``, or all); returns how many."""
        ended = [g for g in self.of_owner(owner) if pool is None or g.pool == pool]
        for grant in ended:
            self.end(grant, TransferState.failed, why)
        return len(ended)

    def revoke_pool(self, pool: str, why: str) -> int:
        ended = [g for g in self._by_token.values()
                 if g.pool == pool and g.state == TransferState.pending]
        for grant in ended:
            self.end(grant, TransferState.failed, why)
        return len(ended)

    def expire(self) -> None:
        """End grants no sender took before their expiry, and the records of writes past
        their deadline (their pages stay fenced); forget ended grants kept over
        ENDED_KEEP_S."""
        now = self._clock()
        for grant in self._deadlines.pop_due(now):
            if not grant.receiving:
                self.end(grant, TransferState.failed,
                         "the receive grant expired before any transfer used it")
            elif grant.window_open and now >= grant.deadline_at:
                self.end(grant, TransferState.failed, (
                    f"the write from {grant.peer} did not complete within its "
                    f"{grant.write_s:g} s deadline (the sender failed, is stopped or gone); "
                    "its pages stay fenced until the sender reports the write ended or its "
                    "process exits"))
        while self._ended and now - self._ended[0].ended_at > ENDED_KEEP_S:
            self._by_token.pop(self._ended.popleft().token, None)

"""Receive grants: which pages of which lease a peer daemon may write, once, until when.

A grant is made by the lease holding the pages (GrantReceive) and named by an opaque token of
:data:`TOKEN_BYTES` random bytes (``secrets.token_bytes``): whoever holds the token may have
one transfer written into those pages, and nothing else. A grant ends as

- ``done``: the sender's write completed (its NIXL notification arrived);
- ``failed``: it expired, its pages were freed or its lease ended (revoked), or the sender
  reported a failed write.

Ended grants are kept :data:`ENDED_KEEP_S` (at most :data:`MAX_ENDED` of them) so the decode
side can still read how they ended. Every count is bounded: live grants per daemon and per
lease, pages per grant. All state is owned by the daemon's event loop (no locks).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import secrets
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kvpool.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvpool.records import TransferState, TransferStatus

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
    slot: int = 0  # its mark on the pool's pages (transfer.marks.PageMarks); 0 when ended
    swa_written: np.ndarray | None = None  # the SWA pages its accepted sender writes

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
    """

    def __init__(self, clock: Callable[[], float],
                 on_end: Callable[[ReceiveGrant], None] | None = None) -> None:
        self._clock = clock
        self._on_end = on_end
        self._by_token: dict[bytes, ReceiveGrant] = {}
        self._by_owner: dict[int, list[ReceiveGrant]] = {}
        self._by_notification: dict[bytes, ReceiveGrant] = {}
        self._ended: deque[ReceiveGrant] = deque()
        # (expires_at, sequence, grant) of grants made, live or ended since: a sweep pops what
        # is due (O(due)) instead of scanning every grant.
        self._deadlines: list[tuple[float, int, ReceiveGrant]] = []
        self._seq = itertools.count()
        self.live = 0

    def __iter__(self) -> Iterator[ReceiveGrant]:
        return iter(list(self._by_token.values()))

    @property
    def receiving(self) -> int:
        return len(self._by_notification)

    def add(self, pool: str, lease_id: int, owner: int, pages: np.ndarray,
            swa_pages: np.ndarray | None, ttl_s: float) -> ReceiveGrant:
        """A new grant (pages already checked as held by ``owner``).

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
        self._by_token[token] = grant
        heapq.heappush(self._deadlines, (grant.expires_at, next(self._seq), grant))
        if len(self._deadlines) > 2 * self.live + 1024:  # mostly grants that ended early
            self._deadlines = [e for e in self._deadlines if e[2].state == TransferState.pending]
            heapq.heapify(self._deadlines)
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

    def accept(self, grant: ReceiveGrant, peer: str, nbytes: int) -> bytes:
        """Mark a pending grant as receiving from ``peer``; returns the notification its
        write must carry.

        Raises:
            FailedPrecondition: it ended, or a sender was already accepted.
        """
        now = self._clock()
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
        grant.notification = b"kvpool1:" + secrets.token_hex(8).encode()
        self._by_notification[grant.notification] = grant
        return grant.notification

    def by_notification(self, message: bytes) -> ReceiveGrant | None:
        return self._by_notification.get(message)

    def end(self, grant: ReceiveGrant, state: TransferState, message: str) -> None:
        """End a live grant (no-op for one already ended)."""
        if not grant.finish(state, message, self._clock()):
            return
        self.live -= 1
        mine = self._by_owner.get(grant.owner)
        if mine is not None:
            mine.remove(grant)
            if not mine:
                del self._by_owner[grant.owner]
        if grant.notification:
            self._by_notification.pop(grant.notification, None)
        self._ended.append(grant)
        while len(self._ended) > MAX_ENDED:
            self._by_token.pop(self._ended.popleft().token, None)
        if self._on_end is not None:
            self._on_end(grant)

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
        """End live grants past their expiry; forget ended ones kept over ENDED_KEEP_S."""
        now = self._clock()
        due = []
        while self._deadlines and self._deadlines[0][0] <= now:
            grant = heapq.heappop(self._deadlines)[2]
            if grant.state == TransferState.pending:
                due.append(grant)
        for grant in due:
            what = (f"the write from {grant.peer} did not complete before the grant expired "
                    "(the sender failed or is gone)") if grant.receiving else (
                "the receive grant expired before any transfer used it")
            self.end(grant, TransferState.failed, what)
        while self._ended and now - self._ended[0].ended_at > ENDED_KEEP_S:
            self._by_token.pop(self._ended.popleft().token, None)

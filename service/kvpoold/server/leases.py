"""Leases: who holds ids, until when. A lease not renewed within its TTL expires.

A lease has a random 63-bit ``lease_id`` (what clients send; random so that a stale id from
before a daemon restart does not name someone else's lease), a random ``secret`` that proves it
(only its opener gets it; every call acting on the lease carries it, see
:meth:`LeaseTable.prove`), the ``identity`` of the caller that opened it
(``kvpoold.server.auth``), and a small sequential ``owner`` (what the allocators record per id;
they take owners in ``1..2**31-1``). Renewing moves the
deadline to ``now + ttl``; :meth:`LeaseTable.pop_expired` hands back the leases whose deadline
has passed so the daemon can reclaim what they hold, a bounded slice at a time if asked.

A lease is expired once its deadline has passed, whether or not a sweep has reclaimed it yet:
from then on it can be neither proven, renewed nor used (:meth:`LeaseTable.get`,
:meth:`LeaseTable.prove`), and it stays in the table (listed, its owner number taken, counted
against its identity's cap) only until its slice of the sweep reclaims what it holds.

Deadlines are kept in a :class:`~kvpoold.deadlines.DeadlineHeap` of ``(lease_id,
generation)``: a sweep pops only what has expired (O(expired log n)), not every lease.
Renewing pushes a new entry and closing leaves the old one behind; such stale entries (their
generation is no longer the lease's) are skipped when they surface, and the heap drops them
all when they outnumber the open leases 2:1.

Not thread-safe: the daemon calls it from its event loop only.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from kvpool.contract.errors import InvalidArgument, NotFound, ResourceExhausted
from kvpool.contract.limits import MAX_NAME_CHARS
from kvpoold.deadlines import DeadlineHeap
from kvpoold.ids.faults import OWNER_MAX
from kvpoold.settings import MAX_LEASES
from kvpoold.settings import MAX_LEASES_PER_IDENTITY as MAX_LEASES_PER_IDENTITY  # daemon.py's

MIN_TTL_S = 0.1
MAX_TTL_S = 86_400.0
SECRET_BYTES = 16
_NO_SECRET = bytes(SECRET_BYTES)  # compared against when the id is unknown (same work)
# Compact the deadline heap when stale entries exceed this many per open lease.
STALE_PER_LEASE = 2


class CacheCounts(NamedTuple):
    """What a lease's page caches of one pool and id space hold, as its KeepAlive reported
    (``CacheReport``): ``cached`` unused; ``in_use`` handed out; of those, ``evictable`` the
    holder frees on demand (an engine's prefix cache). A give-back may take cached, then
    evictable ids."""

    cached: int
    in_use: int
    evictable: int = 0

    @property
    def takeable(self) -> int:
        """What a give-back may take: cached, then evictable ids."""
        return self.cached + self.evictable

    def asked(self, count: int) -> CacheCounts:
        """The counts once a give-back of ``count`` is asked (cached ids first)."""
        from_cached = min(count, self.cached)
        return CacheCounts(self.cached - from_cached, self.in_use,
                           max(0, self.evictable - (count - from_cached)))


@dataclass
class Lease:
    """One lease. ``deadline`` is on the table's clock (the daemon's lease clock: monotonic
    time that stands still while the event loop is stalled, ``kvpoold.server.loop_clock``)."""

    lease_id: int
    owner: int
    name: str
    ttl_s: float
    deadline: float
    opened_at: float
    identity: str = "local"  # who opened it (``kvpoold.server.auth``); only it may use it
    secret: bytes = field(default=b"", repr=False, compare=False)  # the proof; never shown
    # Which deadline-heap entry is current; older entries of this lease are stale.
    generation: int = field(default=0, repr=False, compare=False)
    # (pool, space) -> its page caches' counts as last reported on KeepAlive.
    reports: dict[tuple[str, str], CacheCounts] = field(
        default_factory=dict, repr=False, compare=False)
    # (pool, space) -> ids to give back, not yet sent; ``wake`` tells its KeepAlive stream.
    give_back: dict[tuple[str, str], int] = field(default_factory=dict, repr=False,
                                                  compare=False)
    # (pool, space) -> the lowest ``min_id`` of the queued give-backs (0: any id).
    give_back_from: dict[tuple[str, str], int] = field(default_factory=dict, repr=False,
                                                       compare=False)
    wake: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)
    # Elastic pools' asks to unmap groups, not yet sent: (pool, groups, reclaim, deadline_s).
    unmap: list[tuple[str, tuple[int, ...], int, float]] = field(
        default_factory=list, repr=False, compare=False)

    def cached(self, pool: str, space: str) -> int:
        """Ids of ``pool``/``space`` a give-back may take, as its caches last reported: those
        they hold unused, then those their holder frees on demand (``CacheCounts.takeable``)."""
        report = self.reports.get((pool, space))
        return 0 if report is None else report.takeable

    def ask_give_back(self, pool: str, space: str, count: int, min_id: int = 0) -> None:
        """Queue a give-back (of ids >= ``min_id`` only, when it is > 0) for its KeepAlive
        stream and wake the stream. The report is lowered at once, so a second Allocate does
        not ask for the same ids again."""
        key = (pool, space)
        self.give_back_from[key] = (min(self.give_back_from[key], min_id)
                                    if key in self.give_back else min_id)
        self.give_back[key] = self.give_back.get(key, 0) + count
        self.reports[key] = self.reports.get(key, CacheCounts(0, 0)).asked(count)
        self.wake.set()

    def ask_unmap(self, pool: str, groups: tuple[int, ...], reclaim: int,
                  deadline_s: float) -> None:
        """Queue an ask to unmap ``groups`` of elastic pool ``pool`` and wake the stream."""
        self.unmap.append((pool, groups, reclaim, deadline_s))
        self.wake.set()

    def take_unmap(self) -> list[tuple[str, tuple[int, ...], int, float]]:
        """The queued unmap asks, now sent."""
        out, self.unmap = self.unmap, []
        return out

    @property
    def pending(self) -> bool:
        """Whether give-backs or unmap asks wait to be sent."""
        return bool(self.give_back or self.unmap)

    def take_give_back(self) -> dict[tuple[str, str], tuple[int, int]]:
        """The queued give-backs, now sent: ``(count, min_id)`` per pool and space."""
        out = {key: (n, self.give_back_from.get(key, 0)) for key, n in self.give_back.items()}
        self.give_back, self.give_back_from = {}, {}
        self.wake.clear()
        return out

    def due(self, now: float) -> bool:
        """Whether the deadline has passed at ``now`` (the table's clock): the lease is expired,
        reclaimed or not yet."""
        return self.deadline <= now

    def expires_in(self, now: float) -> float:
        """Seconds left until ``deadline``, 0 once it has passed.

        Args:
            now: the table's clock.

        Returns:
            The seconds left.
        """
        return max(0.0, self.deadline - now)


def check_lease_name(name: str) -> str:
    """A lease name: 1..128 printable characters (engine name, ``host:pid``).

    Raises:
        InvalidArgument: empty, too long, or with control characters.
    """
    if not name:
        raise InvalidArgument("lease name is empty; name the holder (engine, host:pid)",
                              field="name")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidArgument(
            f"lease name has {len(name)} characters, at most {MAX_NAME_CHARS}", field="name"
        )
    if not name.isprintable():
        raise InvalidArgument(f"lease name {name!r} has control characters", field="name")
    return name


def check_ttl(ttl_s: float) -> float:
    """A TTL in ``MIN_TTL_S..MAX_TTL_S`` seconds.

    Raises:
        InvalidArgument: NaN, infinite or out of range.
    """
    if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:  # NaN fails both comparisons
        raise InvalidArgument(
            f"ttl_seconds {ttl_s} is outside {MIN_TTL_S}..{MAX_TTL_S:g} s; a few seconds "
            "(renewed by KeepAlive) is typical",
            field="ttl_seconds",
        )
    return float(ttl_s)


def _no_lease(lease_id: int, field: str) -> NotFound:
    return NotFound(
        f"no open lease {lease_id}: it was never opened, was closed, or expired "
        "(renew it within its TTL with KeepAlive; open a new one with OpenLease)",
        field=field,
    )


class LeaseTable:
    """The open leases, by id, with counters for Stats and a heap of their deadlines.

    Args:
        clock: monotonic seconds (``time.monotonic``, or the daemon's
            ``loop_clock.StallClock``); injected so tests can move time.
        max_leases: refuse to open more than this many at once.
        max_per_identity: refuse one identity more than this many at once (None: no cap
            but ``max_leases``).
    """

    def __init__(self, clock: Callable[[], float], *, max_leases: int = MAX_LEASES,
                 max_per_identity: int | None = None) -> None:
        self._clock = clock
        self._max = max_leases
        self._max_per_identity = max_per_identity
        self._leases: dict[int, Lease] = {}
        # identity -> {lease_id: lease}, in opening order: its cap counts these, and a Stats of
        # a caller that is not admin lists these (O(its own leases), not O(leases)).
        self._by_identity: dict[str, dict[int, Lease]] = {}
        self._by_owner: dict[int, Lease] = {}  # the owners in use, and their leases
        self._next_owner = 1
        # (lease_id, generation) due at the lease's deadline; an entry is stale once its lease
        # was renewed (a newer generation) or closed.
        self._deadlines = DeadlineHeap[tuple[int, int]]()
        self._stale = 0  # heap entries whose lease was renewed or closed since
        self._generation = 0
        # (pool, space) -> {lease_id: lease} of the leases whose caches last reported cached
        # ids there: give-back visits these, not every lease (O(holders), not O(leases)).
        self._cachers: dict[tuple[str, str], dict[int, Lease]] = {}
        self.opened = 0
        self.closed = 0
        self.expired = 0
        self.examined = 0  # heap entries popped by sweeps: what expiry costs, for tests

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    def now(self) -> float:
        """The table's clock (deadlines are on it; the daemon's may be another)."""
        return self._clock()

    def open(self, name: str, ttl_s: float, identity: str = "local") -> Lease:
        """Open a lease of ``identity`` that expires ``ttl_s`` from now unless renewed.

        Raises:
            InvalidArgument: bad name or TTL.
            ResourceExhausted: ``max_leases`` are open, or ``max_per_identity`` of this
                identity's.
        """
        name = check_lease_name(name)
        ttl_s = check_ttl(ttl_s)
        mine = self.count_identity(identity)
        if self._max_per_identity is not None and mine >= self._max_per_identity:
            raise ResourceExhausted(
                f"identity {identity!r} has {mine} leases open, the cap per identity is "
                f"{self._max_per_identity} (max_leases_per_identity, --max-leases-per-identity);"
                " close unused leases (one per engine process is enough)")
        if len(self._leases) >= self._max:
            raise ResourceExhausted(
                f"{len(self._leases)} leases are open, the limit is {self._max}; close unused "
                "leases (one per engine process is enough)"
            )
        lease_id = 0
        while lease_id == 0 or lease_id in self._leases:
            lease_id = secrets.randbits(63)
        owner = self._take_owner()
        now = self._clock()
        lease = Lease(lease_id, owner, name, ttl_s, now + ttl_s, now, identity,
                      secrets.token_bytes(SECRET_BYTES))
        self._leases[lease_id] = lease
        self._by_identity.setdefault(identity, {})[lease_id] = lease
        self._by_owner[owner] = lease
        self._push(lease)
        self.opened += 1
        return lease

    def get(self, lease_id: int, *, field: str = "lease_id") -> Lease:
        """The open lease ``lease_id``, not past its deadline.

        Raises:
            NotFound: unknown, closed or expired (also when its deadline has passed and the
                sweep has not reclaimed it yet).
        """
        lease = self._live_lease(lease_id)
        if lease is None:
            raise _no_lease(lease_id, field)
        return lease

    def prove(self, lease_id: int, secret: bytes, identity: str, *,
              field: str = "lease_id") -> Lease:
        """The open lease ``lease_id``, if ``secret`` is its secret and ``identity`` opened it.

        Every refusal is the same NotFound as for an unknown id, so a caller learns nothing
        about leases it cannot prove; the secret is compared in constant time.

        Raises:
            NotFound: unknown, closed or expired (its deadline passed, reclaimed or not yet), a
                wrong or missing secret, or another identity's lease.
        """
        lease = self._live_lease(lease_id)
        proven = hmac.compare_digest(lease.secret if lease is not None else _NO_SECRET, secret)
        if lease is None or not proven or lease.identity != identity:
            raise NotFound(
                f"no open lease {lease_id} with this lease_secret: it was never opened, was "
                "closed or expired, or lease_secret is not the one OpenLease returned with it "
                "(renew it within its TTL with KeepAlive; open a new one with OpenLease)",
                field=field,
            )
        return lease

    def count_identity(self, identity: str) -> int:
        """Open leases of ``identity``; O(1)."""
        return len(self._by_identity.get(identity, ()))

    def of_identity(self, identity: str) -> list[Lease]:
        """The open leases of ``identity``, in the order they were opened (a new list);
        O(its leases)."""
        return list(self._by_identity.get(identity, {}).values())

    def find(self, lease_id: int) -> Lease | None:
        """The lease ``lease_id`` still in the table, or None; also one past its deadline that
        the sweep has not reclaimed yet (:meth:`get` refuses those)."""
        return self._leases.get(lease_id)

    def _live_lease(self, lease_id: int) -> Lease | None:
        """The lease ``lease_id`` if it is in the table and its deadline has not passed."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.due(self._clock()):
            return None
        return lease

    def of_owner(self, owner: int) -> Lease | None:
        """The open lease with internal number ``owner``, or None; O(1)."""
        return self._by_owner.get(owner)

    def renew(self, lease_id: int) -> Lease:
        """Move the deadline of ``lease_id`` to now + its TTL.

        Raises:
            NotFound: unknown, closed or expired (a lease past its deadline is not renewed,
                even while it waits for its slice of the sweep).
        """
        lease = self.get(lease_id)
        lease.deadline = self._clock() + lease.ttl_s
        self._push(lease)
        self._went_stale()
        return lease

    def set_reports(self, lease: Lease,
                    reports: dict[tuple[str, str], CacheCounts]) -> None:
        """Keep ``lease``'s page-cache report (replacing the last one) and the index of who
        caches what (ids a give-back may take); O(keys of the two reports)."""
        for key in lease.reports.keys() - reports.keys():
            self._uncache(key, lease)
        for key, counts in reports.items():
            if counts.takeable > 0:
                self._cachers.setdefault(key, {})[lease.lease_id] = lease
            else:
                self._uncache(key, lease)
        lease.reports = reports

    def cachers(self, pool: str, space: str) -> list[Lease]:
        """The open leases whose caches last reported cached ids of ``pool``/``space`` (a
        give-back may have lowered a report to 0 since: callers read ``cached``)."""
        return list(self._cachers.get((pool, space), {}).values())

    def _uncache(self, key: tuple[str, str], lease: Lease) -> None:
        holders = self._cachers.get(key)
        if holders is not None:
            holders.pop(lease.lease_id, None)
            if not holders:
                del self._cachers[key]

    def _forget(self, lease: Lease) -> None:
        """Drop a closed or expired lease from the indexes (by owner, identity, cache)."""
        self._by_owner.pop(lease.owner, None)
        for key in lease.reports:
            self._uncache(key, lease)
        mine = self._by_identity[lease.identity]
        del mine[lease.lease_id]
        if not mine:
            del self._by_identity[lease.identity]

    def close(self, lease_id: int) -> Lease:
        """Remove ``lease_id``; the caller returns what it held. The caller proved the lease
        (:meth:`prove`) or is the daemon ending it; one past its deadline that the sweep has not
        reclaimed yet is closed too (the daemon revoking it).

        Raises:
            NotFound: unknown, or already closed or reclaimed.
        """
        lease = self._leases.get(lease_id)
        if lease is None:
            raise _no_lease(lease_id, "lease_id")
        del self._leases[lease_id]
        self._forget(lease)
        self.closed += 1
        self._went_stale()
        return lease

    def pop_expired(self, now: float | None = None, limit: int | None = None) -> list[Lease]:
        """Remove and return the leases whose deadline has passed, earliest first: all of them,
        or the first ``limit``.

        Costs O(popped log n): only heap entries due by ``now`` are popped (counted in
        ``examined``), live or stale; stale ones do not count against ``limit``. With a limit,
        the rest stay due for the next call (:meth:`next_deadline` is then <= ``now``).

        Args:
            now: the time to expire at; default the table's clock.
            limit: at most this many leases (None: every one due).

        Returns:
            The expired leases, by deadline.
        """
        now = self._clock() if now is None else now
        gone: list[Lease] = []
        while limit is None or len(gone) < limit:
            first = self._deadlines.first()
            if first is None or first[0] > now:
                break
            self._deadlines.pop_first()
            lease_id, generation = first[1]
            self.examined += 1
            lease = self._leases.get(lease_id)
            if lease is None or lease.generation != generation:
                self._stale -= 1
                continue
            del self._leases[lease_id]
            self._forget(lease)
            gone.append(lease)
        self.expired += len(gone)
        if gone:
            self._compact_if_stale()  # fewer open leases: the stale ones may now outnumber them
        return gone

    def next_deadline(self) -> float | None:
        """The earliest deadline of an open lease, or None without leases.

        Returns:
            A time on the table's clock; stale entries on top of the heap are dropped.
        """
        while (first := self._deadlines.first()) is not None:
            deadline, (lease_id, generation) = first
            if self._live(lease_id, generation):
                return deadline
            self._deadlines.pop_first()
            self._stale -= 1
        return None

    @property
    def heap_size(self) -> int:
        """Entries in the deadline heap: one per open lease plus the stale ones."""
        return len(self._deadlines)

    def _live(self, lease_id: int, generation: int) -> bool:
        lease = self._leases.get(lease_id)
        return lease is not None and lease.generation == generation

    def _push(self, lease: Lease) -> None:
        self._generation += 1
        lease.generation = self._generation
        self._deadlines.push(lease.deadline, (lease.lease_id, lease.generation))

    def _went_stale(self) -> None:
        self._stale += 1
        self._compact_if_stale()

    def _compact_if_stale(self) -> None:
        """Drop the stale heap entries once they outnumber the open leases 2:1.

        Amortized O(1): a compaction costs O(entries), under 3x the stale entries it drops.
        """
        if self._stale > STALE_PER_LEASE * len(self._leases):
            self._deadlines.keep(lambda entry: self._live(*entry))
            self._stale = 0

    def _take_owner(self) -> int:
        # Sequential owners; after 2**31 - 1 leases they wrap and skip the ones still open.
        # The caller records the new lease under it in ``_by_owner`` at once.
        while True:
            owner = self._next_owner
            self._next_owner = owner % OWNER_MAX + 1
            if owner not in self._by_owner:
                return owner

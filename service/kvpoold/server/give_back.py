"""Cache pressure: asking leases' page caches to give back ids they hold unused.

:func:`give_back_shares` is the policy, pure: who gives how many. :class:`CachePressure` carries
it out on the lease table (each ask rides the lease's KeepAlive stream) and wakes the Allocates
that wait for ids to come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from kvpoold.ids import IdSpace
from kvpoold.server.leases import Lease, LeaseTable

log = logging.getLogger("kvpoold.daemon")

# An Allocate short of free ids, while other leases' page caches report enough cached ones,
# asks them to give back and waits this long at most (less under a shorter gRPC deadline).
GIVE_BACK_WAIT_S = 1.0
# How long an Allocate in an elastic pool waits for groups on their way to it (a grant being
# committed, a reclaim promised to it) when the call has no deadline of its own. Each ends by a
# fact; this only bounds a call that set no deadline.
ELASTIC_WAIT_S = 60.0
# Under pressure: an Allocate that leaves a space fewer than capacity // PRESSURE_FRACTION free
# asks other leases' caches to give back the difference (without waiting).
PRESSURE_FRACTION = 16


def give_back_shares(cached: list[int], count: int) -> list[int]:
    """How many ids each holder gives back of ``count`` in all, given what each holds cached:
    shares proportional to what each holds, at least 1 each, the rest from the largest
    holders first; never more than a holder holds. O(holders log holders).

    >>> give_back_shares([10, 30], 8)
    [2, 6]
    """
    total = sum(cached)
    if not total:
        return [0] * len(cached)
    count = min(count, total)
    shares = [min(c, max(1, count * c // total)) for c in cached]
    rest = count - sum(shares)
    for i, c in sorted(enumerate(cached), key=lambda t: -t[1]):
        if rest <= 0:
            break
        more = min(rest, c - shares[i])
        shares[i] += more
        rest -= more
    return shares


class CachePressure:
    """Give-backs asked of page caches, and the wake-ups of Allocates waiting for ids.

    Args:
        leases: the daemon's lease table (who caches what, their KeepAlive queues).
    """

    def __init__(self, leases: LeaseTable) -> None:
        self._leases = leases
        # Set (and dropped) when ids come back, for Allocates waiting on give-backs; None
        # while nobody waits, so Free costs nothing extra then.
        self._freed: asyncio.Event | None = None
        # What else waits for ids to come back (the elastic pools' drains and cache asks).
        self.also_on_freed: Callable[[], None] = lambda: None

    def notify_freed(self) -> None:
        """Ids came back: wake whoever waits for them (O(1) when nobody does)."""
        if self._freed is not None:
            self._freed.set()
            self._freed = None
        self.also_on_freed()

    async def wait_freed(self, timeout_s: float) -> None:
        """Wait until ids come back, ``timeout_s`` at most."""
        if self._freed is None:
            self._freed = asyncio.Event()
        freed = self._freed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(freed.wait(), timeout_s)

    def cached_of(self, lease: Lease, pool: str, space: IdSpace) -> int:
        """What ``lease``'s caches reported cached in ``pool``/``space``, capped at what it
        holds there now (O(1)): only ids a lease really holds can come back, so a report it
        does not back (stale, or a lie) never makes an Allocate wait nor another cache be
        asked in vain."""
        return min(lease.cached(pool, space.name), space.held(lease.owner))

    def cached_elsewhere(self, pool: str, space: IdSpace, owner: int) -> int:
        """Ids of ``pool``/``space`` cached by leases other than ``owner``."""
        return sum(self.cached_of(x, pool, space)
                   for x in self._leases.cachers(pool, space.name) if x.owner != owner)

    def ask(self, pool: str, space: IdSpace, count: int, owner: int, *, cover: bool,
            min_id: int = 0) -> int:
        """Ask the leases other than ``owner`` whose caches hold cached ids of
        ``pool``/``space`` to give back ``count`` in all (:func:`give_back_shares`; only ids
        ``>= min_id`` when it is > 0). Returns the ids asked.

        ``cover=False`` (pressure after a successful Allocate) skips leases already asked.
        """
        name = space.name
        holders = [(x, c) for x in self._leases.cachers(pool, name)
                   if x.owner != owner and (cover or (pool, name) not in x.give_back)
                   and (c := self.cached_of(x, pool, space)) > 0]
        shares = give_back_shares([c for _, c in holders], count)
        if not sum(shares):
            return 0
        for (x, _), n in zip(holders, shares, strict=True):
            if n:
                x.ask_give_back(pool, name, n, min_id)
        log.info("give-back asked", extra={"fields": {
            "event": "give_back", "pool": pool, "space": name, "asked": sum(shares),
            "leases": len(holders), "waiting": cover,
        }})
        return sum(shares)

"""Allocate and Free: ids of a pool's spaces taken and returned for a proven lease.

The pool's ledger decides (all or none, pins refused); this module adds what happens around
it: pressure on other leases' page caches when a space runs low, an elastic pool growing ahead
of need, and the wait of an Allocate short of ids while give-backs or grants come.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from kvpool.contract.errors import InvalidArgument, ResourceExhausted
from kvpoold.access import Caller
from kvpoold.elastic.manager import ElasticPools
from kvpoold.ids import Grant, IdSpace
from kvpoold.ids.grouped import GroupedSpace
from kvpoold.pools.pool import Pool
from kvpoold.server.args import LeaseRef
from kvpoold.server.give_back import (
    ELASTIC_WAIT_S,
    GIVE_BACK_WAIT_S,
    PRESSURE_FRACTION,
    CachePressure,
)
from kvpoold.server.leases import Lease

_T = TypeVar("_T")


# What an Allocate got: ``(space, grant)`` per item, in order.
Allocated = list[tuple[str, Grant]]


class Allocations:
    """Allocate, Free and the Free check of the daemon.

    Args:
        pool: the pool lookup, checked against the caller's scope.
        lease: the lease proof of a caller.
        pressure: give-backs of page caches, and the wake-ups of waiting Allocates.
        elastic: the elastic pools (grow-ahead, grows for a waiting Allocate).
    """

    def __init__(self, pool: Callable[[str, Caller], Pool],
                 lease: Callable[[Caller, LeaseRef], Lease], pressure: CachePressure,
                 elastic: ElasticPools) -> None:
        self._pool = pool
        self._lease = lease
        self._pressure = pressure
        self._elastic = elastic

    def _items(self, caller: Caller, pool: str, ref: LeaseRef,
               items: Sequence[tuple[str, _T]], verb: str, what: str,
               ) -> tuple[Pool, Lease, list[tuple[IdSpace, _T]]]:
        """The pool, the lease and each item's id space for ``verb`` on ``items`` (``what``:
        the item's other half, named when the list is empty).

        Raises:
            InvalidArgument: bad pool name, no items, an unknown space.
            NotFound / PermissionDenied: as the pool lookup and the lease proof.
        """
        entry = self._pool(pool, caller)
        lease = self._lease(caller, ref)
        if not items:
            raise InvalidArgument(f"{verb} needs at least one (space, {what}) item",
                                  field="items")
        return entry, lease, [(entry.ids.space(name, f"items[{i}].space"), x)
                              for i, (name, x) in enumerate(items)]

    def allocate(self, caller: Caller, pool: str, ref: LeaseRef,
                 items: Sequence[tuple[str, int]], *, evict: bool = True) -> Allocated:
        """Allocate every ``(space, count)`` item for the lease, all or none; short of ids,
        the pool's kept sealed pages are evicted first unless ``evict`` is False.

        Returns:
            ``(space, grant)`` per item, in order.

        Raises:
            InvalidArgument: bad pool name, no items, an unknown space or one that follows
                another.
            NotFound: unknown pool or lease.
            PermissionDenied: the caller's scope does not cover the pool.
            ResourceExhausted: not enough free ids for an item (nothing allocated).
        """
        entry, lease, typed = self._items(caller, pool, ref, items, "allocate", "count")
        ids = entry.ids
        spaces = [space for space, _ in typed]
        grants = entry.allocate(lease.owner, typed, evict=evict)  # sealed pages yield first
        for space in spaces:  # O(items): a comparison each unless the space runs low
            if isinstance(space, GroupedSpace):
                self._elastic_pressure(pool, space, lease.owner)
                continue
            low = max(1, space.capacity // PRESSURE_FRACTION)
            room = ids.room(space)
            if room < low:
                self._pressure.ask(pool, space, low - room, lease.owner, cover=False)
        return [(name, grant) for (name, _), grant in zip(items, grants, strict=True)]

    def _elastic_pressure(self, pool: str, space: GroupedSpace, owner: int) -> None:
        """After an Allocate in an elastic pool: grow ahead of need (a group from free budget,
        when less than half a group's pages are left), and ask other leases' caches to give
        back when under 1/16 of the granted pages are free. O(1) unless it acts."""
        self._elastic.allocated(pool)
        room = space.num_free
        if room < space.pages_per_group // 2:
            self._elastic.grow(pool, space.pages_per_group, reclaim=False)
        low = max(1, space.granted_pages // PRESSURE_FRACTION)
        if room < low:
            self._pressure.ask(pool, space, low - room, owner, cover=False)

    async def allocate_waiting(self, caller: Caller, pool: str, ref: LeaseRef,
                               items: Sequence[tuple[str, int]],
                               wait_s: float = GIVE_BACK_WAIT_S,
                               grow_wait_s: float = ELASTIC_WAIT_S) -> Allocated:
        """:meth:`allocate`; when short of free ids while other leases' page caches report
        enough cached ids to cover every shortfall, ask them to give back (on their KeepAlive
        streams, now) and retry as ids come back, for ``wait_s`` at most. An elastic pool
        short of pages asks for groups and retries while groups are on their way to it (a
        grant committing, a reclaim promised to it: facts that end), for ``grow_wait_s`` at
        most (the call's deadline). Returns once the mapping entries it wrote are on the
        device (``Pool.device_written``).

        Raises:
            As :meth:`allocate`; ResourceExhausted also after the wait, saying how many ids
            were asked back and how many came, and for an elastic pool who holds the budget.
        """
        got = await self._allocate_waiting(caller, pool, ref, items, wait_s, grow_wait_s)
        entry = self._pool(pool, caller)
        await entry.device_written()
        return got

    async def _allocate_waiting(self, caller: Caller, pool: str, ref: LeaseRef,
                                items: Sequence[tuple[str, int]], wait_s: float,
                                grow_wait_s: float) -> Allocated:
        # An elastic pool asks for groups (free budget, other pools' free or cached groups)
        # before it evicts its own kept sealed pages; it evicts them when none can come.
        elastic = self._pool(pool, caller).plan.elastic is not None
        try:
            return self.allocate(caller, pool, ref, items, evict=not elastic)
        except ResourceExhausted as err:
            first = err.with_traceback(None)  # no cycle: err -> traceback -> frame -> err
        entry = self._pool(pool, caller)
        lease = self._lease(caller, ref)
        shortfall: dict[str, int] = {}
        for name, count in items:
            shortfall[name] = shortfall.get(name, 0) + count
        wanted = dict(shortfall)
        free_before = {}
        spaces = {}
        growing: set[str] = set()
        for name in list(shortfall):
            space = spaces[name] = entry.ids.space(name, "items")
            free_before[name] = space.num_free
            short = shortfall[name] - entry.ids.room(space)
            if short <= 0:
                del shortfall[name]
                continue
            shortfall[name] = short
            if isinstance(space, GroupedSpace) and self._elastic.grow(pool, short):
                growing.add(name)  # groups are being granted or taken back for it
                continue
            if isinstance(space, GroupedSpace) and entry.kept_sealed:
                with contextlib.suppress(ResourceExhausted):  # no group comes: evict them
                    return self.allocate(caller, pool, ref, items)
            if self._pressure.cached_elsewhere(pool, space, lease.owner) < short:
                if isinstance(space, GroupedSpace):  # no group can come: say who holds them
                    raise ResourceExhausted(f"{first.message}; no group can be granted to "
                                            f"it: {self._elastic.holders(pool)}",
                                            field=first.field)
                raise first  # even every cached id would not do: refuse at once
        if not shortfall or wait_s <= 0:
            raise first
        asked = sum(self._pressure.ask(pool, spaces[name], short, lease.owner, cover=True)
                    for name, short in shortfall.items() if name not in growing)
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + wait_s  # for give-backs of other leases' caches
        grow_deadline = start + max(wait_s, grow_wait_s)  # while groups are on their way
        while True:
            # a grant arriving late is waited for, as long as one is coming (a fact)
            coming = bool(growing) and self._elastic.coming(pool)
            remaining = (grow_deadline if coming else deadline) - loop.time()
            if remaining <= 0:
                break
            await self._pressure.wait_freed(remaining)
            try:  # while groups come, an elastic pool keeps its sealed pages
                return self.allocate(caller, pool, ref, items,
                                     evict=not (growing and self._elastic.coming(pool)))
            except ResourceExhausted as err:
                first = err.with_traceback(None)  # no cycle: err -> traceback -> frame -> err
            for name in growing:  # budget may have come free meanwhile (a shrink, a Drop)
                room = entry.ids.room(spaces[name])
                if room < wanted[name]:
                    self._elastic.grow(pool, wanted[name] - room)
        entry = self._pool(pool, caller)
        if elastic and entry.kept_sealed:  # nothing more comes: its sealed pages yield
            with contextlib.suppress(ResourceExhausted):
                return self.allocate(caller, pool, ref, items)
        came = sum(max(0, entry.ids.space(name, "items").num_free - before)
                   for name, before in free_before.items())
        waited = loop.time() - start
        gave = (f"; asked other leases' page caches to give back {asked:,} cached ids"
                if asked else "")
        grew = (f"; the elastic pool asked for groups for {', '.join(sorted(growing))} and "
                f"none more are on their way: {self._elastic.holders(pool)}") if growing else ""
        raise ResourceExhausted(
            f"{first.message}{gave}; {came:,} ids came free in the {waited:.2f} s waited{grew}",
            field=first.field)

    def free(self, caller: Caller, pool: str, ref: LeaseRef,
             items: Sequence[tuple[str, np.ndarray]]) -> int:
        """Free every ``(space, ids)`` item of the lease; validated first, all or none.

        Returns:
            Ids returned over all items.

        Raises:
            As :meth:`allocate` for the pool, the lease and the items; InvalidArgument also for
            an id out of range or repeated, FailedPrecondition for one this lease does not hold
            (nothing freed).
        """
        entry, lease, typed = self._items(caller, pool, ref, items, "free", "ids")
        # The ledger refuses pinned ids itself (a transfer in flight moves them).
        freed = sum(entry.free(lease.owner, typed).values())  # sealed pages: to the directory
        self._pressure.notify_freed()
        return freed

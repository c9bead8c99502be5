"""Who gets the device budget: the arbiter of elastic pools (issue 23), pure and without I/O.

Every elastic pool is a range of **groups** (the same token range in every per-layer view; its
bytes are the pool's ``group_bytes``). The arbiter holds, per pool, its ``floor`` (groups always
granted), ``cap`` (groups never exceeded) and ``weight``, and how many groups are granted now; the
budget is the device's, less what fixed pools take. It decides, it never moves memory: the daemon
commits a grant, and turns a reclaim into asks to page caches and to attached processes, then
reports the released groups back (:meth:`Arbiter.released`).

The rules:

1. Configure admits a pool only if every floor fits the budget together (:meth:`admit`), and
   grants its floor at once.
2. A grant above the floor comes from free budget first (:meth:`want`).
3. When the budget is short, groups are taken back from pools above their floor, in this order:
   groups with no page allocated (wholly free now: idle pools first, then the pool furthest
   above its weighted share; taking them costs the victim nothing), then groups that page
   caches hold unused (they are asked to give back): all of them from an idle pool; from a
   busy one what it does not use less one group of headroom, and past that only while its
   weighted share stays at least the asker's after the move (equal weighted shares,
   ``granted_bytes / weight``).
4. Pages in use are never taken: a reclaim names groups the victim can drain. When free and
   cached groups do not cover a busy asker, groups whose pages are in use are asked back
   (``busy``) from pools above their weighted share, down to equal weighted shares only: the
   daemon stops handing out their free pages and asks the victim's caches for what they free,
   so the groups empty as the victim's requests finish (no starvation of the pool that
   arrived second); they are not taken until every page of them is free.

Reclaims are pending until released: the groups stay counted against the budget (they still
hold memory) and are not asked for twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from kvpool.contract.errors import InvalidArgument, ResourceExhausted

Source = Literal["free", "cached", "busy"]
SOURCES: tuple[Source, ...] = ("free", "cached", "busy")


@dataclass
class Share:
    """One elastic pool as the arbiter sees it.

    Attributes:
        name: the pool.
        group_bytes: bytes of one group (all its views' chunks).
        groups: groups in the pool's virtual range.
        floor: groups always granted. cap: groups never exceeded. weight: > 0.
        granted: groups granted now (released ones no longer count).
        free_groups: granted groups with no page allocated (can be released now).
        cached_groups: granted groups whose allocated pages are all unused in page caches (can
            be released once the caches give them back).
        idle: no allocation since the daemon last looked (taken from before busy pools).
        reclaiming: groups asked back and not yet released.
    """

    name: str
    group_bytes: int
    groups: int
    floor: int
    cap: int
    weight: float = 1.0
    granted: int = 0
    free_groups: int = 0
    cached_groups: int = 0
    idle: bool = False
    reclaiming: int = 0

    @property
    def granted_bytes(self) -> int:
        return self.granted * self.group_bytes

    def share(self, granted: int | None = None) -> float:
        """Weighted share: granted bytes per unit of weight."""
        return (self.granted if granted is None else granted) * self.group_bytes / self.weight

    def takeable(self, source: Source) -> int:
        """Groups that may still be asked back from ``source``: above the floor, not asked for
        yet; ``cached`` counts only what ``free`` does not already offer, ``busy`` (groups with
        pages in use) what neither does."""
        above = max(0, self.granted - self.reclaiming - self.floor)
        free = max(0, self.free_groups - self.reclaiming)
        if source == "free":
            return min(above, free)
        cached = max(0, self.free_groups + self.cached_groups - self.reclaiming) - free
        cached_take = max(0, min(above - min(above, free), cached))
        if source == "cached":
            return cached_take
        return max(0, above - min(above, free) - cached_take)


@dataclass(frozen=True)
class Reclaim:
    """Ask ``victim`` for ``groups`` groups from ``source`` (its free or cached groups)."""

    victim: str
    groups: int
    source: Source


@dataclass(frozen=True)
class Decision:
    """What to do for a pool that wants more groups: grant ``grant`` now (budget is free for
    them) and start ``reclaims`` (their groups come to the asker as they are released)."""

    grant: int
    reclaims: tuple[Reclaim, ...] = ()

    @property
    def pending(self) -> int:
        return sum(r.groups for r in self.reclaims)


@dataclass
class Arbiter:
    """The budget and the elastic pools' shares of it.

    Args:
        budget_bytes: the device budget of all pools.
        fixed_bytes: what fixed pools (and other charges) take of it.
    """

    budget_bytes: int
    fixed_bytes: int = 0
    pools: dict[str, Share] = field(default_factory=dict)
    # bytes promised to an asker from pending reclaims, per victim: (asker, victim) -> bytes.
    # Keyed by both ends so a Drop of either cancels exactly its promises (:meth:`drop`).
    promised: dict[tuple[str, str], int] = field(default_factory=dict)

    def promised_to(self, name: str) -> int:
        """Bytes promised to ``name`` from pending reclaims, over every victim."""
        return sum(b for (asker, _), b in self.promised.items() if asker == name)

    def _promised_groups(self, name: str) -> int:
        return -(-self.promised_to(name) // self.pools[name].group_bytes)

    def _unpromise(self, asker: str, victim: str, nbytes: int) -> None:
        key = (asker, victim)
        left = self.promised.get(key, 0) - nbytes
        if left > 0:
            self.promised[key] = left
        else:
            self.promised.pop(key, None)

    @property
    def granted_bytes(self) -> int:
        return sum(p.granted_bytes for p in self.pools.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.fixed_bytes - self.granted_bytes

    def holders(self, asker: str) -> str:
        """Who holds the budget, as a refusal to ``asker`` says it: the fixed pools, each
        elastic pool's granted bytes and floor, what is free, and the knobs."""
        parts = [f"fixed pools {self.fixed_bytes:,} B"]
        for p in sorted(self.pools.values(), key=lambda p: -p.granted_bytes):
            me = " (this pool)" if p.name == asker else ""
            parts.append(f"{p.name!r}{me} {p.granted_bytes:,} B, its floor "
                         f"{p.floor * p.group_bytes:,} B")
        return (f"the budget of {self.budget_bytes:,} B is held by: {'; '.join(parts)}; "
                f"{max(0, self.free_bytes):,} B free. Raise the daemon's --budget, or lower "
                "another pool's floor (--elastic-floor-tokens) so its groups can be taken back")

    # -- configure and drop ----------------------------------------------------------------

    def admit(self, share: Share) -> Decision:
        """Add a pool and grant its floor: what is free now, the rest by reclaims from pools
        above their floors.

        Raises:
            InvalidArgument: floor above cap, cap above the range, a weight that is not > 0,
                a name already admitted.
            ResourceExhausted: the floors together do not fit the budget (names the numbers).
        """
        self.check(share)
        # Floors fit, but others may hold more than theirs now: what is not free is reclaimed
        # for this floor from any pool above its own (a floor is owed), as for any want.
        self.pools[share.name] = dataclasses.replace(share, granted=0, reclaiming=0)
        return self.want(share.name, share.floor)

    def check(self, share: Share) -> None:
        """What :meth:`admit` checks, changing nothing (Configure asks before it builds).

        Raises:
            As :meth:`admit`.
        """
        if share.name in self.pools:
            raise InvalidArgument(f"elastic pool {share.name!r} is already admitted",
                                  field="pool")
        if not 0 < share.weight < float("inf"):
            raise InvalidArgument(f"weight {share.weight} must be > 0", field="weight")
        if not 0 <= share.floor <= share.cap <= share.groups:
            raise InvalidArgument(
                f"elastic pool {share.name!r}: need 0 <= floor ({share.floor}) <= cap "
                f"({share.cap}) <= groups in range ({share.groups})", field="floor")
        floors = sum(p.floor * p.group_bytes for p in self.pools.values())
        need = share.floor * share.group_bytes
        room = self.budget_bytes - self.fixed_bytes - floors
        if need > room:
            raise ResourceExhausted(
                f"elastic pool {share.name!r}: its floor of {share.floor} groups "
                f"({need:,} B) does not fit beside the other pools' floors ({floors:,} B) and "
                f"the fixed pools ({self.fixed_bytes:,} B) in the budget "
                f"({self.budget_bytes:,} B); lower --elastic-floor-tokens or raise the "
                "daemon's --budget", field="elastic_floor_tokens")

    def drop(self, name: str) -> None:
        """Remove a pool, and every promise made to it or by it: a reclaim promised to it
        goes on (its groups come back to free budget, owed to nobody: the victim's
        ``reclaiming`` stays until released or cancelled), and a promise of its groups to
        another pool is void (the asker asks anew, from free budget once the dropped region
        is closed). O(promises)."""
        self.pools.pop(name, None)
        for key in [k for k in self.promised if name in k]:
            del self.promised[key]

    # -- grants ------------------------------------------------------------------------------

    def want(self, name: str, groups: int, *, reclaim: bool = True) -> Decision:
        """``name`` wants ``groups`` more groups than it has granted: what it gets now and what
        is reclaimed for it (less what reclaims already promise it).

        Never above its cap; free budget first; then (unless ``reclaim`` is False: a pool
        growing ahead of need takes only what is free) reclaims by rule 3. The grant is applied
        (counted) at once; reclaimed groups are promised and granted on :meth:`released`.
        """
        asker = self.pools[name]
        promised_groups = self._promised_groups(name)
        # what is already promised to it covers as much of the want: a pool that asks again
        # for the same shortfall (an Allocate waiting, retried) is not granted it twice
        groups = min(groups - promised_groups, asker.cap - asker.granted - promised_groups)
        if groups <= 0:
            return Decision(0)
        grant = min(groups, max(0, self.free_bytes) // asker.group_bytes)
        asker.granted += grant
        need_bytes = (groups - grant) * asker.group_bytes
        if not need_bytes or not reclaim:
            return Decision(grant)
        reclaims: list[Reclaim] = []
        promised = self.promised_to(name)
        below_floor = asker.granted * asker.group_bytes + promised < asker.floor * asker.group_bytes
        for source in SOURCES:
            for victim in self._victims(asker, source):
                if need_bytes <= 0:
                    break
                take = self._take(asker, victim, source, need_bytes, promised, below_floor)
                if take:
                    victim.reclaiming += take
                    reclaims.append(Reclaim(victim.name, take, source))
                    need_bytes -= take * victim.group_bytes
                    promised += take * victim.group_bytes
                    key = (name, victim.name)
                    self.promised[key] = self.promised.get(key, 0) + take * victim.group_bytes
        return Decision(grant, tuple(reclaims))

    def _victims(self, asker: Share, source: Source) -> list[Share]:
        """Pools that may give groups from ``source``: idle ones first, then the furthest above
        their weighted share."""
        others = [p for p in self.pools.values() if p is not asker and p.takeable(source)]
        return sorted(others, key=lambda p: (not p.idle, -p.share(p.granted - p.reclaiming)))

    def _take(self, asker: Share, victim: Share, source: Source, need_bytes: int,
              promised: int, below_floor: bool) -> int:
        """How many of ``victim``'s groups to ask back for ``need_bytes`` of the asker."""
        most = min(victim.takeable(source), -(-need_bytes // victim.group_bytes))
        if below_floor or (source != "busy" and (victim.idle or source == "free")):
            # a floor is owed; an idle pool, and any pool's wholly free groups, give what
            # nobody uses: no request of the victim loses a page
            return most
        if source == "busy":  # pages in use: only down to equal weighted shares
            taken = 0
        else:
            # A busy pool's caches: what it does not use, less one group of headroom, goes
            # to the pool that needs it; past that only down to equal weighted shares.
            used = victim.granted - victim.free_groups - victim.cached_groups
            taken = min(most, max(0, victim.granted - victim.reclaiming - used - 1))
        mine = (asker.granted * asker.group_bytes + promised) / asker.weight
        while taken < most:
            after_victim = victim.share(victim.granted - victim.reclaiming - taken - 1)
            after_asker = mine + (taken + 1) * victim.group_bytes / asker.weight
            if after_asker > after_victim:
                break  # past equal weighted shares: the victim keeps the rest
            taken += 1
        return taken

    def released(self, victim: str, groups: int, to: str | None = None) -> int:
        """``groups`` of ``victim``'s asked-back groups are released (unmapped everywhere,
        memory gone). With ``to`` (the asker they were promised to), grant what the freed budget
        covers of its promise; returns the groups granted to it."""
        v = self.pools[victim]
        groups = min(groups, v.reclaiming)
        v.reclaiming -= groups
        v.granted -= groups
        v.free_groups = max(0, v.free_groups - groups)
        v.cached_groups = min(v.cached_groups, v.granted - v.free_groups)
        if to is None or to not in self.pools:
            return 0
        asker = self.pools[to]
        owed = self._promised_groups(to)
        grant = min(owed, asker.cap - asker.granted, max(0, self.free_bytes) // asker.group_bytes)
        asker.granted += grant
        self._unpromise(to, victim, groups * v.group_bytes)
        # granted beyond what this release brought: other victims' promises are kept by it
        extra = grant * asker.group_bytes - groups * v.group_bytes
        for key in [k for k in self.promised if k[0] == to]:
            if extra <= 0:
                break
            kept = min(extra, self.promised[key])
            self._unpromise(*key, kept)
            extra -= kept
        return grant

    def cancel(self, victim: str, groups: int, to: str | None = None) -> None:
        """``groups`` asked back from ``victim`` will not come (its pages got used meanwhile):
        no longer pending, no longer promised to ``to``."""
        v = self.pools[victim]
        groups = min(groups, v.reclaiming)
        v.reclaiming -= groups
        if to is not None:
            self._unpromise(to, victim, groups * v.group_bytes)

    def observe(self, name: str, *, free_groups: int, cached_groups: int, idle: bool) -> None:
        """What the daemon sees of a pool now: granted groups with no page allocated, groups
        whose pages are all unused in page caches, and whether it allocated since last time."""
        p = self.pools[name]
        p.free_groups = max(0, min(free_groups, p.granted))
        p.cached_groups = max(0, min(cached_groups, p.granted - p.free_groups))
        p.idle = idle

    def give_up(self, name: str, groups: int) -> None:
        """``name`` released ``groups`` of its own granted groups (a shrink it chose, or its
        lease's groups beyond the floor at expiry); never below the floor."""
        p = self.pools[name]
        p.granted = max(p.floor, p.granted - groups)
        p.free_groups = min(p.free_groups, p.granted)

    def failed(self, name: str, groups: int) -> None:
        """``groups`` granted to ``name`` could not be backed (the device is out of memory):
        they no longer count."""
        p = self.pools.get(name)
        if p is not None:
            p.granted = max(0, p.granted - groups)
            p.free_groups = min(p.free_groups, p.granted)

    def take_back(self, name: str, groups: int) -> int:
        r"""Start taking back up to ``groups`` of ``name``'s own groups above its floor (a
        shrink: a lease ended, nobody asked); returns how many are now pending, to be
        :meth:`released` (with no asker) or :meth:`cancel`\ led."""
        p = self.pools[name]
        n = max(0, min(groups, p.granted - p.reclaiming - p.floor))
        p.reclaiming += n
        return n

"""All id spaces of one pool, built from the plan's table: batch allocate/free, reclaim, Stats.

Every call is all-or-nothing: a batch is checked in full (room per space, every id of every
item) before anything changes, so a refused call leaves every ledger as it was.

No locks: the daemon's event loop owns all allocator state, and every call here runs to the end
without yielding (O(count) numpy work, microseconds), so no other call sees a half-done batch.
Engines read the shared mapping buffers without coordination: they read only entries of ids they
were given, which are written before the allocate call returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.contract.errors import Internal, InvalidArgument, KVPoolError, echo
from kvpool.contract.plan import IdSpaceSpec
from kvpool.contract.records import SpaceStats
from kvpoold.ids.faults import Asked, Fault, fault_error, singular
from kvpoold.ids.grouped import GroupedSpace
from kvpoold.ids.pairing import Pairing
from kvpoold.ids.space import IdSpace

_BATCH_DONE = "nothing in the batch was freed"


@dataclass(frozen=True, slots=True, eq=False)
class MappingBuffer:
    """A shared mapping buffer a following space writes its links into.

    ``array`` is the host view (writable 1-D signed ints, indexed by leader id); ``on_write``,
    when set, is called with the (intp) leader ids whose entries were just written (a pool on
    an accelerator mirrors them to device memory through it).
    """

    array: np.ndarray
    on_write: Callable[[np.ndarray], None] | None = None


@dataclass(frozen=True, slots=True)
class Grant:
    """What one allocate item got: ``ids`` (int32), and for a space with a follower the
    follower id linked to each (``paired``) and that space's name (``paired_space``)."""

    ids: np.ndarray
    paired: np.ndarray | None = None
    paired_space: str | None = None


@dataclass(frozen=True, slots=True)
class _Item:
    """One free item, grouped under the space its ids are in (a release: the leader's)."""

    index: int
    space: IdSpace
    release: bool
    ids: np.ndarray


class PoolIds:
    """The id spaces of one pool (``kv``, ``swa`` following ``kv``, ``req``, ``state``...).

    Args:
        pool: the pool's name, for messages (spaces are called ``pool/name``).
        spaces: the plan's ``id_spaces``, in order (Stats and reclaim follow it).
        mappings: the shared buffers a following space's ``mapping`` names, by name.
        grouped: spaces of an elastic pool cut into groups: name -> pages per group.

    Raises:
        InvalidArgument: no space, a repeated name, a bad capacity, a following space whose
            leader is missing, itself follows or already has a follower, a following space
            without a mapping name or whose buffer is not in ``mappings``, or an unusable buffer.
    """

    def __init__(
        self,
        pool: str,
        spaces: Sequence[IdSpaceSpec],
        mappings: Mapping[str, MappingBuffer],
        grouped: Mapping[str, int] | None = None,
    ) -> None:
        self.pool = pool
        what = f"PoolIds {pool}"
        if not spaces:
            raise InvalidArgument(f"{what}: no id space; a pool has kv at least", field="spaces")
        by_name = {spec.name: spec for spec in spaces}
        self._spaces: dict[str, IdSpace] = {}
        for i, spec in enumerate(spaces):
            if spec.name in self._spaces:
                raise InvalidArgument(
                    f"{what}: id space {spec.name} is listed twice", field=f"spaces[{i}].name"
                )
            per = (grouped or {}).get(spec.name)
            self._spaces[spec.name] = (IdSpace(spec, pool=pool) if per is None
                                       else GroupedSpace(spec, per, pool=pool))
        # Leader space -> its pairing, and follower space -> the same pairing.
        self._pair_of_leader: dict[IdSpace, Pairing] = {}
        self._pair_of_follower: dict[IdSpace, Pairing] = {}
        for i, spec in enumerate(spaces):
            if spec.follows is None:
                continue
            lead = by_name.get(spec.follows)
            problem = ""
            if lead is None or lead.name == spec.name:
                problem = f"follows {spec.follows}, which is not another space of the pool"
            elif lead.follows is not None:
                problem = f"follows {lead.name}, which itself follows {lead.follows}"
            elif spec.mapping is None:
                problem = "has no mapping buffer to write its links into"
            elif spec.mapping not in mappings:
                problem = f"writes its links into {spec.mapping}, which was not given"
            if problem:
                raise InvalidArgument(
                    f"{what}: id space {spec.name} {problem} (have: {', '.join(by_name)}; "
                    f"mappings: {', '.join(mappings) or 'none'})",
                    field=f"spaces[{i}].follows",
                )
            assert lead is not None and spec.mapping is not None
            leader, follower = self._spaces[lead.name], self._spaces[spec.name]
            if leader in self._pair_of_leader:
                raise InvalidArgument(
                    f"{what}: id space {lead.name} has two followers "
                    f"({self._pair_of_leader[leader].follower.name}, {spec.name})",
                    field=f"spaces[{i}].follows",
                )
            buffer = mappings[spec.mapping]
            pair = Pairing(leader, follower, buffer.array, buffer.on_write)
            self._pair_of_leader[leader] = pair
            self._pair_of_follower[follower] = pair
        self.names: tuple[str, ...] = tuple(self._spaces)
        self._listed = ", ".join(self.names)

    # -- names ------------------------------------------------------------------------------

    def spec(self, name: str) -> IdSpaceSpec:
        """The plan's row of space ``name``.

        Args:
            name: a space of this pool.

        Returns:
            Its spec.

        Raises:
            InvalidArgument: the pool has no such space.
        """
        return self.space(name, "space").spec

    def space(self, name: str, field: str) -> IdSpace:
        """Resolve a space name from a request, once, at the edge (whether it may be allocated
        on its own is :meth:`allocate`'s one check).

        Args:
            name: the name as sent (``"kv"``).
            field: its input field, for messages (``"items[1].space"``).

        Returns:
            The space, to pass to :meth:`allocate` / :meth:`free`.

        Raises:
            InvalidArgument: the pool has no such space.
        """
        space = self._spaces.get(name) if type(name) is str else None
        if space is None:
            shown = (name if type(name) is str and name.isidentifier() and len(name) <= 40
                     else echo(name, 40))
            raise InvalidArgument(
                f"{field}={shown}: pool {self.pool} has no {shown} space (it has: "
                f"{self._listed}); Configure it with one",
                field=field,
            )
        return space

    # -- allocate ---------------------------------------------------------------------------

    def allocate(self, owner: int, items: Sequence[tuple[IdSpace, int]]) -> list[Grant]:
        """Allocate several ``(space, count)`` items for ``owner``, all or none.

        Room is checked per space for the batch's sum before anything is taken (a leader's room
        is its free count or its follower's, whichever is smaller). A count of 0 gets empty
        arrays.

        Args:
            owner: the lease, ``1..OWNER_MAX``.
            items: spaces from :meth:`space` and counts ``>= 0``; a space
                may appear more than once.

        Returns:
            One grant per item, in order.

        Raises:
            ResourceExhausted: a space (or a leader's follower) has too few free; names the item.
            InvalidArgument: an item names a following space.
            Internal: a space of another pool.
        """
        if len(items) == 1:  # the hot path: one space, no totals to keep
            space, count = items[0]
            self._check_allocatable(space, 0)
            if count > self._room(space):
                self._refuse(space, count, count, 0)
            return [self._take(owner, space, count)]
        for i, (space, _count) in enumerate(items):  # a malformed item before any room check
            self._check_allocatable(space, i)
        totals: dict[IdSpace, int] = {}
        for i, (space, count) in enumerate(items):
            if count:
                total = totals[space] = totals.get(space, 0) + count
                if total > self._room(space):
                    self._refuse(space, total, count, i)
        return [self._take(owner, space, count) for space, count in items]

    def _check_allocatable(self, space: IdSpace, i: int) -> None:
        if self._spaces.get(space.name) is not space:
            raise Internal(f"allocate {self.pool}: items[{i}] is a space of another pool")
        pair = self._pair_of_follower.get(space)
        if pair is not None:  # the one "a following space cannot be allocated" check
            field = f"items[{i}].space"
            leader = pair.leader
            raise InvalidArgument(
                f"{field}={space.name} cannot be allocated on its own: allocate {leader.name}, "
                f"which brings a {space.name} {singular(space.unit)} per {leader.name} "
                f"{singular(leader.unit)}", field=field)

    def room(self, space: IdSpace) -> int:
        """Ids of ``space`` an Allocate could take now (a leader: with its follower's)."""
        return self._room(space)

    def _room(self, space: IdSpace) -> int:
        pair = self._pair_of_leader.get(space)
        return space.num_free if pair is None else pair.room

    def _take(self, owner: int, space: IdSpace, count: int) -> Grant:
        pair = self._pair_of_leader.get(space)
        if pair is None:
            return Grant(space.take(owner, count))
        ids, paired = pair.take(owner, count)
        return Grant(ids, paired, pair.follower.name)

    def _refuse(self, space: IdSpace, total: int, count: int, i: int) -> None:
        """Raise ResourceExhausted for item ``i`` (``total``: the batch's sum so far)."""
        note = "" if total == count else f" in all (items of kind {space.name} up to {i})"
        action = f"allocate {self.pool} items[{i}] ({space.name})"
        field = f"items[{i}].count"
        pair = self._pair_of_leader.get(space)
        if pair is not None:
            pair.require_free(total, action=action, field=field, note=note)
        space.require_free(total, action=action, field=field, note=note)
        raise Internal(f"{action}: refused for room but require_free found room")

    # -- free -------------------------------------------------------------------------------

    def free(self, owner: int, items: Sequence[tuple[IdSpace, np.ndarray]]) -> dict[str, int]:
        """Free several ``(space, ids)`` items of ``owner``; all are checked before any changes.

        An item of a leader space frees its ids and their follower ids; an item of a following
        space takes leader ids and releases only their follower ids. Ids of a leader space and
        release items of its follower share the leader's id space: an id may appear once in
        all of them together (and once per other space).

        Args:
            owner: the lease that holds the ids.
            items: spaces from :meth:`space` and 1-D native int32 id arrays (read-only views of
                wire bytes are fine).

        Returns:
            Ids freed per space name of the items (a following space: follower ids released).

        Raises:
            InvalidArgument: an id out of range or repeated anywhere in its space.
            FailedPrecondition: an id not allocated, held by another lease, or (release) its
                follower id already released. The message names ``items[i].ids[j]`` of the
                first bad id; nothing was freed.
            Internal: a space of another pool.
        """
        if len(items) == 1:
            return self._free_one_item(owner, *items[0])
        groups: dict[IdSpace, list[_Item]] = {}
        for i, (space, ids) in enumerate(items):
            if self._spaces.get(space.name) is not space:
                raise Internal(f"free {self.pool}: items[{i}] is a space of another pool")
            pair = self._pair_of_follower.get(space)
            key = space if pair is None else pair.leader
            groups.setdefault(key, []).append(_Item(i, space, pair is not None, ids))
        checked: list[tuple[IdSpace, list[_Item], np.ndarray, np.ndarray | None]] = []
        refused: list[tuple[tuple[int, int], KVPoolError]] = []
        for key, group in groups.items():
            idx = (
                group[0].ids.astype(np.intp)
                if len(group) == 1
                else np.concatenate([item.ids for item in group]).astype(np.intp)
            )
            pair = self._pair_of_leader.get(key)
            release: np.ndarray | None = None
            fault: Fault | None
            if pair is None:
                fault = key.check(owner, idx)
            else:
                release = np.concatenate(
                    [np.full(item.ids.shape[0], item.release) for item in group]
                )
                fault = pair.check(owner, idx, release)
            if fault is not None:
                refused.append(self._batch_error(owner, key, pair, group, fault))
            checked.append((key, group, idx, release))
        if refused:
            raise min(refused, key=lambda r: r[0])[1]
        freed: dict[str, int] = {}
        for key, group, idx, release in checked:
            pair = self._pair_of_leader.get(key)
            if pair is None or release is None:
                freed[key.name] = key.commit_free(owner, idx)
                continue
            if any(item.release for item in group):
                freed[pair.follower.name] = pair.commit_release(owner, idx[release])
            if not all(item.release for item in group):
                freed[key.name] = pair.commit_free(owner, idx[~release])
        return {name: freed[name] for name in self.names if name in freed}

    def _free_one_item(self, owner: int, space: IdSpace, ids: np.ndarray) -> dict[str, int]:
        """One item: a single pass through the space (or its pairing)."""
        if self._spaces.get(space.name) is not space:
            raise Internal(f"free {self.pool}: items[0] is a space of another pool")
        asked = Asked(f"free {self.pool} ({space.name})", "items[0].ids", _BATCH_DONE)
        pair = self._pair_of_leader.get(space)
        if pair is not None:
            return {space.name: pair.free(owner, ids, asked)}
        pair = self._pair_of_follower.get(space)
        if pair is not None:
            return {space.name: pair.release(owner, ids, asked)}
        return {space.name: space.free(owner, ids, asked)}

    def _batch_error(
        self,
        owner: int,
        key: IdSpace,
        pair: Pairing | None,
        group: list[_Item],
        fault: Fault,
    ) -> tuple[tuple[int, int], KVPoolError]:
        """The error of a refused group, keyed by the bad id's ``(item, position)``."""
        starts = np.cumsum([0, *(item.ids.shape[0] for item in group)])

        def where(pos: int) -> tuple[_Item, int]:
            g = int(np.searchsorted(starts, pos, side="right")) - 1
            return group[g], pos - int(starts[g])

        def label(pos: int) -> str:
            item, j = where(pos)
            return f"items[{item.index}].ids[{j}]"

        item, local = where(fault.pos)
        error = fault_error(
            fault,
            action=f"free {self.pool} ({item.space.name})",
            space=key.space,
            owner=owner,
            value=int(item.ids[local]),
            label=label,
            done=_BATCH_DONE,
            follower=None if pair is None else pair.follower.space,
        )
        return (item.index, local), error

    # -- reclaim and queries ----------------------------------------------------------------

    def reclaim(self, owner: int) -> dict[str, int]:
        """Free everything ``owner`` holds in every space (a lease that ended or crashed).

        Args:
            owner: the lease.

        Returns:
            Ids freed per space name, every space of the pool listed in table order (0 when
            none were held).

        Raises:
            Internal: a held set disagrees with its owner array (see ``IdSpace.reclaim``).
        """
        out: dict[str, int] = {}
        for space in self._spaces.values():
            if space in self._pair_of_follower:
                continue  # its leader's pairing frees it
            pair = self._pair_of_leader.get(space)
            if pair is None:
                out[space.name] = space.reclaim(owner).shape[0]
            else:
                lead, follow = pair.reclaim(owner)
                out[space.name] = lead.shape[0]
                out[pair.follower.name] = follow.shape[0]
        return {name: out[name] for name in self.names}

    def counters(self) -> dict[str, SpaceStats]:
        """Counters per space, in table order.

        Returns:
            ``{name: counters}``.
        """
        return {name: space.counters() for name, space in self._spaces.items()}

    def held_of(self, owner: int) -> dict[str, int]:
        """``{space: ids held}`` of one owner, in table order (zeros left out); O(spaces):
        each space keeps every owner's count as ids come and go (``IdSpace.held``).

        Args:
            owner: the lease.

        Returns:
            A new dict (empty when it holds nothing here).
        """
        return {name: n for name, space in self._spaces.items() if (n := space.held(owner))}

    def held_by_owner(self) -> dict[int, dict[str, int]]:
        """``{owner: {space: ids held}}`` for every owner holding something (zeros left out).

        Returns:
            A new dict.
        """
        out: dict[int, dict[str, int]] = {}
        for name, space in self._spaces.items():
            for owner, held in space.holders().items():
                out.setdefault(owner, {})[name] = held
        return out

    def paired_of(self, space_name: str, ids: np.ndarray) -> np.ndarray:
        """The follower id linked to each leader id (0: released).

        Args:
            space_name: the leader space or its follower (``"kv"`` or ``"swa"``).
            ids: 1-D integer leader ids.

        Returns:
            A new int32 array of follower ids.

        Raises:
            InvalidArgument: no such space, a space without a pairing, or an id out of range.
        """
        space = self.space(space_name, "space")
        pair = self._pair_of_leader.get(space) or self._pair_of_follower.get(space)
        if pair is None:
            raise InvalidArgument(
                f"paired_of {self.pool}: space {space.name} is not paired with another (spaces: "
                f"{self._listed})",
                field="space",
            )
        return pair.paired_of(ids)

    def audit(self) -> None:
        """Check every ledger and link of the pool in O(N); for tests and debugging.

        Raises:
            Internal: naming the first broken invariant.
        """
        for space in self._spaces.values():
            if space not in self._pair_of_leader and space not in self._pair_of_follower:
                space.audit()
        for pair in self._pair_of_leader.values():
            pair.audit()

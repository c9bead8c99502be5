"""Who holds each id of one space: the owner array and each owner's held set.

Data (``N`` = capacity; 8 bytes per id, plus the held sets: 4 bytes per held id, in arrays that
grow by doubling and, past ``SHRINK_ABOVE`` entries, shrink once three quarters are unused):

- ``owners`` (int32, N + 2): the lease holding each id, 0 when free. Slots 0 and N + 1 hold a
  sentinel (-1) that no owner equals: a gather with ``mode="clip"`` maps every out-of-range id
  onto one, so one gather checks range and ownership together.
- ``slots`` (int32, N + 2): each held id's position in its owner's held set.
- ``sets``: per owner a :class:`Held`, the ids it holds, exactly, as a sparse set (``ids[:n]``;
  a removal moves the set's last ids into the holes it leaves), so a reclaim reads O(held).

The ledger knows nothing of which free id is handed out next (the space's free set does) nor of
transfers (its pins): it records ids handed to an owner and forgets ids taken from one, in
O(count). Callers pass trusted arguments (see :mod:`kvpoold.ids.space`).
"""

from __future__ import annotations

import sys

import numpy as np

from kvpoold.ids.faults import QUARANTINE
from kvpoold.ids.pins import Pins

SENTINEL = -1
# Positions of a free get distinct "pending" marks -2, -3, ...: a repeated id keeps only one.
TAGS_CACHED = 1 << 16
# A held set's smallest array, and the room up to which it never shrinks (an owner cycling
# between a few and a few thousand ids must not resize on every call).
MIN_ROOM = 16
SHRINK_ABOVE = 1 << 16
# Slot numbers for the ids a take adds to a held set (sliced rather than built per call).
_POSITIONS = np.arange(SHRINK_ABOVE, dtype=np.int32)
# Comparisons below are of the raw bytes of two int32 arrays: one ``==`` of bytes costs a tenth
# of a numpy ``(a == b).all()`` at the sizes a call sees.
_ZEROS = bytes(4 * TAGS_CACHED)


class Held:
    """The ids one owner holds in one space: ``ids[:n]``, in no particular order."""

    __slots__ = ("ids", "n")

    def __init__(self) -> None:
        self.ids = np.zeros(MIN_ROOM, dtype=np.int32)
        self.n = 0

    def resize(self, room: int) -> None:
        """Move the set into an array of ``room`` entries (``room >= n``)."""
        ids = np.zeros(room, dtype=np.int32)
        ids[: self.n] = self.ids[: self.n]
        self.ids = ids

    def grow(self, stop: int) -> None:
        """Make room for ``stop`` entries, doubling."""
        room = self.ids.shape[0]
        if stop > room:
            while room < stop:
                room *= 2
            self.resize(room)


class Ledger:
    """The owner of every id ``1..capacity`` of one space (0: free) and each owner's held set.

    Args:
        capacity: ids in the space (validated by the space).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.owners = np.zeros(capacity + 2, dtype=np.int32)
        self.owners[0] = self.owners[capacity + 1] = SENTINEL
        self.slots = np.zeros(capacity + 2, dtype=np.int32)
        self.sets: dict[int, Held] = {}
        # One emptied small set kept for the next new owner: an owner that holds nothing between
        # take(1) and free(1) would otherwise build a set per call.
        self._spare: Held | None = None
        self._tags = -2 - np.arange(min(capacity, TAGS_CACHED), dtype=np.int32)
        self._tag_bytes = self._tags.tobytes()

    def record(self, owner: int, ids: np.ndarray, count: int) -> None:
        """Hand ``ids`` (``count`` of them, int32, distinct, off the free set now; at least
        one) to ``owner``."""
        held = self.sets.get(owner)
        if held is None:
            held = self._new_set(owner)
        n = held.n
        stop = n + count
        if count == 1:  # scalar writes: a fifth of the cost of the array path
            if n == held.ids.shape[0]:
                held.resize(2 * n)
            i = int(ids[0])
            held.ids[n] = i
            self.owners[i] = owner
            self.slots[i] = n
        else:
            if stop > held.ids.shape[0]:
                held.grow(stop)
            idx = ids.astype(np.intp)  # numpy scatters with intp ~3x faster than with int32
            held.ids[n:stop] = ids
            self.owners[idx] = owner
            self.slots[idx] = (_POSITIONS[n:stop] if stop <= SHRINK_ABOVE
                               else np.arange(n, stop, dtype=np.int32))
        held.n = stop

    def _new_set(self, owner: int) -> Held:
        """An empty held set for ``owner``, who holds nothing yet (the spare one if kept)."""
        held = self._spare
        if held is None:
            held = Held()
        else:
            self._spare = None
        self.sets[owner] = held
        return held

    def remove_one(self, owner: int, i: int, held: Held) -> None:
        """Forget that ``owner`` holds id ``i`` (it does; ``held`` is its set): owner 0."""
        slots, held_ids = self.slots, held.ids
        last = held.n - 1
        at = int(slots[i])
        if at != last:  # the set's last id fills the hole
            moved = int(held_ids[last])
            held_ids[at] = moved
            slots[moved] = at
        self.owners[i] = 0
        held.n = last
        if not last:
            self.drop(owner, held)

    def mark(self, owner: int, idx: np.ndarray) -> bool:
        """Mark ``idx`` pending (distinct negative tags) when all are the owner's and distinct;
        else change nothing and return False (:meth:`unmark` undoes the marks)."""
        owners = self.owners
        count = idx.shape[0]
        # Range and ownership in one gather: an out-of-range id clips onto a sentinel (-1).
        mine = owner.to_bytes(4, sys.byteorder) * count
        if owners.take(idx, mode="clip").tobytes() != mine:
            return False
        if count <= self._tags.shape[0]:
            tags, tag_bytes = self._tags[:count], self._tag_bytes[: 4 * count]
        else:
            tags = -2 - np.arange(count, dtype=np.int32)
            tag_bytes = tags.tobytes()
        owners[idx] = tags
        # A repeated id keeps only the tag of its last position, so some position reads back
        # another's tag.
        if owners[idx].tobytes() != tag_bytes:
            owners[idx] = owner
            return False
        return True

    def unmark(self, owner: int, idx: np.ndarray) -> None:
        """Undo :meth:`mark`: the ids are ``owner``'s again."""
        self.owners[idx] = owner

    def holds_all(self, owner: int, idx: np.ndarray) -> bool:
        """Whether the owner array names ``owner`` for every id of ``idx`` (in range)."""
        return self.owners[idx].tobytes() == owner.to_bytes(4, sys.byteorder) * idx.shape[0]

    def remove(self, owner: int, held: Held, idx: np.ndarray, to: int = 0) -> None:
        """Move checked ids ``idx`` (intp, distinct, the owner's; maybe marked pending) out of
        ``owner``'s set: free (``to`` 0) or to the owner ``to`` (whose set the caller fills)."""
        owners, slots = self.owners, self.slots
        count = idx.shape[0]
        n = held.n
        keep = n - count
        owners[idx] = to
        if keep:
            tail = held.ids[keep:n]
            left = owners[tail]
            # Holes only when some of the set's last ``count`` entries stay (the ids freed are
            # not the ones taken last): those fill the holes the others leave below ``keep``.
            if to or count > TAGS_CACHED or left.tobytes() != _ZEROS[: 4 * count]:
                stay = tail[left == owner]
                if stay.shape[0]:
                    pos = slots[idx]
                    holes = pos[pos < keep]
                    held.ids[holes] = stay
                    slots[stay] = holes
        held.n = keep
        if not keep:
            self.drop(owner, held)
        elif held.ids.shape[0] > SHRINK_ABOVE and keep * 4 <= held.ids.shape[0]:
            room = held.ids.shape[0]
            while room > MIN_ROOM and keep * 4 <= room:
                room //= 2
            held.resize(room)

    def remove_all(self, owner: int, held: Held, idx: np.ndarray) -> None:
        """Free every id ``owner`` holds (``idx``: its whole set, as intp)."""
        self.owners[idx] = 0
        held.n = 0
        self.drop(owner, held)

    def quarantine(self, ids: np.ndarray) -> None:
        """Move held ``ids`` (int32, one owner's, distinct) to :data:`QUARANTINE`."""
        self.move(int(self.owners[int(ids[0])]), ids, QUARANTINE)

    def move(self, owner: int, ids: np.ndarray, to: int) -> None:
        """Move ``ids`` (int32, distinct, all ``owner``'s, checked) to the owner ``to`` (not 0):
        out of ``owner``'s held set into ``to``'s; O(count)."""
        if not ids.shape[0]:
            return
        idx = ids.astype(np.intp)
        self.remove(owner, self.sets[owner], idx, to=to)
        into = self.sets.get(to) or self._new_set(to)
        n = into.n
        stop = n + ids.shape[0]
        into.grow(stop)
        into.ids[n:stop] = ids
        self.slots[idx] = np.arange(n, stop, dtype=np.int32)
        into.n = stop

    def drop(self, owner: int, held: Held) -> None:
        """Forget an owner that holds nothing now (its set may serve the next new owner)."""
        del self.sets[owner]
        if held.ids.shape[0] == MIN_ROOM:
            self._spare = held

    def audit(self, free_ids: np.ndarray, used: int, pins: Pins) -> list[tuple[bool, str]]:
        """Every invariant of the ledger, with the free set's ids and count and the pins; O(N).

        Args:
            free_ids: every free id (intp), as the space's free set has them.
            used: ids off the free set, as it counts them (held or quarantined).
            pins: the space's pins.

        Returns:
            ``(ok, what)`` pairs, the ones the others rely on first.
        """
        cap = self.capacity
        owners = self.owners[1 : cap + 1]
        checks = [
            (0 <= used <= cap, f"used {used} outside 0..{cap}"),
            (self.owners[0] == SENTINEL and self.owners[cap + 1] == SENTINEL, "sentinels"),
            (bool((owners >= 0).all()), "an owner entry is negative (a pending mark left)"),
            (bool(((free_ids >= 1) & (free_ids <= cap)).all()), "a free-stack id out of range"),
        ]
        if all(ok for ok, _ in checks):
            held = owners != 0
            owned = int(held.sum())
            values, counts = np.unique(owners[held], return_counts=True)
            in_array = dict(zip(values.tolist(), counts.tolist(), strict=True))
            checks += [
                (distinct(free_ids), "an id is twice on the free stack"),
                (not self.owners[free_ids].any(), "a free id has an owner"),
                (owned == used, f"{owned} ids owned but used == {used}"),
                (in_array == {owner: h.n for owner, h in self.sets.items()},
                 "held counts differ from the owner array"),
                *pins.audit(owners, held),
            ]
        return checks + self._audit_sets()

    def _audit_sets(self) -> list[tuple[bool, str]]:
        """Each held set: its ids in range, distinct, owned by it, at their recorded slots."""
        checks: list[tuple[bool, str]] = []
        for owner, holding in self.sets.items():
            mine = holding.ids[: holding.n].astype(np.intp)
            ok_range = bool(((mine >= 1) & (mine <= self.capacity)).all())
            checks.append((0 < holding.n <= holding.ids.shape[0], f"owner {owner}'s set size"))
            checks.append((ok_range, f"owner {owner}'s set holds an id out of range"))
            if ok_range:
                where = np.arange(holding.n)
                checks.append((distinct(mine), f"owner {owner}'s set repeats an id"))
                checks.append((bool((self.owners[mine] == owner).all()), f"owner {owner}'s set"))
                checks.append((bool((self.slots[mine] == where).all()), f"owner {owner}'s slots"))
        return checks


def distinct(values: np.ndarray) -> bool:
    """Whether no value of the 1-D integer array ``values`` repeats; O(n log n), for audits.

    Args:
        values: the array.

    Returns:
        True when every value is distinct.
    """
    # A sort, not np.unique: numpy 2's unique of millions of ints is ~100x slower than a sort.
    ordered = np.sort(values)
    return ordered.shape[0] < 2 or bool((ordered[1:] != ordered[:-1]).all())

"""One id space ``1..N`` with an ownership ledger, in numpy: O(count) take/free, O(held) reclaim.

Data (``N`` = capacity; 12 bytes per id, plus the held sets: 4 bytes per held id, in arrays that
grow by doubling and, past ``SHRINK_ABOVE`` entries, shrink once three quarters are unused):

- ``_stack`` (int32, N): ids ``1..N``; ``_stack[head:]`` are the free ones, ``_stack[:head]`` is
  stale. A take hands out ``_stack[head:head+k]``, a free writes the ids back just below
  ``head``, so a freed id is the next one handed out (LIFO: warm pages first). ``used == head``.
- ``_owner`` (int32, N + 2): the lease holding each id, 0 when free. Slots 0 and N + 1 hold a
  sentinel (-1) that no owner equals: a gather with ``mode="clip"`` maps every out-of-range id
  onto one, so one gather checks range and ownership together.
- ``_slot`` (int32, N + 2): each held id's position in its owner's held set.
- per owner a ``_Held``: the ids it holds, exactly, as a sparse set (``ids[:n]``; a free moves
  the set's last ids into the holes it leaves), so reclaim reads O(held), never O(N).
- ``_pins`` (int32, N + 2; made at the space's first pin, so only pools that move pages between
  daemons pay its 4 bytes per id): how many transfers are moving each id now.

Each id has one owner and one state, and this ledger is the only place that says which:

- **free**: on the stack, owner 0;
- **held**: by one lease (owner = its number), which may free it;
- **pinned** (held, or quarantined, with ``_pins > 0``): a transfer is reading or writing it.
  A free of it is refused; its lease's end does not free it;
- **quarantined**: its lease ended while it was pinned. It is held by the reserved owner
  :data:`QUARANTINE`, so no lease can free or be handed it, and the last unpin frees it.

Every call is O(count) (O(held) for reclaim): a space of 16M ids costs per call what one of 1K
ids does. Callers below the daemon's edge pass trusted arguments: owners in ``1..OWNER_MAX``,
counts in ``0..INT32_MAX`` and ids as 1-D C-contiguous native int32 arrays (``check`` and
``commit`` take ``np.intp``); nothing here re-validates their types.

Not thread-safe and needs no lock: the daemon's event loop owns all allocator state.
"""

from __future__ import annotations

import sys

import numpy as np

from kvpool.contract.errors import Internal, InvalidArgument, KVPoolError, ResourceExhausted
from kvpool.contract.plan import IdSpaceSpec
from kvpool.contract.records import SpaceStats
from kvpoold.ids.faults import (
    CAPACITY_MAX,
    FREE,
    QUARANTINE,
    Asked,
    Fault,
    Reason,
    Space,
    fault_error,
    first_fault,
    position_label,
)

_SENTINEL = -1
# Positions of a free get distinct "pending" marks -2, -3, ...: a repeated id keeps only one.
_TAGS_CACHED = 1 << 16
# A held set's smallest array, and the room up to which it never shrinks (an owner cycling
# between a few and a few thousand ids must not resize on every call).
MIN_ROOM = 16
SHRINK_ABOVE = 1 << 16
# Slot numbers for the ids a take adds to a held set (sliced rather than built per call).
_POSITIONS = np.arange(SHRINK_ABOVE, dtype=np.int32)
# Comparisons below are of the raw bytes of two int32 arrays: one ``==`` of bytes costs a tenth
# of a numpy ``(a == b).all()`` at the sizes a call sees.
_ZEROS = bytes(4 * _TAGS_CACHED)


class _Held:
    """The ids one owner holds in one space: ``ids[:n]``, in no particular order."""

    __slots__ = ("ids", "n")

    def __init__(self) -> None:
        self.ids = np.zeros(MIN_ROOM, dtype=np.int32)
        self.n = 0

    def resize(self, room: int) -> None:
        ids = np.zeros(room, dtype=np.int32)
        ids[: self.n] = self.ids[: self.n]
        self.ids = ids


class IdSpace:
    """Ids ``1..capacity`` of one space (KV pages, request rows, state slots...), lent to owners.

    Args:
        spec: the plan's row for this space: name, capacity, unit and knob (for messages).
        pool: the pool's name; messages and Stats call the space ``pool/name``.

    Raises:
        InvalidArgument: a capacity outside ``1..CAPACITY_MAX``.
    """

    def __init__(self, spec: IdSpaceSpec, *, pool: str = "") -> None:
        cap = spec.capacity
        label = f"{pool}/{spec.name}" if pool else spec.name
        if type(cap) is not int or not 1 <= cap <= CAPACITY_MAX:
            raise InvalidArgument(
                f"IdSpace {label}: capacity must be in 1..{CAPACITY_MAX:,}, got {cap!r}; "
                "leave the space out of the pool when it has no ids",
                field="capacity",
            )
        self.spec = spec
        self.name = spec.name
        self.label = label
        self.capacity = cap
        self.unit = spec.unit
        self.knob = spec.knob
        self.space = Space(name=label, capacity=cap, unit=spec.unit)
        self._stack = np.arange(1, cap + 1, dtype=np.int32)
        self._owner = np.zeros(cap + 2, dtype=np.int32)
        self._owner[0] = self._owner[cap + 1] = _SENTINEL
        self._slot = np.zeros(cap + 2, dtype=np.int32)
        self._head = 0
        self._held: dict[int, _Held] = {}
        # One emptied small set kept for the next new owner: an owner that holds nothing between
        # take(1) and free(1) would otherwise build a set per call.
        self._spare: _Held | None = None
        self._tags = -2 - np.arange(min(cap, _TAGS_CACHED), dtype=np.int32)
        self._tag_bytes = self._tags.tobytes()
        self._high_water = 0
        self._frees = 0
        self._failed_allocs = 0
        self._pins: np.ndarray | None = None  # made by the first pin
        self._pinned = 0  # ids with a pin now

    # -- take -------------------------------------------------------------------------------

    def take(self, owner: int, count: int) -> np.ndarray:
        """Hand ``count`` free ids to ``owner``, all or none; the most recently freed first.

        Args:
            owner: the lease, ``1..OWNER_MAX``.
            count: how many, ``>= 0``.

        Returns:
            A new int32 array of distinct ids in ``1..N`` (empty for 0); the caller owns it.

        Raises:
            ResourceExhausted: fewer than ``count`` ids free (nothing is taken).
        """
        head = self._head
        end = head + count
        if end > self.capacity:
            self.require_free(count)
        if count <= 1:
            if count == 0:
                return np.zeros(0, dtype=np.int32)
            return self._take_one(owner, head)
        ids = self._stack[head:end].copy()
        self._record(owner, ids)
        return ids

    def _record(self, owner: int, ids: np.ndarray) -> None:
        """Hand ``ids`` (distinct, free, off the free set now) to ``owner`` in the ledger."""
        count = ids.shape[0]
        held = self._held_of(owner)
        n = held.n
        stop = n + count
        if stop > held.ids.shape[0]:
            room = held.ids.shape[0]
            while room < stop:
                room *= 2
            held.resize(room)
        idx = ids.astype(np.intp)  # numpy scatters with intp ~3x faster than with int32
        held.ids[n:stop] = ids
        self._owner[idx] = owner
        self._slot[idx] = (
            _POSITIONS[n:stop] if stop <= SHRINK_ABOVE else np.arange(n, stop, dtype=np.int32)
        )
        held.n = stop
        self._head = end = self._head + count
        if end > self._high_water:
            self._high_water = end

    def _take_one(self, owner: int, head: int) -> np.ndarray:
        """``take(owner, 1)`` with scalar writes: a fifth of the cost of the array path."""
        held = self._held_of(owner)
        n = held.n
        if n == held.ids.shape[0]:
            held.resize(2 * n)
        ids = self._stack[head : head + 1].copy()
        i = int(ids[0])
        held.ids[n] = i
        self._owner[i] = owner
        self._slot[i] = n
        held.n = n + 1
        self._head = end = head + 1
        if end > self._high_water:
            self._high_water = end
        return ids

    def _held_of(self, owner: int) -> _Held:
        held = self._held.get(owner)
        if held is None:
            held = self._spare
            if held is None:
                held = _Held()
            else:
                self._spare = None
            self._held[owner] = held
        return held

    def require_free(
        self, count: int, *, action: str = "", field: str = "count", note: str = ""
    ) -> None:
        """Raise unless ``count`` ids are free now; a refusal counts in ``failed_allocs``.

        Args:
            count: ids asked for.
            action: what was asked, for the message (default ``"allocate <label>"``).
            field: the input field of the count.
            note: said right after the count (``" in all (...)"`` for a batch total).

        Raises:
            ResourceExhausted: naming asked, free and capacity, the holders and the knob to turn.
        """
        used = self._head
        free = self.num_free
        if count <= free:
            return
        self._failed_allocs += 1
        action = action or f"allocate {self.label}"
        asked = f"asked for {count:,} {self.label} {self.unit}{note}"
        if count > self.capacity:
            raise ResourceExhausted(
                f"{action}: {asked}, more than the whole space ({self.capacity:,}), so it can "
                f"never fit; ask for fewer or Configure a larger {self.knob}",
                field=field,
            )
        raise ResourceExhausted(
            f"{action}: {asked}, {free:,} of {self.capacity:,} free{self._room_note()} "
            f"({used:,} held by {_leases(len(self._held))}); free some or Configure a larger "
            f"{self.knob}",
            field=field,
        )

    def _room_note(self) -> str:
        """Said after the free count in a refusal (an elastic space names its groups)."""
        return ""

    # -- the free set: a stack here; an elastic space keeps one per group -------------------

    def _push(self, ids: np.ndarray) -> None:
        """Put freed ``ids`` (distinct, owner 0 now) back among the free: next handed out."""
        head = self._head - ids.shape[0]
        self._stack[head : self._head] = ids
        self._head = head

    def _push_one(self, i: int) -> None:
        self._head = head = self._head - 1
        self._stack[head] = i

    def _all_free(self) -> np.ndarray:
        """Every id that is free now, whether it may be handed out or not (audits)."""
        return self._stack[self._head :]

    # -- free -------------------------------------------------------------------------------

    def free(self, owner: int, ids: np.ndarray, asked: Asked = FREE) -> int:
        """Return ``ids`` from ``owner``, checked and committed in one pass, all or nothing.

        Args:
            owner: the lease that holds the ids.
            ids: 1-D C-contiguous native int32 ids (a read-only view of wire bytes is fine).
            asked: the call, for messages (default action ``"free <label>"``).

        Returns:
            How many ids were freed (``len(ids)``).

        Raises:
            InvalidArgument: an id out of range or repeated (nothing changed).
            FailedPrecondition: an id not allocated or held by another lease (nothing changed).
        """
        count = ids.shape[0]
        held = self._held.get(owner)
        if held is not None and count <= held.n:
            if count == 1:
                if self._free_one(owner, int(ids[0]), held):
                    return 1
            elif count:
                idx = ids.astype(np.intp)
                if self._mark(owner, idx) and self._unpinned(owner, idx):
                    self._remove(owner, held, idx)
                    self._frees += count
                    return count
            else:
                return 0
        elif count == 0:
            return 0
        raise self.free_error(owner, ids, asked)

    def _free_one(self, owner: int, i: int, held: _Held) -> bool:
        """Free id ``i`` if ``owner`` holds it (scalar reads and writes); False changes nothing."""
        owners = self._owner
        if not 1 <= i <= self.capacity or owners[i] != owner:
            return False
        if self._pins is not None and self._pins[i]:
            return False
        slots, held_ids = self._slot, held.ids
        last = held.n - 1
        at = int(slots[i])
        if at != last:  # the set's last id fills the hole
            moved = int(held_ids[last])
            held_ids[at] = moved
            slots[moved] = at
        owners[i] = 0
        self._push_one(i)
        held.n = last
        if not last:
            self._drop(owner, held)
        self._frees += 1
        return True

    def check(self, owner: int, idx: np.ndarray) -> Fault | None:
        """The first id of ``idx`` that ``owner`` may not free, or None; changes nothing.

        O(count) when every id may be freed; a refusal's diagnosis is O(position of the bad id).

        Args:
            owner: the lease.
            idx: the ids as a 1-D ``np.intp`` array.

        Returns:
            None when :meth:`commit` of the same ids may follow, else the first fault.

        Raises:
            Internal: the fast check refused but no fault is found (a corrupted ledger).
        """
        count = idx.shape[0]
        if count == 0:
            return None
        held = self._held.get(owner)
        if held is not None and count <= held.n and self._mark(owner, idx):
            self._owner[idx] = owner  # undo the pending marks
            pinned = self._first_pinned(idx)
            return None if pinned < 0 else Fault(pinned, Reason.PINNED)
        fault = first_fault(self._owner, owner, idx)
        if fault is None:
            raise Internal(f"free {self.label}: refused by the fast check but no fault found")
        return fault

    def _unpinned(self, owner: int, idx: np.ndarray) -> bool:
        """After a successful :meth:`_mark`: True when no id of ``idx`` is pinned; else undo
        the marks and return False."""
        if self._pins is None or not self._pins.take(idx).any():
            return True
        self._owner[idx] = owner
        return False

    def _first_pinned(self, idx: np.ndarray) -> int:
        """The first position of ``idx`` (ids in range) that is pinned, or -1."""
        if self._pins is None:
            return -1
        pinned = self._pins.take(idx, mode="clip") != 0
        return int(pinned.argmax()) if pinned.any() else -1

    def commit(self, owner: int, idx: np.ndarray) -> int:
        """Free ids already checked with :meth:`check`, with no call changing this space between.

        Args:
            owner: the lease.
            idx: 1-D ``np.intp`` ids, distinct and held by ``owner``.

        Returns:
            How many ids were freed.
        """
        count = idx.shape[0]
        if count <= 1:
            if count:
                self.commit_one(owner, int(idx[0]))
            return count
        self._remove(owner, self._held[owner], idx)
        self._frees += count
        return count

    def commit_one(self, owner: int, i: int) -> None:
        """:meth:`commit` of the one id ``i``, with scalar reads and writes.

        Args:
            owner: the lease.
            i: an id ``owner`` holds, checked with :meth:`check` (or known to be the owner's).

        Raises:
            Internal: ``owner`` does not hold ``i`` (a corrupted ledger or a caller bug).
        """
        held = self._held.get(owner)
        if held is None or not self._free_one(owner, i, held):
            raise Internal(f"free {self.label}: id {i} checked before was refused at commit")

    def _mark(self, owner: int, idx: np.ndarray) -> bool:
        """Mark ``idx`` pending (distinct negative tags) when all are the owner's and distinct;
        else change nothing and return False."""
        owners = self._owner
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

    def _remove(self, owner: int, held: _Held, idx: np.ndarray, push: bool = True) -> None:
        """Free checked ids ``idx`` (intp, distinct, the owner's; maybe marked pending); with
        ``push`` False they only leave the owner's set (owner 0, not on the free stack)."""
        owners, slots = self._owner, self._slot
        count = idx.shape[0]
        n = held.n
        keep = n - count
        owners[idx] = 0
        if keep:
            tail = held.ids[keep:n]
            left = owners[tail]
            # Holes only when some of the set's last ``count`` entries stay (the ids freed are
            # not the ones taken last): those fill the holes the others leave below ``keep``.
            if count > _TAGS_CACHED or left.tobytes() != _ZEROS[: 4 * count]:
                pos = slots[idx]
                holes = pos[pos < keep]
                stay = tail[left != 0]
                held.ids[holes] = stay
                slots[stay] = holes
        if push:
            self._push(idx)
        held.n = keep
        if not keep:
            self._drop(owner, held)
        elif held.ids.shape[0] > SHRINK_ABOVE and keep * 4 <= held.ids.shape[0]:
            room = held.ids.shape[0]
            while room > MIN_ROOM and keep * 4 <= room:
                room //= 2
            held.resize(room)

    def _drop(self, owner: int, held: _Held) -> None:
        """Forget an owner that holds nothing now (its set may serve the next new owner)."""
        del self._held[owner]
        if held.ids.shape[0] == MIN_ROOM:
            self._spare = held

    def free_error(self, owner: int, ids: np.ndarray, asked: Asked = FREE) -> KVPoolError:
        """The error for a refused free of ``ids`` by ``owner`` (nothing was changed).

        Args:
            owner: the lease.
            ids: the ids as sent.
            asked: the call (default action ``"free <label>"``).

        Returns:
            The error to raise (Internal when no fault is found: a corrupted ledger).
        """
        action = asked.action_or(f"free {self.label}")
        fault = first_fault(self._owner, owner, ids)
        if fault is None:
            pinned = self._first_pinned(ids.astype(np.intp))
            if pinned < 0:
                return Internal(f"{action}: refused by the fast check but no fault found")
            fault = Fault(pinned, Reason.PINNED)
        return fault_error(
            fault,
            action=action,
            space=self.space,
            owner=owner,
            value=int(ids[fault.pos]),
            label=position_label(asked.field),
            done=asked.done,
        )

    # -- reclaim and queries ----------------------------------------------------------------

    def reclaim(self, owner: int) -> np.ndarray:
        """Free everything ``owner`` holds (a lease that ended or crashed); O(held).

        Args:
            owner: the lease.

        Returns:
            The freed ids (a new int32 array; empty when none were held).

        Raises:
            Internal: the held set disagrees with the owner array (nothing is freed).
        """
        held = self._held.get(owner)
        if held is None:
            return np.zeros(0, dtype=np.int32)
        ids = held.ids[: held.n].copy()
        idx = ids.astype(np.intp)
        if self._owner[idx].tobytes() != owner.to_bytes(4, sys.byteorder) * held.n:
            raise Internal(
                f"reclaim {self.label}: owner {owner}'s held set ({held.n} ids) disagrees "
                "with the owner array; nothing was freed"
            )
        if self._pins is not None:
            pinned = self._pins[idx] != 0
            if pinned.any():  # a transfer still moves these: quarantine them, free the rest
                self._quarantine(ids[pinned])
                ids, idx = ids[~pinned], idx[~pinned]
                if not ids.shape[0]:
                    return ids
                held = self._held[owner]  # the set without the quarantined ids
        count = held.n
        self._owner[idx] = 0
        self._push(ids)
        held.n = 0
        self._drop(owner, held)
        self._frees += count
        return ids

    def _quarantine(self, ids: np.ndarray) -> None:
        """Move held, pinned ``ids`` (int32, one owner's, distinct) to :data:`QUARANTINE`."""
        idx = ids.astype(np.intp)
        owner = int(self._owner[idx[0]])
        self._remove(owner, self._held[owner], idx, push=False)
        into = self._held_of(QUARANTINE)
        n = into.n
        stop = n + ids.shape[0]
        if stop > into.ids.shape[0]:
            room = into.ids.shape[0]
            while room < stop:
                room *= 2
            into.resize(room)
        into.ids[n:stop] = ids
        self._owner[idx] = QUARANTINE
        self._slot[idx] = np.arange(n, stop, dtype=np.int32)
        into.n = stop

    # -- pins (transfers in flight) ---------------------------------------------------------

    def pin(self, idx: np.ndarray) -> None:
        """One more transfer moves each id of ``idx`` (intp, distinct, held): it cannot be
        freed, and its lease's end quarantines it, until as many :meth:`unpin` calls.

        Raises:
            Internal: an id is free (the caller checks holdings first).
        """
        if not idx.shape[0]:
            return
        owners = self._owner.take(idx, mode="clip")
        if not (owners > 0).all():
            raise Internal(f"pin {self.label}: an id to pin is free or out of range")
        if self._pins is None:
            self._pins = np.zeros(self.capacity + 2, dtype=np.int32)
        pins = self._pins
        before = pins[idx]
        self._pinned += int((before == 0).sum())
        pins[idx] = before + 1

    def unpin(self, idx: np.ndarray) -> int:
        """One transfer fewer moves each id of ``idx`` (intp, distinct, pinned); a quarantined
        id whose last pin this was is freed.

        Returns:
            How many quarantined ids were freed.

        Raises:
            Internal: an id is not pinned (unbalanced pins: a caller bug).
        """
        if not idx.shape[0]:
            return 0
        pins = self._pins
        if pins is None or not pins.take(idx, mode="clip").all():
            raise Internal(f"unpin {self.label}: an id to unpin is not pinned")
        after = pins[idx] - 1
        pins[idx] = after
        done = idx[after == 0]
        self._pinned -= done.shape[0]
        if not done.shape[0]:
            return 0
        lost = done[self._owner[done] == QUARANTINE]
        if lost.shape[0]:
            self._remove(QUARANTINE, self._held[QUARANTINE], lost)
            self._frees += lost.shape[0]
        return int(lost.shape[0])

    def pinned_of(self, idx: np.ndarray) -> np.ndarray:
        """Which of ``idx`` (intp, in range) a transfer moves now (bool per id)."""
        if self._pins is None:
            return np.zeros(idx.shape[0], dtype=bool)
        return self._pins[idx] != 0

    @property
    def pinned(self) -> int:
        """Ids a transfer moves now (held or quarantined)."""
        return self._pinned

    @property
    def quarantined(self) -> int:
        """Ids whose lease ended while a transfer moved them, waiting for it to end."""
        return self.held(QUARANTINE)

    @property
    def num_free(self) -> int:
        """Ids free now."""
        return self.capacity - self._head

    @property
    def used(self) -> int:
        """Ids held now."""
        return self._head

    def held(self, owner: int) -> int:
        """How many ids ``owner`` holds now.

        Args:
            owner: the lease.

        Returns:
            The count (0 for an owner holding nothing).
        """
        held = self._held.get(owner)
        return 0 if held is None else held.n

    def held_ids(self, owner: int) -> np.ndarray:
        """The ids ``owner`` holds (a new int32 array, in no particular order); O(held)."""
        held = self._held.get(owner)
        return np.zeros(0, dtype=np.int32) if held is None else held.ids[: held.n].copy()

    def holders(self) -> dict[int, int]:
        """``{owner: ids held}`` for every owner holding at least one id.

        Returns:
            A new dict.
        """
        return {owner: held.n for owner, held in self._held.items() if owner != QUARANTINE}

    def owner_of(self, ids: np.ndarray) -> np.ndarray:
        """The owner of each id (0 when free).

        Args:
            ids: 1-D integer ids.

        Returns:
            A new int32 array, one owner per id.

        Raises:
            InvalidArgument: an id outside ``1..N``.
        """
        idx = np.asarray(ids, dtype=np.intp)
        bad = (idx < 1) | (idx > self.capacity)
        if bad.any():
            pos = int(bad.argmax())
            raise InvalidArgument(
                f"owner_of {self.label} ids[{pos}]={idx[pos]}: out of range 1..{self.capacity}",
                field=f"ids[{pos}]",
            )
        return self._owner[idx]

    def free_ids(self) -> np.ndarray:
        """The free ids in the order they will be handed out; O(N), for tests.

        Returns:
            A new int32 array.
        """
        return self._stack[self._head :].copy()

    def counters(self) -> SpaceStats:
        """This space in Stats, taken now: the counters and what the plan says of the space.

        Returns:
            The record Stats carries (``frees`` counts ids, reclaim included;
            ``failed_allocs`` counts refused takes).
        """
        return SpaceStats(
            capacity=self.capacity,
            used=self._head,
            high_water=self._high_water,
            frees=self._frees,
            failed_allocs=self._failed_allocs,
            unit=self.spec.unit,
            bytes_per_unit=self.spec.bytes_per_unit,
            follows=self.spec.follows or "",
            pinned=self._pinned,
            quarantined=self.quarantined,
        )

    def audit(self) -> None:
        """Check every invariant of the ledger in O(N); for tests and debugging.

        Raises:
            Internal: naming the first broken invariant.
        """
        cap, head = self.capacity, self._head
        free_ids = self._all_free().astype(np.intp)
        owners = self._owner[1 : cap + 1]
        held = owners != 0
        checks: list[tuple[bool, str]] = [
            (0 <= head <= cap, f"used {head} outside 0..{cap}"),
            (self._owner[0] == _SENTINEL and self._owner[cap + 1] == _SENTINEL, "sentinels"),
            (bool((owners >= 0).all()), "an owner entry is negative (a pending mark left)"),
            (bool(((free_ids >= 1) & (free_ids <= cap)).all()), "a free-stack id out of range"),
        ]
        if all(ok for ok, _ in checks):
            checks += [
                (distinct(free_ids), "an id is twice on the free stack"),
                (not self._owner[free_ids].any(), "a free id has an owner"),
                (int(held.sum()) == head, f"{int(held.sum())} ids owned but used == {head}"),
            ]
            values, counts = np.unique(owners[held], return_counts=True)
            in_array = dict(zip(values.tolist(), counts.tolist(), strict=True))
            sets = {owner: h.n for owner, h in self._held.items()}
            checks.append((in_array == sets, "held counts differ from the owner array"))
            pins = self._pins
            if pins is None:
                checks.append((self._pinned == 0, f"{self._pinned} pinned without pins"))
            else:
                mine = pins[1 : cap + 1]
                checks += [
                    (pins[0] == 0 and pins[cap + 1] == 0, "a sentinel is pinned"),
                    (bool((mine >= 0).all()), "a pin count is negative"),
                    (int((mine > 0).sum()) == self._pinned,
                     f"{int((mine > 0).sum())} ids pinned but pinned == {self._pinned}"),
                    (not bool(((mine > 0) & ~held).any()), "a free id is pinned"),
                    (not bool(((owners == QUARANTINE) & (mine == 0)).any()),
                     "a quarantined id has no pin"),
                ]
            if pins is None:
                checks.append((not bool((owners == QUARANTINE).any()),
                               "an id is quarantined without pins"))
        for owner, holding in self._held.items():
            mine = holding.ids[: holding.n].astype(np.intp)
            ok_range = bool(((mine >= 1) & (mine <= cap)).all())
            checks.append((0 < holding.n <= holding.ids.shape[0], f"owner {owner}'s set size"))
            checks.append((ok_range, f"owner {owner}'s set holds an id out of range"))
            if ok_range:
                where = np.arange(holding.n)
                checks.append((distinct(mine), f"owner {owner}'s set repeats an id"))
                checks.append((bool((self._owner[mine] == owner).all()), f"owner {owner}'s set"))
                checks.append((bool((self._slot[mine] == where).all()), f"owner {owner}'s slots"))
        for ok, what in checks:
            if not ok:
                raise Internal(f"IdSpace {self.label} ledger broken: {what}")


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


def _leases(n: int) -> str:
    return f"{n} lease" if n == 1 else f"{n} leases"

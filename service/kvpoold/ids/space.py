"""One id space ``1..N``: its ledger composed with a free set, pins and quarantine; O(count) calls.

An :class:`IdSpace` owns three parts and alone changes them:

- the **ledger** (:class:`~kvpoold.ids.ledger.Ledger`): each id's owner, each owner's held set;
- the **free set** (:class:`~kvpoold.ids.free_set.FreeSet`): the free ids, how many are out
  (used, and its high water) and which free id is handed out next: one stack
  (:class:`~kvpoold.ids.free_set.StackFree`, LIFO: warm pages first), or an elastic pool's
  per-group stacks (:class:`~kvpoold.ids.groups.GroupedFree`);
- the **pins** (:class:`~kvpoold.ids.pins.Pins`): how many transfers move each id.

Each id has one owner and one state, and this space is the only place that says which:

- **free**: in the free set, owner 0;
- **held**: by one lease (owner = its number), which may free it;
- **pinned** (held, or quarantined, with a pin): a transfer is reading or writing it.
  A free of it is refused; its lease's end does not free it;
- **quarantined**: its lease ended while it was pinned. It is held by the reserved owner
  :data:`QUARANTINE`, so no lease can free or be handed it, and the last unpin frees it.

Every call is O(count) (O(held) for reclaim): a space of 16M ids costs per call what one of 1K
ids does. Callers below the daemon's edge pass trusted arguments: owners in ``1..OWNER_MAX``,
counts in ``0..INT32_MAX`` and ids as 1-D C-contiguous native int32 arrays (``check`` and
``commit_free`` take ``np.intp``); nothing here re-validates their types.

Not thread-safe and needs no lock: the daemon's event loop owns all allocator state.
"""

from __future__ import annotations

import numpy as np

from kvpool.contract.errors import Internal, InvalidArgument, KVPoolError, ResourceExhausted
from kvpool.contract.plan import IdSpaceSpec
from kvpool.contract.records import SpaceStats
from kvpoold.ids.faults import (
    CAPACITY_MAX,
    DIRECTORY,
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
from kvpoold.ids.free_set import FreeSet, StackFree
from kvpoold.ids.ledger import MIN_ROOM, SHRINK_ABOVE, Ledger, distinct
from kvpoold.ids.pins import Pins

__all__ = ["MIN_ROOM", "SHRINK_ABOVE", "IdSpace", "distinct", "space_label"]


def space_label(spec: IdSpaceSpec, pool: str) -> str:
    """The space's name in messages and Stats (``pool/name``), checking its capacity.

    Raises:
        InvalidArgument: a capacity outside ``1..CAPACITY_MAX``.
    """
    cap = spec.capacity
    label = f"{pool}/{spec.name}" if pool else spec.name
    if type(cap) is not int or not 1 <= cap <= CAPACITY_MAX:
        raise InvalidArgument(
            f"IdSpace {label}: capacity must be in 1..{CAPACITY_MAX:,}, got {cap!r}; "
            "leave the space out of the pool when it has no ids",
            field="capacity",
        )
    return label


class IdSpace:
    """Ids ``1..capacity`` of one space (KV pages, request rows, state slots...), lent to owners.

    Args:
        spec: the plan's row for this space: name, capacity, unit and knob (for messages).
        pool: the pool's name; messages and Stats call the space ``pool/name``.
        free_set: which free id goes out next (default: one stack of ids ``1..capacity``,
            all free).

    Raises:
        InvalidArgument: a capacity outside ``1..CAPACITY_MAX``.
    """

    def __init__(self, spec: IdSpaceSpec, *, pool: str = "",
                 free_set: FreeSet | None = None) -> None:
        label = space_label(spec, pool)
        cap = spec.capacity
        self.spec = spec
        self.name = spec.name
        self.label = label
        self.capacity = cap
        self.unit = spec.unit
        self.knob = spec.knob
        self.space = Space(name=label, capacity=cap, unit=spec.unit)
        self._ledger = Ledger(cap)
        self._free: FreeSet = StackFree(cap, label) if free_set is None else free_set
        self._pins = Pins(cap, label)
        self._frees = 0
        self._failed_allocs = 0

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
        free = self._free
        if count > free.nfree:
            self.require_free(count)
        if count <= 0:
            return np.zeros(0, dtype=np.int32)
        ids = free.pop(count)
        self._ledger.record(owner, ids, count)
        return ids

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
        free = self._free.nfree
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
        used, holders = self._free.used, len(self._ledger.sets)
        raise ResourceExhausted(
            f"{action}: {asked}, {free:,} of {self.capacity:,} free{self._free.room_note()} "
            f"({used:,} held by {_leases(holders)}); free some or Configure a larger {self.knob}",
            field=field,
        )

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
        ledger = self._ledger
        held = ledger.sets.get(owner)
        if held is not None and count <= held.n:
            pins = self._pins.counts
            if count == 1:
                i = int(ids[0])
                if (1 <= i <= self.capacity and ledger.owners[i] == owner
                        and (pins is None or not pins[i])):
                    ledger.remove_one(owner, i, held)
                    self._free.push_one(i)
                    self._frees += 1
                    return 1
            elif count:
                idx = ids.astype(np.intp)
                if ledger.mark(owner, idx):
                    if pins is None or not pins.take(idx).any():
                        ledger.remove(owner, held, idx)
                        self._free.push(idx)
                        self._frees += count
                        return count
                    ledger.unmark(owner, idx)
            else:
                return 0
        elif count == 0:
            return 0
        raise self.free_error(owner, ids, asked)

    def check(self, owner: int, idx: np.ndarray) -> Fault | None:
        """The first id of ``idx`` that ``owner`` may not free, or None; changes nothing.

        O(count) when every id may be freed; a refusal's diagnosis is O(position of the bad id).

        Args:
            owner: the lease.
            idx: the ids as a 1-D ``np.intp`` array.

        Returns:
            None when :meth:`commit_free` of the same ids may follow, else the first fault.

        Raises:
            Internal: the fast check refused but no fault is found (a corrupted ledger).
        """
        count = idx.shape[0]
        if count == 0:
            return None
        ledger = self._ledger
        held = ledger.sets.get(owner)
        if held is not None and count <= held.n and ledger.mark(owner, idx):
            ledger.unmark(owner, idx)
            pinned = self._pins.first(idx)
            return None if pinned < 0 else Fault(pinned, Reason.PINNED)
        fault = first_fault(ledger.owners, owner, idx)
        if fault is None:
            raise Internal(f"free {self.label}: refused by the fast check but no fault found")
        return fault

    def commit_free(self, owner: int, idx: np.ndarray) -> int:
        """Free ids already checked with :meth:`check`, with no call changing this space between.

        Args:
            owner: the lease.
            idx: the ids :meth:`check` accepted (``np.intp``).

        Returns:
            How many ids were freed.
        """
        count = idx.shape[0]
        if count <= 1:
            if count:
                self.commit_free_one(owner, int(idx[0]))
            return count
        ledger = self._ledger
        ledger.remove(owner, ledger.sets[owner], idx)
        self._free.push(idx)
        self._frees += count
        return count

    def commit_free_one(self, owner: int, i: int) -> None:
        """:meth:`commit_free` of the one id ``i``, with scalar reads and writes.

        Args:
            owner: the lease.
            i: an id ``owner`` holds, checked with :meth:`check` (or known to be the owner's).

        Raises:
            Internal: ``owner`` does not hold ``i`` (a corrupted ledger or a caller bug).
        """
        ledger, pins = self._ledger, self._pins.counts
        held = ledger.sets.get(owner)
        if (held is None or not 1 <= i <= self.capacity or ledger.owners[i] != owner
                or (pins is not None and pins[i])):
            raise Internal(f"free {self.label}: id {i} checked before was refused at commit")
        ledger.remove_one(owner, i, held)
        self._free.push_one(i)
        self._frees += 1

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
        fault = first_fault(self._ledger.owners, owner, ids)
        if fault is None:
            pinned = self._pins.first(ids.astype(np.intp))
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

    def reclaim(self, owner: int) -> np.ndarray:
        """Free everything ``owner`` holds (a lease that ended or crashed); O(held).

        Args:
            owner: the lease.

        Returns:
            The freed ids (a new int32 array; empty when none were held).

        Raises:
            Internal: the held set disagrees with the owner array (nothing is freed).
        """
        ledger = self._ledger
        held = ledger.sets.get(owner)
        if held is None:
            return np.zeros(0, dtype=np.int32)
        ids = held.ids[: held.n].copy()
        idx = ids.astype(np.intp)
        if not ledger.holds_all(owner, idx):
            raise Internal(
                f"reclaim {self.label}: owner {owner}'s held set ({held.n} ids) disagrees "
                "with the owner array; nothing was freed"
            )
        if self._pins.counts is not None:
            pinned = self._pins.of(idx)
            if pinned.any():  # a transfer still moves these: quarantine them, free the rest
                ledger.quarantine(ids[pinned])
                ids, idx = ids[~pinned], idx[~pinned]
                if not ids.shape[0]:
                    return ids
                held = ledger.sets[owner]  # the set without the quarantined ids
        count = held.n
        ledger.remove_all(owner, held, idx)
        self._free.push(ids)
        self._frees += count
        return ids

    def move(self, owner: int, ids: np.ndarray, to: int) -> None:
        """Hand ``ids`` (int32, distinct, held by ``owner`` and not pinned: checked with
        :meth:`check`) from ``owner`` to ``to`` without freeing them: a lease's sealed pages to
        the directory, the directory's to the lease that adopts them; O(count)."""
        self._ledger.move(owner, ids, to)

    # -- pins (transfers in flight) ---------------------------------------------------------

    def pin(self, idx: np.ndarray) -> None:
        """One more transfer moves each id of ``idx`` (intp, distinct, held): it cannot be
        freed, and its lease's end quarantines it, until as many :meth:`unpin` calls.

        Raises:
            Internal: an id is free (the caller checks holdings first).
        """
        if idx.shape[0]:
            self._pins.pin(idx, self._ledger.owners)

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
        done = self._pins.unpin(idx)
        if not done.shape[0]:
            return 0
        ledger = self._ledger
        lost = done[ledger.owners[done] == QUARANTINE]
        if lost.shape[0]:
            ledger.remove(QUARANTINE, ledger.sets[QUARANTINE], lost)
            self._free.push(lost)
            self._frees += lost.shape[0]
        return int(lost.shape[0])

    def pinned_of(self, idx: np.ndarray) -> np.ndarray:
        """Which of ``idx`` (intp, in range) a transfer moves now (bool per id)."""
        return self._pins.of(idx)

    @property
    def pinned(self) -> int:
        """Ids a transfer moves now (held or quarantined)."""
        return self._pins.pinned

    # -- queries ----------------------------------------------------------------------------

    @property
    def quarantined(self) -> int:
        """Ids whose lease ended while a transfer moved them, waiting for it to end."""
        return self.held(QUARANTINE)

    @property
    def num_free(self) -> int:
        """Ids a take may have now."""
        return self._free.nfree

    @property
    def used(self) -> int:
        """Ids held now (quarantined ones included)."""
        return self._free.used

    def held(self, owner: int) -> int:
        """How many ids ``owner`` holds now (0 for an owner holding nothing)."""
        held = self._ledger.sets.get(owner)
        return 0 if held is None else held.n

    def held_ids(self, owner: int) -> np.ndarray:
        """The ids ``owner`` holds (a new int32 array, in no particular order); O(held)."""
        held = self._ledger.sets.get(owner)
        return np.zeros(0, dtype=np.int32) if held is None else held.ids[: held.n].copy()

    def holders(self) -> dict[int, int]:
        """``{owner: ids held}`` for every owner holding at least one id (a new dict)."""
        return {owner: held.n for owner, held in self._ledger.sets.items()
                if owner not in (QUARANTINE, DIRECTORY)}

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
        return self._ledger.owners[idx]

    def free_ids(self) -> np.ndarray:
        """The ids a take may hand out, in the order it would; O(N), for tests (a new array)."""
        return self._free.free_ids()

    def counters(self) -> SpaceStats:
        """This space in Stats, taken now: the counters and what the plan says of the space.

        Returns:
            The record Stats carries (``frees`` counts ids, reclaim included;
            ``failed_allocs`` counts refused takes).
        """
        return SpaceStats(
            capacity=self.capacity,
            used=self._free.used,
            high_water=self._free.high_water,
            frees=self._frees,
            failed_allocs=self._failed_allocs,
            unit=self.spec.unit,
            bytes_per_unit=self.spec.bytes_per_unit,
            follows=self.spec.follows or "",
            pinned=self._pins.pinned,
            quarantined=self.quarantined,
        )

    def audit(self) -> None:
        """Check every invariant of the ledger, the pins and the free set in O(N); for tests.

        Raises:
            Internal: naming the first broken invariant.
        """
        free = self._free
        for ok, what in self._ledger.audit(free.all_free().astype(np.intp), free.used, self._pins):
            if not ok:
                raise Internal(f"IdSpace {self.label} ledger broken: {what}")
        free.audit(self._ledger.owners[1 : self.capacity + 1])


def _leases(n: int) -> str:
    return f"{n} lease" if n == 1 else f"{n} leases"

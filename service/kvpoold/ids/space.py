"""One id space ``1..N`` with an ownership ledger: O(count) allocate/free, O(held) reclaim.

Data (``N`` = capacity; 12 bytes per id, plus the held sets: 4 bytes per held id, in arrays
that grow by doubling and, past 256 KiB, shrink once three quarters are unused):

- ``_stack`` (int32, N): ids ``1..N``; ``_stack[head:]`` are the free ones, ``_stack[:head]`` is
  stale. Allocate takes ``_stack[head:head+k]``, free writes the ids back just below ``head``,
  so a freed id is the next one handed out (LIFO, warm pages first). ``used == head``.
- ``_owner`` (int32, N + 2): the lease holding each id, ``<= 0`` when free. Slots 0 and N + 1 hold
  a sentinel (-1), never handed out.
- ``_slots`` (int32, N + 2): each held id's position in its owner's held set.
- per owner a ``HeldSet`` (``ledger.py``): the ids it holds, exactly, as a sparse set, so
  reclaim is O(held).
- ``_ledger`` (``ledger.py``): does the O(count) loops over those arrays (take, validated give,
  check) in one C call, or in numpy when the C extension is not built; it keeps ``head``.

Not thread-safe: the caller (``PoolAllocator``) holds one lock around every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpool.errors import Internal, InvalidArgument, ResourceExhausted
from kvpoold.ids.faults import (
    CAPACITY_MAX,
    EMPTY_IDS,
    OWNER_MAX,
    Fault,
    IdsLike,
    Space,
    as_ids,
    check_count,
    check_owner,
    fault_error,
    first_fault,
    position_label,
    to_index,
)
from kvpoold.ids.ledger import Backend, HeldSet, check_backend, default_backend, new_ledger

_SENTINEL = -1


@dataclass(frozen=True, slots=True)
class PoolCounters:
    """A snapshot of one id space for Stats.

    ``allocs`` / ``frees`` count ids (not calls) handed out and returned since start, reclaim
    included, so ``used == allocs - frees``; ``failed_allocs`` counts refused allocate calls
    (not enough free). ``high_water`` is the largest ``used`` seen.
    """

    capacity: int
    used: int
    free: int
    high_water: int
    allocs: int
    frees: int
    failed_allocs: int


class IdPool:
    """Ids ``1..capacity`` of one space (KV pages, token slots, request rows, state slots).

    Args:
        capacity: the number of ids, N; ids are ``1..N`` and 0 is never handed out.
        name: for messages and Stats (``"llama/kv"``).
        unit: what an id is, for messages (``"pages"``, ``"slots"``).
        knob: the setting that makes the space larger, for ResourceExhausted messages.
        backend: ``"native"`` (C) or ``"numpy"`` ledger; None takes ``$KVPOOL_LEDGER``, by
            default C when it is built (see ``ledger.py``).

    Raises:
        InvalidArgument: for a capacity outside ``1..CAPACITY_MAX``, or an unusable backend.
    """

    def __init__(
        self,
        capacity: int,
        name: str,
        *,
        unit: str = "ids",
        knob: str = "budget_bytes",
        backend: Backend | None = None,
    ) -> None:
        cap = check_count(capacity, f"IdPool {name}", field="capacity")
        if not 1 <= cap <= CAPACITY_MAX:
            raise InvalidArgument(
                f"IdPool {name}: capacity must be in 1..{CAPACITY_MAX:,}, got {cap:,}; "
                "leave the space out of the pool when it has no ids",
                field="capacity",
            )
        self.space = Space(name=name, capacity=cap, unit=unit)
        self.name = name
        self.capacity = cap
        self.knob = knob
        self.backend = default_backend() if backend is None else check_backend(backend)
        self._stack = np.arange(1, cap + 1, dtype=np.int32)
        self._owner = np.zeros(cap + 2, dtype=np.int32)
        self._owner[0] = self._owner[cap + 1] = _SENTINEL
        self._slots = np.full(cap + 2, -1, dtype=np.int32)
        self._ledger = new_ledger(self._stack, self._owner, self._slots, self.backend)
        self._holdings: dict[int, HeldSet] = {}
        self._high_water = 0
        self._frees = 0
        self._failed_allocs = 0

    def allocate(self, owner: int, count: int) -> np.ndarray:
        """Hand ``count`` free ids to ``owner``, all or none.

        Args:
            owner: the lease, ``>= 1``.
            count: how many; 0 returns an empty array.

        Returns:
            A new int32 array of distinct ids in ``1..N``; the caller may keep or change it.

        Raises:
            InvalidArgument: bad owner or count.
            ResourceExhausted: fewer than ``count`` ids free (nothing is allocated).
        """
        if type(owner) is not int or not 0 < owner <= OWNER_MAX:
            owner = check_owner(owner, f"allocate {self.name}")
        if type(count) is not int or count <= 0:
            count = check_count(count, f"allocate {self.name}")
            if count == 0:
                return EMPTY_IDS
        ledger = self._ledger
        if ledger.head + count > self.capacity:  # before np.empty: count may be huge
            self.require_free(check_count(count, f"allocate {self.name}"))
        holding = self._holdings.get(owner)
        if holding is None:
            holding = self._holdings[owner] = ledger.new_set(owner)
        ids = np.empty(count, dtype=np.int32)
        end = ledger.take(owner, ids, holding)
        if end > self._high_water:
            self._high_water = end
        return ids

    def require_free(
        self, count: int, *, action: str = "", field: str = "count", note: str = ""
    ) -> None:
        """Raise unless ``count`` ids are free now; a refusal counts in ``failed_allocs``.

        Args:
            count: ids asked for.
            action: what was asked, for the message (default ``"allocate <name>"``).
            field: the input field of the count.
            note: said right after the count (``" in all"`` for a batch total).

        Raises:
            ResourceExhausted: naming asked, free and capacity, and the knob to turn.
        """
        used = self._ledger.head
        free = self.capacity - used
        if count <= free:
            return
        self._failed_allocs += 1
        action = action or f"allocate {self.name}"
        asked = f"asked for {count:,} {self.name} {self.space.unit}{note}"
        if count > self.capacity:
            raise ResourceExhausted(
                f"{action}: {asked}, more than the whole space ({self.capacity:,}), so it can "
                f"never fit; ask for fewer or Configure a larger {self.knob}",
                field=field,
            )
        raise ResourceExhausted(
            f"{action}: {asked}, {free:,} of {self.capacity:,} free ({used:,} held by "
            f"{_leases(len(self._holdings))}); free some or Configure a larger {self.knob}",
            field=field,
        )

    def free(self, owner: int, ids: IdsLike) -> int:
        """Return ``ids`` from ``owner``; every id is checked first and a refusal changes nothing.

        Args:
            owner: the lease that holds the ids.
            ids: 1-D integer ids (int32 from the wire, any integer dtype or a sequence).

        Returns:
            How many ids were freed (``len(ids)``).

        Raises:
            InvalidArgument: bad owner, dtype or shape; an id out of range or repeated.
            FailedPrecondition: an id not allocated or held by another lease.
        """
        if type(owner) is not int or not 0 < owner <= OWNER_MAX:
            owner = check_owner(owner, f"free {self.name}")
        holding = self._holdings.get(owner)
        if holding is None:  # holds nothing: only an empty free can succeed
            arr = as_ids(ids, f"free {self.name}")
            if arr.shape[0]:
                raise self._free_error(owner, arr)
            return 0
        arr: np.ndarray | None = None
        if type(ids) is np.ndarray:  # the hot path: the ledger reads int32/int64 as they are
            try:
                bad = self._ledger.give(owner, ids, holding)
                arr = ids
            except TypeError:  # uint32, strided, float, 2-D, ...: checked and converted below
                pass
        if arr is None:  # also a list, an array.array, a memoryview
            arr = as_ids(ids, f"free {self.name}")  # InvalidArgument for what is not ids
            bad = self._ledger.give(owner, to_index(arr), holding)
        if bad >= 0:
            raise self._free_error(owner, arr)
        count = arr.shape[0]
        self._frees += count
        if not len(holding):
            del self._holdings[owner]
        return count

    def validate_free(self, owner: int, ids: IdsLike) -> None:
        """Check ``free(owner, ids)`` would succeed, without changing anything.

        Raises:
            InvalidArgument, FailedPrecondition: as :meth:`free` would.
        """
        owner = check_owner(owner, f"free {self.name}")
        arr = as_ids(ids, f"free {self.name}")
        if self.find_fault(owner, to_index(arr)) is not None:
            raise self._free_error(owner, arr)

    def find_fault(self, owner: int, idx: np.ndarray) -> Fault | None:
        """The first id of ``idx`` (``np.intp``) that ``owner`` may not free, or None.

        Changes nothing. O(k) when every id may be freed; the diagnosis of a refusal is
        O(k log k) (see ``checks.first_fault``).
        """
        if self._ledger.check(owner, idx) < 0:
            return None
        return first_fault(self._owner, owner, idx)

    def commit_free(self, owner: int, idx: np.ndarray) -> int:
        """Free ids already checked with :meth:`find_fault` under the same lock.

        For callers that validate several spaces before changing any (``SwaPair``,
        ``PoolAllocator.free_batch``). ``idx``: int32 or int64, distinct and held by owner.

        Returns:
            How many ids were freed.
        """
        count = idx.shape[0]
        if count == 0:
            return 0
        holding = self._holdings[owner]
        if self._ledger.give(owner, idx, holding) >= 0:
            raise Internal(f"free {self.name}: ids checked by find_fault were refused at commit")
        self._frees += count
        if not len(holding):
            del self._holdings[owner]
        return count

    def reclaim(self, owner: int) -> int:
        """Free everything ``owner`` holds (a crashed or expired lease); O(held). Returns how
        many ids came back (0 when none were held); InvalidArgument for a bad owner."""
        return int(self.reclaim_ids(owner).shape[0])

    def reclaim_ids(self, owner: int) -> np.ndarray:
        """Like :meth:`reclaim`, returning the freed ids (int32) instead of their number."""
        owner = check_owner(owner, f"reclaim {self.name}")
        holding = self._holdings.get(owner)
        if holding is None:
            return EMPTY_IDS
        live = np.frombuffer(holding.tobytes(), dtype=np.int32).copy()
        if self._ledger.give(owner, live, holding) >= 0:
            raise Internal(
                f"reclaim {self.name}: owner {owner}'s held set ({len(holding)} ids) disagrees "
                "with the owner array; nothing was freed"
            )
        del self._holdings[owner]
        self._frees += live.shape[0]
        return live

    @property
    def num_free(self) -> int:
        """Ids free now."""
        return self.capacity - self._ledger.head

    def free_ids(self) -> np.ndarray:
        """The free ids in the order they will be handed out (a copy; O(N), for tests)."""
        return self._stack[self._ledger.head :].copy()

    def held(self, owner: int) -> int:
        """How many ids ``owner`` holds now."""
        holding = self._holdings.get(owner)
        return 0 if holding is None else len(holding)

    def holders(self) -> dict[int, int]:
        """``{owner: ids held}`` for every owner holding at least one id."""
        return {owner: len(h) for owner, h in self._holdings.items()}

    def owner_of(self, ids: IdsLike) -> np.ndarray:
        """The owner of each id (0 when free) as int32.

        Raises:
            InvalidArgument: bad dtype or shape, or an id outside ``1..N``.
        """
        idx = to_index(as_ids(ids, f"owner_of {self.name}"))
        bad = (idx < 1) | (idx > self.capacity)
        if bad.any():
            pos = int(bad.argmax())
            raise InvalidArgument(
                f"owner_of {self.name} ids[{pos}]={idx[pos]}: out of range 1..{self.capacity}",
                field=f"ids[{pos}]",
            )
        return np.maximum(self._owner[idx], 0)

    def stats(self) -> PoolCounters:
        """Counters for Stats, taken now."""
        used = self._ledger.head
        return PoolCounters(
            capacity=self.capacity,
            used=used,
            free=self.capacity - used,
            high_water=self._high_water,
            allocs=self._frees + used,
            frees=self._frees,
            failed_allocs=self._failed_allocs,
        )

    def audit(self) -> None:
        """Check every invariant of the ledger in O(N); for tests and debugging.

        Raises:
            Internal: naming the first broken invariant.
        """
        cap, head = self.capacity, self._ledger.head
        free_ids = self._stack[head:]
        owners = self._owner[1 : cap + 1]
        held = owners > 0
        checks = [
            (self._owner[0] == _SENTINEL and self._owner[cap + 1] == _SENTINEL, "sentinels"),
            (np.unique(free_ids).shape[0] == cap - head, "an id is twice on the free stack"),
            (bool((self._owner[free_ids] <= 0).all()), "a free id has an owner"),
            (int(held.sum()) == head, f"{int(held.sum())} ids owned but used == {head}"),
        ]
        values, counts = np.unique(owners[held], return_counts=True)
        in_array = dict(zip(values.tolist(), counts.tolist(), strict=True))
        checks.append((in_array == self.holders(), "held counts differ from the owner array"))
        for owner, holding in self._holdings.items():
            mine = np.frombuffer(holding.tobytes(), dtype=np.int32).astype(np.intp)
            where = np.arange(mine.shape[0])
            checks.append((bool((self._owner[mine] == owner).all()), f"owner {owner}'s set"))
            checks.append((bool((self._slots[mine] == where).all()), f"owner {owner}'s slots"))
        for ok, what in checks:
            if not ok:
                raise Internal(f"IdPool {self.name} ledger broken: {what}")

    def _free_error(self, owner: int, arr: np.ndarray) -> Exception:
        """The error for a refused free of ``arr`` (state unchanged)."""
        fault = self.find_fault(owner, to_index(arr))
        if fault is None:
            return Internal(f"free {self.name}: refused by the fast check but no fault found")
        return fault_error(
            fault,
            action=f"free {self.name}",
            space=self.space,
            owner=owner,
            value=int(arr[fault.pos]),
            label=position_label(),
        )


def _leases(n: int) -> str:
    return f"{n} lease" if n == 1 else f"{n} leases"

"""Allocator invariants under random call sequences, checked against plain-Python models.

Two hypothesis state machines: ``IdPool`` on its own (its fast free path) and a hybrid
``PoolAllocator`` (kv + swa + req + state, batch calls, swa release, reclaim). After every step:
no id held twice, every id's owner equals the model's, ``used + free == capacity``, the free
stack holds exactly the free ids, id 0 never handed out, and the shared mapping equals the
model's links. Every refused call must name the model's first bad id and change nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.errors import FailedPrecondition, InvalidArgument, KVPoolError, ResourceExhausted
from kvpoold.ids.ledger import Backend, native_available
from kvpoold.ids.pool_ids import Kind, PoolAllocator
from kvpoold.ids.space import IdPool

OWNERS = st.integers(min_value=1, max_value=3)
# Derandomized, so every run explores the same programs. No shrinking: minimizing a failing
# 40-step program takes hypothesis up to 5 minutes per machine, far past the suite's timeout; a
# failure is reported in seconds, and adding Phase.shrink locally minimizes it.
SETTINGS = settings(
    max_examples=80,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
REASON_ERROR = {
    "range": InvalidArgument,
    "repeated": InvalidArgument,
    "not allocated": FailedPrecondition,
    "other": FailedPrecondition,
    "released": FailedPrecondition,
}


def model_fault(
    owners: dict[int, int],
    capacity: int,
    owner: int,
    ids: list[int],
    release: list[bool] | None = None,
    links: dict[int, int] | None = None,
) -> tuple[int, str] | None:
    """The first bad position of a free (or, where ``release``, a swa release) and why."""
    seen: set[int] = set()
    fault = None
    for pos, i in enumerate(ids):
        if not 1 <= i <= capacity:
            fault = (pos, "range")
        elif i in seen:
            fault = (pos, "repeated")
        elif i not in owners:
            fault = (pos, "not allocated")
        elif owners[i] != owner:
            fault = (pos, "other")
        if fault:
            break
        seen.add(i)
    if release is not None and links is not None:
        end = len(ids) if fault is None else fault[0]
        for pos in range(end):
            if release[pos] and ids[pos] not in links:
                return pos, "released"
    return fault


def draw_ids(
    data: st.DataObject, owners: dict[int, int], capacity: int, owner: int, max_size: int = 5
) -> list[int]:
    """Ids to free: mostly the owner's own (a good free), sometimes with one id repeated, or a
    mix of held ids of any owner, free ids and out-of-range ids."""
    mine = sorted(i for i, o in owners.items() if o == owner)
    mode = data.draw(st.sampled_from(["mine", "mine", "repeat", "mixed"]))
    if not mine or mode == "mixed":
        free = [i for i in range(1, capacity + 1) if i not in owners][:3]
        pool = sorted(owners) + free + [0, capacity + 1, -1, 2**31 - 1]
        return data.draw(st.lists(st.sampled_from(pool), max_size=max_size))
    ids = data.draw(st.lists(st.sampled_from(mine), max_size=max_size, unique=True))
    if mode == "repeat" and ids:
        at = data.draw(st.integers(0, len(ids)))
        ids.insert(at, data.draw(st.sampled_from(ids)))
    return ids


def check_owners(pool: IdPool, owners: dict[int, int]) -> None:
    """The pool agrees with the model id by id, in counts and on its free stack."""
    cap = pool.capacity
    expected = [owners.get(i, 0) for i in range(1, cap + 1)]
    assert pool.owner_of(np.arange(1, cap + 1)).tolist() == expected
    stats = pool.stats()
    assert stats.used == len(owners) and stats.used + stats.free == cap
    assert stats.allocs - stats.frees == stats.used
    counts: dict[int, int] = {}
    for o in owners.values():
        counts[o] = counts.get(o, 0) + 1
    assert pool.holders() == counts
    free_stack = pool.free_ids().tolist()
    assert sorted(free_stack) == [i for i in range(1, cap + 1) if i not in owners]


class IdPoolMachine(RuleBasedStateMachine):
    """One IdPool of 12 ids against a dict id -> owner."""

    BACKEND: Backend = "native"

    def __init__(self) -> None:
        super().__init__()
        self.cap = 12
        self.pool = IdPool(self.cap, "p", backend=self.BACKEND)
        self.owners: dict[int, int] = {}
        self.high_water = 0

    def state(self) -> tuple[object, ...]:
        return self.pool.stats(), self.pool.holders(), self.pool.free_ids().tolist()

    @rule(owner=OWNERS, count=st.integers(min_value=0, max_value=14))
    def allocate(self, owner: int, count: int) -> None:
        free = self.cap - len(self.owners)
        if count > free:
            before = self.state()
            try:
                self.pool.allocate(owner, count)
            except ResourceExhausted:
                after = self.state()
                assert after[1:] == before[1:]
                assert after[0].failed_allocs == before[0].failed_allocs + 1  # type: ignore[attr-defined]
                return
            raise AssertionError("allocate past the free count succeeded")
        ids = self.pool.allocate(owner, count).tolist()
        assert len(ids) == count == len(set(ids))
        for i in ids:
            assert 1 <= i <= self.cap and i not in self.owners
            self.owners[i] = owner
        self.high_water = max(self.high_water, len(self.owners))

    @rule(owner=OWNERS, data=st.data(), as_list=st.booleans())
    def free(self, owner: int, data: st.DataObject, as_list: bool) -> None:
        ids = draw_ids(data, self.owners, self.cap, owner)
        fault = model_fault(self.owners, self.cap, owner, ids)
        before = self.state()
        arg: object = ids if as_list else np.array(ids, dtype=np.int64)
        if fault is None:
            assert self.pool.free(owner, arg) == len(ids)  # type: ignore[arg-type]
            for i in ids:
                del self.owners[i]
            return
        try:
            self.pool.free(owner, arg)  # type: ignore[arg-type]
        except KVPoolError as err:
            assert type(err) is REASON_ERROR[fault[1]]
            assert err.field == f"ids[{fault[0]}]", (err, fault)
            assert self.state() == before
            return
        raise AssertionError(f"bad free {ids} by {owner} succeeded, expected {fault}")

    @rule(owner=OWNERS, data=st.data())
    def validate_free(self, owner: int, data: st.DataObject) -> None:
        ids = draw_ids(data, self.owners, self.cap, owner, max_size=4)
        fault = model_fault(self.owners, self.cap, owner, ids)
        before = self.state()
        try:
            self.pool.validate_free(owner, np.array(ids, dtype=np.int32))
            assert fault is None
        except KVPoolError as err:
            assert fault is not None and err.field == f"ids[{fault[0]}]"
        assert self.state() == before

    @rule(owner=OWNERS)
    def reclaim(self, owner: int) -> None:
        mine = [i for i, o in self.owners.items() if o == owner]
        assert sorted(self.pool.reclaim_ids(owner).tolist()) == sorted(mine)
        for i in mine:
            del self.owners[i]

    @invariant()
    def agrees_with_model(self) -> None:
        check_owners(self.pool, self.owners)
        assert self.pool.stats().high_water == self.high_water
        self.pool.audit()


class AllocatorMachine(RuleBasedStateMachine):
    """A hybrid PoolAllocator (kv 10, swa 6, req 3, state 2) against dicts per space."""

    CAPS = {Kind.KV: 10, Kind.SWA: 6, Kind.REQ: 3, Kind.STATE: 2}
    BACKEND: Backend = "native"

    def __init__(self) -> None:
        super().__init__()
        self.mapping = np.zeros(self.CAPS[Kind.KV] + 2, dtype=np.int64)
        self.mapping[-1] = -1
        self.alloc = PoolAllocator(
            "m",
            kv_pages=self.CAPS[Kind.KV],
            swa_pages=self.CAPS[Kind.SWA],
            full_to_swa=self.mapping,
            req_rows=self.CAPS[Kind.REQ],
            state_slots=self.CAPS[Kind.STATE],
            backend=self.BACKEND,
        )
        self.owners: dict[Kind, dict[int, int]] = {k: {} for k in Kind}
        self.links: dict[int, int] = {}  # full id -> swa id

    def state(self) -> tuple[object, ...]:
        return self.alloc.stats(), self.alloc.held_by_owner(), self.mapping.tolist()

    def free_count(self, kind: Kind) -> int:
        return self.CAPS[kind] - len(self.owners[kind])

    @rule(
        owner=OWNERS,
        items=st.lists(
            st.tuples(st.sampled_from(["kv", "req", "state", "swa"]), st.integers(0, 5)),
            max_size=3,
        ),
    )
    def allocate_batch(self, owner: int, items: list[tuple[str, int]]) -> None:
        expected: tuple[type[Exception], str] | None = None
        totals: dict[Kind, int] = {}
        for i, (name, count) in enumerate(items):
            kind = Kind(name)
            if kind is Kind.SWA:
                expected = (InvalidArgument, f"items[{i}].kind")
                break
            totals[kind] = totals.get(kind, 0) + count
            room = self.free_count(kind)
            if kind is Kind.KV:
                room = min(room, self.free_count(Kind.SWA))
            if count and totals[kind] > room:
                expected = (ResourceExhausted, f"items[{i}].count")
                break
        before = self.state()
        if expected is not None:
            try:
                self.alloc.allocate_batch(owner, items)
            except KVPoolError as err:
                assert (type(err), err.field) == expected
                after = self.state()
                assert after[1:] == before[1:]
                return
            raise AssertionError(f"allocate_batch {items} succeeded, expected {expected}")
        arrays = self.alloc.allocate_batch(owner, items)
        assert [a.shape[0] for a in arrays] == [c for _, c in items]
        for (name, _), ids in zip(items, arrays, strict=True):
            kind = Kind(name)
            for i in ids.tolist():
                assert 1 <= i <= self.CAPS[kind] and i not in self.owners[kind]
                self.owners[kind][i] = owner
                if kind is Kind.KV:
                    s = int(self.mapping[i])
                    assert 1 <= s <= self.CAPS[Kind.SWA] and s not in self.owners[Kind.SWA]
                    self.owners[Kind.SWA][s] = owner
                    self.links[i] = s

    @rule(owner=OWNERS, data=st.data())
    def free_batch(self, owner: int, data: st.DataObject) -> None:
        kinds = data.draw(st.lists(st.sampled_from(["kv", "swa", "req", "state"]), max_size=3))
        items: list[tuple[str, list[int]]] = []
        for name in kinds:
            space = Kind.KV if name == "swa" else Kind(name)
            items.append((name, draw_ids(data, self.owners[space], self.CAPS[space], owner, 3)))
        expected = self.model_free_fault(owner, items)
        before = self.state()
        if expected is not None:
            try:
                self.alloc.free_batch(owner, items)  # type: ignore[arg-type]
            except KVPoolError as err:
                assert (type(err), err.field) == expected, (err, expected)
                assert self.state() == before
                return
            raise AssertionError(f"free_batch {items} by {owner} succeeded, expected {expected}")
        self.alloc.free_batch(owner, items)  # type: ignore[arg-type]
        for name, ids in items:
            kind = Kind(name)
            for i in ids:
                if kind in (Kind.KV, Kind.SWA):
                    s = self.links.pop(i, None)
                    if s is not None:
                        del self.owners[Kind.SWA][s]
                if kind is not Kind.SWA:
                    del self.owners[kind][i]

    def model_free_fault(
        self, owner: int, items: list[tuple[str, list[int]]]
    ) -> tuple[type[Exception], str] | None:
        """The error class and field of the first bad id in item order, or None."""
        groups: dict[Kind, list[tuple[int, str, list[int]]]] = {}
        for i, (name, ids) in enumerate(items):
            space = Kind.KV if name == "swa" else Kind(name)
            groups.setdefault(space, []).append((i, name, ids))
        found: list[tuple[tuple[int, int], str]] = []
        for space, group in groups.items():
            ids = [x for _, _, part in group for x in part]
            where = [(i, j) for i, _, part in group for j in range(len(part))]
            release = [name == "swa" for _, name, part in group for _ in part]
            fault = model_fault(
                self.owners[space], self.CAPS[space], owner, ids, release, self.links
            )
            if fault is not None:
                found.append((where[fault[0]], fault[1]))
        if not found:
            return None
        (item, pos), reason = min(found)
        return REASON_ERROR[reason], f"items[{item}].ids[{pos}]"

    @rule(owner=OWNERS)
    def reclaim(self, owner: int) -> None:
        expected = {k: sum(1 for o in self.owners[k].values() if o == owner) for k in Kind}
        assert self.alloc.reclaim(owner) == expected
        for kind in Kind:
            self.owners[kind] = {i: o for i, o in self.owners[kind].items() if o != owner}
        self.links = {f: s for f, s in self.links.items() if f in self.owners[Kind.KV]}

    @invariant()
    def agrees_with_model(self) -> None:
        for kind in Kind:
            check_owners(self.alloc._spaces[kind], self.owners[kind])
        cap = self.CAPS[Kind.KV]
        assert self.mapping[1 : cap + 1].tolist() == [
            self.links.get(f, 0) for f in range(1, cap + 1)
        ]
        assert self.mapping[0] == 0 and self.mapping[-1] == -1
        self.alloc.audit()


class NumpyIdPoolMachine(IdPoolMachine):
    BACKEND = "numpy"


class NumpyAllocatorMachine(AllocatorMachine):
    BACKEND = "numpy"


# Each machine on both ledgers; the C one is skipped only where it is not built (CI requires it).
NATIVE = pytest.mark.skipif(not native_available(), reason="kvpoold.ids._ledger is not built")
TestIdPoolMachine = NATIVE(IdPoolMachine.TestCase)
TestAllocatorMachine = NATIVE(AllocatorMachine.TestCase)
TestIdPoolMachineNumpy = NumpyIdPoolMachine.TestCase
TestAllocatorMachineNumpy = NumpyAllocatorMachine.TestCase
for case in (TestIdPoolMachine, TestAllocatorMachine, TestIdPoolMachineNumpy,
             TestAllocatorMachineNumpy):
    case.settings = SETTINGS

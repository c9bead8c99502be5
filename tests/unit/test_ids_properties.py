"""Allocator invariants under random call sequences, checked against dict-of-sets models.

Two hypothesis state machines: one ``IdSpace`` (take, one-pass free, check + commit, reclaim)
and a ``PoolIds`` with kv, swa following kv, and req (batch allocate, batch free with releases,
reclaim). After every step: every id's owner equals the model's, counters add up, the free stack
is exactly the model's LIFO order (IdSpace), the shared mapping equals the model's links,
each owner's held counts (``PoolIds.held_of``, what Stats reads per lease) equal a recount of
the owner arrays, and ``audit()`` passes. Bad calls (foreign ids, repeats, out-of-range ids,
double releases, too large counts) must raise the class and field of the model's first bad id
and change nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVPoolError,
    ResourceExhausted,
)
from kvpool.contract.plan import FULL_TO_SWA, IdSpaceSpec
from kvpoold.ids import IdSpace, MappingBuffer, PoolIds
from kvpoold.ids.faults import Reason
from tests.conftest import stateful_settings

OWNERS = st.integers(min_value=1, max_value=3)
SETTINGS = stateful_settings(examples=80, steps=40)
REASONS = {
    "range": (InvalidArgument, Reason.OUT_OF_RANGE),
    "repeated": (InvalidArgument, Reason.REPEATED),
    "not allocated": (FailedPrecondition, Reason.NOT_ALLOCATED),
    "other": (FailedPrecondition, Reason.OTHER_OWNER),
    "released": (FailedPrecondition, Reason.RELEASED),
}
INT32_EDGES = [0, -1, 2**31 - 1, -(2**31)]
# Mostly counts that fit, so the spaces fill up and frees find held ids; 0 and too many too.
COUNTS = st.sampled_from([1, 2, 1, 3, 4, 0, 2, 13])
# Each machine has one rule that draws its action from a weighted list: hypothesis runs rules
# with few arguments far more often than the others, which would leave the spaces mostly empty.
SPACE_ACTIONS = st.sampled_from(["take", "free", "check_then_commit", "take", "free", "reclaim"])
POOL_ACTIONS = st.sampled_from(["allocate", "free", "allocate", "free", "reclaim"])

Held = dict[int, set[int]]  # owner -> the ids it holds in one space


def owner_map(held: Held) -> dict[int, int]:
    """id -> owner, from a model space."""
    return {i: owner for owner, mine in held.items() for i in mine}


def model_fault(
    held: Held,
    capacity: int,
    owner: int,
    ids: Sequence[int],
    release: Sequence[bool] | None = None,
    links: dict[int, int] | None = None,
) -> tuple[int, str] | None:
    """The first bad position of a free (or, where ``release``, a release) and why."""
    owners = owner_map(held)
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


# How the ids of a free are drawn: the owner's own (a good free), or those with one bad id put
# in: a repeat, one held by another owner, a free one, one outside 1..N.
MODES = ["mine", "mine", "mine", "repeat", "foreign", "free", "outside"]


def draw_ids(
    data: st.DataObject, held: Held, capacity: int, owner: int, max_size: int = 5
) -> list[int]:
    """Ids to free: mostly some of the owner's own, else those with one bad id put in."""
    mine = sorted(held.get(owner, ()))
    ids: list[int] = []
    if mine:
        size = min(max_size, len(mine))
        ids = data.draw(st.lists(st.sampled_from(mine), min_size=1, max_size=size, unique=True))
    mode = data.draw(st.sampled_from(MODES))
    owners = owner_map(held)
    choices = {
        "repeat": ids,
        "foreign": sorted(i for i, o in owners.items() if o != owner),
        "free": [i for i in range(1, capacity + 1) if i not in owners],
        "outside": [capacity + 1, *INT32_EDGES],
    }.get(mode, [])
    if mode in ("foreign", "free", "outside"):
        ids = ids[: data.draw(st.integers(0, len(ids)))]  # a bad id alone, too
    if choices:
        at = data.draw(st.integers(0, len(ids)))
        ids.insert(at, data.draw(st.sampled_from(choices)))
    return ids


def as_ids(values: Sequence[int]) -> np.ndarray:
    """Ids as the edge hands them down; sometimes a read-only view of wire bytes."""
    return np.frombuffer(np.array(values, dtype="<i4").tobytes(), dtype=np.int32)


def check_space(space: IdSpace, held: Held) -> None:
    """The space agrees with the model id by id and in its counts."""
    cap = space.capacity
    owners = owner_map(held)
    expected = [owners.get(i, 0) for i in range(1, cap + 1)]
    assert space.owner_of(np.arange(1, cap + 1)).tolist() == expected
    counters = space.counters()
    assert counters.used == len(owners) and counters.used + counters.free == cap
    assert counters.allocs - counters.frees == counters.used
    assert space.holders() == {o: len(ids) for o, ids in held.items() if ids}
    assert sorted(space.free_ids().tolist()) == [i for i in range(1, cap + 1) if i not in owners]
    space.audit()


def spec(name: str, capacity: int, **kw: str) -> IdSpaceSpec:
    return IdSpaceSpec(
        name=name, capacity=capacity, unit="pages", bytes_per_unit=64, knob="budget_bytes", **kw
    )


class IdSpaceMachine(RuleBasedStateMachine):
    """One IdSpace of 12 ids against owner -> set of ids, and the free stack as a list."""

    def __init__(self) -> None:
        super().__init__()
        self.cap = 12
        self.space = IdSpace(spec("kv", self.cap), pool="p")
        self.held: Held = {}
        self.stack = list(range(1, self.cap + 1))  # the next ids handed out first
        self.high_water = 0
        self.failed = 0

    def snapshot(self) -> tuple[object, ...]:
        return self.space.counters(), self.space.holders(), self.space.free_ids().tolist()

    def drop(self, owner: int, ids: Sequence[int]) -> None:
        self.held[owner] -= set(ids)
        if not self.held[owner]:
            del self.held[owner]
        self.stack[:0] = ids  # freed ids are handed out next, in the order given

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One call, drawn from a weighted list (see ``SPACE_ACTIONS``)."""
        action = data.draw(SPACE_ACTIONS, label="action")
        if action in ("free", "check_then_commit") and not self.held:
            action = "take"
        getattr(self, action)(data.draw(OWNERS, label="owner"), data)

    def take(self, owner: int, data: st.DataObject) -> None:
        count = data.draw(COUNTS, label="count")
        if count > len(self.stack):
            before = self.snapshot()
            try:
                self.space.take(owner, count)
            except ResourceExhausted as err:
                assert err.field == "count"
                self.failed += 1
                after = self.snapshot()
                assert after[1:] == before[1:]
                return
            raise AssertionError("take past the free count succeeded")
        got = self.space.take(owner, count).tolist()
        assert got == self.stack[:count]  # LIFO, in order
        del self.stack[:count]
        if got:
            self.held.setdefault(owner, set()).update(got)
        self.high_water = max(self.high_water, self.cap - len(self.stack))

    def free(self, owner: int, data: st.DataObject) -> None:
        values = draw_ids(data, self.held, self.cap, owner)
        fault = model_fault(self.held, self.cap, owner, values)
        before = self.snapshot()
        if fault is None:
            assert self.space.free(owner, as_ids(values)) == len(values)
            if values:
                self.drop(owner, values)
            return
        try:
            self.space.free(owner, as_ids(values))
        except KVPoolError as err:
            assert type(err) is REASONS[fault[1]][0]
            assert err.field == f"ids[{fault[0]}]", (err, fault)
            assert self.snapshot() == before
            return
        raise AssertionError(f"bad free {values} by {owner} succeeded, expected {fault}")

    def check_then_commit(self, owner: int, data: st.DataObject) -> None:
        values = draw_ids(data, self.held, self.cap, owner, max_size=4)
        fault = model_fault(self.held, self.cap, owner, values)
        before = self.snapshot()
        got = self.space.check(owner, np.array(values, dtype=np.intp))
        assert self.snapshot() == before
        if fault is not None:
            assert got is not None and (got.pos, got.reason) == (fault[0], REASONS[fault[1]][1])
            return
        assert got is None
        assert self.space.commit_free(owner, np.array(values, dtype=np.intp)) == len(values)
        if values:
            self.drop(owner, values)

    def reclaim(self, owner: int, data: st.DataObject) -> None:
        got = self.space.reclaim(owner).tolist()
        assert sorted(got) == sorted(self.held.get(owner, ()))
        if got:
            self.drop(owner, got)

    @invariant()
    def agrees_with_model(self) -> None:
        check_space(self.space, self.held)
        assert self.space.free_ids().tolist() == self.stack
        counters = self.space.counters()
        assert counters.high_water == self.high_water
        assert counters.failed_allocs == self.failed


class PoolIdsMachine(RuleBasedStateMachine):
    """A PoolIds with kv 10, swa 6 following kv, and req 3, against sets per space and links."""

    CAPS = {"kv": 10, "swa": 6, "req": 3}

    def __init__(self) -> None:
        super().__init__()
        self.mapping = np.zeros(self.CAPS["kv"] + 2, dtype=np.int64)
        self.mapping[-1] = -1
        self.pool = PoolIds(
            "m",
            [
                spec("kv", self.CAPS["kv"]),
                spec("swa", self.CAPS["swa"], follows="kv", mapping=FULL_TO_SWA),
                spec("req", self.CAPS["req"]),
            ],
            {FULL_TO_SWA: MappingBuffer(self.mapping)},
        )
        self.held: dict[str, Held] = {name: {} for name in self.CAPS}
        self.links: dict[int, int] = {}  # kv id -> swa id

    def snapshot(self) -> tuple[object, ...]:
        return self.pool.counters(), self.pool.held_by_owner(), self.mapping.tolist()

    def free_count(self, name: str) -> int:
        return self.CAPS[name] - sum(len(ids) for ids in self.held[name].values())

    def drop(self, name: str, owner: int, ids: Sequence[int]) -> None:
        if not ids:
            return
        self.held[name][owner] -= set(ids)
        if not self.held[name][owner]:
            del self.held[name][owner]

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One call, drawn from a weighted list (see ``SPACE_ACTIONS``)."""
        action = data.draw(POOL_ACTIONS, label="action")
        if action == "free" and not (self.held["kv"] or self.held["req"]):
            action = "allocate"
        getattr(self, action)(data.draw(OWNERS, label="owner"), data)

    def allocate(self, owner: int, data: st.DataObject) -> None:
        kinds = st.sampled_from(["kv", "kv", "req", "swa"])
        items = data.draw(st.lists(st.tuples(kinds, COUNTS), max_size=3), label="items")
        expected: tuple[type[Exception], str] | None = None
        totals: dict[str, int] = {}
        # The edge resolves every name before anything is allocated: a following space is
        # refused whatever the room of earlier items.
        followers = [i for i, (name, _) in enumerate(items) if name == "swa"]
        if followers:
            expected = (InvalidArgument, f"items[{followers[0]}].space")
        for i, (name, count) in enumerate(items):
            if expected is not None:
                break
            totals[name] = totals.get(name, 0) + count
            room = self.free_count(name)
            if name == "kv":
                room = min(room, self.free_count("swa"))
            if count and totals[name] > room:
                expected = (ResourceExhausted, f"items[{i}].count")
                break
        before = self.snapshot()
        try:
            resolved = [
                (self.pool.space(name, f"items[{i}].space"), count)
                for i, (name, count) in enumerate(items)
            ]
            grants = self.pool.allocate(owner, resolved)
        except KVPoolError as err:
            assert expected is not None, err
            assert (type(err), err.field) == expected
            assert self.snapshot()[1:] == before[1:]
            return
        assert expected is None, f"allocate {items} succeeded, expected {expected}"
        for (name, count), grant in zip(items, grants, strict=True):
            got = grant.ids.tolist()
            assert len(got) == count == len(set(got))
            taken = owner_map(self.held[name])
            assert all(1 <= i <= self.CAPS[name] and i not in taken for i in got)
            if got:
                self.held[name].setdefault(owner, set()).update(got)
            if name != "kv":
                assert grant.paired is None and grant.paired_space is None
                continue
            assert grant.paired is not None and grant.paired_space == "swa"
            paired = grant.paired.tolist()
            taken = owner_map(self.held["swa"])
            assert all(1 <= s <= self.CAPS["swa"] and s not in taken for s in paired)
            assert self.mapping[grant.ids].tolist() == paired
            if paired:
                self.held["swa"].setdefault(owner, set()).update(paired)
            self.links.update(zip(got, paired, strict=True))

    def free(self, owner: int, data: st.DataObject) -> None:
        names = data.draw(
            st.lists(st.sampled_from(["kv", "swa", "req"]), min_size=1, max_size=3)
        )
        items: list[tuple[str, list[int]]] = []
        for name in names:
            space = "kv" if name == "swa" else name
            items.append((name, draw_ids(data, self.held[space], self.CAPS[space], owner, 3)))
        expected = self.model_free_fault(owner, items)
        before = self.snapshot()
        resolved = [
            (self.pool.space(name, f"items[{i}].space"), as_ids(values))
            for i, (name, values) in enumerate(items)
        ]
        if expected is not None:
            try:
                self.pool.free(owner, resolved)
            except KVPoolError as err:
                assert (type(err), err.field) == expected, (err, expected)
                assert self.snapshot() == before
                return
            raise AssertionError(f"free {items} by {owner} succeeded, expected {expected}")
        freed = self.pool.free(owner, resolved)
        want: dict[str, int] = {}
        for name, values in items:
            want[name] = want.get(name, 0) + len(values)
            for i in values if name in ("kv", "swa") else ():
                s = self.links.pop(i, None)
                if s is not None:
                    self.drop("swa", owner, [s])
            if name != "swa":
                self.drop(name, owner, values)
        assert freed == want

    def model_free_fault(
        self, owner: int, items: list[tuple[str, list[int]]]
    ) -> tuple[type[Exception], str] | None:
        """The error class and field of the first bad id in item order, or None."""
        groups: dict[str, list[tuple[int, str, list[int]]]] = {}
        for i, (name, values) in enumerate(items):
            groups.setdefault("kv" if name == "swa" else name, []).append((i, name, values))
        found: list[tuple[tuple[int, int], str]] = []
        for space, group in groups.items():
            values = [x for _, _, part in group for x in part]
            where = [(i, j) for i, _, part in group for j in range(len(part))]
            release = [name == "swa" for _, name, part in group for _ in part]
            fault = model_fault(
                self.held[space], self.CAPS[space], owner, values, release, self.links
            )
            if fault is not None:
                found.append((where[fault[0]], fault[1]))
        if not found:
            return None
        (item, pos), reason = min(found)
        return REASONS[reason][0], f"items[{item}].ids[{pos}]"

    def reclaim(self, owner: int, data: st.DataObject) -> None:
        expected = {name: len(self.held[name].get(owner, ())) for name in self.CAPS}
        assert self.pool.reclaim(owner) == expected
        for name in self.CAPS:
            self.held[name].pop(owner, None)
        kv = owner_map(self.held["kv"])
        self.links = {f: s for f, s in self.links.items() if f in kv}

    @invariant()
    def agrees_with_model(self) -> None:
        for name in self.CAPS:
            check_space(self.pool.space(name, "space"), self.held[name])
        cap = self.CAPS["kv"]
        want = [self.links.get(f, 0) for f in range(1, cap + 1)]
        assert self.mapping[1 : cap + 1].tolist() == want
        assert self.pool.paired_of("kv", np.arange(1, cap + 1)).tolist() == want
        assert self.mapping[0] == 0 and self.mapping[-1] == -1
        swa = owner_map(self.held["swa"])
        kv = owner_map(self.held["kv"])
        assert all(swa[s] == kv[f] for f, s in self.links.items())
        assert len(swa) == len(self.links)
        for owner in (0, 1, 2, 3, 4):  # OWNERS, and owners that never hold anything
            recount = {}
            for name, space_cap in self.CAPS.items():
                space = self.pool.space(name, "space")
                n = int((space.owner_of(np.arange(1, space_cap + 1)) == owner).sum())
                if n and owner:
                    recount[name] = n
            assert self.pool.held_of(owner) == recount  # kept as ids come and go: O(spaces)
        self.pool.audit()


TestIdSpaceMachine = IdSpaceMachine.TestCase
TestPoolIdsMachine = PoolIdsMachine.TestCase
TestIdSpaceMachine.settings = SETTINGS
TestPoolIdsMachine.settings = SETTINGS

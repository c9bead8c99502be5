"""The page space of an elastic pool (kvpoold.ids.grouped): a model-based test against plain sets,
and the packing that lets groups drain whole."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.contract.errors import Internal, ResourceExhausted
from kvpool.contract.plan import IdSpaceSpec
from kvpoold.ids import PoolIds
from kvpoold.ids.grouped import GroupedSpace

PER = 8
GROUPS = 6


def make(per: int = PER, groups: int = GROUPS) -> GroupedSpace:
    spec = IdSpaceSpec(name="kv", capacity=groups * per - 1, unit="pages", bytes_per_unit=1,
                       knob="budget_bytes")
    return GroupedSpace(spec, per, pool="p")


def members(g: int, per: int = PER) -> set[int]:
    return set(range(max(1, g * per), g * per + per))


def opened(space: GroupedSpace, g: int) -> None:
    """Grant group ``g`` as the manager does: commit, then open."""
    space.commit(g)
    space.open_group(g)


class GroupedMachine(RuleBasedStateMachine):
    """Every page is free in an open group, free in a draining one, held by one owner, or in a
    closed group; takes come from open groups, lowest first; a group moves only along the state
    table (closed -> committing -> open -> draining -> unmapping -> releasing -> closed, a failed
    release retried), any other move refused."""

    def __init__(self) -> None:
        super().__init__()
        self.space = make()
        self.state = ["closed"] * GROUPS
        self.held: dict[int, set[int]] = {1: set(), 2: set(), 3: set()}

    def free_in(self, g: int) -> set[int]:
        taken = set().union(*self.held.values())
        return members(g) - taken if self.state[g] != "closed" else set()

    @rule(g=st.integers(0, GROUPS - 1), commits=st.booleans())
    def grant(self, g: int, commits: bool) -> None:
        if self.state[g] != "closed":
            with pytest.raises(Internal):
                self.space.commit(g)
            with pytest.raises(Internal):
                self.space.open_group(g)
            return
        self.space.commit(g)
        assert self.space.state(g) == "committing" and self.space.moving(g)
        assert g not in self.space.granted().tolist() and self.space.used_in(g) == 0
        if commits:
            self.space.open_group(g)
            self.state[g] = "open"
        else:  # the memory could not be committed: closed again
            self.space.abort(g)

    @rule(owner=st.sampled_from([1, 2, 3]), count=st.integers(0, 3 * PER))
    def take(self, owner: int, count: int) -> None:
        avail = sum(len(self.free_in(g)) for g in range(GROUPS) if self.state[g] == "open")
        if count > avail:
            with pytest.raises(ResourceExhausted):
                self.space.take(owner, count)
            return
        ids = set(self.space.take(owner, count).tolist())
        assert len(ids) == count
        groups = {i // PER for i in ids}
        assert all(self.state[g] == "open" for g in groups)
        for i in ids:
            assert i in self.free_in(i // PER)
        self.held[owner] |= ids
        if groups:  # first fit: every open group below the highest one used is full now
            top = max(groups)
            for g in range(top):
                if self.state[g] == "open":
                    assert not self.free_in(g), (g, top)

    @rule(owner=st.sampled_from([1, 2, 3]), data=st.data())
    def free(self, owner: int, data: st.DataObject) -> None:
        mine = sorted(self.held[owner])
        if not mine:
            return
        some = data.draw(st.lists(st.sampled_from(mine), unique=True, min_size=1))
        assert self.space.free(owner, np.array(some, dtype=np.int32)) == len(some)
        self.held[owner] -= set(some)

    @rule(owner=st.sampled_from([1, 2, 3]))
    def reclaim(self, owner: int) -> None:
        assert set(self.space.reclaim(owner).tolist()) == self.held[owner]
        self.held[owner] = set()

    @rule()
    def drain_releasable(self) -> None:
        whole = [g for g in range(GROUPS) if self.state[g] == "open"
                 and self.free_in(g) == members(g)]
        got = self.space.releasable().tolist()
        assert got == sorted(whole, reverse=True)
        if got:
            self.space.drain(got[0])
            self.state[got[0]] = "draining"

    @precondition(lambda self: "draining" in self.state)
    @rule(data=st.data(), close=st.booleans(), failures=st.integers(0, 2))
    def close_or_reopen(self, data: st.DataObject, close: bool, failures: int) -> None:
        g = data.draw(st.sampled_from([g for g in range(GROUPS)
                                       if self.state[g] == "draining"]))
        whole = self.free_in(g) == members(g)
        if close and whole:
            with pytest.raises(Internal):  # still draining: not yet unmapped everywhere
                self.space.close_group(g)
            self.space.unmap(g)
            with pytest.raises(Internal):  # no page of an unmapping group is handed out
                self.space.reopen(g)
            self.space.release(g)
            for _ in range(failures):  # freeing its memory failed: retried
                self.space.fail(g)
                assert self.space.state(g) == "failed" and self.space.count("failed") == 1
                self.space.audit()
                self.space.release(g)
            self.space.close_group(g)
            self.state[g] = "closed"
        elif close:
            with pytest.raises(Internal):
                self.space.unmap(g)
        else:
            self.space.reopen(g)
            self.state[g] = "open"

    @invariant()
    def agrees(self) -> None:
        self.space.audit()
        avail = sum(len(self.free_in(g)) for g in range(GROUPS) if self.state[g] == "open")
        assert self.space.num_free == avail
        assert [self.space.state(g) for g in range(GROUPS)] == self.state
        for name in ("closed", "open", "draining"):
            assert self.space.count(name) == self.state.count(name)
        for g in range(GROUPS):
            held = sum(1 for ids in self.held.values() for i in ids if i // PER == g)
            assert self.space.used_in(g) == held


TestGroupedMachine = GroupedMachine.TestCase
TestGroupedMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_churn_packs_pages_low_so_high_groups_drain_whole() -> None:
    """Requests come and go at random with the pool half full: with first fit the used pages
    stay in the low groups, and the high groups are wholly free (releasable)."""
    space = make(per=64, groups=16)
    for g in range(16):
        opened(space, g)
    rng = np.random.default_rng(7)
    live: list[np.ndarray] = []
    for _ in range(2000):
        if live and (space.used > space.capacity // 2 or rng.random() < 0.5):
            space.free(1, live.pop(int(rng.integers(len(live)))))
        else:
            live.append(space.take(1, int(rng.integers(1, 40))))
    used_groups = {int(i) // 64 for ids in live for i in ids}
    assert len(space.releasable()) >= 16 - len(used_groups)
    # half full or less: at least a third of the groups are wholly free
    assert len(space.releasable()) >= 5, space.releasable()
    space.audit()


def test_refusal_names_the_granted_groups() -> None:
    space = make()
    opened(space, 0)
    with pytest.raises(ResourceExhausted, match="in the 1 granted groups of 6"):
        space.take(1, PER)


def test_a_batch_free_of_several_items_in_an_elastic_pool() -> None:
    """Two kv items in one Free are checked together, then committed: the commit of a checked
    free is the ledger's, not a group's (the space's group ``commit(g)`` once shadowed it, and
    such a Free ended in a TypeError, INTERNAL on the wire)."""
    spec = IdSpaceSpec(name="kv", capacity=GROUPS * PER - 1, unit="pages", bytes_per_unit=1,
                       knob="budget_bytes")
    pool = PoolIds("p", [spec], {}, {"kv": PER})
    kv = pool.space("kv", "items[0].space")
    assert isinstance(kv, GroupedSpace)
    opened(kv, 0)
    got = pool.allocate(1, [(kv, 5)])[0].ids
    assert pool.free(1, [(kv, got[:2]), (kv, got[2:])]) == {"kv": 5}
    assert kv.used_in(0) == 0 and kv.num_free == PER - 1 and kv.releasable().tolist() == [0]
    pool.audit()

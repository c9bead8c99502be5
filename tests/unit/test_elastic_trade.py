"""Two elastic pools trading groups under one budget: the arbiter's decisions carried out on
real sparse memfds. Physical memory (``st_blocks``) never exceeds the budget, and equals what
the arbiter says is granted after every step."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.mapping.sparse import backed_bytes
from kvpoold.elastic.arbiter import Arbiter, Reclaim, Share
from kvpoold.sharing.sparse_groups import SparseBacking, group_geometry

GROUPS = 6  # per pool's virtual range


@dataclass
class Pool:
    """One elastic pool: its file, its backing and the groups it holds."""

    name: str
    backing: SparseBacking
    fd: int
    held: list[int] = field(default_factory=list)

    def grow(self, n: int) -> None:
        free = [g for g in range(self.backing.geometry.groups) if g not in self.backing.granted]
        for g in free[:n]:
            self.backing.grant(g)
            self.held.append(g)

    def shrink(self, n: int) -> None:
        for _ in range(n):
            self.backing.release(self.held.pop())


def make_pool(name: str, rows: tuple[int, ...]) -> Pool:
    geo = group_geometry(rows, page_size=16, capacity_tokens=1024 * GROUPS)
    fd = os.memfd_create(f"kvpool-test-{name}", os.MFD_CLOEXEC)
    offsets, at = [], 0
    for size in geo.view_bytes:
        offsets.append(at)
        at += size
    os.ftruncate(fd, at)
    return Pool(name, SparseBacking(fd, geo, tuple(offsets)), fd)


class TradeMachine(RuleBasedStateMachine):
    """Pools of different layouts (2 and 3 views of 2 KiB a token: 4 and 6 MiB groups) want
    groups, report what they could give back, and the daemon's part (release, then grant to
    the asker) happens in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.pools = {"a": make_pool("a", (2048, 2048)), "b": make_pool("b", (2048,) * 3)}
        self.budget = 5 * self.pools["a"].backing.geometry.bytes  # 20 MiB: not all fits
        self.arb = Arbiter(self.budget)
        self.pending: list[tuple[str, Reclaim]] = []
        for name, floor in (("a", 1), ("b", 1)):
            p = self.pools[name]
            d = self.arb.admit(Share(name, group_bytes=p.backing.geometry.bytes,
                                     groups=GROUPS, floor=floor, cap=GROUPS,
                                     weight=1.0 if name == "a" else 2.0))
            p.grow(d.grant)
            self.pending += [(name, r) for r in d.reclaims]

    def teardown(self) -> None:
        for p in self.pools.values():
            os.close(p.fd)

    @rule(name=st.sampled_from("ab"), groups=st.integers(1, GROUPS))
    def want(self, name: str, groups: int) -> None:
        d = self.arb.want(name, groups)
        self.pools[name].grow(d.grant)
        self.pending += [(name, r) for r in d.reclaims]

    @rule(name=st.sampled_from("ab"), idle=st.booleans())
    def everything_is_cached(self, name: str, idle: bool) -> None:
        """The pool's page caches hold every page of its groups unused."""
        g = self.arb.pools[name].granted
        self.arb.observe(name, free_groups=0, cached_groups=g, idle=idle)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.pending:
            return
        asker, r = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        victim = self.pools[r.victim]
        take = min(r.groups, len(victim.held))
        victim.shrink(take)  # every process unmapped them: the memory goes
        self.pools[asker].grow(self.arb.released(r.victim, take, to=asker))

    @invariant()
    def memory_is_what_is_granted_and_never_over_budget(self) -> None:
        backed = sum(backed_bytes(p.fd) for p in self.pools.values())
        granted = sum(len(p.held) * p.backing.geometry.bytes for p in self.pools.values())
        assert backed == granted == self.arb.granted_bytes
        assert backed <= self.budget
        for name, p in self.pools.items():
            assert len(p.held) == self.arb.pools[name].granted >= min(1, len(p.held))


TestTrade = TradeMachine.TestCase
TestTrade.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


@pytest.fixture
def two() -> Iterator[TradeMachine]:
    m = TradeMachine()
    yield m
    m.teardown()


def test_a_heavier_weight_ends_with_more_of_a_short_budget(two: TradeMachine) -> None:
    """Both want everything and use what they hold but one group of headroom their caches
    give back: b (weight 2) ends with more of a's bytes, never over the budget, each at least
    its floor. (A pool whose caches hold everything gives it all up to one group: it uses
    nothing of it.)"""
    for _ in range(12):
        for name in "ab":
            g = two.arb.pools[name].granted
            two.arb.observe(name, free_groups=0, cached_groups=min(1, g), idle=False)
            two.want(name, GROUPS)
        while two.pending:
            asker, r = two.pending.pop()
            victim = two.pools[r.victim]
            take = min(r.groups, len(victim.held))
            victim.shrink(take)
            two.pools[asker].grow(two.arb.released(r.victim, take, to=asker))
        two.memory_is_what_is_granted_and_never_over_budget()
    a = len(two.pools["a"].held) * two.pools["a"].backing.geometry.bytes
    b = len(two.pools["b"].held) * two.pools["b"].backing.geometry.bytes
    assert a >= two.pools["a"].backing.geometry.bytes and b > a
    assert a + b <= two.budget

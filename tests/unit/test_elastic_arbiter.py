"""The arbiter of elastic pools against a model of its rules (hypothesis state machine), and the
rules one by one: floors, caps, weights, reclaim order, refused floors."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.contract.errors import InvalidArgument, ResourceExhausted
from kvpoold.elastic.arbiter import Arbiter, Reclaim, Share

MiB = 1 << 20
BUDGET = 64 * 128 * MiB  # 64 groups of Llama-3.1-8B's 128 MiB


def share(name: str, *, floor: int = 0, cap: int = 64, weight: float = 1.0,
          group_bytes: int = 128 * MiB, groups: int = 64) -> Share:
    return Share(name, group_bytes=group_bytes, groups=groups, floor=floor, cap=cap,
                 weight=weight)


def settle(arb: Arbiter, asker: str, reclaims: tuple[Reclaim, ...]) -> int:
    """Release every asked-back group (the daemon's part) and grant them to ``asker``."""
    return sum(arb.released(r.victim, r.groups, to=asker) for r in reclaims)


def test_floor_granted_at_once_and_floors_that_do_not_fit_are_refused() -> None:
    arb = Arbiter(BUDGET)
    assert arb.admit(share("a", floor=40)).grant == 40
    with pytest.raises(ResourceExhausted) as info:
        arb.admit(share("b", floor=30))
    msg = info.value.message
    assert "floor of 30 groups" in msg and f"{40 * 128 * MiB:,} B" in msg
    assert "--elastic-floor-tokens" in msg
    assert "b" not in arb.pools
    assert arb.admit(share("b", floor=24)).grant == 24
    assert arb.free_bytes == 0


def test_bad_shares_are_refused() -> None:
    arb = Arbiter(BUDGET)
    with pytest.raises(InvalidArgument):
        arb.admit(share("a", floor=10, cap=5))
    with pytest.raises(InvalidArgument):
        arb.admit(share("a", weight=0))
    arb.admit(share("a"))
    with pytest.raises(InvalidArgument):
        arb.admit(share("a"))


def test_grants_stop_at_the_cap_and_the_budget() -> None:
    arb = Arbiter(BUDGET, fixed_bytes=16 * 128 * MiB)
    arb.admit(share("a", cap=20))
    assert arb.want("a", 100).grant == 20
    arb.admit(share("b"))
    d = arb.want("b", 100)
    assert d.grant == 28 and d.reclaims == ()  # a holds none free: nothing to take
    assert arb.free_bytes == 0


def test_free_groups_are_taken_first_and_idle_pools_before_busy_ones() -> None:
    arb = Arbiter(BUDGET)
    for name in ("idle", "busy"):
        arb.admit(share(name))
        arb.want(name, 32)
    arb.observe("idle", free_groups=4, cached_groups=20, idle=True)
    arb.observe("busy", free_groups=10, cached_groups=10, idle=False)
    arb.admit(share("new"))
    d = arb.want("new", 20)
    assert d.grant == 0
    # free groups of the idle pool, then the busy pool's free ones, then cached (idle first)
    assert d.reclaims[0] == Reclaim("idle", 4, "free")
    assert d.reclaims[1].victim == "busy" and d.reclaims[1].source == "free"
    assert all(r.source == "cached" for r in d.reclaims[2:])
    assert d.pending == 20
    assert settle(arb, "new", d.reclaims) == 20


def test_a_busy_pool_gives_what_it_does_not_use_then_down_to_equal_weighted_shares() -> None:
    arb = Arbiter(BUDGET)
    arb.admit(share("a", weight=1))
    arb.want("a", 64)
    arb.observe("a", free_groups=0, cached_groups=24, idle=False)  # it uses 40 groups
    arb.admit(share("b", weight=1))
    d = arb.want("b", 64)
    # a's caches give what a does not use (all 24: b's share stays below a's after them);
    # then groups with pages in use are drained for b, down to equal weighted shares (8
    # more), never past
    assert [(r.victim, r.groups, r.source) for r in d.reclaims] == [
        ("a", 24, "cached"), ("a", 8, "busy")]
    settle(arb, "b", d.reclaims)
    assert (arb.pools["a"].granted, arb.pools["b"].granted) == (32, 32)
    arb.observe("a", free_groups=0, cached_groups=0, idle=False)
    assert arb.want("b", 64).reclaims == ()  # equal shares: a keeps the rest of its pages
    # all of a's caches, cached again: with a's pages in use the shares decide
    arb.observe("a", free_groups=0, cached_groups=32, idle=False)
    for _ in range(10):  # b keeps asking; a's caches keep giving back
        settle(arb, "b", arb.want("b", 64).reclaims)
        arb.observe("a", free_groups=0, cached_groups=arb.pools["a"].granted, idle=False)
    assert arb.pools["a"].granted == 1 and arb.pools["b"].granted == 63


def test_a_floor_is_owed_even_from_a_busy_pool_and_nobody_goes_below_theirs() -> None:
    arb = Arbiter(BUDGET)
    arb.admit(share("a", floor=8))
    arb.want("a", 64)
    arb.observe("a", free_groups=0, cached_groups=64, idle=False)
    d = arb.admit(share("b", floor=40, weight=0.01))  # tiny weight: only its floor is owed
    assert d.grant == 0 and d.pending == 40
    settle(arb, "b", d.reclaims)
    assert arb.pools["b"].granted == 40
    arb.observe("a", free_groups=0, cached_groups=8, idle=False)  # a uses 16 of its 24
    d = arb.want("b", 64)  # a's unused cache less one group of headroom; not the last group:
    assert d.pending == 7  # b's tiny weight puts its share far above a's
    settle(arb, "b", d.reclaims)
    arb.observe("a", free_groups=0, cached_groups=1, idle=False)
    assert arb.want("b", 64).reclaims == ()
    arb.pools["b"].weight = 100
    # by weight: the headroom, then the groups a's requests use, drained down to its floor
    d = arb.want("b", 64)
    assert [(r.groups, r.source) for r in d.reclaims] == [(1, "cached"), (8, "busy")]
    assert arb.pools["a"].granted - d.pending == arb.pools["a"].floor


def test_a_cancelled_reclaim_is_neither_pending_nor_promised() -> None:
    arb = Arbiter(BUDGET)
    arb.admit(share("a"))
    arb.want("a", 64)
    arb.observe("a", free_groups=10, cached_groups=0, idle=True)
    arb.admit(share("b"))
    assert arb.want("b", 10).pending == 10
    arb.cancel("a", 10, to="b")
    assert arb.pools["a"].reclaiming == 0 and not arb.promised_to("b")
    assert arb.want("b", 10).pending == 10  # asked again


class ArbiterMachine(RuleBasedStateMachine):
    """Random admits, wants, observations, releases and cancels; the rules hold after each."""

    def __init__(self) -> None:
        super().__init__()
        self.arb = Arbiter(BUDGET, fixed_bytes=3 * 128 * MiB)
        self.pending: list[tuple[str, Reclaim]] = []
        self.n = 0

    @rule(floor=st.integers(0, 40), cap=st.integers(0, 64), weight=st.sampled_from([0.5, 1, 3]),
          mib=st.sampled_from([64, 128, 192]))
    def admit(self, floor: int, cap: int, weight: float, mib: int) -> None:
        name = f"p{self.n}"
        self.n += 1
        floors = sum(p.floor * p.group_bytes for p in self.arb.pools.values())
        s = share(name, floor=min(floor, cap), cap=cap, weight=weight, group_bytes=mib * MiB)
        fits = floors + s.floor * s.group_bytes <= BUDGET - self.arb.fixed_bytes
        try:
            d = self.arb.admit(s)
        except ResourceExhausted:
            assert not fits
            return
        assert fits
        self.pending += [(name, r) for r in d.reclaims]

    @precondition(lambda self: self.arb.pools)
    @rule(data=st.data(), groups=st.integers(1, 64))
    def want(self, data: st.DataObject, groups: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.arb.pools)))
        before = self.arb.pools[name].granted
        d = self.arb.want(name, groups)
        assert self.arb.pools[name].granted == before + d.grant
        self.pending += [(name, r) for r in d.reclaims]

    @precondition(lambda self: self.arb.pools)
    @rule(data=st.data(), free=st.integers(0, 64), cached=st.integers(0, 64), idle=st.booleans())
    def observe(self, data: st.DataObject, free: int, cached: int, idle: bool) -> None:
        name = data.draw(st.sampled_from(sorted(self.arb.pools)))
        self.arb.observe(name, free_groups=free, cached_groups=cached, idle=idle)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), cancel=st.booleans())
    def finish(self, data: st.DataObject, cancel: bool) -> None:
        i = data.draw(st.integers(0, len(self.pending) - 1))
        asker, r = self.pending.pop(i)
        if cancel:
            self.arb.cancel(r.victim, r.groups, to=asker)
        else:
            self.arb.released(r.victim, r.groups, to=asker)

    @invariant()
    def never_over_budget(self) -> None:
        assert self.arb.granted_bytes + self.arb.fixed_bytes <= BUDGET

    @invariant()
    def floors_and_caps(self) -> None:
        for p in self.arb.pools.values():
            assert p.reclaiming >= 0
            assert p.granted <= p.cap
            assert p.granted - p.reclaiming >= min(p.floor, p.granted)  # asks never below
            assert p.free_groups + p.cached_groups <= p.granted


TestArbiterMachine = ArbiterMachine.TestCase
TestArbiterMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_asking_again_for_the_same_shortfall_is_not_granted_twice() -> None:
    """An Allocate that waits retries its grow: what reclaims already promise the asker covers
    as much of its want (over-asking left groups wholly free for the other pool to take back
    at once, and two bursting pools traded groups back and forth)."""
    arb = Arbiter(BUDGET)
    arb.admit(share("a"))
    arb.want("a", 64)
    arb.observe("a", free_groups=10, cached_groups=0, idle=False)
    arb.admit(share("b"))
    first = arb.want("b", 4)
    assert first.pending == 4
    assert arb.want("b", 4).pending == 0  # the same 4 again: all promised already
    assert arb.want("b", 6).pending == 2  # 2 more than promised
    settle(arb, "b", first.reclaims)
    assert arb.pools["b"].granted == 4 and arb.promised_to("b") == 2 * 128 * MiB

"""IdSpace: allocation order, ownership checks, reclaim, counters, audit and every error message."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.contract.errors import FailedPrecondition, Internal, InvalidArgument, ResourceExhausted
from kvpool.contract.plan import IdSpaceSpec
from kvpool.contract.records import SpaceStats
from kvpoold.ids import IdSpace
from kvpoold.ids.faults import Asked, Reason
from kvpoold.ids.space import MIN_ROOM, SHRINK_ABOVE


def numbers(c: SpaceStats) -> tuple[int, ...]:
    """The counters of a Stats entry: capacity, used, free, high_water, allocs, frees, failed."""
    return (c.capacity, c.used, c.free, c.high_water, c.allocs, c.frees, c.failed_allocs)


def make_space(
    capacity: int = 10,
    name: str = "kv",
    *,
    unit: str = "pages",
    knob: str = "budget_bytes",
    pool: str = "p",
) -> IdSpace:
    spec = IdSpaceSpec(name=name, capacity=capacity, unit=unit, bytes_per_unit=4096, knob=knob)
    return IdSpace(spec, pool=pool)


def ids(*values: int) -> np.ndarray:
    """Ids as the edge hands them down: 1-D native int32."""
    return np.array(values, dtype=np.int32)


def snapshot(space: IdSpace) -> tuple[object, ...]:
    """Everything observable: counters, holders, every id's owner, and the order ids would be
    handed out next."""
    return (
        space.counters(),
        space.holders(),
        space.owner_of(np.arange(1, space.capacity + 1)).tolist(),
        space.free_ids().tolist(),
    )


def test_take_hands_out_1_to_n_in_order_and_never_0() -> None:
    space = make_space(5)
    assert space.take(1, 2).tolist() == [1, 2]
    assert space.take(2, 1).tolist() == [3]
    assert space.take(2, 2).tolist() == [4, 5]
    assert space.take(3, 0).tolist() == []
    assert numbers(space.counters()) == (5, 5, 0, 5, 5, 0, 0)
    assert space.name == "kv" and space.label == "p/kv"
    space.audit()


def test_returned_ids_are_fresh_int32_arrays() -> None:
    space = make_space()
    for count in (0, 1, 3):
        got = space.take(1, count)
        assert got.dtype == np.int32 and got.ndim == 1 and got.flags.writeable
        assert got.base is None  # not a view of the space's own arrays
    assert space.take(1, 0) is not space.take(1, 0)


def test_freed_ids_are_reused_first() -> None:
    space = make_space(6)
    space.take(1, 4)
    space.free(1, ids(3, 1))
    assert sorted(space.take(2, 2).tolist()) == [1, 3]
    assert space.take(2, 1).tolist() == [5]
    space.free(2, ids(5))
    assert space.take(3, 1).tolist() == [5]  # LIFO on the one-id path too
    space.audit()


def test_free_returns_the_count_and_empty_frees_nothing() -> None:
    space = make_space()
    got = space.take(1, 6)
    assert space.free(1, got[:1]) == 1
    assert space.free(1, got[1:3]) == 2
    assert space.free(1, ids()) == 0
    assert space.free(9, ids()) == 0  # an owner holding nothing may free nothing
    assert space.held(1) == 3
    space.audit()


def test_free_of_read_only_wire_bytes_needs_no_copy() -> None:
    space = make_space(8)
    got = space.take(1, 5)
    for part in (got[:1], got[1:]):
        wire = np.frombuffer(part.astype("<i4").tobytes(), dtype=np.int32)
        assert not wire.flags.writeable
        assert space.free(1, wire) == part.shape[0]
    assert space.holders() == {}
    space.audit()


def test_counters_count_ids_high_water_and_failures() -> None:
    space = make_space(4)
    a = space.take(1, 3)
    space.free(1, a[:2])
    space.take(2, 2)
    with pytest.raises(ResourceExhausted):
        space.take(2, 2)
    c = space.counters()
    assert (c.capacity, c.used, c.free, c.high_water, c.allocs, c.frees, c.failed_allocs) == (
        4, 3, 1, 3, 5, 2, 1)
    assert (c.unit, c.bytes_per_unit, c.follows) == (space.spec.unit, space.spec.bytes_per_unit, "")
    assert space.num_free == 1 and space.used == 3
    assert space.holders() == {1: 1, 2: 2}
    assert space.held(1) == 1 and space.held(7) == 0


def test_reclaim_frees_everything_the_owner_holds_and_nothing_else() -> None:
    space = make_space(10)
    mine = space.take(1, 4)
    theirs = space.take(2, 3)
    space.free(1, mine[1:2])
    back = space.reclaim(1)
    assert back.dtype == np.int32
    assert sorted(back.tolist()) == sorted([*mine[:1].tolist(), *mine[2:].tolist()])
    assert space.reclaim(1).tolist() == []
    assert space.holders() == {2: 3}
    assert space.owner_of(theirs).tolist() == [2, 2, 2]
    assert space.counters().frees == 4
    space.audit()


def test_reclaimed_ids_are_handed_out_next() -> None:
    space = make_space(10)
    space.take(1, 3)
    back = space.reclaim(1)
    assert sorted(space.take(2, 3).tolist()) == sorted(back.tolist())


def test_reclaim_after_id_comes_back_to_same_owner_counts_it_once() -> None:
    space = make_space(3)
    space.take(1, 3)
    space.free(1, ids(2))
    assert space.take(1, 1).tolist() == [2]  # freed and handed back to the same owner
    assert sorted(space.reclaim(1).tolist()) == [1, 2, 3]
    assert space.counters().used == 0
    space.audit()


def test_held_set_stays_small_under_churn_so_reclaim_reads_o_held() -> None:
    """An owner holding 5 ids and churning 1 and 2 at a time keeps a held set of 5 ids in a
    small array: nothing grows with the number of calls."""
    space = make_space(100)
    space.take(1, 5)
    for _ in range(5_000):
        space.free(1, space.take(1, 2))
        space.free(1, space.take(1, 1))
    holding = space._ledger.sets[1]
    assert holding.n == 5 and holding.ids.shape[0] == MIN_ROOM
    assert sorted(space.reclaim(1).tolist()) == [1, 2, 3, 4, 5]
    space.audit()


def test_frees_in_the_middle_of_a_held_set_fill_the_holes() -> None:
    space = make_space(40)
    got = space.take(1, 30)
    space.free(1, got[3:20:4])  # holes below the set's tail
    space.free(1, got[[0, 29, 14]])  # one id, the last one, and one in the middle
    space.free(1, got[25:26])
    space.audit()
    left = set(got.tolist()) - set(got[3:20:4].tolist()) - set(got[[0, 29, 14, 25]].tolist())
    assert sorted(space.reclaim(1).tolist()) == sorted(left)
    space.audit()


def test_held_set_grows_and_shrinks_with_the_owner() -> None:
    space = make_space(3 * SHRINK_ABOVE)
    first = space.take(1, 10)
    big = space.take(1, 2 * SHRINK_ABOVE)
    assert space._ledger.sets[1].ids.shape[0] >= 2 * SHRINK_ABOVE + 10
    space.free(1, big)
    assert space._ledger.sets[1].ids.shape[0] < 4 * 10 * 2  # shrunk, still holding the 10
    assert sorted(space.reclaim(1).tolist()) == sorted(first.tolist())
    assert 1 not in space._ledger.sets  # an owner holding nothing keeps no set
    space.audit()


def test_writing_into_a_returned_array_changes_nothing() -> None:
    space = make_space(8)
    got = space.take(1, 4)
    got[:] = 7  # the caller's copy: the space keeps its own
    one = space.take(1, 1)
    one[:] = 2
    assert sorted(space.reclaim(1).tolist()) == [1, 2, 3, 4, 5]
    assert space.counters().used == 0
    space.audit()


def test_free_of_more_ids_than_the_tag_cache_uses_fresh_tags() -> None:
    space = make_space(70_000)
    got = space.take(1, 70_000)
    with pytest.raises(InvalidArgument, match=r"ids\[70000\]=1: repeated \(also at ids\[69999\]\)"):
        space.free(1, np.concatenate([got[1:], got[:1], got[:1]]))
    assert space.held(1) == 70_000
    space.audit()
    assert space.free(1, got[::-1].copy()) == 70_000
    space.audit()


def test_check_and_commit_free() -> None:
    space = make_space()
    got = space.take(1, 3)
    space.take(2, 1)
    before = snapshot(space)
    idx = got.astype(np.intp)
    assert space.check(1, idx) is None
    assert space.check(1, idx[:0]) is None
    fault = space.check(2, idx)
    assert fault is not None and fault.reason is Reason.OTHER_OWNER and fault.holder == 1
    fault = space.check(1, np.array([1, 1], dtype=np.intp))
    assert fault is not None and (fault.pos, fault.reason, fault.first) == (1, Reason.REPEATED, 0)
    fault = space.check(1, np.array([2, 11], dtype=np.intp))
    assert fault is not None and (fault.pos, fault.reason) == (1, Reason.OUT_OF_RANGE)
    fault = space.check(1, np.array([9], dtype=np.intp))
    assert fault is not None and fault.reason is Reason.NOT_ALLOCATED
    assert snapshot(space) == before
    space.audit()
    assert space.commit_free(1, idx[1:2]) == 1
    assert space.commit_free(1, idx[[2, 0]]) == 2
    assert space.commit_free(1, idx[:0]) == 0
    assert space.holders() == {2: 1} and space.counters().frees == 3
    space.audit()


def test_owner_of_reports_zero_for_free_ids() -> None:
    space = make_space(4)
    space.take(3, 2)
    assert space.owner_of(ids(1, 2, 3, 4)).tolist() == [3, 3, 0, 0]
    with pytest.raises(InvalidArgument, match=r"owner_of p/kv ids\[1\]=5: out of range 1..4") as e:
        space.owner_of(ids(1, 5))
    assert e.value.field == "ids[1]"


def test_a_space_of_16m_ids_works() -> None:
    space = make_space(1 << 24)
    assert space.take(1, 3).tolist() == [1, 2, 3]
    many = space.take(2, 100_000)
    assert many[-1] == 100_003 and space.num_free == (1 << 24) - 100_003
    assert space.free(2, many[-2:]) == 2
    assert space.take(3, 1).tolist() == [100_002]
    with pytest.raises(InvalidArgument, match=r"ids\[1\]=16777217: out of range: p/kv pages are"):
        space.free(2, ids(int(many[0]), (1 << 24) + 1))
    with pytest.raises(FailedPrecondition, match=r"ids\[0\]=16777216: not allocated"):
        space.free(2, ids(1 << 24))
    assert space.owner_of(ids(1 << 24, 100_002)).tolist() == [0, 3]
    assert sorted(space.reclaim(2).tolist()) == many[:-2].tolist()
    assert space.counters().used == 4
    space.audit()


# -- audit ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("corrupt", "what"),
    [
        (lambda s: s._ledger.owners.__setitem__(3, 1), "a free id has an owner"),
        (lambda s: s._ledger.owners.__setitem__(1, 2), "held counts differ"),
        (lambda s: s._ledger.owners.__setitem__(0, 0), "sentinels"),
        (lambda s: s._ledger.owners.__setitem__(4, -5), "pending mark"),
        (lambda s: s._free.stack.__setitem__(5, 5), "twice on the free stack"),
        (lambda s: s._free.stack.__setitem__(5, 0), "free-stack id out of range"),
        (lambda s: s._ledger.slots.__setitem__(1, 1), "owner 1's slots"),
        (lambda s: s._ledger.sets[1].ids.__setitem__(0, 2), "owner 1's set"),
    ],
)
def test_audit_finds_a_corrupted_ledger(corrupt, what: str) -> None:
    space = make_space(8)
    space.take(1, 2)
    space.audit()
    corrupt(space)
    with pytest.raises(Internal, match=f"IdSpace p/kv ledger broken: .*{what}"):
        space.audit()


def test_reclaim_refuses_when_held_set_and_owner_array_disagree() -> None:
    space = make_space(6)
    space.take(1, 3)
    space._ledger.owners[2] = 9  # memory corruption: the owner array no longer names owner 1
    with pytest.raises(Internal, match=r"owner 1's held set \(3 ids\) disagrees .* nothing was"):
        space.reclaim(1)
    assert space.counters().used == 3 and space.owner_of(ids(1, 2, 3)).tolist() == [1, 9, 1]
    with pytest.raises(Internal, match="ledger broken"):
        space.audit()


# -- error messages -------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [0, -1, 2**31 - 1])
def test_bad_capacity(capacity: int) -> None:
    with pytest.raises(InvalidArgument, match=r"IdSpace p/kv: capacity must be in 1\.\.") as err:
        make_space(capacity)
    assert err.value.field == "capacity"


def test_count_larger_than_the_space_can_never_fit() -> None:
    space = make_space(10)
    with pytest.raises(ResourceExhausted) as err:
        space.take(1, 11)
    assert err.value.message == (
        "allocate p/kv: asked for 11 p/kv pages, more than the whole space (10), so it can "
        "never fit; ask for fewer or Configure a larger budget_bytes"
    )
    assert err.value.field == "count"
    with pytest.raises(ResourceExhausted, match="more than the whole space"):
        space.take(1, 2**31 - 1)  # refused before any array is made
    assert space.counters().failed_allocs == 2


def test_shortage_says_asked_free_holders_and_knob() -> None:
    space = make_space(10, "req", unit="rows", knob="max_running_requests")
    space.take(1, 4)
    space.take(2, 3)
    before = snapshot(space)
    with pytest.raises(ResourceExhausted) as err:
        space.take(3, 4)
    assert err.value.message == (
        "allocate p/req: asked for 4 p/req rows, 3 of 10 free (7 held by 2 leases); "
        "free some or Configure a larger max_running_requests"
    )
    space.take(1, 3)
    with pytest.raises(ResourceExhausted, match=r"0 of 10 free \(10 held by 2 leases\)"):
        space.take(3, 1)
    assert space.counters().failed_allocs == 2
    assert snapshot(space)[1:] != before[1:]


def test_refused_take_changes_nothing() -> None:
    space = make_space(5)
    space.take(1, 4)
    before = snapshot(space)
    for count in (2, 1_000):
        with pytest.raises(ResourceExhausted):
            space.take(2, count)
    after = snapshot(space)
    assert after[1:] == before[1:]


def test_require_free_names_the_caller_and_field() -> None:
    space = make_space(4)
    space.require_free(4)
    with pytest.raises(ResourceExhausted) as err:
        space.require_free(5, action="allocate m items[2] (kv)", field="items[2].count",
                           note=" in all")
    assert err.value.message.startswith(
        "allocate m items[2] (kv): asked for 5 p/kv pages in all, more than the whole space"
    )
    assert err.value.field == "items[2].count"


def _held_space() -> tuple[IdSpace, np.ndarray, np.ndarray]:
    space = make_space(10)
    mine = space.take(5, 4)  # 1..4
    theirs = space.take(2, 2)  # 5, 6
    return space, mine, theirs


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        (
            [1, 0],
            InvalidArgument,
            "free p/kv ids[1]=0: out of range: p/kv pages are 1..10 (0 is reserved and never "
            "handed out); nothing was freed",
        ),
        ([11], InvalidArgument, "free p/kv ids[0]=11: out of range: p/kv pages are 1..10"),
        ([2, -1], InvalidArgument, "free p/kv ids[1]=-1: out of range"),
        ([2, 2**31 - 1], InvalidArgument, "free p/kv ids[1]=2147483647: out of range"),
        ([-(2**31)], InvalidArgument, "free p/kv ids[0]=-2147483648: out of range"),
        (
            [1, 3, 1],
            InvalidArgument,
            "free p/kv ids[2]=1: repeated (also at ids[0]); list each id once; nothing was freed",
        ),
        ([4, 4], InvalidArgument, "free p/kv ids[1]=4: repeated (also at ids[0])"),
        (
            [2, 8],
            FailedPrecondition,
            "free p/kv ids[1]=8: not allocated (already free: a double free?); free only ids "
            "this lease was given and still holds; nothing was freed",
        ),
        (
            [1, 2, 3, 6],
            FailedPrecondition,
            "free p/kv ids[3]=6: held by another lease, not by this one; nothing was "
            "freed",
        ),
        ([6], FailedPrecondition, "free p/kv ids[0]=6: held by another lease, not by this one"),
        ([9], FailedPrecondition, "free p/kv ids[0]=9: not allocated"),
        ([0], InvalidArgument, "free p/kv ids[0]=0: out of range"),
        ([1, 2, 3, 4, 1], InvalidArgument, "free p/kv ids[4]=1: repeated (also at ids[0])"),
    ],
)
def test_bad_free_names_first_bad_id_and_changes_nothing(
    values: list[int], error: type[Exception], message: str
) -> None:
    space, _, _ = _held_space()
    before = snapshot(space)
    with pytest.raises(error) as err:
        space.free(5, ids(*values))
    assert err.value.message.startswith(message)  # type: ignore[attr-defined]
    pos = message.split("ids[", 1)[1].split("]", 1)[0]
    assert err.value.field == f"ids[{pos}]"  # type: ignore[attr-defined]
    assert snapshot(space) == before
    space.audit()


def test_first_bad_position_wins_over_later_worse_ones() -> None:
    space, _, _ = _held_space()
    with pytest.raises(FailedPrecondition, match=r"ids\[1\]=6: held by another lease"):
        space.free(5, ids(1, 6, 99, 1))


def test_free_by_owner_holding_nothing_names_no_owner_number() -> None:
    space, _, _ = _held_space()
    # owners are internal numbers: the message says "another lease", never "owner 5"
    with pytest.raises(FailedPrecondition, match=r"ids\[0\]=1: held by another lease, not by"):
        space.free(9, ids(1, 2))
    with pytest.raises(FailedPrecondition, match=r"ids\[0\]=1: held by another lease, not by"):
        space.free(9, ids(1))


def test_free_of_more_ids_than_held_names_the_bad_one() -> None:
    space, _, _ = _held_space()
    with pytest.raises(FailedPrecondition, match=r"ids\[4\]=5: held by another lease"):
        space.free(5, ids(1, 2, 3, 4, 5))
    with pytest.raises(InvalidArgument, match=r"ids\[4\]=4: repeated"):
        space.free(5, ids(1, 2, 3, 4, 4))
    assert space.held(5) == 4


def test_free_names_the_caller_field_and_action() -> None:
    space, _, _ = _held_space()
    with pytest.raises(InvalidArgument) as err:
        space.free(5, ids(1, 1), Asked("free m (kv)", "items[3].ids", "nope"))
    assert err.value.message == (
        "free m (kv) items[3].ids[1]=1: repeated (also at items[3].ids[0]); list each id once; "
        "nope"
    )
    assert err.value.field == "items[3].ids[1]"

"""IdPool: allocation order, ownership checks, reclaim, counters and every error message."""

from __future__ import annotations

import array

import numpy as np
import pytest

from kvpool.errors import FailedPrecondition, Internal, InvalidArgument, ResourceExhausted
from kvpoold.ids.ledger import MIN_ROOM, SHRINK_ABOVE
from kvpoold.ids.space import IdPool, PoolCounters

# Every test runs on the C ledger and on the numpy one.
pytestmark = pytest.mark.usefixtures("ledger_backend")


def make_pool(capacity: int = 10, name: str = "p/kv") -> IdPool:
    return IdPool(capacity, name, unit="pages")


def snapshot(pool: IdPool) -> tuple[object, ...]:
    """Everything observable: counters, holders, every id's owner, and the order ids would be
    handed out next."""
    return (
        pool.stats(),
        pool.holders(),
        pool.owner_of(np.arange(1, pool.capacity + 1)).tolist(),
        pool.free_ids().tolist(),
    )


def test_allocate_hands_out_1_to_n_in_order_and_never_0() -> None:
    pool = make_pool(5)
    assert pool.allocate(1, 2).tolist() == [1, 2]
    assert pool.allocate(2, 3).tolist() == [3, 4, 5]
    assert pool.allocate(3, 0).tolist() == []
    assert pool.stats() == PoolCounters(5, 5, 0, 5, 5, 0, 0)
    pool.audit()


def test_returned_ids_are_int32() -> None:
    ids = make_pool().allocate(1, 3)
    assert ids.dtype == np.int32 and ids.ndim == 1


def test_freed_ids_are_reused_first() -> None:
    pool = make_pool(6)
    pool.allocate(1, 4)
    pool.free(1, np.array([3, 1], dtype=np.int32))
    assert sorted(pool.allocate(2, 2).tolist()) == [1, 3]
    assert pool.allocate(2, 1).tolist() == [5]


def test_free_accepts_lists_and_other_integer_dtypes() -> None:
    pool = make_pool()
    pool.allocate(1, 6)
    assert pool.free(1, [1]) == 1
    assert pool.free(1, (2, 3)) == 2
    assert pool.free(1, np.array([4], dtype=np.uint16)) == 1
    assert pool.free(1, np.array([5, 6], dtype=np.int64)) == 2
    assert pool.free(1, []) == 0
    assert pool.held(1) == 0
    pool.audit()


def test_counters_count_ids_high_water_and_failures() -> None:
    pool = make_pool(4)
    a = pool.allocate(1, 3)
    pool.free(1, a[:2])
    pool.allocate(2, 2)
    with pytest.raises(ResourceExhausted):
        pool.allocate(2, 2)
    assert pool.stats() == PoolCounters(
        capacity=4, used=3, free=1, high_water=3, allocs=5, frees=2, failed_allocs=1
    )
    assert pool.holders() == {1: 1, 2: 2}
    assert pool.held(1) == 1 and pool.held(7) == 0


def test_reclaim_frees_everything_the_owner_holds_and_nothing_else() -> None:
    pool = make_pool(10)
    mine = pool.allocate(1, 4)
    theirs = pool.allocate(2, 3)
    pool.free(1, mine[1:2])
    back = pool.reclaim_ids(1)
    assert sorted(back.tolist()) == sorted([*mine[:1].tolist(), *mine[2:].tolist()])
    assert pool.reclaim(1) == 0
    assert pool.holders() == {2: 3}
    assert pool.owner_of(theirs).tolist() == [2, 2, 2]
    pool.audit()


def test_reclaim_after_id_comes_back_to_same_owner_counts_it_once() -> None:
    pool = make_pool(3)
    pool.allocate(1, 3)
    pool.free(1, [2])
    assert pool.allocate(1, 1).tolist() == [2]  # freed and handed back to the same owner
    assert sorted(pool.reclaim_ids(1).tolist()) == [1, 2, 3]
    assert pool.stats().used == 0
    pool.audit()


def test_held_set_stays_small_under_churn_so_reclaim_reads_o_held() -> None:
    """An owner holding 5 ids and churning 2 at a time keeps a held set of 5 ids in a small
    array: nothing grows with the number of calls."""
    pool = make_pool(100)
    pool.allocate(1, 5)
    for _ in range(20_000):
        pool.free(1, pool.allocate(1, 2))
    holding = pool._holdings[1]
    assert len(holding) == 5 and holding.room == MIN_ROOM
    assert sorted(pool.reclaim_ids(1).tolist()) == [1, 2, 3, 4, 5]
    pool.audit()


def test_held_set_grows_and_shrinks_with_the_owner() -> None:
    pool = IdPool(3 * SHRINK_ABOVE, "big")
    first = pool.allocate(1, 10)
    big = pool.allocate(1, 2 * SHRINK_ABOVE)
    assert pool._holdings[1].room >= 2 * SHRINK_ABOVE + 10
    pool.free(1, big)
    assert pool._holdings[1].room < 4 * 10 * 2  # shrunk, still holding the 10
    assert sorted(pool.reclaim_ids(1).tolist()) == sorted(first.tolist())
    assert 1 not in pool._holdings  # an owner holding nothing keeps no set
    pool.audit()


def test_writing_into_a_returned_array_changes_nothing() -> None:
    pool = make_pool(8)
    ids = pool.allocate(1, 4)
    ids[:] = 7  # the caller's copy: the pool keeps its own
    assert sorted(pool.reclaim_ids(1).tolist()) == [1, 2, 3, 4]
    assert pool.stats().used == 0
    pool.audit()


def test_free_of_more_ids_than_the_tag_cache_uses_fresh_tags() -> None:
    pool = IdPool(70_000, "big")
    ids = pool.allocate(1, 70_000)
    with pytest.raises(InvalidArgument, match=r"ids\[70000\]=1: repeated \(also at ids\[69999\]\)"):
        pool.free(1, np.concatenate([ids[1:], ids[:1], ids[:1]]))
    assert pool.held(1) == 70_000
    assert pool.free(1, ids) == 70_000
    pool.audit()


def test_validate_free_checks_without_changing() -> None:
    pool = make_pool()
    ids = pool.allocate(1, 3)
    before = snapshot(pool)
    pool.validate_free(1, ids)
    with pytest.raises(FailedPrecondition, match="held by another lease"):
        pool.validate_free(2, ids)
    assert snapshot(pool) == before


def test_owner_of_reports_zero_for_free_ids() -> None:
    pool = make_pool(4)
    pool.allocate(3, 2)
    assert pool.owner_of([1, 2, 3, 4]).tolist() == [3, 3, 0, 0]
    with pytest.raises(InvalidArgument, match=r"owner_of p/kv ids\[1\]=5: out of range 1..4"):
        pool.owner_of([1, 5])


def test_audit_finds_a_corrupted_ledger() -> None:
    pool = make_pool(4)
    pool.allocate(1, 2)
    pool._owner[3] = 1  # an owner on a free id
    with pytest.raises(Internal, match="ledger broken: a free id has an owner"):
        pool.audit()


# -- error messages -------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [0, -1, 2**31])
def test_bad_capacity(capacity: int) -> None:
    with pytest.raises(InvalidArgument, match="IdPool x: ") as err:
        IdPool(capacity, "x")
    assert err.value.field == "capacity"


@pytest.mark.parametrize("owner", [0, -3, 2**31, True, 1.0, "1", None])
def test_bad_owner(owner: object) -> None:
    pool = make_pool()
    with pytest.raises(InvalidArgument) as err:
        pool.allocate(owner, 1)  # type: ignore[arg-type]
    assert err.value.field == "owner"
    assert str(err.value.message) == (
        f"allocate p/kv: owner must be a lease id in 1..2147483647 (0 means free), got {owner!r}"
    )
    with pytest.raises(InvalidArgument, match=r"free p/kv: owner must be a lease id"):
        pool.free(owner, [1])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"reclaim p/kv: owner must be a lease id"):
        pool.reclaim(owner)  # type: ignore[arg-type]


def test_numpy_integer_owner_and_count_are_accepted() -> None:
    pool = make_pool()
    ids = pool.allocate(np.int64(4), np.int32(2))  # type: ignore[arg-type]
    assert pool.holders() == {4: 2}
    assert pool.free(np.uint8(4), ids) == 2  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("count", "message"),
    [
        (-1, "allocate p/kv: count must be >= 0, got -1"),
        (1.5, "allocate p/kv: count must be an integer, got 1.5"),
        (True, "allocate p/kv: count must be an integer, got True"),
        (
            2**31,
            "allocate p/kv: count 2,147,483,648 is past the int32 id space (2,147,483,647); "
            "ask for what one request needs",
        ),
    ],
)
def test_bad_count(count: object, message: str) -> None:
    pool = make_pool()
    with pytest.raises(InvalidArgument) as err:
        pool.allocate(1, count)  # type: ignore[arg-type]
    assert err.value.message == message
    assert err.value.field == "count"
    assert pool.stats().failed_allocs == 0


def test_count_larger_than_the_pool_can_never_fit() -> None:
    pool = make_pool(10)
    with pytest.raises(ResourceExhausted) as err:
        pool.allocate(1, 11)
    assert err.value.message == (
        "allocate p/kv: asked for 11 p/kv pages, more than the whole space (10), so it can "
        "never fit; ask for fewer or Configure a larger budget_bytes"
    )
    assert err.value.field == "count"


def test_shortage_says_asked_free_holders_and_knob() -> None:
    pool = IdPool(10, "p/req", unit="rows", knob="max_running_requests")
    pool.allocate(1, 4)
    pool.allocate(2, 3)
    before = snapshot(pool)
    with pytest.raises(ResourceExhausted) as err:
        pool.allocate(3, 4)
    assert err.value.message == (
        "allocate p/req: asked for 4 p/req rows, 3 of 10 free (7 held by 2 leases); "
        "free some or Configure a larger max_running_requests"
    )
    assert pool.stats().failed_allocs == 1
    assert snapshot(pool)[1:] == before[1:]


def _held_pool() -> tuple[IdPool, np.ndarray, np.ndarray]:
    pool = make_pool(10)
    mine = pool.allocate(5, 4)  # 1..4
    theirs = pool.allocate(2, 2)  # 5, 6
    return pool, mine, theirs


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        (
            [1, 0],
            InvalidArgument,
            "free p/kv ids[1]=0: out of range: p/kv pages are 1..10 (0 is reserved and never "
            "handed out); nothing was freed",
        ),
        ([11], InvalidArgument, "free p/kv ids[0]=11: out of range: p/kv pages are 1..10"),
        ([2, -1], InvalidArgument, "free p/kv ids[1]=-1: out of range"),
        (
            np.array([1, 2**64 - 1], dtype=np.uint64),
            InvalidArgument,
            "free p/kv ids[1]=18446744073709551615: out of range",
        ),
        (
            [1, 3, 1],
            InvalidArgument,
            "free p/kv ids[2]=1: repeated (also at ids[0]); list each id once; nothing was freed",
        ),
        (
            [2, 8],
            FailedPrecondition,
            "free p/kv ids[1]=8: not allocated (already free: a double free?); free only ids "
            "lease 5 was given and still holds; nothing was freed",
        ),
        (
            [1, 2, 3, 6],
            FailedPrecondition,
            "free p/kv ids[3]=6: held by another lease (owner 2), not by lease 5; nothing was "
            "freed",
        ),
        ([6], FailedPrecondition, "free p/kv ids[0]=6: held by another lease (owner 2)"),
        ([9], FailedPrecondition, "free p/kv ids[0]=9: not allocated"),
        ([0], InvalidArgument, "free p/kv ids[0]=0: out of range"),
    ],
)
def test_bad_free_names_first_bad_id_and_changes_nothing(
    ids: object, error: type[Exception], message: str
) -> None:
    pool, _, _ = _held_pool()
    before = snapshot(pool)
    with pytest.raises(error) as err:
        pool.free(5, ids)  # type: ignore[arg-type]
    assert err.value.message.startswith(message)  # type: ignore[attr-defined]
    pos = message.split("ids[", 1)[1].split("]", 1)[0]
    assert err.value.field == f"ids[{pos}]"  # type: ignore[attr-defined]
    assert snapshot(pool) == before
    pool.audit()


def test_first_bad_position_wins_over_later_worse_ones() -> None:
    pool, _, _ = _held_pool()
    with pytest.raises(FailedPrecondition, match=r"ids\[1\]=6: held by another lease"):
        pool.free(5, [1, 6, 99, 1])


def test_free_by_owner_holding_nothing_names_the_holder() -> None:
    pool, _, _ = _held_pool()
    with pytest.raises(FailedPrecondition, match=r"ids\[0\]=1: held by another lease \(owner 5\)"):
        pool.free(9, [1, 2])


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (np.array([1.0, 2.0]), "free p/kv: ids must hold integers (int32 on the wire), got dtype"),
        (np.array([True]), "free p/kv: ids must hold integers (int32 on the wire), got dtype bool"),
        (np.array([[1, 2]], np.int32), "free p/kv: ids must be a 1-D array of ids, got shape"),
        (np.int32(3), "free p/kv: ids must be a 1-D array of ids, got shape ()"),
        (["a"], "free p/kv: ids must hold integers (int32 on the wire), got dtype <U1"),
        ([1, 2**70], "free p/kv: ids must hold integers (int32 on the wire), got dtype object"),
    ],
)
def test_bad_ids_dtype_or_shape(ids: object, message: str) -> None:
    pool, _, _ = _held_pool()
    with pytest.raises(InvalidArgument) as err:
        pool.free(5, ids)  # type: ignore[arg-type]
    assert err.value.message.startswith(message)
    assert err.value.field == "ids"
    assert pool.held(5) == 4


def test_empty_float_array_is_an_empty_free() -> None:
    pool, _, _ = _held_pool()
    assert pool.free(5, np.array([])) == 0
    assert pool.held(5) == 4


def test_reclaim_refuses_when_held_set_and_owner_array_disagree() -> None:
    pool = make_pool(6)
    pool.allocate(1, 3)
    pool._owner[2] = 9  # memory corruption: the owner array no longer names owner 1
    with pytest.raises(Internal, match=r"owner 1's held set \(3 ids\) disagrees .* nothing was"):
        pool.reclaim(1)
    assert pool.stats().used == 3 and pool.owner_of([1, 2, 3]).tolist() == [1, 9, 1]
    with pytest.raises(Internal, match="ledger broken"):
        pool.audit()


@pytest.mark.parametrize("wrap", [
    lambda ids: array.array("i", ids.tolist()),
    lambda ids: memoryview(ids.copy()),
    lambda ids: ids.astype(np.int64)[::-1],  # strided int64
    lambda ids: ids.astype(np.uint32),
])
def test_free_takes_any_integer_buffer_and_counts_it(wrap) -> None:
    pool = make_pool(8)
    ids = pool.allocate(1, 4)
    assert pool.free(1, wrap(ids)) == 4
    assert pool.stats().frees == 4 and pool.holders() == {}
    pool.audit()


@pytest.mark.parametrize("wrap", [
    lambda ids: memoryview(ids.copy()),
    lambda ids: ids.astype(np.int64)[::-1],
])
def test_refused_free_of_other_buffers_names_the_id(wrap) -> None:
    pool = make_pool(8)
    ids = pool.allocate(1, 4)
    with pytest.raises(FailedPrecondition, match="held by another lease"):
        pool.free(2, wrap(ids))
    with pytest.raises(FailedPrecondition, match="held by another lease"):
        pool.validate_free(2, wrap(ids))
    assert pool.held(1) == 4
    pool.audit()

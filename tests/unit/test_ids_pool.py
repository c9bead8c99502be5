"""PoolIds: the table of spaces, batch allocate/free, release, reclaim, counters, every message."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from kvpool.contract.errors import FailedPrecondition, Internal, InvalidArgument, ResourceExhausted
from kvpool.contract.plan import FULL_TO_SWA, IdSpaceSpec
from kvpool.contract.records import SpaceStats
from kvpoold.ids import Grant, IdSpace, MappingBuffer, PoolIds


def numbers(c: SpaceStats) -> tuple[int, ...]:
    """The counters of a Stats entry: capacity, used, free, high_water, allocs, frees, failed."""
    return (c.capacity, c.used, c.free, c.high_water, c.allocs, c.frees, c.failed_allocs)


def spec(
    name: str,
    capacity: int,
    unit: str = "pages",
    knob: str = "budget_bytes",
    follows: str | None = None,
    mapping: str | None = None,
) -> IdSpaceSpec:
    return IdSpaceSpec(
        name=name,
        capacity=capacity,
        unit=unit,
        bytes_per_unit=4096,
        knob=knob,
        follows=follows,
        mapping=mapping,
    )


def table(kv: int = 8, swa: int = 5, req: int = 3, state: int = 2) -> list[IdSpaceSpec]:
    """The spaces of a hybrid pool, as ``sizing.space_table.declare_spaces`` makes them."""
    out = [spec("kv", kv, knob="budget_bytes or max_total_tokens")]
    if swa:
        out.append(
            spec("swa", swa, knob="budget_bytes or swa_full_tokens_ratio", follows="kv",
                 mapping=FULL_TO_SWA)
        )
    out.append(spec("req", req, unit="rows", knob="max_running_requests"))
    if state:
        out.append(spec("state", state, unit="slots",
                        knob="budget_bytes or mamba_full_memory_ratio"))
    return out


def make_pool(
    kv: int = 8, swa: int = 5, req: int = 3, state: int = 2
) -> tuple[PoolIds, np.ndarray]:
    mapping = np.zeros(kv + 2, dtype=np.int64)
    mapping[-1] = -1
    pool = PoolIds("m", table(kv, swa, req, state), {FULL_TO_SWA: MappingBuffer(mapping)})
    return pool, mapping


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def alloc(pool: PoolIds, owner: int, items: Sequence[tuple[str, int]]) -> list[Grant]:
    """Resolve names as the edge does, then allocate."""
    return pool.allocate(
        owner,
        [(pool.space(name, f"items[{i}].space"), n)
         for i, (name, n) in enumerate(items)],
    )


def free(pool: PoolIds, owner: int, items: Sequence[tuple[str, Sequence[int]]]) -> dict[str, int]:
    return pool.free(
        owner,
        [(pool.space(name, f"items[{i}].space"), ids(*values))
         for i, (name, values) in enumerate(items)],
    )


def state_of(pool: PoolIds, mapping: np.ndarray) -> tuple[object, ...]:
    return pool.counters(), pool.held_by_owner(), mapping.tolist()


def test_names_follow_the_table() -> None:
    assert make_pool()[0].names == ("kv", "swa", "req", "state")
    assert make_pool(swa=0, state=0)[0].names == ("kv", "req")
    dsv4 = [*table(swa=0, state=0), spec("c4_state", 4, "slots"), spec("c128_state", 2, "slots")]
    pool = PoolIds("d", dsv4, {})
    assert pool.names == ("kv", "req", "c4_state", "c128_state")
    assert pool.spec("c128_state").capacity == 2
    grants = alloc(pool, 1, [("c4_state", 2), ("c128_state", 2), ("kv", 1)])
    assert [g.ids.tolist() for g in grants] == [[1, 2], [1, 2], [1]]
    assert pool.reclaim(1) == {"kv": 1, "req": 0, "c4_state": 2, "c128_state": 2}


def test_allocate_returns_one_grant_per_item_in_order() -> None:
    pool, mapping = make_pool()
    kv, req, none, kv2, state = alloc(
        pool, 7, [("kv", 2), ("req", 1), ("state", 0), ("kv", 1), ("state", 2)]
    )
    assert (kv.ids.tolist(), req.ids.tolist(), none.ids.tolist(), kv2.ids.tolist(),
            state.ids.tolist()) == ([1, 2], [1], [], [3], [1, 2])
    assert kv.paired is not None and kv.paired.tolist() == [1, 2] and kv.paired_space == "swa"
    assert kv2.paired is not None and kv2.paired.tolist() == [3]
    assert req.paired is None and req.paired_space is None
    assert mapping[1:4].tolist() == [1, 2, 3]
    assert pool.held_by_owner() == {7: {"kv": 3, "swa": 3, "req": 1, "state": 2}}
    pool.audit()


def test_a_leader_item_of_zero_still_names_its_follower() -> None:
    pool, _ = make_pool()
    (grant,) = alloc(pool, 1, [("kv", 0)])
    assert grant.ids.tolist() == [] and grant.paired is not None
    assert grant.paired.tolist() == [] and grant.paired_space == "swa"


def test_empty_batch_is_a_no_op() -> None:
    pool, _ = make_pool()
    assert pool.allocate(1, []) == []
    assert pool.free(1, []) == {}
    assert pool.held_by_owner() == {}


def test_same_space_twice_is_checked_against_the_sum() -> None:
    pool, mapping = make_pool(swa=0)
    alloc(pool, 9, [("kv", 2)])
    before = state_of(pool, mapping)
    with pytest.raises(ResourceExhausted) as err:
        alloc(pool, 1, [("kv", 3), ("req", 1), ("kv", 4)])
    assert err.value.message == (
        "allocate m items[2] (kv): asked for 7 m/kv pages in all (items of kind kv up to 2), "
        "6 of 8 free (2 held by 1 lease); free some or Configure a larger budget_bytes or "
        "max_total_tokens"
    )
    assert err.value.field == "items[2].count"
    after = state_of(pool, mapping)
    assert after[1:] == before[1:]
    assert after[0]["kv"].failed_allocs == 1  # type: ignore[index]


def test_a_leader_needs_room_on_the_follower_side_too() -> None:
    pool, _ = make_pool(kv=8, swa=3)
    alloc(pool, 1, [("kv", 2)])
    for items, at in (([("req", 1), ("kv", 2)], 1), ([("kv", 2)], 0)):
        with pytest.raises(ResourceExhausted) as err:
            alloc(pool, 2, items)
        assert err.value.message == (
            f"allocate m items[{at}] (kv): asked for 2 m/swa pages, 1 of 3 free (2 held by "
            "1 lease); free some or Configure a larger budget_bytes or swa_full_tokens_ratio"
        )
        assert err.value.field == f"items[{at}].count"
    assert pool.held_by_owner() == {1: {"kv": 2, "swa": 2}}


@pytest.mark.parametrize(
    ("name", "knob"),
    [("req", "max_running_requests"), ("state", "budget_bytes or mamba_full_memory_ratio")],
)
def test_shortage_names_the_space_knob(name: str, knob: str) -> None:
    pool, _ = make_pool()
    with pytest.raises(ResourceExhausted, match=f"Configure a larger {knob}$"):
        alloc(pool, 1, [(name, 3), (name, 1)])


def test_count_past_capacity_can_never_fit() -> None:
    pool, _ = make_pool()
    with pytest.raises(ResourceExhausted) as err:
        alloc(pool, 1, [("req", 4)])
    assert err.value.message == (
        "allocate m items[0] (req): asked for 4 m/req rows, more than the whole space "
        "(3), so it can never fit; ask for fewer or Configure a larger max_running_requests"
    )


def test_free_frees_every_space_and_releases() -> None:
    pool, mapping = make_pool()
    kv, req, state = (g.ids for g in alloc(pool, 3, [("kv", 4), ("req", 2), ("state", 1)]))
    freed = pool.free(
        3,
        [
            (pool.space("swa", "items[0].space"), kv[:2]),
            (pool.space("kv", "items[1].space"), kv[2:3]),
            (pool.space("req", "items[2].space"), req),
            (pool.space("state", "items[3].space"), state),
        ],
    )
    assert freed == {"swa": 2, "kv": 1, "req": 2, "state": 1}
    assert mapping.tolist() == [0, 0, 0, 0, 4, 0, 0, 0, 0, -1]
    assert pool.held_by_owner() == {3: {"kv": 3, "swa": 1}}
    assert pool.paired_of("kv", kv).tolist() == [0, 0, 0, 4]
    assert pool.paired_of("swa", kv).tolist() == [0, 0, 0, 4]
    pool.audit()


def test_single_item_frees_go_through_one_pass() -> None:
    pool, mapping = make_pool()
    kv = alloc(pool, 3, [("kv", 4), ("req", 2)])[0].ids
    assert free(pool, 3, [("swa", [1])]) == {"swa": 1}
    assert free(pool, 3, [("kv", [1, 2])]) == {"kv": 2}
    assert free(pool, 3, [("req", [2])]) == {"req": 1}
    assert free(pool, 3, [("kv", [])]) == {"kv": 0}
    assert pool.held_by_owner() == {3: {"kv": 2, "swa": 2, "req": 1}}
    assert mapping[1:5].tolist() == [0, 0, 3, 4] and kv.tolist() == [1, 2, 3, 4]
    pool.audit()


def test_free_and_release_of_one_leader_id_in_one_batch_is_a_repeat() -> None:
    pool, mapping = make_pool()
    alloc(pool, 1, [("kv", 2)])
    before = state_of(pool, mapping)
    with pytest.raises(InvalidArgument) as err:
        free(pool, 1, [("swa", [2]), ("kv", [1, 2])])
    assert err.value.message == (
        "free m (kv) items[1].ids[1]=2: repeated (also at items[0].ids[0]); list each id once; "
        "nothing in the batch was freed"
    )
    assert state_of(pool, mapping) == before


def test_free_of_wire_bytes_needs_no_copy() -> None:
    pool, _ = make_pool()
    kv, req = (g.ids for g in alloc(pool, 1, [("kv", 3), ("req", 1)]))

    def wire(arr: np.ndarray) -> np.ndarray:
        return np.frombuffer(arr.astype("<i4").tobytes(), dtype=np.int32)

    space = pool.space
    assert pool.free(1, [(space("swa", "k"), wire(kv[:1]))]) == {"swa": 1}
    assert pool.free(1, [(space("kv", "k"), wire(kv)),
                         (space("req", "k"), wire(req))]) == {"kv": 3, "req": 1}
    assert pool.held_by_owner() == {}
    pool.audit()


def test_reclaim_returns_every_space_and_zeroes_the_mapping() -> None:
    pool, mapping = make_pool()
    alloc(pool, 1, [("kv", 3), ("req", 1), ("state", 2)])
    other = alloc(pool, 2, [("kv", 1)])[0].ids
    free(pool, 1, [("swa", [1])])
    assert pool.reclaim(1) == {"kv": 3, "swa": 2, "req": 1, "state": 2}
    assert pool.reclaim(1) == {"kv": 0, "swa": 0, "req": 0, "state": 0}
    assert list(pool.reclaim(1)) == ["kv", "swa", "req", "state"]
    assert pool.held_by_owner() == {2: {"kv": 1, "swa": 1}}
    assert mapping[other[0]] == 4 and mapping[1:4].tolist() == [0, 0, 0]
    pool.audit()


def test_counters_per_space() -> None:
    pool, _ = make_pool()
    alloc(pool, 1, [("kv", 2), ("req", 1)])
    free(pool, 1, [("swa", [2])])
    counters = pool.counters()
    assert list(counters) == ["kv", "swa", "req", "state"]
    assert numbers(counters["kv"]) == (8, 2, 6, 2, 2, 0, 0)
    assert numbers(counters["swa"]) == (5, 1, 4, 2, 2, 1, 0)
    assert numbers(counters["req"]) == (3, 1, 2, 1, 1, 0, 0)
    assert numbers(counters["state"]) == (2, 0, 2, 0, 0, 0, 0)


def test_on_write_of_the_mapping_buffer_mirrors_every_write() -> None:
    mapping = np.zeros(10, dtype=np.int64)
    device = np.full(10, -7, dtype=np.int64)

    def on_write(idx: np.ndarray) -> None:
        device[idx] = mapping[idx]

    pool = PoolIds("m", table(), {FULL_TO_SWA: MappingBuffer(mapping, on_write)})
    assert device[1:9].tolist() == [0] * 8
    kv = alloc(pool, 1, [("kv", 4)])[0].ids
    free(pool, 1, [("swa", [int(kv[0])]), ("kv", [int(kv[1])])])
    free(pool, 1, [("swa", [int(kv[2])])])
    assert device[1:9].tolist() == mapping[1:9].tolist() == [0, 0, 0, 4, 0, 0, 0, 0]
    pool.reclaim(1)
    assert device[1:9].tolist() == [0] * 8


def test_audit_finds_a_corrupted_space() -> None:
    pool, mapping = make_pool()
    alloc(pool, 1, [("kv", 2), ("req", 1)])
    pool.audit()
    pool.space("req", "k")._ledger.owners[2] = 1
    with pytest.raises(Internal, match="IdSpace m/req ledger broken"):
        pool.audit()
    pool.space("req", "k")._ledger.owners[2] = 0
    mapping[1] = 5
    with pytest.raises(Internal, match="Pairing m/kv->swa broken: shared != private"):
        pool.audit()


# -- error messages -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spaces", "mappings", "message", "field"),
    [
        ([], {}, "PoolIds m: no id space; a pool has kv at least", "spaces"),
        (
            [spec("kv", 4), spec("kv", 2)],
            {},
            "PoolIds m: id space kv is listed twice",
            "spaces[1].name",
        ),
        (
            [spec("swa", 2, follows="kv", mapping=FULL_TO_SWA)],
            {FULL_TO_SWA: None},
            "PoolIds m: id space swa follows kv, which is not another space of the pool "
            "(have: swa; mappings: full_to_swa)",
            "spaces[0].follows",
        ),
        (
            [spec("kv", 4), spec("swa", 2, follows="kv")],
            {},
            "PoolIds m: id space swa has no mapping buffer to write its links into",
            "spaces[1].follows",
        ),
        (
            [spec("kv", 4), spec("swa", 2, follows="kv", mapping=FULL_TO_SWA)],
            {},
            "PoolIds m: id space swa writes its links into full_to_swa, which was not given "
            "(have: kv, swa; mappings: none)",
            "spaces[1].follows",
        ),
        (
            [spec("kv", 4, follows="req", mapping="a"), spec("req", 2),
             spec("swa", 2, follows="kv", mapping="b")],
            {"a": None, "b": None},
            "PoolIds m: id space swa follows kv, which itself follows req",
            "spaces[2].follows",
        ),
        (
            [spec("kv", 4), spec("swa", 2, follows="kv", mapping="a"),
             spec("swb", 2, follows="kv", mapping="b")],
            "two buffers",
            "PoolIds m: id space kv has two followers (swa, swb)",
            "spaces[2].follows",
        ),
        ([spec("kv", 0)], {}, "IdSpace m/kv: capacity must be in 1..", "capacity"),
        (
            [spec("kv", 4), spec("swa", 2, follows="kv", mapping=FULL_TO_SWA)],
            "short",
            "Pairing m/kv: full_to_swa has 3 entries, the kv space needs 5",
            "full_to_swa",
        ),
    ],
)
def test_bad_construction(
    spaces: list[IdSpaceSpec], mappings: object, message: str, field: str
) -> None:
    if mappings == "two buffers":
        mappings = {k: MappingBuffer(np.zeros(6, np.int64)) for k in "ab"}
    elif mappings == "short":
        mappings = {FULL_TO_SWA: MappingBuffer(np.zeros(3, np.int64))}
    else:
        mappings = {k: MappingBuffer(np.zeros(6, np.int64)) for k in mappings}  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument) as err:
        PoolIds("m", spaces, mappings)  # type: ignore[arg-type]
    assert err.value.message.startswith(message)
    assert err.value.field == field


def test_unknown_space_names_the_spaces_the_pool_has() -> None:
    pool, _ = make_pool(swa=0, state=0)
    with pytest.raises(InvalidArgument) as err:
        pool.space("state", "items[0].space")
    assert err.value.message == (
        "items[0].space=state: pool m has no state space (it has: kv, req); Configure it with one"
    )
    assert err.value.field == "items[0].space"
    with pytest.raises(InvalidArgument, match=r"^items\[2\]\.space=swa: pool m has no swa space"):
        pool.space("swa", "items[2].space")
    with pytest.raises(InvalidArgument,
                       match=r"items\[1\]\.space='k v': pool m has no 'k v' space"):
        pool.space("k v", "items[1].space")
    with pytest.raises(InvalidArgument, match=r"items\[1\]\.space=3: pool m has no 3 space"):
        pool.space(3, "items[1].space")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="pool m has no swa space"):
        pool.paired_of("swa", ids(1))
    with pytest.raises(InvalidArgument, match="space kv is not paired with another"):
        pool.paired_of("kv", ids(1))
    with pytest.raises(InvalidArgument, match="pool m has no nope space"):
        pool.spec("nope")


def test_a_following_space_cannot_be_allocated() -> None:
    """Resolving swa is fine (Free takes it); allocate is the one place that refuses it."""
    pool, mapping = make_pool()
    swa = pool.space("swa", "items[0].space")
    kv = pool.space("kv", "items[0].space")
    before = state_of(pool, mapping)
    with pytest.raises(InvalidArgument) as err:
        pool.allocate(1, [(swa, 1)])
    assert err.value.message == (
        "items[0].space=swa cannot be allocated on its own: allocate kv, which brings a swa page "
        "per kv page"
    )
    assert err.value.field == "items[0].space"
    with pytest.raises(InvalidArgument, match=r"^items\[1\]\.space=swa cannot be allocated"):
        pool.allocate(1, [(kv, 1), (swa, 1)])
    assert state_of(pool, mapping) == before


def test_a_space_of_another_pool_is_refused() -> None:
    pool, _ = make_pool()
    other, _ = make_pool()
    kv = other.space("kv", "k")
    with pytest.raises(Internal, match=r"allocate m: items\[0\] is a space of another pool"):
        pool.allocate(1, [(kv, 1)])
    other.allocate(1, [(kv, 1)])
    with pytest.raises(Internal, match=r"free m: items\[0\] is a space of another pool"):
        pool.free(1, [(kv, ids(1))])
    with pytest.raises(Internal, match=r"free m: items\[1\] is a space of another pool"):
        pool.free(1, [(pool.space("req", "k"), ids()), (kv, ids(1))])
    assert isinstance(kv, IdSpace) and kv.held(1) == 1


def _held() -> tuple[PoolIds, np.ndarray]:
    """Lease 5 holds kv 1..3 (swa of 1 released) and req 1; lease 2 holds kv 4 and req 2."""
    pool, mapping = make_pool()
    alloc(pool, 5, [("kv", 3), ("req", 1)])
    alloc(pool, 2, [("kv", 1), ("req", 1)])
    free(pool, 5, [("swa", [1])])
    return pool, mapping


@pytest.mark.parametrize(
    ("items", "error", "message"),
    [
        (
            [("kv", [2]), ("req", [1]), ("kv", [3, 4])],
            FailedPrecondition,
            "free m (kv) items[2].ids[1]=4: held by another lease, not by this one; "
            "nothing in the batch was freed",
        ),
        (
            [("kv", [2]), ("swa", [3, 2])],
            InvalidArgument,
            "free m (swa) items[1].ids[1]=2: repeated (also at items[0].ids[0]); list each id "
            "once; nothing in the batch was freed",
        ),
        (
            [("req", [1]), ("req", [1])],
            InvalidArgument,
            "free m (req) items[1].ids[0]=1: repeated (also at items[0].ids[0])",
        ),
        (
            [("swa", [2, 1])],
            FailedPrecondition,
            "free m (swa) items[0].ids[1]=1: its swa page was already released; free it as kv "
            "to return the full page, release each swa page once; nothing in the batch was freed",
        ),
        (
            [("swa", [2]), ("swa", [1])],
            FailedPrecondition,
            "free m (swa) items[1].ids[0]=1: its swa page was already released",
        ),
        (
            [("kv", [3]), ("req", [3]), ("kv", [9])],
            FailedPrecondition,
            "free m (req) items[1].ids[0]=3: not allocated (already free: a double free?)",
        ),
        (
            [("kv", [2, 9])],
            InvalidArgument,
            "free m (kv) items[0].ids[1]=9: out of range: m/kv pages are 1..8 (0 is "
            "reserved and never handed out); nothing in the batch was freed",
        ),
        (
            [("state", [0])],
            InvalidArgument,
            "free m (state) items[0].ids[0]=0: out of range: m/state slots are 1..2",
        ),
        ([("kv", [4])], FailedPrecondition, "free m (kv) items[0].ids[0]=4: held by another"),
        ([("req", [1, 1])], InvalidArgument, "free m (req) items[0].ids[1]=1: repeated"),
        ([("swa", [9])], InvalidArgument, "free m (swa) items[0].ids[0]=9: out of range: m/kv"),
        (
            [("req", [2]), ("kv", [2])],
            FailedPrecondition,
            "free m (req) items[0].ids[0]=2: held by another lease, not by this one",
        ),
    ],
)
def test_bad_free_names_item_and_position_and_changes_nothing(
    items: list[tuple[str, list[int]]], error: type[Exception], message: str
) -> None:
    pool, mapping = _held()
    before = state_of(pool, mapping)
    with pytest.raises(error) as err:
        free(pool, 5, items)
    assert err.value.message.startswith(message)  # type: ignore[attr-defined]
    assert err.value.field == message.split(") ", 1)[1].split("=", 1)[0]  # type: ignore[attr-defined]
    assert state_of(pool, mapping) == before
    pool.audit()

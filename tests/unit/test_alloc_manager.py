"""PoolAllocator: batch allocate/free, kinds, reclaim, stats, the lock, every error message."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvpool.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvpoold.ids.pool_ids import Kind, PoolAllocator
from kvpoold.ids.space import PoolCounters

# Every test runs on the C ledger and on the numpy one.
pytestmark = pytest.mark.usefixtures("ledger_backend")


def make_alloc(
    kv: int = 8, swa: int = 5, req: int = 3, state: int = 2
) -> tuple[PoolAllocator, np.ndarray]:
    mapping = np.zeros(kv + 2, dtype=np.int64)
    mapping[-1] = -1
    alloc = PoolAllocator(
        "m",
        kv_pages=kv,
        swa_pages=swa,
        full_to_swa=mapping if swa else None,
        req_rows=req,
        state_slots=state,
    )
    return alloc, mapping


def state_of(alloc: PoolAllocator, mapping: np.ndarray) -> tuple[object, ...]:
    return alloc.stats(), alloc.held_by_owner(), mapping.tolist()


def test_kinds_present_follow_the_sizes() -> None:
    assert make_alloc()[0].kinds == (Kind.KV, Kind.SWA, Kind.REQ, Kind.STATE)
    assert make_alloc(swa=0, state=0)[0].kinds == (Kind.KV, Kind.REQ)
    assert PoolAllocator("s", state_slots=4).kinds == (Kind.STATE,)


def test_allocate_batch_returns_one_array_per_item_in_order() -> None:
    alloc, mapping = make_alloc()
    kv, req, none, kv2, state = alloc.allocate_batch(
        7, [("kv", 2), (Kind.REQ, 1), ("state", 0), (Kind.KV, 1), ("state", 2)]
    )
    assert (kv.tolist(), req.tolist(), none.tolist(), kv2.tolist(), state.tolist()) == (
        [1, 2],
        [1],
        [],
        [3],
        [1, 2],
    )
    assert mapping[1:4].tolist() == [1, 2, 3]
    assert alloc.held_by_owner() == {7: {Kind.KV: 3, Kind.SWA: 3, Kind.REQ: 1, Kind.STATE: 2}}
    alloc.audit()


def test_empty_batch_is_a_no_op() -> None:
    alloc, _ = make_alloc()
    assert alloc.allocate_batch(1, []) == []
    assert alloc.free_batch(1, []) == {}
    assert alloc.held_by_owner() == {}


def test_same_kind_twice_is_checked_against_the_sum() -> None:
    alloc, mapping = make_alloc(swa=0)
    alloc.allocate_batch(9, [("kv", 2)])
    before = state_of(alloc, mapping)
    with pytest.raises(ResourceExhausted) as err:
        alloc.allocate_batch(1, [("kv", 3), ("req", 1), ("kv", 4)])
    assert err.value.message == (
        "allocate_batch m items[2] (kv): asked for 7 m/kv pages in all (items of kind kv up to "
        "2), 6 of 8 free (2 held by 1 lease); free some or Configure a larger budget_bytes"
    )
    assert err.value.field == "items[2].count"
    after = state_of(alloc, mapping)
    assert after[1:] == before[1:]
    assert after[0][Kind.KV].failed_allocs == 1  # type: ignore[index]


def test_hybrid_kv_needs_room_on_the_swa_side_too() -> None:
    alloc, _ = make_alloc(kv=8, swa=3)
    alloc.allocate_batch(1, [("kv", 2)])
    with pytest.raises(ResourceExhausted) as err:
        alloc.allocate_batch(2, [("req", 1), ("kv", 2)])
    assert err.value.message == (
        "allocate_batch m items[1] (kv): asked for 2 m/swa pages, 1 of 3 free (2 held by "
        "1 lease); free some or Configure a larger budget_bytes or swa_full_tokens_ratio"
    )
    assert alloc.held_by_owner() == {1: {Kind.KV: 2, Kind.SWA: 2}}


@pytest.mark.parametrize(
    ("kind", "knob"),
    [("req", "max_running_requests"), ("state", "budget_bytes or mamba_full_memory_ratio")],
)
def test_shortage_names_the_kind_knob(kind: str, knob: str) -> None:
    alloc, _ = make_alloc()
    with pytest.raises(ResourceExhausted, match=f"Configure a larger {knob}$"):
        alloc.allocate_batch(1, [(kind, 3), (kind, 1)])


def test_count_past_capacity_can_never_fit() -> None:
    alloc, _ = make_alloc()
    with pytest.raises(ResourceExhausted) as err:
        alloc.allocate_batch(1, [("req", 4)])
    assert err.value.message == (
        "allocate_batch m items[0] (req): asked for 4 m/req rows, more than the whole space "
        "(3), so it can never fit; ask for fewer or Configure a larger max_running_requests"
    )


def test_free_batch_frees_every_kind_and_release_swa() -> None:
    alloc, mapping = make_alloc()
    kv, req, state = alloc.allocate_batch(3, [("kv", 4), ("req", 2), ("state", 1)])
    freed = alloc.free_batch(
        3, [("swa", kv[:2]), ("kv", kv[2:3]), ("req", req), (Kind.STATE, state.tolist())]
    )
    assert freed == {Kind.SWA: 2, Kind.KV: 1, Kind.REQ: 2, Kind.STATE: 1}
    assert mapping.tolist() == [0, 0, 0, 0, 4, 0, 0, 0, 0, -1]
    assert alloc.held_by_owner() == {3: {Kind.KV: 3, Kind.SWA: 1}}
    assert alloc.swa_of(kv).tolist() == [0, 0, 0, 4]
    alloc.audit()


def test_reclaim_returns_every_kind_and_zeroes_the_mapping() -> None:
    alloc, mapping = make_alloc()
    alloc.allocate_batch(1, [("kv", 3), ("req", 1), ("state", 2)])
    other = alloc.allocate_batch(2, [("kv", 1)])[0]
    alloc.free_batch(1, [("swa", [1])])
    assert alloc.reclaim(1) == {Kind.KV: 3, Kind.SWA: 2, Kind.REQ: 1, Kind.STATE: 2}
    assert alloc.reclaim(1) == {Kind.KV: 0, Kind.SWA: 0, Kind.REQ: 0, Kind.STATE: 0}
    assert alloc.held_by_owner() == {2: {Kind.KV: 1, Kind.SWA: 1}}
    assert mapping[other[0]] == 4 and mapping[1:4].tolist() == [0, 0, 0]
    alloc.audit()


def test_stats_per_kind() -> None:
    alloc, _ = make_alloc()
    alloc.allocate_batch(1, [("kv", 2), ("req", 1)])
    alloc.free_batch(1, [("swa", [2])])
    stats = alloc.stats()
    assert stats[Kind.KV] == PoolCounters(8, 2, 6, 2, 2, 0, 0)
    assert stats[Kind.SWA] == PoolCounters(5, 1, 4, 2, 2, 1, 0)
    assert stats[Kind.REQ] == PoolCounters(3, 1, 2, 1, 1, 0, 0)
    assert stats[Kind.STATE] == PoolCounters(2, 0, 2, 0, 0, 0, 0)


def test_threads_never_share_an_id() -> None:
    alloc, _ = make_alloc(kv=64, swa=48, req=16, state=16)
    seen: list[tuple[int, list[int]]] = []
    errors: list[BaseException] = []

    def worker(owner: int) -> None:
        rng = np.random.default_rng(owner)
        try:
            for _ in range(300):
                try:
                    kv, req = alloc.allocate_batch(
                        owner, [("kv", int(rng.integers(1, 4))), ("req", 1)]
                    )
                except ResourceExhausted:
                    continue
                seen.append((owner, kv.tolist()))
                owners = alloc.held_by_owner()
                assert owners[owner][Kind.KV] >= kv.shape[0]
                alloc.free_batch(owner, [("kv", kv), ("req", req)])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(o,)) for o in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(seen) > 100
    assert alloc.held_by_owner() == {}
    alloc.audit()


# -- error messages -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "message", "field"),
    [
        ({}, "PoolAllocator m: every space is empty", "kv_pages"),
        ({"kv_pages": -1}, "PoolAllocator m: count must be >= 0, got -1", "kv_pages"),
        (
            {"kv_pages": 4, "swa_pages": 2},
            "PoolAllocator m: swa_pages=2 needs kv_pages > 0 "
            "(got 4) and the full_to_swa mapping (got NoneType)",
            "swa_pages",
        ),
        (
            {"swa_pages": 2, "full_to_swa": np.zeros(4, np.int64)},
            "PoolAllocator m: swa_pages=2 needs kv_pages > 0 (got 0)",
            "swa_pages",
        ),
    ],
)
def test_bad_construction(sizes: dict[str, object], message: str, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        PoolAllocator("m", **sizes)  # type: ignore[arg-type]
    assert err.value.message.startswith(message)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("items", "message", "field"),
    [
        (
            [("kv", 1), ("kvv", 1)],
            "allocate_batch m: items[1].kind='kvv' is not a kind; known: kv, swa, req, state",
            "items[1].kind",
        ),
        ([(3, 1)], "allocate_batch m: items[0].kind=3 is not a kind", "items[0].kind"),
        (
            [("swa", 1)],
            "allocate_batch m: items[0].kind=swa cannot be allocated on its own: "
            "allocate kv, which brings a swa page per kv page in a hybrid pool",
            "items[0].kind",
        ),
        ([("kv", -2)], "allocate_batch m: count must be >= 0, got -2", "items[0].count"),
        (
            [("kv", 2**40)],
            "allocate_batch m: count 1,099,511,627,776 is past the int32 id space",
            "items[0].count",
        ),
        ([("kv", "2")], "allocate_batch m: count must be an integer, got '2'", "items[0].count"),
        (
            [("kv",)],
            "allocate_batch m: items[0] must be a (kind, count) pair, got ('kv',)",
            "items[0]",
        ),
        (["kv"], "allocate_batch m: items[0] must be a (kind, count) pair, got 'kv'", "items[0]"),
    ],
)
def test_bad_allocate_items(items: list[object], message: str, field: str) -> None:
    alloc, mapping = make_alloc()
    before = state_of(alloc, mapping)
    with pytest.raises(InvalidArgument) as err:
        alloc.allocate_batch(1, items)  # type: ignore[arg-type]
    assert err.value.message.startswith(message)
    assert err.value.field == field
    assert state_of(alloc, mapping) == before


def test_absent_kind_names_the_kinds_the_pool_has() -> None:
    alloc, _ = make_alloc(swa=0, state=0)
    with pytest.raises(InvalidArgument) as err:
        alloc.allocate_batch(1, [("state", 1)])
    assert err.value.message == (
        "allocate_batch m: items[0].kind=state: pool m has no state space (it has: kv, req); "
        "Configure it with one"
    )
    with pytest.raises(InvalidArgument) as err:
        alloc.free_batch(1, [("swa", [1])])
    assert err.value.message == (
        "free_batch m: pool m is not a hybrid sliding-window pool, it has no swa pages (it has: "
        "kv, req)"
    )
    assert err.value.field == "items[0].kind"
    with pytest.raises(InvalidArgument, match="pool m is not a hybrid"):
        alloc.swa_of([1])


def test_bad_owner_in_every_call() -> None:
    alloc, _ = make_alloc()
    for call, action in [
        (lambda: alloc.allocate_batch(0, [("kv", 1)]), "allocate_batch m"),
        (lambda: alloc.free_batch(-1, [("kv", [1])]), "free_batch m"),
        (lambda: alloc.reclaim(0), "reclaim m"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            call()
        assert err.value.message.startswith(f"{action}: owner must be a lease id in 1..")
        assert err.value.field == "owner"


def _held() -> tuple[PoolAllocator, np.ndarray]:
    """Lease 5 holds kv 1..3 (swa of 1 released) and req 1; lease 2 holds kv 4 and req 2."""
    alloc, mapping = make_alloc()
    alloc.allocate_batch(5, [("kv", 3), ("req", 1)])
    alloc.allocate_batch(2, [("kv", 1), ("req", 1)])
    alloc.free_batch(5, [("swa", [1])])
    return alloc, mapping


@pytest.mark.parametrize(
    ("items", "error", "message"),
    [
        (
            [("kv", [2]), ("req", [1]), ("kv", [3, 4])],
            FailedPrecondition,
            "free_batch m (kv) items[2].ids[1]=4: held by another lease (owner 2), not by lease "
            "5; nothing in the batch was freed",
        ),
        (
            [("kv", [2]), ("swa", [3, 2])],
            InvalidArgument,
            "free_batch m (swa) items[1].ids[1]=2: repeated (also at items[0].ids[0]); list each "
            "id once; nothing in the batch was freed",
        ),
        (
            [("req", [1]), ("req", [1])],
            InvalidArgument,
            "free_batch m (req) items[1].ids[0]=1: repeated (also at items[0].ids[0])",
        ),
        (
            [("swa", [2, 1])],
            FailedPrecondition,
            "free_batch m (swa) items[0].ids[1]=1: its swa page was already released; free it "
            "as kv to return the full page, release each swa page once; nothing in the batch "
            "was freed",
        ),
        (
            [("kv", [3]), ("req", [3]), ("kv", [9])],
            FailedPrecondition,
            "free_batch m (req) items[1].ids[0]=3: not allocated (already free: a double free?)",
        ),
        (
            [("kv", [2, 9])],
            InvalidArgument,
            "free_batch m (kv) items[0].ids[1]=9: out of range: m/kv pages are 1..8 (0 is "
            "reserved and never handed out)",
        ),
        (
            [("state", [0])],
            InvalidArgument,
            "free_batch m (state) items[0].ids[0]=0: out of range: m/state slots are 1..2",
        ),
    ],
)
def test_bad_free_batch_names_item_and_position_and_changes_nothing(
    items: list[tuple[str, list[int]]], error: type[Exception], message: str
) -> None:
    alloc, mapping = _held()
    before = state_of(alloc, mapping)
    with pytest.raises(error) as err:
        alloc.free_batch(5, items)  # type: ignore[arg-type]
    assert err.value.message.startswith(message)  # type: ignore[attr-defined]
    assert err.value.field == message.split(") ", 1)[1].split("=", 1)[0]  # type: ignore[attr-defined]
    assert state_of(alloc, mapping) == before
    alloc.audit()


@pytest.mark.parametrize(
    ("items", "message", "field"),
    [
        (
            [("kv", np.zeros((1, 2), np.int32))],
            "free_batch m: items[0].ids must be a 1-D array of ids, got shape (1, 2)",
            "items[0].ids",
        ),
        (
            [("kv", [2]), ("req", [1.5])],
            "free_batch m: items[1].ids must hold integers (int32 on the wire), got dtype float64",
            "items[1].ids",
        ),
        (
            [("kv", [2]), ("what", [1])],
            "free_batch m: items[1].kind='what' is not a kind",
            "items[1].kind",
        ),
        ([("kv", [2], 1)], "free_batch m: items[0] must be a (kind, ids) pair", "items[0]"),
    ],
)
def test_malformed_free_batch(items: list[object], message: str, field: str) -> None:
    alloc, mapping = _held()
    before = state_of(alloc, mapping)
    with pytest.raises(InvalidArgument) as err:
        alloc.free_batch(5, items)  # type: ignore[arg-type]
    assert err.value.message.startswith(message)
    assert err.value.field == field
    assert state_of(alloc, mapping) == before

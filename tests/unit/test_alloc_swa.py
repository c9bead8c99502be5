"""SwaPair: full and SWA ids allocated together, the shared mapping, release and reclaim."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvpoold.ids.pairing import SwaPair
from kvpoold.ids.space import IdPool

# Every test runs on the C ledger and on the numpy one.
pytestmark = pytest.mark.usefixtures("ledger_backend")


def make_pair(full: int = 6, swa: int = 4) -> tuple[SwaPair, np.ndarray]:
    """A pair over a SGLang-shaped mapping: full + 2 entries, the last one -1."""
    mapping = np.zeros(full + 2, dtype=np.int64)
    mapping[-1] = -1
    pair = SwaPair(IdPool(full, "p/kv", unit="pages"), IdPool(swa, "p/swa", unit="pages"), mapping)
    return pair, mapping


def test_allocate_links_each_full_id_to_a_swa_id_in_the_shared_mapping() -> None:
    pair, mapping = make_pair()
    full = pair.allocate(1, 3)
    assert full.tolist() == [1, 2, 3]
    assert mapping.tolist() == [0, 1, 2, 3, 0, 0, 0, -1]
    assert pair.swa_of(full).tolist() == [1, 2, 3]
    assert pair.full.holders() == {1: 3} and pair.swa.holders() == {1: 3}
    pair.audit()


def test_count_zero_returns_empty_and_changes_nothing() -> None:
    pair, mapping = make_pair()
    assert pair.allocate(1, 0).tolist() == []
    assert pair.full.stats().used == 0 and not mapping[1:-1].any()


def test_free_returns_both_sides_and_zeroes_the_mapping() -> None:
    pair, mapping = make_pair()
    full = pair.allocate(1, 3)
    assert pair.free(1, full[:2]) == 2
    assert mapping.tolist() == [0, 0, 0, 3, 0, 0, 0, -1]
    assert pair.full.held(1) == 1 and pair.swa.held(1) == 1
    pair.audit()


def test_release_swa_keeps_the_full_page() -> None:
    pair, mapping = make_pair()
    full = pair.allocate(1, 3)
    assert pair.release_swa(1, full[:1]) == 1
    assert mapping[1] == 0 and pair.full.held(1) == 3 and pair.swa.held(1) == 2
    assert pair.free(1, full) == 3  # frees the 3 full and the 2 still-linked swa pages
    assert pair.swa.stats().used == 0 and pair.full.stats().used == 0
    pair.audit()


def test_released_swa_page_is_reused_for_the_next_full_page() -> None:
    pair, mapping = make_pair(full=6, swa=2)
    full = pair.allocate(1, 2)
    with pytest.raises(ResourceExhausted, match="asked for 1 p/swa pages, 0 of 2 free"):
        pair.allocate(1, 1)
    pair.release_swa(1, full[1:])
    assert pair.allocate(2, 1).tolist() == [3]
    assert mapping[3] == 2
    pair.audit()


def test_reclaim_frees_both_sides_and_clears_the_mapping() -> None:
    pair, mapping = make_pair()
    mine = pair.allocate(1, 2)
    theirs = pair.allocate(2, 2)
    pair.release_swa(1, mine[:1])
    assert pair.reclaim(1) == (2, 1)
    assert mapping.tolist() == [0, 0, 0, 3, 4, 0, 0, -1]
    assert pair.full.owner_of(theirs).tolist() == [2, 2]
    assert pair.reclaim(1) == (0, 0)
    pair.audit()


def test_scribbling_on_the_shared_mapping_cannot_free_other_pages() -> None:
    pair, mapping = make_pair()
    mine = pair.allocate(1, 1)
    pair.allocate(2, 1)
    mapping[mine[0]] = 2  # a client points our page at lease 2's swa page
    pair.free(1, mine)
    assert pair.swa.holders() == {2: 1}
    assert mapping[mine[0]] == 0


def test_shortage_on_either_side_allocates_nothing() -> None:
    pair, mapping = make_pair(full=6, swa=3)
    pair.allocate(1, 2)
    with pytest.raises(ResourceExhausted) as err:
        pair.allocate(1, 2)
    assert err.value.message == (
        "allocate p/kv: asked for 2 p/swa pages, 1 of 3 free (2 held by 1 lease); free some "
        "or Configure a larger budget_bytes"
    )
    assert pair.full.stats().used == 2 and pair.swa.stats().used == 2
    assert pair.swa.stats().failed_allocs == 1 and pair.full.stats().failed_allocs == 0
    assert mapping.tolist() == [0, 1, 2, 0, 0, 0, 0, -1]
    with pytest.raises(ResourceExhausted, match="asked for 7 p/kv pages, more than the whole"):
        pair.allocate(1, 7)


# -- error messages -------------------------------------------------------------------------


def test_free_of_another_leases_page_names_it_and_changes_nothing() -> None:
    pair, mapping = make_pair()
    pair.allocate(1, 2)
    pair.allocate(2, 1)
    with pytest.raises(FailedPrecondition) as err:
        pair.free(1, [1, 3])
    assert err.value.message == (
        "free p/kv ids[1]=3: held by another lease (owner 2), not by lease 1; nothing was freed"
    )
    assert err.value.field == "ids[1]"
    assert mapping.tolist() == [0, 1, 2, 3, 0, 0, 0, -1]
    assert pair.full.holders() == {1: 2, 2: 1}


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        ([2, 7], InvalidArgument, "release_swa p/kv ids[1]=7: out of range: p/kv pages are 1..6"),
        ([1, 7], FailedPrecondition, "release_swa p/kv ids[0]=1: its swa page was already"),
        ([2, 2], InvalidArgument, "release_swa p/kv ids[1]=2: repeated (also at ids[0])"),
        ([5], FailedPrecondition, "release_swa p/kv ids[0]=5: not allocated"),
        ([3], FailedPrecondition, "release_swa p/kv ids[0]=3: held by another lease (owner 2)"),
        (
            [2, 1],
            FailedPrecondition,
            "release_swa p/kv ids[1]=1: its swa page was already released; free it as kv to "
            "return the full page, release each swa page once; nothing was released",
        ),
    ],
)
def test_bad_release_swa(ids: list[int], error: type[Exception], message: str) -> None:
    pair, mapping = make_pair()
    pair.allocate(1, 2)
    pair.allocate(2, 1)
    pair.release_swa(1, [1])
    before = (mapping.copy(), pair.full.holders(), pair.swa.holders())
    with pytest.raises(error) as err:
        pair.release_swa(1, ids)
    assert err.value.message.startswith(message)  # type: ignore[attr-defined]
    assert (mapping.tolist(), pair.full.holders(), pair.swa.holders()) == (
        before[0].tolist(),
        before[1],
        before[2],
    )


@pytest.mark.parametrize(
    ("mapping", "problem"),
    [
        ([0] * 7, "must be a numpy array, got list"),
        (np.zeros((7, 1), np.int64), "must be 1-D signed integers, got int64 (7, 1)"),
        (np.zeros(7, np.uint32), "must be 1-D signed integers, got uint32 (7,)"),
        (np.zeros(7, np.float64), "must be 1-D signed integers, got float64 (7,)"),
        (np.zeros(7, np.int16), "must hold int32 ids at least, got int16"),
        (np.zeros(6, np.int64), "has 6 entries, the full space needs 7"),
    ],
)
def test_bad_mapping(mapping: object, problem: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        SwaPair(IdPool(6, "p/kv"), IdPool(4, "p/swa"), mapping)  # type: ignore[arg-type]
    assert err.value.message == (
        f"SwaPair p/kv: full_to_swa {problem} (full ids 1..6 index it); pass the pool's "
        "full_to_swa view"
    )
    assert err.value.field == "full_to_swa"


def test_read_only_mapping_is_refused() -> None:
    mapping = np.zeros(7, np.int32)
    mapping.flags.writeable = False
    with pytest.raises(InvalidArgument, match="full_to_swa is read-only"):
        SwaPair(IdPool(6, "p/kv"), IdPool(4, "p/swa"), mapping)


def test_construction_zeroes_entries_1_to_n_only() -> None:
    mapping = np.full(8, 9, dtype=np.int64)
    SwaPair(IdPool(6, "p/kv"), IdPool(4, "p/swa"), mapping)
    assert mapping.tolist() == [9, 0, 0, 0, 0, 0, 0, 9]


def test_bad_owner_and_count() -> None:
    pair, _ = make_pair()
    with pytest.raises(InvalidArgument) as err:
        pair.allocate(0, 1)
    assert err.value.message.startswith("allocate p/kv: owner must be a lease id in 1..")
    with pytest.raises(InvalidArgument, match="allocate p/kv: count must be >= 0, got -1"):
        pair.allocate(1, -1)
    with pytest.raises(InvalidArgument, match="release_swa p/kv: owner must be a lease id"):
        pair.release_swa(-4, [1])
    with pytest.raises(InvalidArgument, match="free p/kv: ids must be a 1-D array of ids"):
        pair.free(1, [[1]])  # type: ignore[list-item]

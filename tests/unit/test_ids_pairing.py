"""Pairing: leader and follower ids taken together, the shared mapping, release, reclaim."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.contract.errors import FailedPrecondition, Internal, InvalidArgument, ResourceExhausted
from kvpool.contract.plan import IdSpaceSpec
from kvpoold.ids import IdSpace, Pairing
from kvpoold.ids.faults import Reason


def kv_spec(capacity: int = 6) -> IdSpaceSpec:
    return IdSpaceSpec(
        name="kv", capacity=capacity, unit="pages", bytes_per_unit=4096, knob="budget_bytes"
    )


def swa_spec(capacity: int = 4) -> IdSpaceSpec:
    return IdSpaceSpec(
        name="swa",
        capacity=capacity,
        unit="pages",
        bytes_per_unit=1024,
        knob="swa_full_tokens_ratio",
        follows="kv",
        mapping="full_to_swa",
    )


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


class Mirror:
    """An ``on_write`` that copies written entries to a second buffer, as a device pool does."""

    def __init__(self, shared: np.ndarray) -> None:
        self.shared = shared
        self.device = np.full_like(shared, 77)
        self.calls: list[list[int]] = []

    def __call__(self, idx: np.ndarray) -> None:
        assert idx.dtype == np.intp
        self.calls.append(idx.tolist())
        self.device[idx] = self.shared[idx]


def make_pair(
    full: int = 6, swa: int = 4, *, mirror: bool = False
) -> tuple[Pairing, np.ndarray, Mirror | None]:
    """A pairing over a SGLang-shaped mapping: full + 2 entries, the last one -1."""
    mapping = np.zeros(full + 2, dtype=np.int64)
    mapping[-1] = -1
    spy = Mirror(mapping) if mirror else None
    pair = Pairing(
        IdSpace(kv_spec(full), pool="p"), IdSpace(swa_spec(swa), pool="p"), mapping, spy
    )
    return pair, mapping, spy


def state(pair: Pairing, mapping: np.ndarray) -> tuple[object, ...]:
    return (
        mapping.tolist(),
        pair.leader.holders(),
        pair.follower.holders(),
        pair.leader.free_ids().tolist(),
        pair.follower.free_ids().tolist(),
        pair.paired_of(np.arange(1, pair.leader.capacity + 1)).tolist(),
    )


def test_take_links_each_leader_id_to_a_follower_id_in_the_shared_mapping() -> None:
    pair, mapping, _ = make_pair()
    lead, follow = pair.take(1, 3)
    assert lead.tolist() == [1, 2, 3] and follow.tolist() == [1, 2, 3]
    assert lead.dtype == follow.dtype == np.int32
    assert mapping.tolist() == [0, 1, 2, 3, 0, 0, 0, -1]
    assert pair.paired_of(lead).tolist() == [1, 2, 3]
    assert pair.leader.holders() == {1: 3} and pair.follower.holders() == {1: 3}
    assert pair.take(1, 1)[1].tolist() == [4]  # the one-id path links too
    assert mapping[4] == 4
    pair.audit()


def test_count_zero_returns_empty_and_changes_nothing() -> None:
    pair, mapping, _ = make_pair()
    lead, follow = pair.take(1, 0)
    assert lead.tolist() == [] and follow.tolist() == []
    assert pair.leader.used == 0 and not mapping[1:-1].any()


def test_free_returns_both_sides_and_zeroes_the_mapping() -> None:
    pair, mapping, _ = make_pair()
    lead, _ = pair.take(1, 3)
    assert pair.free(1, lead[:2]) == 2
    assert mapping.tolist() == [0, 0, 0, 3, 0, 0, 0, -1]
    assert pair.leader.held(1) == 1 and pair.follower.held(1) == 1
    assert pair.free(1, lead[2:]) == 1  # the one-id path
    assert pair.leader.holders() == {} and pair.follower.holders() == {}
    assert not mapping[1:-1].any()
    pair.audit()


def test_release_keeps_the_leader_id() -> None:
    pair, mapping, _ = make_pair()
    lead, _ = pair.take(1, 3)
    assert pair.release(1, lead[:1]) == 1
    assert mapping[1] == 0 and pair.leader.held(1) == 3 and pair.follower.held(1) == 2
    assert pair.paired_of(lead).tolist() == [0, 2, 3]
    assert pair.free(1, lead) == 3  # frees the 3 leader and the 2 still-linked follower ids
    assert pair.follower.used == 0 and pair.leader.used == 0
    pair.audit()


def test_released_follower_id_is_reused_for_the_next_leader_id() -> None:
    pair, mapping, _ = make_pair(full=6, swa=2)
    lead, _ = pair.take(1, 2)
    with pytest.raises(ResourceExhausted, match="asked for 1 p/swa pages, 0 of 2 free"):
        pair.take(1, 1)
    pair.release(1, lead[1:])
    assert pair.room == 1
    got, follow = pair.take(2, 1)
    assert got.tolist() == [3] and follow.tolist() == [2]
    assert mapping[3] == 2
    pair.audit()


def test_reclaim_frees_both_sides_and_clears_the_mapping() -> None:
    pair, mapping, _ = make_pair()
    mine, _ = pair.take(1, 2)
    theirs, _ = pair.take(2, 2)
    pair.release(1, mine[:1])
    lead, follow = pair.reclaim(1)
    assert sorted(lead.tolist()) == [1, 2] and follow.tolist() == [2]
    assert mapping.tolist() == [0, 0, 0, 3, 4, 0, 0, -1]
    assert pair.leader.owner_of(theirs).tolist() == [2, 2]
    assert [a.tolist() for a in pair.reclaim(1)] == [[], []]
    pair.audit()


def test_scribbling_on_the_shared_mapping_cannot_free_other_ids() -> None:
    pair, mapping, _ = make_pair()
    mine, _ = pair.take(1, 1)
    pair.take(2, 1)
    mapping[mine[0]] = 2  # a client points our page at lease 2's swa page
    pair.free(1, mine)
    assert pair.follower.holders() == {2: 1}
    assert mapping[mine[0]] == 0
    pair.audit()


def test_shortage_on_either_side_takes_nothing() -> None:
    pair, mapping, _ = make_pair(full=6, swa=3)
    pair.take(1, 2)
    with pytest.raises(ResourceExhausted) as err:
        pair.take(1, 2)
    assert err.value.message == (
        "allocate p/kv: asked for 2 p/swa pages, 1 of 3 free (2 held by 1 lease); free some "
        "or Configure a larger swa_full_tokens_ratio"
    )
    assert pair.leader.used == 2 and pair.follower.used == 2
    assert pair.follower.counters().failed_allocs == 1
    assert pair.leader.counters().failed_allocs == 0
    assert mapping.tolist() == [0, 1, 2, 0, 0, 0, 0, -1]
    with pytest.raises(ResourceExhausted, match="asked for 7 p/kv pages, more than the whole"):
        pair.take(1, 7)
    assert pair.room == 1


def test_on_write_sees_every_write_of_the_shared_mapping() -> None:
    pair, mapping, spy = make_pair(mirror=True)
    assert spy is not None
    assert spy.calls == [[1, 2, 3, 4, 5, 6]]  # construction zeroes the entries
    lead, _ = pair.take(1, 3)
    pair.release(1, lead[:1])
    pair.free(1, lead[1:2])
    pair.take(2, 1)
    pair.reclaim(1)
    assert spy.calls[1:] == [[1, 2, 3], [1], [2], [2], [1, 3]]
    assert spy.device[1:-1].tolist() == mapping[1:-1].tolist()
    assert spy.device[0] == spy.device[-1] == 77  # entries outside 1..N are never touched
    pair.audit()


def test_check_and_commit_for_batches() -> None:
    pair, mapping, _ = make_pair()
    lead, _ = pair.take(1, 4)
    pair.release(1, lead[:1])
    before = state(pair, mapping)
    idx = lead.astype(np.intp)
    assert pair.check(1, idx[1:], False) is None
    assert pair.check(1, idx[1:], True) is None
    assert pair.check(1, idx, False) is None  # a free of a released leader id is fine
    fault = pair.check(1, idx, True)
    assert fault is not None and (fault.pos, fault.reason) == (0, Reason.RELEASED)
    fault = pair.check(1, idx, np.array([False, False, True, False]))
    assert fault is None
    fault = pair.check(1, idx, np.array([False, True, False, True]))
    assert fault is None
    fault = pair.check(2, idx, True)
    assert fault is not None and fault.reason is Reason.OTHER_OWNER
    assert state(pair, mapping) == before
    assert pair.commit_release(1, idx[1:2]) == 1
    assert pair.commit_free(1, idx[[0, 2]]) == 2
    assert pair.commit_free(1, idx[:0]) == 0 and pair.commit_release(1, idx[:0]) == 0
    assert mapping.tolist() == [0, 0, 0, 0, 4, 0, 0, -1]
    assert pair.leader.holders() == {1: 2} and pair.follower.holders() == {1: 1}
    pair.audit()


def test_audit_finds_broken_links() -> None:
    pair, mapping, _ = make_pair()
    pair.take(1, 2)
    mapping[1] = 3
    with pytest.raises(Internal, match="Pairing p/kv->swa broken: shared != private"):
        pair.audit()
    mapping[1] = 1
    pair._link[2] = 1
    pair._shared[2] = 1
    with pytest.raises(Internal, match="a follower id linked twice"):
        pair.audit()


def test_paired_of_checks_the_range() -> None:
    pair, _, _ = make_pair()
    with pytest.raises(InvalidArgument, match=r"owner_of p/kv ids\[1\]=7: out of range 1..6"):
        pair.paired_of(ids(1, 7))


# -- error messages -------------------------------------------------------------------------


def test_free_of_another_leases_id_names_it_and_changes_nothing() -> None:
    pair, mapping, _ = make_pair()
    pair.take(1, 2)
    pair.take(2, 1)
    before = state(pair, mapping)
    for bad in (ids(1, 3), ids(3)):
        with pytest.raises(FailedPrecondition) as err:
            pair.free(1, bad)
        pos = bad.shape[0] - 1
        assert err.value.message == (
            f"free p/kv ids[{pos}]=3: held by another lease, not by this one; nothing "
            "was freed"
        )
        assert err.value.field == f"ids[{pos}]"
        assert state(pair, mapping) == before


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        ([2, 7], InvalidArgument, "release p/swa ids[1]=7: out of range: p/kv pages are 1..6"),
        ([1, 7], FailedPrecondition, "release p/swa ids[0]=1: its swa page was already"),
        ([2, 2], InvalidArgument, "release p/swa ids[1]=2: repeated (also at ids[0])"),
        ([5], FailedPrecondition, "release p/swa ids[0]=5: not allocated"),
        ([3], FailedPrecondition, "release p/swa ids[0]=3: held by another lease, not by this one"),
        (
            [2, 1],
            FailedPrecondition,
            "release p/swa ids[1]=1: its swa page was already released; free it as kv to "
            "return the full page, release each swa page once; nothing was released",
        ),
        ([1], FailedPrecondition, "release p/swa ids[0]=1: its swa page was already released"),
    ],
)
def test_bad_release(values: list[int], error: type[Exception], message: str) -> None:
    pair, mapping, _ = make_pair()
    pair.take(1, 2)
    pair.take(2, 1)
    pair.release(1, ids(1))
    before = state(pair, mapping)
    with pytest.raises(error) as err:
        pair.release(1, ids(*values))
    assert err.value.message.startswith(message)  # type: ignore[attr-defined]
    assert err.value.field == message.split(" ", 2)[2].split("=", 1)[0]  # type: ignore[attr-defined]
    assert state(pair, mapping) == before
    pair.audit()


@pytest.mark.parametrize(
    ("mapping", "problem"),
    [
        ([0] * 7, "must be a numpy array, got list"),
        (np.zeros((7, 1), np.int64), "must be 1-D signed integers, got int64 (7, 1)"),
        (np.zeros(7, np.uint32), "must be 1-D signed integers, got uint32 (7,)"),
        (np.zeros(7, np.float64), "must be 1-D signed integers, got float64 (7,)"),
        (np.zeros(7, np.int16), "must hold int32 ids at least, got int16"),
        (np.zeros(6, np.int64), "has 6 entries, the kv space needs 7"),
    ],
)
def test_bad_mapping(mapping: object, problem: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        Pairing(IdSpace(kv_spec(), pool="p"), IdSpace(swa_spec(), pool="p"), mapping)  # type: ignore[arg-type]
    assert err.value.message == (
        f"Pairing p/kv: full_to_swa {problem} (kv ids 1..6 index it); pass the pool's "
        "full_to_swa view"
    )
    assert err.value.field == "full_to_swa"


def test_read_only_mapping_is_refused() -> None:
    mapping = np.zeros(7, np.int32)
    mapping.flags.writeable = False
    with pytest.raises(InvalidArgument, match="full_to_swa is read-only"):
        Pairing(IdSpace(kv_spec()), IdSpace(swa_spec()), mapping)


def test_construction_zeroes_entries_1_to_n_only() -> None:
    mapping = np.full(8, 9, dtype=np.int64)
    Pairing(IdSpace(kv_spec()), IdSpace(swa_spec()), mapping)
    assert mapping.tolist() == [9, 0, 0, 0, 0, 0, 0, 9]

"""``kvpoold.ids.faults.first_fault``: the first bad id of a free, found in steps that stop at
the fault (never a pass over the whole request when the fault comes early), the same answer as
the definition (a reference over the whole request), and the owner array left as it was."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpoold.ids.faults import FIRST_STEP, Fault, Reason, first_fault

SENTINEL = -1


def reference(owners: np.ndarray, owner: int, idx: np.ndarray) -> Fault | None:
    """The definition, over the whole request at once: the first position out of range, else
    repeating an earlier one, else not allocated, else held by another owner."""
    seen: dict[int, int] = {}
    capacity = owners.shape[0] - 2
    for pos, value in enumerate(int(v) for v in idx):
        if not 1 <= value <= capacity:
            return Fault(pos, Reason.OUT_OF_RANGE)
        if value in seen:
            return Fault(pos, Reason.REPEATED, first=seen[value])
        seen[value] = pos
        holder = int(owners[value])
        if holder <= 0:
            return Fault(pos, Reason.NOT_ALLOCATED)
        if holder != owner:
            return Fault(pos, Reason.OTHER_OWNER, holder=holder)
    return None


def owner_array(holders: list[int]) -> np.ndarray:
    """Owners of ids 1..N (0: free) between the two sentinel slots."""
    return np.array([SENTINEL, *holders, SENTINEL], dtype=np.int32)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(holders=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       ids=st.lists(st.integers(-2, 44), max_size=60), step=st.integers(1, 8),
       wide=st.booleans())
def test_the_first_fault_is_the_definitions(holders: list[int], ids: list[int], step: int,
                                            wide: bool) -> None:
    owners = owner_array(holders)
    before = owners.copy()
    idx = np.array(ids, dtype=np.intp if wide else np.int32)
    got = first_fault(owners, 1, idx, first_step=step, max_step=2 * step)
    assert got == reference(before, 1, idx)
    assert np.array_equal(owners, before)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(held=st.integers(1, 30), repeat_at=st.integers(1, 90), step=st.integers(1, 8))
def test_a_repeat_of_an_id_marked_steps_before_is_found(held: int, repeat_at: int,
                                                        step: int) -> None:
    """Every id held, sent once in order and one of them again later, across step borders."""
    owners = owner_array([1] * held)
    ids = list(range(1, held + 1))
    again = ids[repeat_at % held]
    idx = np.array([*ids, again, *ids], dtype=np.int32)
    fault = first_fault(owners, 1, idx, first_step=step, max_step=step)
    assert fault == Fault(held, Reason.REPEATED, first=repeat_at % held)
    assert (owners[1:-1] == 1).all()


def test_a_foreign_negative_entry_is_no_mark() -> None:
    """An owner entry below -2 that is not this call's mark (a state another part of the
    ledger may keep) is not taken for a repeat: it is an id this lease does not hold."""
    owners = owner_array([1, 1, 1])
    owners[3] = -5  # decodes to a position whose id is another
    idx = np.array([1, 2, 3], dtype=np.int32)
    assert first_fault(owners, 1, idx) == Fault(2, Reason.NOT_ALLOCATED)
    assert owners[3] == -5 and (owners[1:3] == 1).all()


def test_a_long_request_whose_first_id_is_bad_is_not_read_past_the_first_step() -> None:
    """15M ids from a lease that holds none: the answer comes from the first step (the ids past
    it are not even valid ids, and are never looked at)."""
    owners = owner_array([0] * 1024)
    idx = np.full(15_000_000, 1 << 30, dtype=np.int32)
    idx[:FIRST_STEP] = 7
    assert first_fault(owners, 1, idx) == Fault(0, Reason.NOT_ALLOCATED)
    idx[:FIRST_STEP] = np.arange(1, FIRST_STEP + 1)  # out of range from position 1024 on
    owners[1:-1] = 1
    assert first_fault(owners, 1, idx) == Fault(1024, Reason.OUT_OF_RANGE)
    assert (owners[1:-1] == 1).all()


def test_a_lease_holding_one_id_sending_it_15m_times_is_refused_at_position_1() -> None:
    owners = owner_array([0, 1, 0])
    idx = np.full(15_000_000, 2, dtype=np.int32)
    assert first_fault(owners, 1, idx) == Fault(1, Reason.REPEATED, first=0)
    assert owners[2] == 1


def test_no_fault_in_a_request_longer_than_a_step() -> None:
    n = 3 * FIRST_STEP + 5
    owners = owner_array([1] * n)
    idx = np.arange(n, 0, -1, dtype=np.int32)
    assert first_fault(owners, 1, idx) is None
    assert (owners[1:-1] == 1).all()

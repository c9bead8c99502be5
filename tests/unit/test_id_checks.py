"""``kvpool.contract.id_checks.first_bad_id``: the one rule of a refused free that the daemon's
id spaces and the client's page cache share: the first position out of range, else repeating an
earlier one, else refused by the caller's state rule; found in steps that stop at the fault."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.contract.id_checks import FIRST_STEP, BadId, Why, first_bad_id


def reference(idx: list[int], capacity: int, allowed: set[int]) -> BadId | None:
    """The definition, one position at a time over the whole request."""
    seen: dict[int, int] = {}
    for pos, value in enumerate(idx):
        if not 1 <= value <= capacity:
            return BadId(pos, Why.OUT_OF_RANGE)
        if value in seen:
            return BadId(pos, Why.REPEATED, first=seen[value])
        seen[value] = pos
        if value not in allowed:
            return BadId(pos, Why.STATE)
    return None


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(capacity=st.integers(1, 40), allowed=st.sets(st.integers(1, 40)),
       ids=st.lists(st.integers(-3, 44), max_size=80), step=st.integers(1, 8),
       dtype=st.sampled_from([np.int32, np.int64, np.uint32]))
def test_the_first_bad_id_is_the_definitions(capacity: int, allowed: set[int],
                                             ids: list[int], step: int, dtype: type) -> None:
    if dtype is np.uint32:
        ids = [i for i in ids if i >= 0]
    idx = np.array(ids, dtype=dtype)
    mask = np.zeros(capacity + 2, dtype=bool)
    mask[[a for a in allowed if a <= capacity]] = True
    calls: list[np.ndarray] = []

    def rule(v: np.ndarray) -> np.ndarray:
        calls.append(v)
        return mask[v]

    got = first_bad_id(idx, capacity, rule, first_step=step, max_step=2 * step)
    assert got == reference(ids, capacity, allowed)
    for v in calls:  # the caller's rule only ever sees in-range ids
        assert v.dtype == np.intp and ((v >= 1) & (v <= capacity)).all()


def test_an_unsigned_id_past_2_63_is_out_of_range() -> None:
    idx = np.array([1, (1 << 64) - 1], dtype=np.uint64)
    assert first_bad_id(idx, 4, lambda v: v > 0) == BadId(1, Why.OUT_OF_RANGE)


def test_a_long_request_whose_first_id_is_bad_stops_at_the_first_step() -> None:
    """15M ids, the first refused: the rule is asked of the first step's ids only."""
    idx = np.full(15_000_000, 3, dtype=np.int32)
    asked: list[int] = []

    def rule(v: np.ndarray) -> np.ndarray:
        asked.append(v.shape[0])
        return np.zeros(v.shape[0], dtype=bool)

    assert first_bad_id(idx, 10, rule) == BadId(0, Why.STATE)
    assert asked == [FIRST_STEP]


def test_a_repeat_at_the_end_of_a_long_request_is_found_across_steps() -> None:
    n = 3_000_000
    idx = np.concatenate((np.arange(1, n + 1, dtype=np.int32), np.array([17], np.int32)))
    assert first_bad_id(idx, n, lambda v: np.ones(v.shape[0], bool)) == BadId(
        n, Why.REPEATED, first=16)
    assert first_bad_id(idx[:n], n, lambda v: np.ones(v.shape[0], bool)) is None

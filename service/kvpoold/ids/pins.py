"""How many transfers move each id of one space now (its pins), made at the space's first pin."""

from __future__ import annotations

import numpy as np

from kvpool.contract.errors import Internal
from kvpoold.ids.faults import QUARANTINE


class Pins:
    """Pin counts of ids ``1..capacity``; only pools that move pages between daemons pay for
    them (the array, 4 bytes per id, is made by the first :meth:`pin`).

    Args:
        capacity: ids in the space.
        label: the space, for messages.
    """

    def __init__(self, capacity: int, label: str) -> None:
        self.capacity = capacity
        self.label = label
        self.counts: np.ndarray | None = None  # int32, N + 2 (sentinel slots never pinned)
        self.pinned = 0  # ids with a pin now

    def pin(self, idx: np.ndarray, owners: np.ndarray) -> None:
        """One more transfer moves each id of ``idx`` (intp, distinct, held).

        Args:
            idx: the ids.
            owners: the space's owner array (to refuse a free id).

        Raises:
            Internal: an id is free or out of range (the caller checks holdings first).
        """
        if not (owners.take(idx, mode="clip") > 0).all():
            raise Internal(f"pin {self.label}: an id to pin is free or out of range")
        if self.counts is None:
            self.counts = np.zeros(self.capacity + 2, dtype=np.int32)
        counts = self.counts
        before = counts[idx]
        self.pinned += int((before == 0).sum())
        counts[idx] = before + 1

    def unpin(self, idx: np.ndarray) -> np.ndarray:
        """One transfer fewer moves each id of ``idx`` (intp, distinct, pinned).

        Returns:
            The ids of ``idx`` whose last pin this was (intp).

        Raises:
            Internal: an id is not pinned (unbalanced pins: a caller bug).
        """
        counts = self.counts
        if counts is None or not counts.take(idx, mode="clip").all():
            raise Internal(f"unpin {self.label}: an id to unpin is not pinned")
        after = counts[idx] - 1
        counts[idx] = after
        done = idx[after == 0]
        self.pinned -= done.shape[0]
        return done

    def first(self, idx: np.ndarray) -> int:
        """The first position of ``idx`` (intp) whose id is pinned, or -1."""
        if self.counts is None:
            return -1
        pinned = self.counts.take(idx, mode="clip") != 0
        return int(pinned.argmax()) if pinned.any() else -1

    def of(self, idx: np.ndarray) -> np.ndarray:
        """Which of ``idx`` (intp, in range) a transfer moves now (bool per id)."""
        if self.counts is None:
            return np.zeros(idx.shape[0], dtype=bool)
        return self.counts[idx] != 0

    def audit(self, owners: np.ndarray, held: np.ndarray) -> list[tuple[bool, str]]:
        """The pins' invariants against the ledger, O(N).

        Args:
            owners: the owners of ids ``1..N``.
            held: which of ids ``1..N`` are owned.

        Returns:
            ``(ok, what)`` pairs.
        """
        counts, cap = self.counts, self.capacity
        if counts is None:
            return [(self.pinned == 0, f"{self.pinned} pinned without pins"),
                    (not bool((owners == QUARANTINE).any()), "an id is quarantined without pins")]
        mine = counts[1 : cap + 1]
        n = int((mine > 0).sum())
        return [
            (counts[0] == 0 and counts[cap + 1] == 0, "a sentinel is pinned"),
            (bool((mine >= 0).all()), "a pin count is negative"),
            (n == self.pinned, f"{n} ids pinned but pinned == {self.pinned}"),
            (not bool(((mine > 0) & ~held).any()), "a free id is pinned"),
            (not bool(((owners == QUARANTINE) & (mine == 0)).any()),
             "a quarantined id has no pin"),
        ]

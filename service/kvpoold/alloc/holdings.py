"""What one owner holds in an id space: a count, and a log of its arrays read back in O(held).

The log holds every array ``IdPool.allocate`` handed the owner since the last compaction, so it
covers every id the owner holds, plus ids freed since (the pool's owner array no longer names
the owner for those) and repeats (an id freed and handed back to the same owner). Reading it back
filters both out. ``IdPool`` compacts the log once it is longer than ``2 * held +
COMPACT_SLACK``, so a read costs O(held) and a compaction is paid for by the frees before it.
"""

from __future__ import annotations

import numpy as np

from kvpool.errors import Internal
from kvpoold.alloc.ledger import Ledger

# Log entries allowed beyond twice the held count before a compaction. A compaction costs a
# fixed ~10 µs plus ~4 ns per entry, paid every ~COMPACT_SLACK freed ids: 4096 keeps it near
# 5-10 ns per freed id, a reclaim under 2 * held + 4096 entries, and a churning owner's log (one
# small array per allocate) under ~0.5 MB.
COMPACT_SLACK = 4096


class Holding:
    """One owner's ids in one space. Plain attributes: ``IdPool`` updates them inline on its
    hot path (``held``, ``log``, ``logged``)."""

    __slots__ = ("held", "log", "logged")

    def __init__(self) -> None:
        self.held = 0
        self.log: list[np.ndarray] = []
        self.logged = 0

    def stale(self) -> bool:
        """Whether the log is long enough to compact."""
        return self.logged > 2 * self.held + COMPACT_SLACK

    def compact(self, ledger: Ledger, owners: np.ndarray, owner: int) -> None:
        """Replace the log by the live ids; O(log length)."""
        live = self.live(ledger, owners, owner)
        self.log = [live]
        self.logged = live.shape[0]

    def live(
        self, ledger: Ledger, owners: np.ndarray, owner: int, *, scan: bool = True
    ) -> np.ndarray:
        """The ids ``owner`` holds, each once, as int32; O(log length).

        Args:
            ledger: the pool's ledger (``collect`` reads the log, in C when it is built).
            owners: the pool's owner array (ids 1..N at 1..N, sentinels at 0 and N + 1).
            owner: the owner this holding belongs to.
            scan: when the log misses ids, scan the owner array instead of raising.

        Raises:
            Internal: the owner array and the held count disagree.
        """
        live = np.empty(self.held, dtype=np.int32)
        found = ledger.collect(owner, self.log, live)
        if found == self.held:
            return live
        if scan:
            # Someone wrote into an array allocate returned (the log shares it): the owner
            # array is still the truth, so scan it, O(N), this once.
            live = (np.flatnonzero(owners[1:-1] == owner) + 1).astype(np.int32)
            found = live.shape[0]
        if found != self.held:
            source = "the owner array" if scan else "its log"
            raise Internal(f"owner {owner} should hold {self.held} ids, {source} has {found}")
        return live

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

# Log entries allowed beyond twice the held count before a compaction. A compaction costs a
# fixed ~10 µs plus ~4 ns per entry, paid every ~COMPACT_SLACK freed ids: 4096 keeps it near
# 5-10 ns per freed id, a reclaim under 2 * held + 4096 entries, and a churning owner's log (one
# small array per allocate) under ~0.5 MB.
COMPACT_SLACK = 4096


class Holding:
    """One owner's ids in one space. Plain attributes: ``IdPool`` updates them inline on its
    hot path (``held``, ``log``, ``logged``)."""

    __slots__ = ("held", "log", "logged", "mark")

    def __init__(self, owner: int) -> None:
        self.held = 0
        self.log: list[np.ndarray] = []
        self.logged = 0
        # The owner as 4 int32 bytes: "all k ids held by owner" is one bytes comparison.
        self.mark = np.int32(owner).tobytes()

    def stale(self) -> bool:
        """Whether the log is long enough to compact."""
        return self.logged > 2 * self.held + COMPACT_SLACK

    def compact(self, owners: np.ndarray, owner: int) -> None:
        """Replace the log by the live ids; O(log length)."""
        live = self.live(owners, owner)
        self.log = [live.astype(np.int32)]
        self.logged = live.shape[0]

    def live(self, owners: np.ndarray, owner: int, *, scan: bool = True) -> np.ndarray:
        """The ids ``owner`` holds, each once, as intp; O(log length).

        Args:
            owners: the pool's owner array (ids 1..N at 1..N, sentinels at 0 and N + 1); it is
                written during the call and left as it was.
            owner: the owner this holding belongs to.
            scan: when the log misses ids, scan the owner array instead of raising.

        Raises:
            Internal: the owner array and the held count disagree.
        """
        logged = np.concatenate(self.log).astype(np.intp, copy=False)
        mine = logged[owners[logged] == owner]
        if mine.shape[0] == self.held:
            return mine  # every held id is logged, so exactly once each
        # An id freed and handed back to the same owner is logged twice. Keep one copy: each
        # position writes its own mark, the position whose mark survives is kept, then the
        # owner is written back.
        marks = -2 - np.arange(mine.shape[0], dtype=np.int32)
        owners[mine] = marks
        live = mine[owners[mine] == marks]
        owners[live] = owner
        if live.shape[0] != self.held and scan:
            # Someone wrote into an array allocate returned (the log shares it): the owner
            # array is still the truth, so scan it, O(N), this once.
            live = np.flatnonzero(owners[1:-1] == owner) + 1
        if live.shape[0] != self.held:
            source = "the owner array" if scan else "its log"
            raise Internal(
                f"owner {owner} should hold {self.held} ids, {source} has {live.shape[0]}"
            )
        return live

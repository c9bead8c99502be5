"""Per page of a pool: which live receive grant covers a KV page, and how many transfers are
moving each KV and SWA page, so a Free checks its ids in O(ids freed) whatever the number of
grants and sends.

Free must refuse a page a transfer is reading (a send of this daemon) or writing (a grant a
sender was accepted into), and a freed page revokes the grant covering it. Scanning the lease's
grants and sends on every Free would cost O(their pages) per call; these arrays answer both
questions with one gather of the freed ids. They exist only for pools that have had a grant or
a send (4 + 4 bytes per KV page, 4 per SWA page) and go with the pool.
"""

from __future__ import annotations

import numpy as np

from kvpool.errors import FailedPrecondition
from kvpoold.transfer.grants import ReceiveGrant


class PageMarks:
    """The marks of one pool's KV pages (ids ``1..capacity``)."""

    def __init__(self, pool: str, capacity: int, swa_capacity: int = 0) -> None:
        self.pool = pool
        self.capacity = capacity
        self.swa_capacity = swa_capacity
        # The slot of the live grant covering each page (0: none); a page is in one grant.
        self.grant = np.zeros(capacity + 1, dtype=np.int32)
        # Transfers moving each page now: sends reading it plus an accepted grant writing it.
        self.busy = np.zeros(capacity + 1, dtype=np.int32)
        # The same for SWA pages (hybrid SWA pools: a transfer moves each page's SWA pair too).
        self.swa_busy = np.zeros(swa_capacity + 1, dtype=np.int32)
        self._grants: dict[int, ReceiveGrant] = {}
        self._free_slots: list[int] = []

    def in_range(self, ids: np.ndarray, swa: bool = False) -> np.ndarray:
        """``ids`` (of the KV space, or the SWA one) without those out of range (the Free that
        carries them refuses them itself, naming the bound)."""
        return ids[(ids >= 1) & (ids <= (self.swa_capacity if swa else self.capacity))]

    # -- grants -------------------------------------------------------------------------------

    def check_ungranted(self, pages: np.ndarray, field: str) -> None:
        """Raises FailedPrecondition if a page is already in a live grant: one transfer at a
        time writes a page."""
        taken = self.grant[pages] != 0
        if taken.any():
            pos = int(taken.argmax())
            raise FailedPrecondition(
                f"{field}[{pos}]={int(pages[pos])} of pool {self.pool!r} is already in a live "
                "receive grant; a page takes one transfer at a time (wait for that grant to "
                "end, or free and allocate another page)", field=f"{field}[{pos}]")

    def add_grant(self, grant: ReceiveGrant) -> None:
        slot = self._free_slots.pop() if self._free_slots else len(self._grants) + 1
        grant.slot = slot
        self._grants[slot] = grant
        self.grant[grant.pages] = slot

    def end_grant(self, grant: ReceiveGrant) -> None:
        """The grant ended: its pages are free of it (and no longer written, if accepted)."""
        slot = grant.slot
        if not slot or self._grants.get(slot) is not grant:
            return
        del self._grants[slot]
        self._free_slots.append(slot)
        grant.slot = 0
        self.grant[grant.pages] = 0
        if grant.receiving:
            self.moving(grant.pages, grant.swa_written, -1)

    def moving(self, pages: np.ndarray, swa_pages: np.ndarray | None, delta: int) -> None:
        """A transfer of ``pages`` (and their SWA pairs) starts (+1) or ends (-1): a send
        reading them, or an accepted grant being written."""
        np.add.at(self.busy, pages, delta)
        if swa_pages is not None and swa_pages.shape[0]:
            np.add.at(self.swa_busy, swa_pages, delta)

    def grants_of(self, ids: np.ndarray) -> list[ReceiveGrant]:
        """The live grants covering any of ``ids`` (in range)."""
        slots = self.grant[ids]
        slots = slots[slots != 0]
        if not slots.shape[0]:
            return []
        return [self._grants[int(s)] for s in np.unique(slots)]

    def busy_of(self, ids: np.ndarray, swa: bool = False) -> np.ndarray:
        """The pages of ``ids`` (in range) a transfer is moving."""
        return ids[(self.swa_busy if swa else self.busy)[ids] != 0]

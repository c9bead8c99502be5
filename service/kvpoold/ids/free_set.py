"""Which free ids a space hands out next: the free-set strategies an :class:`IdSpace` composes.

A free set holds exactly the ids whose owner is 0 that may come back into use; the space's
ledger says who holds the others. :class:`StackFree` is one stack (LIFO: the most recently freed
id is handed out first, so warm pages are reused); an elastic pool's page space keeps one stack
per group instead (:class:`~kvpoold.ids.groups.GroupedFree`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvpool.contract.errors import Internal


class FreeSet(Protocol):
    """What an :class:`~kvpoold.ids.space.IdSpace` asks of its free ids.

    ``nfree`` (a plain attribute, read on every take) is how many a take may hand out now;
    ``used`` how many are off the set (held or quarantined), ``high_water`` the most ever.
    """

    nfree: int
    high_water: int

    @property
    def used(self) -> int:
        """Ids off the free set now."""
        ...

    def pop(self, count: int) -> np.ndarray:
        """Take ``count`` (``1..nfree``) ids off the free set: a new int32 array."""
        ...

    def push(self, ids: np.ndarray) -> None:
        """Put freed ``ids`` (distinct, at least one, int32 or intp) back: next handed out."""
        ...

    def push_one(self, i: int) -> None:
        """:meth:`push` of one id."""
        ...

    def free_ids(self) -> np.ndarray:
        """The ids a take may hand out, in the order it would (a new array; O(N), tests)."""
        ...

    def all_free(self) -> np.ndarray:
        """Every free id, whether it may be handed out now or not (audits)."""
        ...

    def room_note(self) -> str:
        """Said after the free count in a refusal ("" or what limits the room)."""
        ...

    def audit(self, owners: np.ndarray) -> None:
        """Check the set's own invariants against the owners of ids ``1..N``; O(N).

        Raises:
            Internal: naming the first broken invariant.
        """
        ...


class StackFree:
    """Ids ``1..capacity`` on one stack: ``stack[capacity - nfree:]`` are free, the next one
    handed out first; a free writes ids back just below, so they are the next handed out.

    Args:
        capacity: ids in the space, all free at first (handed out lowest first).
        label: the space, for messages.
    """

    __slots__ = ("capacity", "high_water", "label", "nfree", "stack")

    def __init__(self, capacity: int, label: str) -> None:
        self.capacity = capacity
        self.label = label
        self.stack = np.arange(1, capacity + 1, dtype=np.int32)
        self.nfree = capacity
        self.high_water = 0

    @property
    def used(self) -> int:
        """Ids off the stack (held or quarantined)."""
        return self.capacity - self.nfree

    def pop(self, count: int) -> np.ndarray:
        """Take ``count`` ids (``1..nfree``) off the top of the stack (a new array)."""
        head = self.capacity - self.nfree
        end = head + count
        self.nfree -= count
        if end > self.high_water:
            self.high_water = end
        return self.stack[head:end].copy()

    def push(self, ids: np.ndarray) -> None:
        """Put ``ids`` back on top."""
        head = self.capacity - self.nfree
        count = ids.shape[0]
        self.stack[head - count : head] = ids
        self.nfree += count

    def push_one(self, i: int) -> None:
        """Put id ``i`` back on top."""
        self.nfree = nfree = self.nfree + 1
        self.stack[self.capacity - nfree] = i

    def free_ids(self) -> np.ndarray:
        """The free ids, next handed out first."""
        return self.stack[self.capacity - self.nfree :].copy()

    def all_free(self) -> np.ndarray:
        """The free ids (a view)."""
        return self.stack[self.capacity - self.nfree :]

    def room_note(self) -> str:
        """Nothing limits the room but the held ids."""
        return ""

    def audit(self, owners: np.ndarray) -> None:
        """Nothing to check beyond what the space checks (its count is the stack's head).

        Raises:
            Internal: the free count is outside ``0..capacity``.
        """
        if not 0 <= self.nfree <= self.capacity:
            raise Internal(f"IdSpace {self.label} ledger broken: {self.nfree} free on the stack "
                           f"of {self.capacity}")

"""The page space of an elastic pool: an :class:`IdSpace` whose free set is
:class:`~kvpoold.ids.groups.GroupedFree` (free pages per group, and each group's state).

The ledger, pins, quarantine and audit are the space's own, unchanged; this class only composes
the grouped free set and names its group calls on the space, so the elastic manager moves a
group along the state table (see :mod:`kvpoold.ids.groups`) on the space it allocates from.
``isinstance(space, GroupedSpace)`` is the daemon's one question "is this an elastic space?".
"""

from __future__ import annotations

import numpy as np

from kvpool.contract.plan import IdSpaceSpec
from kvpoold.ids.groups import GroupedFree
from kvpoold.ids.space import IdSpace, space_label


class GroupedSpace(IdSpace):
    """Ids ``1..capacity`` of a page space cut into groups of ``pages_per_group``, every group
    closed at first.

    Args:
        spec: the plan's row of the space (capacity ``groups * pages_per_group - 1``).
        pages_per_group: pages per group.
        pool: the pool's name, for messages.

    Raises:
        InvalidArgument: a capacity outside ``1..CAPACITY_MAX``, or not whole groups less the
            padding page.
    """

    def __init__(self, spec: IdSpaceSpec, pages_per_group: int, *, pool: str = "") -> None:
        table = GroupedFree(spec.capacity, pages_per_group, space_label(spec, pool))
        super().__init__(spec, pool=pool, free_set=table)
        self.table = table
        self.pages_per_group = table.pages_per_group
        self.groups = table.groups

    @property
    def granted_pages(self) -> int:
        """Pages in granted groups (O(1)): the space's capacity as memory stands now."""
        return self.table.granted_pages

    def state(self, g: int) -> str:
        """Group ``g``'s state (see :mod:`kvpoold.ids.groups`)."""
        return self.table.state(g)

    def commit(self, g: int) -> None:
        """A closed group is granted: its memory is being committed (no page handed out)."""
        self.table.commit(g)

    def abort(self, g: int) -> None:
        """A commit failed: the group is closed again."""
        self.table.abort(g)

    def open_group(self, g: int) -> None:
        """A committed group's pages become free to hand out (lowest first)."""
        self.table.open_group(g)

    def drain(self, g: int) -> None:
        """Hand out no more pages of group ``g`` (it is being taken back)."""
        self.table.drain(g)

    def reopen(self, g: int) -> None:
        """Group ``g`` is not taken back after all: hand its free pages out again."""
        self.table.reopen(g)

    def unmap(self, g: int) -> None:
        """A drained group is wholly free: processes are asked to unmap it.

        Raises:
            Internal: it is not draining, or a page of it is held.
        """
        self.table.unmap(g)

    def release(self, g: int) -> None:
        """Every process unmapped group ``g`` (or a failed release is retried): its memory is
        being freed."""
        self.table.release(g)

    def fail(self, g: int) -> None:
        """Freeing group ``g``'s memory failed: it stays charged until a retry frees it."""
        self.table.fail(g)

    def close_group(self, g: int) -> None:
        """Group ``g``'s memory is freed: it is closed.

        Raises:
            Internal: it is not releasing, or a page of it is held.
        """
        self.table.close_group(g)

    def moving(self, g: int) -> bool:
        """Whether a worker thread is committing or freeing group ``g``'s memory now."""
        return self.table.moving(g)

    def used_in(self, g: int) -> int:
        """Pages of group ``g`` held now (0 for a closed group)."""
        return self.table.used_in(g)

    def releasable(self) -> np.ndarray:
        """Open groups with every page free, highest first (what a release takes; O(groups))."""
        return self.table.releasable()

    @property
    def num_releasable(self) -> int:
        """How many groups :meth:`releasable` would list (O(1))."""
        return self.table.num_releasable

    def closed_groups(self) -> np.ndarray:
        """Groups not granted, lowest first (what a grant opens)."""
        return self.table.closed_groups()

    def granted(self) -> np.ndarray:
        """Groups whose pages are in the ledger now, lowest first."""
        return self.table.granted()

    def in_state(self, state: str) -> np.ndarray:
        """Groups in ``state`` now, lowest first (O(groups))."""
        return self.table.in_state(state)

    def count(self, state: str) -> int:
        """Groups in ``state`` now (O(1))."""
        return self.table.count(state)

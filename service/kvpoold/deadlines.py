"""A heap of deadlines: items due at a time, popped when due in O(due · log n), never scanned.

The one deadline heap of the daemon: lease expiry (``server/leases.py``) and receive-grant
expiry and fences (``transfer/grants.py``) each keep one. An item whose deadline moved or
that ended early stays in the heap as a stale entry; its owner recognises it when it is
popped or found on top (and may compact the heap with :meth:`keep`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class DeadlineHeap(Generic[T]):
    """Items with the time they are due; ties pop in the order they were pushed."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, when: float, item: T) -> None:
        """Add ``item``, due at ``when``; O(log n)."""
        heapq.heappush(self._heap, (when, next(self._seq), item))

    def first(self) -> tuple[float, T] | None:
        """The earliest ``(when, item)``, left in the heap; None when empty. O(1)."""
        return (self._heap[0][0], self._heap[0][2]) if self._heap else None

    def pop_first(self) -> None:
        """Drop the earliest entry (a stale one its owner found on top); O(log n)."""
        heapq.heappop(self._heap)

    def pop_due(self, now: float) -> list[T]:
        """Pop every item due at or before ``now``, earliest first."""
        heap = self._heap
        due = []
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap)[2])
        return due

    def keep(self, alive: Callable[[T], bool]) -> None:
        """Drop the entries whose item is no longer ``alive``; O(n)."""
        self._heap = [e for e in self._heap if alive(e[2])]
        heapq.heapify(self._heap)

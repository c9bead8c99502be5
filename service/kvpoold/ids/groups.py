"""The free set of an elastic pool's page space: one stack per **group**, and each group's state,
so that only granted groups hand out pages and groups drain whole (issue 23).

Page ``p`` lies in group ``p // P`` (``P`` = pages per group; group 0 has ``P - 1`` pages, the
padding page 0 being nobody's). This free set is the one owner of each group's state; the
elastic manager only asks it (through :class:`~kvpoold.ids.grouped.GroupedSpace`) to move a
group along (an :class:`~kvpool.contract.errors.Internal` for any other move)::

    closed -> committing -> open -> draining -> unmapping -> releasing -> closed
                  |                    |                        |
                  +-> closed           +-> open (reopen)        +-> failed -> releasing (retry)

- **closed**: not granted (no memory behind it); none of its pages is free or held;
- **committing**: granted by the arbiter, its memory being committed off the loop; its pages
  are not in the ledger yet (a failed commit closes it again);
- **open**: granted; its free pages may be handed out;
- **draining**: granted, but its free pages are not handed out (it is being taken back; pages
  still held come back as their holders free them);
- **unmapping**: drained and wholly free; attached processes are asked to unmap it;
- **releasing**: every process unmapped it; its memory is being freed off the loop;
- **failed**: freeing its memory failed; the budget still pays for it, Stats show it, and the
  sweep retries (back to releasing).

Allocation is address-ordered first fit over open groups: a take hands out pages of the
lowest-numbered open group that has one, then the next, so held pages pack into the low groups
and the high ones empty out; a release takes the highest wholly free groups
(:meth:`GroupedFree.releasable`). Within a group, freed pages are handed out first (LIFO), as in
every space. A pop or push is O(count + groups it touches x log groups); group state changes
are O(pages per group); :meth:`GroupedFree.releasable` is O(groups), for the arbiter's rare
looks.
"""

from __future__ import annotations

import heapq

import numpy as np

from kvpool.contract.errors import Internal, InvalidArgument

CLOSED, COMMITTING, OPEN, DRAINING, UNMAPPING, RELEASING, FAILED = range(7)
STATES = ("closed", "committing", "open", "draining", "unmapping", "releasing", "failed")
# States whose pages are in the ledger (memory is behind them): "granted" groups.
_GRANTED = frozenset({OPEN, DRAINING, UNMAPPING, RELEASING, FAILED})
# States in which the group's memory is moved off the loop (a worker thread holds it).
_MOVING = frozenset({COMMITTING, RELEASING})


class GroupedFree:
    """The free pages ``1..capacity`` of a page space cut into groups of ``pages_per_group``,
    kept per group, and each group's state; every group closed at first.

    Args:
        capacity: pages in the space (``groups * pages_per_group - 1``).
        pages_per_group: pages per group.
        label: the space, for messages.

    Raises:
        InvalidArgument: a capacity that is not whole groups less the padding page.
    """

    def __init__(self, capacity: int, pages_per_group: int, label: str) -> None:
        per = pages_per_group
        if per < 1 or (capacity + 1) % per:
            raise InvalidArgument(
                f"IdSpace {label}: capacity {capacity} + the padding page is not "
                f"whole groups of {per} pages", field="capacity")
        self.label = label
        self.capacity = capacity
        self.pages_per_group = per
        self.groups = (capacity + 1) // per
        self._gstack = np.zeros((self.groups, per), dtype=np.int32)
        # Per group, as Python lists: the hot path reads and writes single entries, which
        # lists do several times faster than numpy scalars.
        self._gcount = [0] * self.groups  # free pages of each group
        self._sizes = [per] * self.groups
        self._sizes[0] = per - 1
        self._state = [CLOSED] * self.groups
        self._nstate = [0] * len(STATES)  # groups in each state (O(1) counts)
        self._nstate[CLOSED] = self.groups
        self._heap: list[int] = []  # open groups that may have a free page (lazy)
        self._in_heap = [False] * self.groups
        self.nfree = 0  # free pages of open groups: what a take may have
        self.used = 0  # pages of granted groups off their stacks (held or quarantined)
        self.high_water = 0
        self._granted = 0  # groups granted (open, draining, unmapping, releasing, failed)
        self.num_releasable = 0  # open groups with every page free (O(1) for the arbiter)
        self.granted_pages = 0  # pages in granted groups: the space's capacity as memory stands

    # -- the free set -----------------------------------------------------------------------

    def pop(self, count: int) -> np.ndarray:
        """Take ``count`` (``1..nfree``) free pages of open groups, lowest group first."""
        heap, gcount, gstack, state = self._heap, self._gcount, self._gstack, self._state
        parts: list[np.ndarray] = []
        k = count
        while k:
            g = heap[0]
            c = gcount[g]
            if state[g] != OPEN or not c:
                heapq.heappop(heap)
                self._in_heap[g] = False
                continue
            if c == self._sizes[g]:  # a wholly free group is one no longer
                self.num_releasable -= 1
            n = min(k, c)
            parts.append(gstack[g, c - n : c])
            gcount[g] = c - n
            k -= n
            if n == c:
                heapq.heappop(heap)
                self._in_heap[g] = False
        self.nfree -= count
        self.used = used = self.used + count
        if used > self.high_water:
            self.high_water = used
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def push(self, ids: np.ndarray) -> None:
        """Put freed pages back on their groups' stacks."""
        count = ids.shape[0]
        self.used -= count
        per = self.pages_per_group
        lo, hi = int(ids.min()) // per, int(ids.max()) // per
        if lo == hi:  # the common case: one request's pages of one group
            self._push_group(lo, ids)
            return
        groups = ids // per
        order = np.argsort(groups, kind="stable")
        ordered, keys = ids[order], groups[order]
        cuts = np.flatnonzero(keys[1:] != keys[:-1]) + 1
        start = 0
        for stop in (*cuts.tolist(), count):
            self._push_group(int(keys[start]), ordered[start:stop])
            start = stop

    def _push_group(self, g: int, ids: np.ndarray) -> None:
        c = self._gcount[g]
        m = ids.shape[0]
        self._gstack[g, c : c + m] = ids
        self._gcount[g] = c + m
        if self._state[g] == OPEN:
            self.nfree += m
            if c + m == self._sizes[g]:
                self.num_releasable += 1
            if not self._in_heap[g]:
                heapq.heappush(self._heap, g)
                self._in_heap[g] = True

    def push_one(self, i: int) -> None:
        """Put freed page ``i`` back on its group's stack."""
        self.used -= 1
        g = i // self.pages_per_group
        c = self._gcount[g]
        self._gstack[g, c] = i
        self._gcount[g] = c + 1
        if self._state[g] == OPEN:
            self.nfree += 1
            if c + 1 == self._sizes[g]:
                self.num_releasable += 1
            if not self._in_heap[g]:
                heapq.heappush(self._heap, g)
                self._in_heap[g] = True

    def room_note(self) -> str:
        """A refusal names the granted groups: the daemon may grant more."""
        return (f" in the {self._granted} granted groups of {self.groups} (an elastic pool: "
                "the daemon grants more groups as the device budget allows)")

    def all_free(self) -> np.ndarray:
        """The free pages of every granted group (audits)."""
        parts = [self._gstack[g, : self._gcount[g]] for g in self.granted().tolist()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def free_ids(self) -> np.ndarray:
        """The pages a take may hand out, lowest group first (O(N), for tests)."""
        parts = [self._gstack[g, : self._gcount[g]][::-1] for g in range(self.groups)
                 if self._state[g] == OPEN]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    # -- group states -----------------------------------------------------------------------

    def state(self, g: int) -> str:
        """The group's state (see the module docstring)."""
        return STATES[self._state[self._check(g)]]

    def _check(self, g: int) -> int:
        if not 0 <= g < self.groups:
            raise InvalidArgument(f"group {g} is outside 0..{self.groups - 1} of {self.label}",
                                  field="group")
        return g

    def _move(self, g: int, want: tuple[int, ...], to: int, verb: str) -> None:
        have = self._state[self._check(g)]
        if have not in want:
            raise Internal(f"{verb} group {g} of {self.label}: it is {STATES[have]}, not "
                           f"{' or '.join(STATES[w] for w in want)}")
        self._nstate[have] -= 1
        self._nstate[to] += 1
        self._state[g] = to

    def _require_whole(self, g: int, verb: str) -> None:
        if self._gcount[g] != self._sizes[g]:
            raise Internal(f"{verb} group {g} of {self.label}: "
                           f"{self._sizes[g] - self._gcount[g]} of its pages are held")

    def commit(self, g: int) -> None:
        """A closed group is granted: its memory is being committed (no page handed out)."""
        self._move(g, (CLOSED,), COMMITTING, "commit")

    def abort(self, g: int) -> None:
        """A commit failed: the group is closed again."""
        self._move(g, (COMMITTING,), CLOSED, "abort")

    def open_group(self, g: int) -> None:
        """A committed group's pages become free to hand out (lowest first)."""
        self._move(g, (COMMITTING,), OPEN, "open")
        per = self.pages_per_group
        first, last = max(1, g * per), g * per + per - 1
        n = last - first + 1
        self._gstack[g, :n] = np.arange(last, first - 1, -1, dtype=np.int32)
        self._gcount[g] = n
        self._granted += 1
        self.granted_pages += n
        self.nfree += n
        self.num_releasable += 1
        if not self._in_heap[g]:
            heapq.heappush(self._heap, g)
            self._in_heap[g] = True

    def drain(self, g: int) -> None:
        """Hand out no more pages of group ``g`` (it is being taken back)."""
        self._move(g, (OPEN,), DRAINING, "drain")
        self.nfree -= self._gcount[g]
        if self._gcount[g] == self._sizes[g]:
            self.num_releasable -= 1

    def reopen(self, g: int) -> None:
        """Group ``g`` is not taken back after all: hand its free pages out again."""
        self._move(g, (DRAINING,), OPEN, "reopen")
        self.nfree += self._gcount[g]
        if self._gcount[g] == self._sizes[g]:
            self.num_releasable += 1
        if not self._in_heap[g]:
            heapq.heappush(self._heap, g)
            self._in_heap[g] = True

    def unmap(self, g: int) -> None:
        """A drained group is wholly free: processes are asked to unmap it.

        Raises:
            Internal: it is not draining, or a page of it is held.
        """
        self._require_whole(g, "unmap")
        self._move(g, (DRAINING,), UNMAPPING, "unmap")

    def release(self, g: int) -> None:
        """Every process unmapped group ``g`` (or a failed release is retried): its memory is
        being freed."""
        self._move(g, (UNMAPPING, FAILED), RELEASING, "release")

    def fail(self, g: int) -> None:
        """Freeing group ``g``'s memory failed: it stays charged until a retry frees it."""
        self._move(g, (RELEASING,), FAILED, "fail")

    def close_group(self, g: int) -> None:
        """Group ``g``'s memory is freed: it is closed.

        Raises:
            Internal: it is not releasing.
        """
        self._require_whole(g, "close")
        self._move(g, (RELEASING,), CLOSED, "close")
        self._gcount[g] = 0
        self._granted -= 1
        self.granted_pages -= self._sizes[g]

    def moving(self, g: int) -> bool:
        """Whether a worker thread is committing or freeing group ``g``'s memory now."""
        return self._state[self._check(g)] in _MOVING

    def used_in(self, g: int) -> int:
        """Pages of group ``g`` held now (0 for a closed group)."""
        if self._state[self._check(g)] not in _GRANTED:
            return 0
        return self._sizes[g] - self._gcount[g]

    def releasable(self) -> np.ndarray:
        """Open groups with every page free, highest first (what a release takes)."""
        state, gcount, sizes = self._state, self._gcount, self._sizes
        return np.array([g for g in range(self.groups - 1, -1, -1)
                         if state[g] == OPEN and gcount[g] == sizes[g]], dtype=np.intp)

    def closed_groups(self) -> np.ndarray:
        """Groups not granted, lowest first (what a grant opens)."""
        return self.in_state("closed")

    def granted(self) -> np.ndarray:
        """Groups whose pages are in the ledger now (open, draining, unmapping, releasing or
        failed), lowest first."""
        return np.array([g for g, st in enumerate(self._state) if st in _GRANTED],
                        dtype=np.intp)

    def in_state(self, state: str) -> np.ndarray:
        """Groups in ``state`` now, lowest first (O(groups))."""
        want = STATES.index(state)
        return np.array([g for g, st in enumerate(self._state) if st == want], dtype=np.intp)

    def count(self, state: str) -> int:
        """Groups in ``state`` now (O(1))."""
        return self._nstate[STATES.index(state)]

    def audit(self, owners: np.ndarray) -> None:
        """The groups' invariants: closed groups hold nothing, every page of a granted group is
        free in it or held, the counts are what the groups have; O(N).

        Args:
            owners: the owners of pages ``1..capacity``.

        Raises:
            Internal: naming the first broken invariant.
        """
        per = self.pages_per_group
        held_per = np.bincount((np.flatnonzero(owners != 0) + 1) // per, minlength=self.groups)
        checks: list[tuple[bool, str]] = []
        for g in range(self.groups):
            c, size, st = self._gcount[g], self._sizes[g], self._state[g]
            free = self._gstack[g, :c]
            if st in (CLOSED, COMMITTING):
                checks.append((c == 0 and held_per[g] == 0,
                               f"{STATES[st]} group {g} holds pages"))
            else:
                checks.append((c + held_per[g] == size,
                               f"group {g}: {c} free + {held_per[g]} held != {size}"))
                checks.append((bool(((free // per) == g).all()),
                               f"group {g}'s free stack holds another group's page"))
        granted = [g for g in range(self.groups) if self._state[g] in _GRANTED]
        checks.append((self._granted == len(granted), "granted count"))
        checks.append((self.num_releasable == len(self.releasable()), "releasable count"))
        checks.append((self._nstate == [self._state.count(i) for i in range(len(STATES))],
                       "state counts"))
        for g, st in enumerate(self._state):
            if st in (COMMITTING, UNMAPPING, RELEASING, FAILED):
                checks.append((held_per[g] == 0 and self._gcount[g] in (0, self._sizes[g]),
                               f"{STATES[st]} group {g} holds pages"))
        checks.append((self.granted_pages == sum(self._sizes[g] for g in granted),
                       "granted pages"))
        nfree = sum(self._gcount[g] for g in range(self.groups) if self._state[g] == OPEN)
        checks.append((nfree == self.nfree, f"free count {self.nfree} != {nfree}"))
        used = self.granted_pages - sum(self._gcount[g] for g in granted)
        checks.append((used == self.used, f"used count {self.used} != {used}"))
        for ok, what in checks:
            if not ok:
                raise Internal(f"IdSpace {self.label} groups broken: {what}")

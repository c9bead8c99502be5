"""The page cache's ring: which ids are cached, which are handed out, and the checks of a free.

No I/O, no policy, no locking: :class:`IdRing` is the data structure under both page caches;
:class:`~kvpool.cache.policy.PageCacheCore` holds one and decides when to refill and return.
Ids move between three places here: cached (in the ring), handed out (``n_in_use``), and taken
out by an ``alloc`` waiting on the daemon (``reserved``).

Layout: the cached ids sit in a ring, at absolute slots ``head..tail - 1`` (slot ``s`` is
``ring[s % capacity]``); ``take`` hands out from ``head``, ``free_ids`` and ``push`` append at
``tail``. ``pos[id]`` is the slot an id was last cached at, less ``base``, so an id is in use
exactly when ``pos[id] < head - base``: ``take`` hands ids out by moving ``head`` past them and
writes nothing per id (its cost is the floor's: one slice copied). Ids not here (never fetched,
returned, reserved, out of range) have ``pos`` = ``not_here`` (the dtype's largest value), never
below; ids handed out by a miss, or in use when ``base`` moved, have ``by_miss`` (its smallest).
Before relative slots outgrow the dtype, ``rebase`` moves ``base`` up to ``head`` (O(capacity),
once per 2**30 slots: a billion ids cached).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.contract.errors import FailedPrecondition, InvalidArgument, KVPoolError
from kvpool.contract.id_checks import Why, first_bad_id
from kvpool.contract.limits import ID_DTYPE

try:  # numpy's C function itself: ``np.count_nonzero`` wraps it in Python (~0.2 us a call)
    from numpy._core.multiarray import count_nonzero
except ImportError:  # pragma: no cover - another numpy layout
    count_nonzero = np.count_nonzero
INTP = np.dtype(np.intp)
# ``pos`` of an id not in this ring: above any slot ``head`` reaches.
# ``pos`` holds int32 slot numbers relative to ``base`` (int64 for a space of more than 2**28
# ids): half the memory the checks of a ``free`` touch per id.
SMALL_SPACE = 1 << 28
REBASE_CHUNK = 1 << 20
SLOT_WINDOW = 4096  # slot numbers kept ready for ``free`` (32 KiB, shifted every 4,096)


class IdRing:
    """The cached and handed-out ids of one id space ``1..capacity``; see the module docstring.

    Args:
        label: ``pool/space``, for error messages.
        capacity: ids ``1..capacity``.
        window: slot numbers kept ready for ``free_ids``.
        rebase_at: relative slot at which ``base`` moves up (tests set it low).
    """

    def __init__(self, label: str, capacity: int, window: int = SLOT_WINDOW,
                 rebase_at: int | None = None) -> None:
        self.label = label
        self.capacity = capacity
        self.ring = np.empty(capacity, dtype=ID_DTYPE)  # 4 B per id: handed out as is
        self.head = 0
        self.tail = 0
        dtype = np.dtype(np.int32 if capacity <= SMALL_SPACE else np.int64)
        info = np.iinfo(dtype)
        self.not_here = int(info.max)
        self.by_miss = int(info.min)
        self.rebase_at = int(info.max) // 2 if rebase_at is None else rebase_at
        self.base = 0
        # 4 B per id: ids 1..capacity; 0 and capacity + 1 are sentinels, always not_here, so
        # ``take(ids, mode="clip")`` checks range and state in one pass.
        self.pos = np.full(capacity + 2, self.not_here, dtype=dtype)
        self.ramp = np.arange(window, dtype=dtype)
        self.window_base = 0  # absolute slot of window[0]
        self.window = self.ramp.copy()
        self.n_in_use = 0
        self.reserved = 0

    @property
    def cached(self) -> int:
        return self.tail - self.head

    # -- the ring -----------------------------------------------------------------------------

    def read(self, start: int, k: int) -> np.ndarray:
        """A copy of the ids at slots ``start..start + k - 1`` (int32)."""
        size = self.capacity
        i = start % size
        j = i + k
        if j <= size:
            return self.ring[i:j].copy()
        return np.concatenate((self.ring[i:], self.ring[:j - size]))

    def write(self, start: int, ids: np.ndarray) -> None:
        """Put ``ids`` at slots ``start..``; the caller sets their ``pos``."""
        size = self.capacity
        i = start % size
        j = i + ids.shape[0]
        if j <= size:
            self.ring[i:j] = ids
        else:
            self.ring[i:] = ids[:size - i]
            self.ring[:j - size] = ids[size - i:]

    def uncache(self, ids: np.ndarray) -> None:
        """Ids taken out of the ring other than by ``alloc``: not here any more."""
        self.pos[ids] = self.not_here

    def slots(self, start: int, n: int) -> np.ndarray:
        """Slots ``start .. start + n - 1`` as stored in ``pos`` (less ``base``), to use at
        once: a view of a window of them, refilled in place when ``start`` leaves it (no
        allocation, no fresh memory to fault in, per ``free``)."""
        if start + n - self.base > self.rebase_at:
            self.rebase()
        window = self.window
        i = start - self.window_base
        if i >= 0 and i + n <= window.shape[0]:
            return window[i:i + n]
        first = start - self.base
        if n > window.shape[0]:
            return np.arange(first, first + n, dtype=self.pos.dtype)
        np.add(self.ramp, first, out=window)
        self.window_base = start
        return window[:n]

    def rebase(self) -> None:
        """Move ``base`` up to ``head``: cached ids keep their slots (relative to the new
        base), ids in use become ``by_miss``; O(capacity)."""
        shift = self.head - self.base
        pos = self.pos
        for lo in range(0, pos.shape[0], REBASE_CHUNK):  # bounded temporaries
            part = pos[lo:lo + REBASE_CHUNK]
            in_use = part < shift
            np.subtract(part, shift, out=part, where=part != self.not_here)
            part[in_use] = self.by_miss
        self.base = self.head
        self.window_base = -(self.window.shape[0] + 1)  # refilled at the next ``slots``

    # -- alloc --------------------------------------------------------------------------------

    def take(self, n: int) -> np.ndarray | None:
        """``n`` ids from ``head`` (the longest cached first), handed out; None when fewer are
        cached. Nothing is written per id: moving ``head`` past them marks them in use."""
        head = self.head
        if self.tail - head < n:
            return None
        self.head = head + n
        self.n_in_use += n
        i = head % self.capacity
        j = i + n
        if j <= self.capacity:
            return self.ring[i:j].copy()  # the copy handed out
        return self.read(head, n)

    def cached_ids(self) -> np.ndarray:
        """A copy of the cached ids, oldest first; O(cached)."""
        return self.read(self.head, self.tail - self.head)

    def take_newest(self, k: int) -> np.ndarray:
        """Take the ``k`` most recently cached ids out of the ring (a return to the daemon:
        the oldest stay, to be handed out next)."""
        self.tail -= k
        ids = self.read(self.tail, k)
        self.uncache(ids)
        return ids

    def take_highest(self, k: int) -> np.ndarray:
        """Take the ``k`` highest cached ids out of the ring (all of them when fewer are
        cached), keeping the others in their order; O(cached). What a give-back returns: in an
        elastic pool the daemon takes back the highest groups (allocation packs low), so the
        highest ids are the ones whose return can empty a group."""
        n = self.tail - self.head
        k = min(k, n)
        if k <= 0:
            return np.zeros(0, dtype=ID_DTYPE)
        ids = self.read(self.head, n)
        if k == n:
            out, keep = ids, ids[:0]
        else:
            cut = np.partition(ids, n - k)[n - k]  # the k-th highest (ids are distinct)
            taken = ids >= cut
            out, keep = ids[taken], ids[~taken]
        self.uncache(out)
        self.tail = self.head
        if keep.shape[0]:
            self.push(keep)
        return out

    def reserve(self, n: int) -> np.ndarray:
        """An ``alloc`` of ``n`` the ring cannot serve: take what it has (all of it) while the
        rest is asked of the daemon."""
        k = min(self.cached, n)
        ids = self.read(self.head, k)
        self.head += k
        self.uncache(ids)
        self.reserved += k
        return ids

    def unreserve(self, ids: np.ndarray) -> None:
        """The daemon refused: the reserved ids go back into the ring."""
        self.push(ids)
        self.reserved -= ids.shape[0]

    def hand_out(self, reserved: np.ndarray, got: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` ids of a missing ``alloc``: the reserved ones and the first of ``got``
        (fresh from the daemon), handed out; the rest of ``got`` goes into the ring."""
        need = n - reserved.shape[0]
        ids = np.concatenate((reserved, got[:need])).astype(ID_DTYPE, copy=False)
        self.push(got[need:])
        self.reserved -= reserved.shape[0]
        self.pos[ids] = self.by_miss
        self.n_in_use += n
        return ids

    def push(self, ids: np.ndarray) -> None:
        """Ids held by the lease, not in use, into the ring at ``tail``."""
        k = ids.shape[0]
        tail = self.tail
        self.write(tail, ids)
        self.pos[ids] = self.slots(tail, k)
        self.tail = tail + k

    # -- free ---------------------------------------------------------------------------------

    def unmark_few(self, arr: np.ndarray) -> np.ndarray:
        """``free_ids`` of anything but a 1-D integer array of 2 or more ids: 0 or 1 id (the
        one given the next slot), or a refusal.

        Raises:
            InvalidArgument: not a 1-D integer array, or the id out of range.
            FailedPrecondition: the id not handed out by this cache (or already freed).
        """
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            if arr.ndim == 1 and arr.size == 0:
                return arr.astype(ID_DTYPE)
            raise InvalidArgument(f"ids must be a 1-D array of integer ids, got {arr.dtype} "
                                  f"{arr.shape}", field="ids")
        if arr.shape[0] == 1:
            value = arr[0]
            if not (0 < value <= self.capacity and self.pos[value] < self.head - self.base):
                raise self.free_error(arr)
            self.pos[value] = self.slots(self.tail, 1)[0]
        return arr

    def in_use_of(self, ids: Any) -> np.ndarray:
        """Per id: handed out by this cache and not freed (False for an id out of range)."""
        ids = np.asarray(ids).astype(np.intp)
        return self.pos.take(ids, mode="clip") < self.head - self.base

    def handed_out(self) -> np.ndarray:
        """Every id handed out and not freed, ascending (int32); O(capacity)."""
        in_use = self.pos[1:self.capacity + 1] < self.head - self.base
        return (np.flatnonzero(in_use) + 1).astype(ID_DTYPE)

    def free_ids(self, ids: Any, keep: bool) -> np.ndarray:
        """Take back ids handed out, in O(len(ids)): every id must be in use and listed once;
        on a refusal nothing changes. With ``keep`` they go into the ring at ``tail``
        (cached); without, they are forgotten (the owner gives them back to the daemon).

        Returns:
            The ids, as an integer array.

        Raises:
            InvalidArgument: not a 1-D integer array, or the first id out of range or repeated.
            FailedPrecondition: the first id not handed out by this ring (or already freed).
        """
        # One function, few numpy calls: each costs microseconds on a cold path (after the
        # engine's forward pass), and so does each Python call.
        arr = ids if type(ids) is np.ndarray else np.asarray(ids)
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.shape[0] < 2:
            arr = self.unmark_few(arr)
        else:
            n = arr.shape[0]
            if self.tail + n - self.base > self.rebase_at:
                self.rebase()  # first: ``was`` below must be relative to the base it uses
            # One conversion for the three fancy ops (an int32 index costs ~0.5 us more in
            # each); a uint64 id past 2**63 becomes negative: clipped to the sentinel 0.
            idx = arr if arr.dtype is INTP else arr.astype(np.intp)
            pos = self.pos
            tail = self.tail
            was = pos.take(idx, mode="clip")  # out of range: a sentinel, not_here
            # Every id in use: the largest slot is behind ``head`` (``argmax`` is a plain C
            # loop, ~1 us less than ``max``).
            if n > self.capacity or was[was.argmax()] >= self.head - self.base:
                raise self.free_error(arr)
            i = tail - self.window_base
            if i >= 0 and i + n <= self.window.shape[0]:
                slots = self.window[i:i + n]
            else:
                slots = self.slots(tail, n)
            # Each id listed once: each reads back the slot it was given (an id listed twice
            # reads back the same slot at both places, so one of them differs).
            pos[idx] = slots
            if count_nonzero(pos[idx] != slots):
                pos[idx] = was  # back as it was
                raise self.free_error(arr)
        n = arr.shape[0]
        self.n_in_use -= n
        if not keep:
            self.uncache(arr)
            return arr
        tail = self.tail
        i = tail % self.capacity
        if i + n <= self.capacity:
            self.ring[i:i + n] = arr
        else:
            self.write(tail, arr)
        self.tail = tail + n
        return arr

    def free_error(self, arr: np.ndarray) -> KVPoolError:
        """The error for the first bad id of ``arr`` (the refusal path; the daemon's rules and
        steps, ``first_bad_id``: O(position of the bad id))."""
        rel = self.head - self.base
        pos = self.pos
        bad = first_bad_id(arr, self.capacity, lambda ids: pos[ids] < rel)
        if bad is None:
            return InvalidArgument(f"free {self.label}: refused but no bad id found",
                                   field="ids")
        where = f"ids[{bad.pos}]"
        head = f"free {self.label} {where}={int(arr[bad.pos])}"
        if bad.why is Why.OUT_OF_RANGE:
            return InvalidArgument(f"{head}: out of range: {self.label} ids are "
                                   f"1..{self.capacity}; nothing was freed", field=where)
        if bad.why is Why.REPEATED:
            return InvalidArgument(f"{head}: repeated (also at ids[{bad.first}]); list each id "
                                   "once; nothing was freed", field=where)
        return FailedPrecondition(f"{head}: not in use in this page cache (never handed out by "
                                  "it, or already freed: a double free?); nothing was freed",
                                  field=where)

    def adopt(self, ids: np.ndarray) -> None:
        """Count ids the lease came to hold outside this ring (an adoption of sealed pages) as
        handed out: in use from now on, freed like any other. O(len(ids)).

        Raises:
            InvalidArgument: an id out of range or repeated. FailedPrecondition: an id already
                cached or in use here. Nothing is changed.
        """
        arr = np.asarray(ids).astype(np.intp)
        if not arr.shape[0]:
            return
        if arr.ndim != 1 or int(arr.min()) < 1 or int(arr.max()) > self.capacity:
            raise InvalidArgument(f"adopt {self.label}: ids must be 1..{self.capacity}",
                                  field="ids")
        if np.unique(arr).shape[0] != arr.shape[0]:
            raise InvalidArgument(f"adopt {self.label}: an id is repeated", field="ids")
        if (self.pos[arr] != self.not_here).any():
            raise FailedPrecondition(f"adopt {self.label}: an id is already cached or in use "
                                     "in this page cache; nothing was adopted", field="ids")
        self.pos[arr] = self.by_miss
        self.n_in_use += arr.shape[0]

    def unforget(self, arr: np.ndarray) -> None:
        """Undo a ``free_ids`` without ``keep``: the daemon refused the Free."""
        self.pos[arr] = self.by_miss
        self.n_in_use += arr.shape[0]


    # -- end ----------------------------------------------------------------------------------

    def drain(self) -> np.ndarray:
        """Every cached id, taken out of the ring (``close``)."""
        ids = self.read(self.head, self.cached)
        self.head = self.tail
        self.uncache(ids)
        return ids

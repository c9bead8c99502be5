"""A client-side page cache: ``alloc``/``free`` of one id space in microseconds, no gRPC call.

An engine scheduler allocates and frees KV pages every step; one Allocate or Free costs about
0.4-1 ms over gRPC. A :class:`PageCache` keeps a queue of ids that its lease already holds in
the daemon and serves ``alloc``/``free`` from it:

    with client.lease("engine-0", ttl_s=10) as lease, lease.page_cache("llama") as cache:
        pages = cache.alloc(16)        # int32 ids, from the local queue
        cache.free(pages[:4])          # back into the queue, checked first

Every id in the cache is held by the lease, so a crash returns them all when the lease expires
(TTL + at most 0.2 s), exactly as for ids allocated one call at a time.

Watermarks (pages; per cache):

- ``low``: when an ``alloc`` leaves fewer than ``low`` ids cached, a background worker tops the
  cache up to ``high`` with one Allocate, so the engine rarely waits.
- ``high``: when a ``free`` leaves more than ``high`` cached, the worker returns ids to the
  daemon with one Free, down to ``max(low, high - batch)`` (so each return moves more than
  ``batch`` ids instead of one Free per few frees at the mark). In the background: ``free``
  stays local; until the worker runs the ids are still this lease's.
- ``batch``: an ``alloc`` that the cache cannot serve calls Allocate itself (``waits`` counts
  it) for ``max(n - cached, batch)`` ids: its own plus a refill; if the daemon cannot give that
  many it asks for exactly ``n - cached``, and if that is refused too it raises the daemon's
  ``ResourceExhausted`` with the cache as it was.

Checks: ``free`` refuses, naming the first bad id and its position (``ids[3]``) and changing
nothing, an id out of the space's range or repeated in the call (``InvalidArgument``) and an id
this cache has not handed out or that was already freed (``FailedPrecondition``), the daemon's
classes for the same faults. O(count): per id of the space the cache keeps the slot it was last
queued at (4 bytes), and an id is in use exactly when that slot is behind the queue's head.

Ids freed behind its back (``lease.free`` of its ids, misuse): every Allocate and Free the
cache makes answers what the lease holds of the space; fewer than the cache counts, with no
other RPC of the cache in flight, and the worker checks which of its ids the lease still holds
(one Free with ``check``) and drops the others (``dropped_unheld``): cached ones at once, ones
in use when they are freed. See docs/api.md, "Page cache".

Order: ``alloc`` hands out the ids cached longest first (FIFO): it takes a slice from the head
of a ring and writes nothing per id, so it costs what an in-process free list costs;
``free`` and refills append at the tail, returns to the daemon take the newest from the tail.

Spaces: any id space that no other space follows and that follows none (``kv`` of MHA, MLA,
DSA and hybrid linear pools; ``req``, ``state``, ``c4_state``, ``c128_state``). Paired pages
(``kv`` of hybrid SWA and DeepSeek-V4 pools, which ``swa`` follows, and ``swa``) are refused for
now: a page's ``swa`` side is released through the daemon as the window slides (``Free`` of
``swa``), so a cached pair can go stale; see docs/api.md, "Page cache".

Locking (the sync cache): one lock guards the ring, the slots and the counters; ``alloc`` and
``free`` hold it for a few numpy operations. No RPC is ever made with it held: the worker and
a missing ``alloc`` take ids out of the ring under the lock, call the daemon unlocked, and put
the result back under the lock. The lock is innermost (nothing else is acquired under it but
the worker's ``threading.Event``); the lease's keep-alive thread takes it briefly, holding
nothing else, to read the counts it reports and to pass on a give-back (docs/api.md, "Page
cache", pressure).
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvpool.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVPoolError,
    NotFound,
    ResourceExhausted,
    error_from_code,
    lease_closed,
)
from kvpool.contract.id_checks import Why, first_bad_id
from kvpool.contract.limits import ID_DTYPE

if TYPE_CHECKING:
    from kvpool.contract.records import Stats


class Lease(Protocol):
    """What a page cache needs of its lease (``kvpool.clients.client.Lease`` is one): the
    cache depends on this, not on the clients, which depend on the cache."""

    lease_id: int
    client: Any  # its ``stats(pool)`` sizes the cache

    @property
    def closed(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    def free(self, pool: str, space: str, ids: Any) -> int: ...

    def allocate_swa_pairs(self, pool: str, count: int) -> tuple[np.ndarray, np.ndarray]: ...

    def report_now(self, timeout_s: float = ...) -> bool: ...

    def _allocate_held(self, pool: str, space: str, count: int
                       ) -> tuple[np.ndarray, int | None]: ...

    def _free_held(self, pool: str, space: str, ids: Any) -> tuple[int, int | None]: ...

    def _check_held(self, pool: str, space: str, ids: Any) -> tuple[np.ndarray, int | None]: ...

    def _register_cache(self, cache: Any) -> None: ...

    def _unregister_cache(self, cache: Any) -> None: ...

log = logging.getLogger("kvpool.cache.page_cache")
try:  # numpy's C function itself: ``np.count_nonzero`` wraps it in Python (~0.2 us a call)
    from numpy._core.multiarray import count_nonzero
except ImportError:  # pragma: no cover - another numpy layout
    count_nonzero = np.count_nonzero
INTP = np.dtype(np.intp)
# ``pos`` of an id not in this cache (see PageCacheCore): above any slot ``head`` reaches.
# ``pos`` holds int32 slot numbers relative to ``base`` (int64 for a space of more than 2**28
# ids): half the memory the checks of a ``free`` touch per id.
SMALL_SPACE = 1 << 28
REBASE_CHUNK = 1 << 20
SLOT_WINDOW = 4096  # slot numbers kept ready for ``free`` (32 KiB, shifted every 4,096)


def no_worker() -> None:
    """``PageCacheCore.wake`` until its owner sets its own."""


# Defaults, clamped for small spaces (see ``watermarks``).
DEFAULT_LOW = 64
DEFAULT_HIGH = 512
DEFAULT_BATCH = 128
# After a refill or return the daemon refused (other than ResourceExhausted with room to ask
# for less), the worker waits RETRY_S before trying that again, twice that after a second
# refusal in a row, and so on up to RETRY_MAX_S; a success resets it. Refills and returns back
# off apart: a pool with no room to refill from never holds a return back.
RETRY_S = 0.1
RETRY_MAX_S = 1.6
# How often an idle worker looks whether its lease was closed (it then ends).
LEASE_POLL_S = 1.0

# After giving ids back at the daemon's request, the worker does not refill for this long (an
# ``alloc`` the cache cannot serve still calls Allocate), so the ids reach the lease that ran
# short instead of coming straight back.
GIVE_BACK_HOLD_S = 0.5

REFILL = "refill"
RETURN = "return"
GIVE_BACK = "give_back"
CHECK = "check"  # which of the cache's ids its lease still holds (a Free with ``check``)
# The lease's call that does each job, ``(pool, space, arg)`` its arguments; both caches'
# workers dispatch through this one table.
JOB_CALLS = {REFILL: "_allocate_held", CHECK: "_check_held", RETURN: "_free_held",
             GIVE_BACK: "_free_held"}


class Backoff:
    """When the worker may next try one kind of job (refills, or returns) after the daemon
    refused it, and in which ``settle`` round it was last refused."""

    __slots__ = ("at", "refused_in", "wait_s")

    def __init__(self) -> None:
        self.at = 0.0  # no attempt before this (time.monotonic)
        self.wait_s = RETRY_S
        self.refused_in = -1  # ``PageCacheCore.settle_round`` of the last refusal; -1: none

    def refused(self, settle_round: int) -> None:
        """A refusal the worker retries at once (a refill asking for less)."""
        self.refused_in = settle_round

    def wait(self, now: float, settle_round: int) -> None:
        """A refusal the worker retries after ``wait_s`` (doubled for the next one)."""
        self.refused_in = settle_round
        self.at = now + self.wait_s
        self.wait_s = min(RETRY_MAX_S, self.wait_s * 2)

    def succeeded(self) -> None:
        self.at = 0.0
        self.wait_s = RETRY_S
        self.refused_in = -1


@dataclass(frozen=True)
class PageCacheCounters:
    """A consistent snapshot of a cache's counters.

    Attributes:
        in_use: ids handed out by ``alloc`` and not freed.
        cached: ids cached: held by the lease, not handed out.
        refills: Allocate calls that succeeded (background refills and ``alloc`` misses).
        returns: Free calls of the worker that succeeded (cached ids above ``high``).
        rpc_calls: Allocate and Free calls made, refused ones included (not the Stats call
            made when the cache is opened).
        waits: ``alloc`` calls that had to wait on an Allocate (misses), refused ones included.
        fetched: ids received from the daemon, in all.
        returned: ids given back to the daemon by the worker, in all (not by ``close``).
        gave_back: of ``returned``, ids given back because the daemon asked (another lease's
            Allocate ran short; see docs/api.md, "Page cache", pressure).
        checks: checks made of which of its ids the lease still holds (each one Free with
            ``check``, in ``rpc_calls``): after a reply said the lease holds fewer ids than the
            cache counts.
        dropped_unheld: ids a check found the lease no longer held (freed behind the cache's
            back, with ``lease.free``): dropped from the cache, never handed out again (one in
            use is dropped when it is freed).
    """

    in_use: int
    cached: int
    refills: int
    returns: int
    rpc_calls: int
    waits: int
    fetched: int
    returned: int
    gave_back: int = 0
    checks: int = 0
    dropped_unheld: int = 0


def space_capacity(stats: Stats, pool: str, space: str) -> int:
    """The capacity of ``pool``'s id space ``space``, if a page cache can serve it.

    Args:
        stats: the daemon's Stats for ``pool``.
        pool: the pool's name.
        space: the id space.

    Returns:
        The capacity (ids ``1..capacity``).

    Raises:
        NotFound: no such pool. InvalidArgument: no such space, a following space (``swa``),
        or a space another follows (``kv`` of a hybrid SWA pool).
    """
    try:
        spaces = stats.pool(pool).spaces
    except KeyError:
        raise NotFound(f"no pool {pool!r}", field="pool") from None
    info = spaces.get(space)
    if info is None:
        raise InvalidArgument(f"pool {pool!r} has no id space {space!r} (it has: "
                              f"{', '.join(spaces)})", field="space")
    if info.follows:
        raise InvalidArgument(
            f"{pool}/{space} follows {info.follows!r}: its ids come paired with "
            f"{info.follows} ids and cannot be cached by themselves", field="space")
    followers = [name for name, s in spaces.items() if s.follows == space]
    if followers:
        raise InvalidArgument(
            f"{pool}/{space} is paired with {'/'.join(followers)}: each {space} id comes with "
            f"a {followers[0]} id, and the page cache does not serve paired pages yet; use "
            "lease.allocate_swa_pairs and lease.free", field="space")
    return info.capacity


def watermarks(capacity: int, low: int | None, high: int | None,
               batch: int | None) -> tuple[int, int, int]:
    """``(low, high, batch)``: the given values checked, the defaults filled in.

    Defaults: ``high`` = min(512, capacity // 4) (a cache keeps at most a quarter of a small
    pool), ``low`` = min(64, high // 8), ``batch`` = min(128, high // 4), each at least 1
    (``low`` at least 0).

    Raises:
        InvalidArgument: not ``0 <= low <= high <= capacity`` or not ``1 <= batch <= high``.
    """
    hi = max(1, min(DEFAULT_HIGH, capacity // 4)) if high is None else as_int(high, "high")
    if not 1 <= hi <= capacity:
        raise InvalidArgument(f"high={hi}: the high watermark must be 1..{capacity} (the "
                              "space's capacity)", field="high")
    lo = min(DEFAULT_LOW, hi // 8) if low is None else as_int(low, "low")
    if not 0 <= lo <= hi:
        raise InvalidArgument(f"low={lo}: the low watermark must be 0..high ({hi})",
                              field="low")
    ba = max(1, min(DEFAULT_BATCH, hi // 4)) if batch is None else as_int(batch, "batch")
    if not 1 <= ba <= hi:
        raise InvalidArgument(f"batch={ba}: must be 1..high ({hi})", field="batch")
    return lo, hi, ba


def as_int(value: Any, field: str) -> int:
    """``value`` as an int (any integer type).

    Raises:
        InvalidArgument: not an integer.
    """
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{field}={value!r}: must be an integer", field=field) from None


def copy_error(err: KVPoolError) -> KVPoolError:
    """A fresh exception of ``err``'s class and text (raising one instance again and again
    would grow its traceback)."""
    return error_from_code(err.code_name, err.message, err.field)


class PageCacheCore:
    """The state of a page cache and every operation on it; no I/O, no locking.

    The sync :class:`PageCache` calls it under its lock, the asyncio ``AsyncPageCache`` from
    its event loop. Ids move between four places: cached (in the ring), handed out
    (``n_in_use``), taken by an ``alloc`` waiting on the daemon (``reserved``), and being
    returned by the worker (``returning``); all of them are held by the lease.

    Layout: the cached ids sit in a ring, at absolute slots ``head..tail - 1`` (slot ``s`` is
    ``ring[s % capacity]``); ``alloc`` takes from ``head``, ``free`` and refills append at
    ``tail``, returns take back from ``tail``. ``pos[id]`` is the slot an id was last cached
    at, less ``base``, so an id is in use exactly when ``pos[id] < head - base``: ``alloc``
    hands ids out by moving ``head`` past them and writes nothing per id (its cost is the
    floor's: one slice copied). Ids not held here (never fetched, returned, reserved, out of
    range) have ``pos`` = ``not_here`` (the dtype's largest value), never below; ids handed out
    by a miss, or in use when ``base`` moved, have ``by_miss`` (its smallest). Before relative
    slots outgrow the dtype, ``rebase`` moves ``base`` up to ``head`` (O(capacity), once per
    2**30 slots: a billion ids cached).
    """

    def __init__(self, pool: str, space: str, capacity: int, low: int, high: int,
                 batch: int, window: int = SLOT_WINDOW, rebase_at: int | None = None) -> None:
        self.pool = pool
        self.space = space
        self.label = f"{pool}/{space}"
        self.capacity = capacity
        self.low = low
        self.high = high
        self.batch = batch
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
        self.returning = 0
        self.refills = 0
        self.returns = 0
        self.rpc_calls = 0
        self.waits = 0
        self.fetched = 0
        self.returned = 0
        self.gave_back = 0
        self.checks = 0
        self.dropped_unheld = 0
        # ``pos`` of an id in use that a check found the lease no longer holds: still in use
        # (below any head), dropped instead of cached when it is freed.
        self.unheld_mark = self.by_miss + 1
        self.unheld_in_use = 0  # ids in use with that mark
        self.check_due = False  # a reply said the lease holds fewer ids than the cache counts
        # RPCs of this cache in flight, and started in all: a reply's ``held`` is compared only
        # when no other RPC of the cache ran at the same time (``rpc_begin``/``rpc_end``).
        self.active = 0
        self.starts = 0
        self.give_back = 0  # ids the daemon asked back, not yet taken out of the ring
        self.hold_until = 0.0  # no background refill before (after a give-back)
        self.closed = False
        self.lost: KVPoolError | None = None  # the lease or pool is gone
        self.dead: KVPoolError | None = None  # closed or lost: ``alloc`` raises this
        # Whether ``take`` (below ``low``) and ``free`` (above ``high``) need not wake the
        # worker: it has been woken and has not gone idle since, or it sleeps until it may
        # retry that kind of job by itself.
        self.kicked = False
        self.kicked_return = False
        self.wake: Callable[[], object] = no_worker  # wakes the owner's worker
        self.refill_retry = Backoff()
        self.return_retry = Backoff()
        self.settle_round = 0  # ``begin_settle`` calls
        self.refill_cap = high
        self.prefill = True  # the first refill fills to ``high`` even when ``low`` is 0
        self.last_error: KVPoolError | None = None

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
            unheld = part == self.unheld_mark
            np.subtract(part, shift, out=part, where=part != self.not_here)
            part[in_use] = self.by_miss
            part[unheld] = self.unheld_mark
        self.base = self.head
        self.window_base = -(self.window.shape[0] + 1)  # refilled at the next ``slots``

    # -- alloc --------------------------------------------------------------------------------

    def take(self, n: int) -> np.ndarray | None:
        """``n`` ids from ``head`` (the longest cached first), handed out; None when fewer are
        cached. Nothing is written per id: moving ``head`` past them marks them in use. Wakes
        the worker when fewer than ``low`` are left."""
        head = self.head
        left = self.tail - head - n
        if left < 0:
            return None
        self.head = head + n
        self.n_in_use += n
        if left < self.low and not self.kicked:
            self.kicked = True
            self.wake()
        i = head % self.capacity
        j = i + n
        if j <= self.capacity:
            return self.ring[i:j].copy()  # the copy handed out
        return self.read(head, n)

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

    def finish_miss(self, reserved: np.ndarray, got: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` ids of a missing ``alloc``: the reserved ones and the first of ``got``;
        the rest of ``got`` goes into the ring."""
        need = n - reserved.shape[0]
        ids = np.concatenate((reserved, got[:need])).astype(ID_DTYPE, copy=False)
        self.push(got[need:])
        self.reserved -= reserved.shape[0]
        self.pos[ids] = self.by_miss
        self.n_in_use += n
        self.refills += 1
        self.fetched += got.shape[0]
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

    def free_ids(self, ids: Any) -> tuple[np.ndarray, bool]:
        """The whole of both caches' ``free`` but the lock and the RPC: ``(ids, send)``, in
        O(len(ids)). Every id must be in use and listed once; on a refusal nothing changes.
        While the cache is open the ids go into the ring at ``tail`` (the worker is woken
        above ``high``); after ``close`` they are forgotten, and ``send`` says to Free them at
        the daemon now (counted in ``rpc_calls``): not once the lease is gone, which took them.

        Raises:
            InvalidArgument: not a 1-D integer array, or the first id out of range or repeated.
            FailedPrecondition: the first id not handed out by this cache (or already freed).
        """
        # One function, few numpy calls: each costs microseconds on a cold path (after the
        # engine's forward pass), and so does each Python call.
        if self.unheld_in_use:
            return self.free_with_unheld(ids)
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
        if self.dead is None:
            tail = self.tail
            i = tail % self.capacity
            if i + n <= self.capacity:
                self.ring[i:i + n] = arr
            else:
                self.write(tail, arr)
            self.tail = tail = tail + n
            self.n_in_use -= n
            if tail - self.head > self.high and not self.kicked_return:
                self.kicked_return = True
                self.wake()
            return arr, False
        self.forget(arr)
        send = self.lost is None and n > 0
        if send:
            self.rpc_calls += 1
        return arr, send

    def free_with_unheld(self, ids: Any) -> tuple[np.ndarray, bool]:
        """``free_ids`` while some ids in use are marked unheld (a check found the lease no
        longer holds them): those are dropped rather than cached (or sent after ``close``)."""
        arr = np.asarray(ids)
        marked = np.zeros(0, dtype=ID_DTYPE)
        if arr.ndim == 1 and arr.dtype.kind in "iu" and arr.shape[0]:
            idx = np.clip(arr.astype(np.intp), 0, self.capacity + 1)
            marked = arr[self.pos[idx] == self.unheld_mark].astype(ID_DTYPE)
        count, self.unheld_in_use = self.unheld_in_use, 0  # the plain path for a moment
        try:
            arr, send = self.free_ids(arr)
        finally:
            self.unheld_in_use = count
        if not marked.shape[0]:
            return arr, send
        self.unheld_in_use -= marked.shape[0]
        if self.dead is None:  # just cached at the tail: take them out again
            n = arr.shape[0]
            self.tail -= n
            tail = self.read(self.tail, n)
            self.uncache(marked)
            self.push(tail[self.pos[tail] != self.not_here])
            return arr, False
        keep = arr[~np.isin(arr, marked)]
        if send and not keep.shape[0]:
            self.rpc_calls -= 1
        return keep, send and keep.shape[0] > 0

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

    def forget(self, arr: np.ndarray) -> None:
        """Ids ``free_ids`` took, not cached (a free after ``close``)."""
        self.uncache(arr)
        self.n_in_use -= arr.shape[0]

    def unforget(self, arr: np.ndarray) -> None:
        """Undo ``free_ids`` after ``close``: the Free was refused."""
        self.pos[arr] = self.by_miss
        self.n_in_use += arr.shape[0]

    # -- the worker ---------------------------------------------------------------------------

    def wants_work(self) -> bool:
        cached = self.tail - self.head
        return (cached < self.low or cached > self.high or self.give_back > 0
                or self.check_due)

    def refill_due(self, cached: int) -> bool:
        """Whether the watermarks ask for a refill (below ``low``, or the first fill)."""
        return cached < self.low or (self.prefill and cached < self.high)

    def kick(self) -> None:
        """Wake the worker (it then looks at everything there is to do)."""
        self.kicked = self.kicked_return = True
        self.wake()

    def ask_give_back(self, n: int) -> int:
        """The daemon asks for ``n`` cached ids: the worker returns up to that many from the
        cache (never ids in use). Returns how many it will return."""
        if self.dead is not None:
            return 0
        k = min(n, self.cached - self.give_back)
        if k > 0:
            self.give_back += k
        return max(0, k)

    def report(self) -> tuple[int, int]:
        """``(cached, in_use)`` for the lease's KeepAlive report (ids an ``alloc`` waiting on
        the daemon took out of the ring count as in use)."""
        return self.cached, self.n_in_use - self.unheld_in_use + self.reserved

    # -- is what the cache counts still held by its lease? -------------------------------------

    def rpc_begin(self) -> tuple[int, bool]:
        """An RPC of this cache starts (under the lock): the token ``rpc_end`` takes."""
        alone = self.active == 0
        self.active += 1
        self.starts += 1
        return self.starts, alone

    def rpc_end(self, token: tuple[int, bool], held: int | None) -> None:
        """The RPC of ``token`` is done and its effect on the cache made; ``held``: what the
        daemon said the lease holds of the space once the call was done (None: refused, or a
        daemon that does not say). If no other RPC of the cache ran meanwhile, the lease holds
        at least every id the cache counts; fewer means ids were freed behind the cache's back
        (``lease.free`` of its ids): a check is due (O(1) here)."""
        self.active -= 1
        start, alone = token
        if held is None or not alone or self.starts != start or self.dead is not None:
            return
        mine = (self.n_in_use - self.unheld_in_use + self.cached + self.reserved
                + self.returning)
        if held < mine and not self.check_due:
            log.warning("page cache %s: its lease holds %d ids of the space, the cache counts "
                        "%d: ids were freed behind its back (lease.free of its ids?); checking "
                        "which it still holds", self.label, held, mine)
            self.check_due = True
            self.kick()

    def check_ids(self) -> np.ndarray:
        """Every id the cache counts as its lease's: cached, then in use (O(capacity))."""
        in_use = self.pos[1:self.capacity + 1]
        handed = np.flatnonzero((in_use < self.head - self.base)
                                & (in_use != self.unheld_mark)) + 1
        return np.concatenate((self.read(self.head, self.cached), handed.astype(ID_DTYPE)))

    def drop_unheld(self, ids: np.ndarray) -> None:
        """A check found the lease no longer holds ``ids``: those cached leave the ring (never
        handed out again), those in use are marked (dropped when freed). Ids neither cached nor
        in use now (reserved by a miss since) are left: the next reply's count tells again."""
        p = self.pos[ids]
        rel = self.head - self.base
        cached = ids[(p >= rel) & (p != self.not_here)]
        in_use = ids[(p < rel) & (p != self.unheld_mark)]
        if cached.shape[0]:
            ring = self.read(self.head, self.cached)
            self.uncache(cached)
            self.tail = self.head
            self.push(ring[self.pos[ring] != self.not_here])
        self.pos[in_use] = self.unheld_mark
        self.unheld_in_use += in_use.shape[0]
        k = cached.shape[0] + in_use.shape[0]
        self.dropped_unheld += k
        if k:
            log.warning("page cache %s: dropped %d ids its lease no longer holds (%d cached, "
                        "%d in use: dropped when freed)", self.label, k, cached.shape[0],
                        in_use.shape[0])

    def next_job(self, now: float, lease: Any) -> tuple[str, Any] | None:
        """The RPC the worker (or ``maintain``) should make now, counted in ``rpc_calls``:
        ``(GIVE_BACK | RETURN, ids)`` (taken out of the ring), ``(REFILL, count)``, or None. A
        cache whose lease is gone is marked lost first and has nothing to do."""
        if self.dead is None:
            lost = lease_lost(lease)
            if lost is not None:
                self.lose(lost)
        job = self.pick_job(now)
        if job is not None:
            self.rpc_calls += 1
        return job

    def pick_job(self, now: float) -> tuple[str, Any] | None:
        if self.dead is not None:
            return None
        if self.check_due:  # first: a cached id the lease does not hold must not go out
            self.check_due = False
            ids = self.check_ids()
            if ids.shape[0]:
                return CHECK, ids
        if self.give_back > 0:
            k = min(self.give_back, self.cached)
            self.give_back = 0
            if k:
                self.tail -= k  # the most recently cached
                ids = self.read(self.tail, k)
                self.uncache(ids)
                self.returning += k
                return GIVE_BACK, ids
        cached = self.tail - self.head
        if cached > self.high and now >= self.return_retry.at:
            keep = max(self.low, self.high - self.batch)
            self.tail -= cached - keep
            ids = self.read(self.tail, cached - keep)
            self.uncache(ids)
            self.returning += ids.shape[0]
            return RETURN, ids
        if self.refill_due(cached) and now >= max(self.refill_retry.at, self.hold_until):
            return REFILL, min(self.high - cached, self.refill_cap)
        return None

    def job_done(self, kind: str, arg: Any, result: Any) -> None:
        if kind == CHECK:
            self.checks += 1
            self.drop_unheld(result)
            return
        if kind == REFILL:
            self.refill_retry.succeeded()
            self.push(result)
            self.refills += 1
            self.fetched += result.shape[0]
            self.refill_cap = self.high
            self.prefill = False
        else:
            self.return_retry.succeeded()
            k = arg.shape[0]
            self.returning -= k
            self.returns += 1
            self.returned += k
            if kind == GIVE_BACK:
                self.gave_back += k
                self.hold_until = time.monotonic() + GIVE_BACK_HOLD_S

    def job_error(self, kind: str, err: Exception) -> KVPoolError:
        """What a failed job's RPC means to the cache: the daemon's error as it is; anything
        else (a bug, a broken channel) logged with its traceback, as FailedPrecondition. Call
        it inside the ``except`` block."""
        if isinstance(err, KVPoolError):
            return err
        log.exception("page cache %s: %s failed", self.label, kind)
        return FailedPrecondition(str(err))

    def job_failed(self, kind: str, arg: Any, err: KVPoolError, now: float) -> None:
        self.last_error = err
        if kind == CHECK:  # the next reply's count tells again whether one is due
            if isinstance(err, NotFound):
                self.lose(err)
            else:
                log.warning("page cache %s: checking its ids failed: %s", self.label, err)
            return
        retry = self.refill_retry if kind == REFILL else self.return_retry
        if kind != REFILL:
            self.returning -= arg.shape[0]
            self.push(arg)  # still the lease's
        if isinstance(err, NotFound):
            self.lose(err)
        elif kind == REFILL and isinstance(err, ResourceExhausted) and arg > 1:
            self.refill_cap = max(1, arg // 2)  # ask for half at once
            retry.refused(self.settle_round)
        else:
            if not isinstance(err, ResourceExhausted):
                log.warning("page cache %s: %s failed, retrying in %.1f s: %s", self.label,
                            kind, retry.wait_s, err)
            retry.wait(now, self.settle_round)
            if kind == REFILL:
                self.refill_cap = self.high
                self.prefill = False

    def deferred(self, now: float) -> tuple[float, float]:
        """When the worker may next make a refill, and a return, that the watermarks ask for
        but that it holds back now (a refusal's backoff, the hold after a give-back); ``inf``
        for one it does not hold back (none due, or due now)."""
        cached = self.cached
        refill = max(self.refill_retry.at, self.hold_until)
        ret = self.return_retry.at
        inf = float("inf")
        return (refill if self.refill_due(cached) and refill > now else inf,
                ret if cached > self.high and ret > now else inf)

    def idle(self, now: float) -> tuple[bool, float]:
        """The worker found nothing to do: ``(stop, how long to sleep)``; sets ``kicked`` and
        ``kicked_return`` for what it will retry by itself when it wakes."""
        if self.dead is not None:
            self.kicked = self.kicked_return = False
            return True, 0.0
        refill_at, return_at = self.deferred(now)
        # While it waits to retry, ``alloc`` (refills) or ``free`` (returns) need not wake it.
        self.kicked = refill_at != float("inf")
        self.kicked_return = return_at != float("inf")
        return False, min(LEASE_POLL_S, min(refill_at, return_at) - now)

    def begin_settle(self) -> None:
        """``settle`` starts: what the worker was holding back (a refusal's backoff, the hold
        after a give-back) it may try now, and refusals count from here on."""
        self.settle_round += 1
        self.refill_retry.at = self.return_retry.at = self.hold_until = 0.0

    def settled(self) -> bool:
        """Whether the worker, idle now, has done what ``settle`` waits for: no give-back, and
        no return or refill the watermarks ask for, is due or in flight, except one the daemon
        refused since ``begin_settle`` (the worker retries it after its backoff)."""
        if self.dead is not None:
            return True
        if self.returning or (self.give_back and self.cached) or self.check_due:
            return False
        cached = self.cached
        rnd = self.settle_round
        if cached > self.high and self.return_retry.refused_in < rnd:
            return False
        return not (self.refill_due(cached) and self.refill_retry.refused_in < rnd)

    # -- end ----------------------------------------------------------------------------------

    def close(self) -> None:
        self.closed = True
        if self.dead is None:
            self.dead = FailedPrecondition(f"the page cache of {self.label} is closed",
                                           field="cache")

    def lose(self, err: KVPoolError) -> None:
        """The lease or pool is gone, and with it every id this cache had."""
        if self.lost is None:
            self.lost = err
            self.dead = err
            self.check_due = False
            self.drain()
            log.error("page cache %s lost its ids: %s", self.label, err)

    def drain(self) -> np.ndarray:
        """Every cached id, taken out of the ring (``close``)."""
        ids = self.read(self.head, self.cached)
        self.head = self.tail
        self.uncache(ids)
        return ids

    def counters(self) -> PageCacheCounters:
        return PageCacheCounters(self.n_in_use, self.cached, self.refills, self.returns,
                                 self.rpc_calls, self.waits, self.fetched, self.returned,
                                 self.gave_back, self.checks, self.dropped_unheld)

    def check_count(self, n: Any) -> int:
        n = as_int(n, "count")
        if n < 0:
            raise InvalidArgument(f"count={n}: must be >= 0", field="count")
        return n


def lease_lost(lease: Any) -> KVPoolError | None:
    """Why the lease can no longer hold ids: its keep-alive was told NotFound (it expired), or
    it was closed; None while it is alive."""
    err = lease.error
    if isinstance(err, NotFound):
        return err
    if lease.closed:
        return lease_closed(lease.lease_id)
    return None


def _from_core(attr: str, doc: str = "") -> Any:
    """A read-only property of a cache that reads its core's ``attr``."""
    return property(lambda self: getattr(self._core, attr), doc=doc or None)


class CacheState:
    """The read-only state both page caches expose (``self._core`` is their
    :class:`PageCacheCore`)."""

    _core: PageCacheCore
    _lease: Any

    def _report_soon(self) -> None:
        """The cached count moved by a batch (a refill, a return, a give-back, a miss): the
        lease sends its report now rather than at the next renewal, so the daemon knows what
        it may ask back."""
        report_soon = getattr(self._lease, "_report_soon", None)
        if report_soon is not None:
            report_soon()

    def _raise_dead(self) -> None:
        """Raise why the cache cannot hand out ids (closed, or its lease or pool gone)."""
        assert self._core.dead is not None
        raise copy_error(self._core.dead)

    def in_use_of(self, ids: Any) -> np.ndarray:
        """Per id of ``ids``: whether ``alloc`` handed it out and it was not freed (False for
        ids out of range). O(len(ids)); call it from the thread that allocates and frees."""
        return self._core.in_use_of(ids)

    def handed_out(self) -> np.ndarray:
        """Every id handed out and not freed (int32, ascending). O(capacity): for a reset,
        not for the hot path."""
        return self._core.handed_out()

    # What the cache is and counts, read from its core (the counters' meanings: see
    # PageCacheCounters).
    pool = _from_core("pool")
    space = _from_core("space")
    capacity = _from_core("capacity")
    low = _from_core("low")
    high = _from_core("high")
    batch = _from_core("batch")
    in_use = _from_core("n_in_use")
    cached = _from_core("cached")
    refills = _from_core("refills")
    returns = _from_core("returns")
    rpc_calls = _from_core("rpc_calls")
    waits = _from_core("waits")
    gave_back = _from_core("gave_back")
    checks = _from_core("checks")
    dropped_unheld = _from_core("dropped_unheld")
    closed = _from_core("closed")
    # Why the cache lost its ids (lease expired or closed, pool dropped), else None.
    error = _from_core("lost", "Why the cache lost its ids (KVPoolError), else None.")


class PageCache(CacheState):
    """Ids of one (lease, pool, id space) served from a local queue; see the module docstring.

    Made by :meth:`kvpool.clients.client.Lease.page_cache`; a context manager (``close`` on exit).
    Thread-safe: ``alloc``, ``free`` and the counters may be used from any thread.
    """

    def __init__(self, lease: Lease, pool: str, space: str, capacity: int, *,
                 low: int | None = None, high: int | None = None,
                 batch: int | None = None, background: bool = True) -> None:
        lo, hi, ba = watermarks(capacity, low, high, batch)
        self._lease = lease
        self._core = PageCacheCore(pool, space, capacity, lo, hi, ba)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._core.wake = self._wake.set
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvpool-page-cache-{pool}-{space}")
        self._core.kick()  # the first refill, to ``high``
        # background=False: no worker thread; the engine calls ``maintain`` (between steps,
        # while its forward pass runs), so no refill or return ever lands inside its calls.
        self.background = background
        if background:
            self._thread.start()
        else:
            self.maintain()
        # The lease reports the cache on KeepAlive, routes give-backs, and says when it ends.
        lease._register_cache(self)
        lost = lease_lost(lease)
        if lost is not None:  # closed or lost before the registration
            self.lease_gone(lost)

    @classmethod
    def open(cls, lease: Lease, pool: str, space: str = "kv", *, low: int | None = None,
             high: int | None = None, batch: int | None = None,
             background: bool = True) -> PageCache:
        """A cache over ``pool``'s ``space`` for ``lease``: one Stats call learns the space's
        capacity (and whether it is paired); the cache is then filled to ``high`` (by the
        worker, or at once without one)."""
        stats = lease.client.stats(pool)
        capacity = space_capacity(stats, pool, space)
        return cls(lease, pool, space, capacity, low=low, high=high, batch=batch,
                   background=background)

    def maintain(self) -> int:
        """Do now, in this thread, the refills, returns and give-backs the watermarks ask for
        (what the worker does in the background); for a cache opened with
        ``background=False``, call it once per engine step, outside the step's allocs and
        frees (a give-back the daemon asks for also waits for it). Without work it costs a
        lock and a few comparisons.

        Returns:
            The RPCs made.
        """
        done = 0
        while True:
            with self._lock:
                core = self._core
                now = time.monotonic()
                job = core.next_job(now, self._lease)
                if job is None:
                    core.idle(now)  # what the worker does when it runs out of work
                    return done
            self._do_job(job)
            done += 1

    # -- the hot path -------------------------------------------------------------------------

    def alloc(self, n: int) -> np.ndarray:
        """``n`` ids (int32), from the cache when it has them, else with one Allocate.

        Raises:
            ResourceExhausted: the cache and the daemon together have fewer than ``n`` (the
                cache is left as it was). FailedPrecondition: the cache is closed.
            NotFound / FailedPrecondition: the lease expired or was closed, or the pool was
                dropped (the cache's ids are gone with it).
        """
        if type(n) is not int or n < 0:
            n = self._core.check_count(n)
        core = self._core
        lock = self._lock
        # acquire/release, not ``with``: ~1 us less on a cold path (after the forward pass).
        lock.acquire()
        try:
            # The lease marks the cache dead (``lease_gone``) before its CloseLease takes back
            # every id, and when its keep-alive learns that it expired.
            if core.dead is not None:
                self._raise_dead()
            ids = core.take(n)
            if ids is not None:
                return ids
            reserved = core.reserve(n)
        finally:
            lock.release()
        return self._miss(n, reserved)

    def free(self, ids: Any) -> int:
        """Give back ids this cache handed out; they go into the cache (above ``high``, the
        worker returns some). After ``close``, they go straight to the daemon (one Free).

        Returns:
            The number of ids freed.

        Raises:
            InvalidArgument: an id out of range or repeated. FailedPrecondition: an id not in
                use (never handed out by this cache, or already freed). Nothing is changed.
        """
        core = self._core
        lock = self._lock
        lock.acquire()
        try:
            arr, send = core.free_ids(ids)
        finally:
            lock.release()
        if send:
            try:
                self._lease.free(core.pool, core.space, arr)
            except KVPoolError as err:
                if not isinstance(err, NotFound):
                    with self._lock:
                        core.unforget(arr)  # still the lease's and in use: free them again
                raise
        return arr.shape[0]

    # -- state --------------------------------------------------------------------------------

    def counters(self) -> PageCacheCounters:
        """All counters at one instant."""
        with self._lock:
            return self._core.counters()

    def settle(self, timeout_s: float | None = None) -> bool:
        """Wait until no refill, return or give-back is due or in flight. For tests and
        shutdown; never needed for correctness.

        What the worker holds back it tries at once (a refill or return waiting out a refusal's
        backoff, a refill held off after a give-back). Settled means: no give-back asked and not
        done, at most ``high`` cached, and at least ``low`` (``high`` before the first refill),
        each unless the daemon refused that refill or return since this call began (it is
        retried after its backoff: the daemon has no room, or cannot be reached). Frees and
        allocs made meanwhile, and give-backs the daemon asks later, may make new work.

        A give-back reaches the cache on the lease's KeepAlive stream: one the daemon asked
        that is still on its way is not waited for. To include every give-back asked so far,
        call ``lease.report_now()`` first (its answer comes after them), then ``settle()``.
        Another lease's Allocate can ask for more at any time, so the counts of two caches on
        one pool are still only once neither lease makes an RPC (tests/e2e/test_two_engines.py).

        Returns:
            True when settled (or the cache is closed or lost); False if ``timeout_s`` passed
            first.
        """
        core = self._core
        if not self.background:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            with self._lock:
                core.begin_settle()
            while True:
                self.maintain()
                with self._lock:
                    if core.settled():
                        return True
                    now = time.monotonic()
                    wake_at = min(core.deferred(now))  # a give-back's hold, at most
                until = min(wake_at, now + LEASE_POLL_S)
                if deadline is not None:
                    if now >= deadline:
                        return False
                    until = min(until, deadline)
                time.sleep(max(0.0, until - now))
        with self._lock:
            if core.dead is not None or not self._thread.is_alive():
                return True
            self._idle.clear()
            core.begin_settle()
            core.kick()
        return self._idle.wait(timeout_s)

    def close(self) -> int:
        """Stop the worker and return every cached id to the daemon (one Free). Ids in use stay
        the lease's until freed (``free`` then calls the daemon) or the lease ends. Idempotent.

        Returns:
            The ids returned.
        """
        with self._lock:
            if self._core.closed:
                return 0
            self._core.close()
        self._lease._unregister_cache(self)
        self._wake.set()
        if self.background:
            self._thread.join()
        with self._lock:
            ids = self._core.drain()
            if not ids.shape[0] or self._core.lost is not None:
                return 0
            self._core.rpc_calls += 1
        try:
            self._lease.free(self._core.pool, self._core.space, ids)
        except NotFound:
            return 0  # the lease (or pool) is gone and the ids with it
        return ids.shape[0]

    def __enter__(self) -> PageCache:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self._core
        return (f"PageCache({c.label}, lease={self._lease.lease_id}, low={c.low}, "
                f"high={c.high}, batch={c.batch}, in_use={c.n_in_use}, cached={c.cached})")

    # -- the lease's keep-alive thread --------------------------------------------------------

    def lease_gone(self, err: KVPoolError) -> None:
        """The lease is closing or expired: every id of the cache goes with it (``alloc``
        raises ``err`` from now on; ``free`` only unmarks)."""
        with self._lock:
            self._core.lose(err)
        self._wake.set()

    def _report(self) -> tuple[int, int]:
        """``(cached, in_use)`` now, for the lease's KeepAlive."""
        with self._lock:
            return self._core.report()

    def _give_back(self, n: int) -> int:
        """The daemon asked for ``n`` cached ids; the worker returns up to that many (one
        Free), then the lease reports the new counts. Returns how many it will return."""
        with self._lock:
            k = self._core.ask_give_back(n)
            if k:
                self._core.kick()
        return k

    # -- the slow paths -----------------------------------------------------------------------


    def _miss(self, n: int, reserved: np.ndarray) -> np.ndarray:
        """Allocate what the cache lacked (plus a refill), unlocked; see the module docstring."""
        core = self._core
        need = n - reserved.shape[0]
        ask = max(need, core.batch)
        try:
            try:
                got, token, held = self._allocate(ask)
            except ResourceExhausted:
                if ask == need:
                    raise
                got, token, held = self._allocate(need)
        except BaseException as err:  # any failure (an interrupt too): the reserved ids go back
            with self._lock:
                core.waits += 1
                core.unreserve(reserved)
                if isinstance(err, NotFound):
                    core.lose(err)
            raise
        with self._lock:
            core.waits += 1
            ids = core.finish_miss(reserved, got, n)
            core.rpc_end(token, held)
            if core.wants_work():
                core.kick()
        self._report_soon()
        return ids

    def _allocate(self, count: int) -> tuple[np.ndarray, tuple[int, bool], int | None]:
        """One Allocate of ``count`` (unlocked): the ids, the RPC's token and the lease's
        holding, for the ``rpc_end`` the caller makes once the ids are in the cache."""
        core = self._core
        with self._lock:
            core.rpc_calls += 1
            token = core.rpc_begin()
        try:
            got, held = self._lease._allocate_held(core.pool, core.space, count)
        except BaseException:
            with self._lock:
                core.rpc_end(token, None)
            raise
        return got, token, held

    def _do_job(self, job: tuple[str, Any]) -> None:
        """One refill, return or check RPC for the worker or ``maintain`` (called unlocked)."""
        core = self._core
        kind, arg = job
        with self._lock:
            token = core.rpc_begin()
        try:
            result, held = getattr(self._lease, JOB_CALLS[kind])(core.pool, core.space, arg)
        except Exception as err:  # never let the worker die silently
            with self._lock:
                core.job_failed(kind, arg, core.job_error(kind, err), time.monotonic())
                core.rpc_end(token, None)
        else:
            with self._lock:
                core.job_done(kind, arg, result)
                core.rpc_end(token, held)
            self._report_soon()

    def _run(self) -> None:
        """The worker: refill below ``low``, return above ``high``; one RPC at a time."""
        core = self._core
        sleep = 0.0
        while True:
            self._wake.wait(sleep)
            self._wake.clear()
            while True:
                now = time.monotonic()
                with self._lock:
                    job = core.next_job(now, self._lease)
                    if job is None:
                        stop, sleep = core.idle(now)
                        if stop or core.settled():
                            self._idle.set()
                        if stop:
                            return
                        break
                self._do_job(job)

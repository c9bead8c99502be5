"""The page cache's sans-IO core: when to refill, return and give back, how to back off.

:class:`PageCacheCore` holds an :class:`~kvpool.cache.ring.IdRing` (the ids: a data structure,
composed, not inherited) and this policy; it never makes a call. Both page caches
(``kvpool.cache.page_cache``, ``kvpool.cache.aio_page_cache``) are thin shells around one (the
h11 shape): they lock (the sync one) or not (the asyncio one), make the RPCs the core asks for
(``work``, ``miss_counts``), and hand it the replies. See ``kvpool.cache.page_cache`` for the
behaviour.

Every id the core counts (cached, in use, reserved by a miss, being returned) is held by its
lease, and the lease refuses its own Allocate and Free of the space while the cache is open
(``kvpool.clients.session``), so what the lease holds of the space is exactly what the core
counts: nothing can free an id behind its back.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.cache.ring import SLOT_WINDOW, IdRing, count_nonzero
from kvpool.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVPoolError,
    NotFound,
    ResourceExhausted,
    error_from_code,
    lease_closed,
)

if TYPE_CHECKING:
    from kvpool.contract.records import Stats

log = logging.getLogger("kvpool.cache.page_cache")
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
# The lease's call that does each job, ``(pool, space, arg)`` its arguments; both caches'
# workers dispatch through this one table.
JOB_CALLS = {REFILL: "_cache_allocate", RETURN: "_cache_free", GIVE_BACK: "_cache_free"}


def no_worker() -> None:
    """``PageCacheCore.wake`` and ``on_settled`` until the shell sets its own."""


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
        refused: ``try_alloc`` calls the cache and the daemon together could not serve.
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
    refused: int = 0


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


def lease_holds(stats: Stats, lease_id: int, pool: str, space: str) -> int:
    """How many ids of ``pool``/``space`` the lease holds, from a Stats reply (0 if the lease
    is not listed)."""
    for info in stats.leases:
        if info.lease_id == lease_id:
            return int(info.held.get(pool, {}).get(space, 0))
    return 0


def refuse_held(stats: Stats, lease_id: int, pool: str, space: str,
                expected: int = 0) -> None:
    """Refuse a page cache over a space of which its lease already holds ids (other than the
    ``expected`` ones it hands the cache as in use): the cache is the only path to its space,
    so what the lease holds of it is what the cache counts.

    Raises:
        FailedPrecondition: the lease holds ids of the space (its own Allocate, or another
            open page cache).
    """
    held = lease_holds(stats, lease_id, pool, space)
    if held != expected:
        raise FailedPrecondition(
            f"lease {lease_id} holds {held} ids of {pool}/{space} outside a page cache (its "
            "own allocate, or another open page cache of it): a page cache must be the only "
            "path to its space; free them, or close that cache, first", field="space")


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
    """A page cache's ids (an :class:`~kvpool.cache.ring.IdRing`, ``ring``) and its policy:
    when to refill, return and give back, how to back off; no I/O, no locking.

    The sync ``PageCache`` calls it under its lock, the asyncio ``AsyncPageCache`` from its
    event loop; both read its state from here (``cache.core.cached``). Besides the ring's three
    places (cached, handed out, reserved by a miss), ids may be being returned by the worker
    (``returning``); all of them are held by the lease, and nothing else of the space is.

    Args:
        pool: the pool's name.
        space: the id space.
        capacity: ids ``1..capacity``.
        low: below this many cached, a refill (to ``high``) is due.
        high: above this many cached, a return (to ``max(low, high - batch)``) is due.
        batch: the least a miss asks the daemon for.
        window, rebase_at: the ring's (see :class:`~kvpool.cache.ring.IdRing`).
    """

    def __init__(self, pool: str, space: str, capacity: int, low: int, high: int,
                 batch: int, window: int = SLOT_WINDOW, rebase_at: int | None = None) -> None:
        self.label = f"{pool}/{space}"
        self.ring = IdRing(self.label, capacity, window, rebase_at)
        self.pool = pool
        self.space = space
        self.low = low
        self.high = high
        self.batch = batch
        self.returning = 0
        self.refills = 0
        self.returns = 0
        self.rpc_calls = 0
        self.waits = 0
        self.fetched = 0
        self.returned = 0
        self.gave_back = 0
        self.refused = 0
        self.give_back = 0  # ids the daemon asked back, not yet taken out of the ring
        # Ids in use that the owner frees on demand (an engine's prefix cache: ``evictable``,
        # set by the owner; 0 without an evictor), and of the give-backs asked, how many the
        # owner's evictor must free into the ring first (``maintain`` runs it).
        self.can_evict = False
        self.evictable = 0
        self.evict_wanted = 0
        self.hold_until = 0.0  # no background refill before (after a give-back)
        self.closed = False
        # Why ids can no longer be handed out (closed, or the lease or pool gone); freed ids
        # are then forgotten instead of cached.
        self.dead: KVPoolError | None = None
        self.lost: KVPoolError | None = None  # the lease or pool is gone, with every id
        self.refill_retry = Backoff()
        self.return_retry = Backoff()
        self.settle_round = 0  # ``begin_settle`` calls
        self.refill_cap = high
        self.prefill = True  # the first refill fills to ``high`` even when ``low`` is 0
        self.last_error: KVPoolError | None = None
        # Whether ``take`` (below ``low``) and ``free`` (above ``high``) need not wake the
        # worker: it has been woken and has not gone idle since, or it sleeps until it may
        # retry that kind of job by itself.
        self.kicked = False
        self.kicked_return = False
        self.wake: Callable[[], object] = no_worker  # wakes the shell's worker
        self.on_settled: Callable[[], object] = no_worker  # tells ``settle`` (the shell's)

    # -- what the cache is and counts (the counters' meanings: PageCacheCounters) --------------

    @property
    def capacity(self) -> int:
        return self.ring.capacity

    @property
    def cached(self) -> int:
        """Ids cached: held by the lease, not handed out."""
        return self.ring.tail - self.ring.head

    @property
    def in_use(self) -> int:
        """Ids handed out and not freed."""
        return self.ring.n_in_use

    @property
    def error(self) -> KVPoolError | None:
        """Why the cache lost its ids (lease expired or closed, pool dropped), else None."""
        return self.lost

    def in_use_of(self, ids: Any) -> np.ndarray:
        """Per id of ``ids``: whether ``alloc`` handed it out and it was not freed (False for
        ids out of range). O(len(ids)); call it from the thread that allocates and frees."""
        return self.ring.in_use_of(ids)

    def handed_out(self) -> np.ndarray:
        """Every id handed out and not freed (int32, ascending). O(capacity): for a reset,
        not for the hot path."""
        return self.ring.handed_out()

    def counters(self) -> PageCacheCounters:
        return PageCacheCounters(self.ring.n_in_use, self.cached, self.refills, self.returns,
                                 self.rpc_calls, self.waits, self.fetched, self.returned,
                                 self.gave_back, self.refused)

    # -- the hot path -------------------------------------------------------------------------

    def take(self, n: int) -> np.ndarray | None:
        """``n`` cached ids, handed out (the longest cached first); None when fewer are cached
        (the shell then ``reserve``s and asks the daemon). Wakes the worker when fewer than
        ``low`` are left.

        Raises:
            KVPoolError: why the cache cannot hand out ids (``dead``: closed, lease or pool
                gone).
        """
        if self.dead is not None:
            raise copy_error(self.dead)
        ring = self.ring
        ids = ring.take(n)
        if ids is not None and not self.kicked and ring.tail - ring.head < self.low:
            self.kicked = True
            self.wake()
        return ids

    def free(self, ids: Any) -> tuple[np.ndarray, bool]:
        """Take back ids ``take`` handed out (checked, all or nothing: see
        ``IdRing.free_ids``): ``(ids, send)``. While the cache is open they are cached (the
        worker is woken above ``high``); once it is dead they are forgotten, and ``send``
        says whether the shell Frees them at the daemon now (counted in ``rpc_calls``): not
        once the lease is gone, which took them."""
        ring = self.ring
        if self.dead is None:
            arr = ring.free_ids(ids, True)
            if ring.tail - ring.head > self.high and not self.kicked_return:
                self.kicked_return = True
                self.wake()
            return arr, False
        arr = ring.free_ids(ids, False)
        send = self.lost is None and arr.shape[0] > 0
        if send:
            self.rpc_calls += 1
        return arr, send

    def release(self, ids: Any) -> np.ndarray:
        """Take back ids ``take`` handed out (checked as ``free`` checks them) without caching
        them: the owner gives them back to the daemon itself (an engine's sealed pages, which
        must never be handed out again from this cache). Returns the ids."""
        return self.ring.free_ids(ids, False)

    def adopt(self, ids: Any) -> None:
        """Ids the lease came to hold outside the cache (adopted sealed pages): in use from now
        on (see ``IdRing.adopt``)."""
        self.ring.adopt(ids)

    def unfree(self, arr: np.ndarray) -> None:
        """The daemon refused the Free that ``free`` asked for: the ids are still in use."""
        self.ring.unforget(arr)

    def check_count(self, n: Any) -> int:
        """``alloc``'s count, checked.

        Raises:
            InvalidArgument: not an integer >= 0.
        """
        n = as_int(n, "count")
        if n < 0:
            raise InvalidArgument(f"count={n}: must be >= 0", field="count")
        return n

    # -- a miss: an alloc the ring cannot serve -----------------------------------------------

    def reserve(self, n: int) -> np.ndarray:
        """Take every cached id (fewer than ``n``) out of the ring while the rest is asked of
        the daemon (see ``IdRing.reserve``)."""
        return self.ring.reserve(n)

    def miss_counts(self, n: int, reserved: np.ndarray) -> tuple[int, ...]:
        """The Allocates a miss of ``n`` tries in turn until one is granted: what it lacks
        plus a refill (at least ``batch``), then, if that was refused, exactly what it lacks."""
        need = n - reserved.shape[0]
        ask = max(need, self.batch)
        return (ask,) if ask == need else (ask, need)

    def miss_failed(self, reserved: np.ndarray, err: BaseException, calls: int) -> None:
        """That miss failed after ``calls`` Allocates (the daemon refused, or anything else):
        its reserved ids go back into the ring."""
        self.rpc_calls += calls
        self.waits += 1
        self.ring.unreserve(reserved)
        if isinstance(err, ResourceExhausted):
            self.refused += 1
        elif isinstance(err, NotFound):
            self.lose(err)

    def miss_done(self, reserved: np.ndarray, got: np.ndarray, n: int,
                  calls: int) -> np.ndarray:
        """The ``n`` ids of that miss (see ``IdRing.hand_out``), counted as a refill; the
        worker is woken if the watermarks now ask for work."""
        self.rpc_calls += calls
        self.waits += 1
        ids = self.ring.hand_out(reserved, got, n)
        self.refills += 1
        self.fetched += got.shape[0]
        if self.wants_work():
            self.kick()
        return ids

    # -- the worker ---------------------------------------------------------------------------

    def wants_work(self) -> bool:
        cached = self.cached
        return cached < self.low or cached > self.high or self.give_back > 0

    def refill_due(self, cached: int) -> bool:
        """Whether the watermarks ask for a refill (below ``low``, or the first fill)."""
        return cached < self.low or (self.prefill and cached < self.high)

    def kick(self) -> None:
        """Wake the worker (it then looks at everything there is to do)."""
        self.kicked = self.kicked_return = True
        self.wake()

    def ask_give_back(self, n: int, min_id: int = 0) -> int:
        """The daemon asks for ``n`` cached ids: the worker returns up to that many from the
        cache, the highest first (never ids in use), and past what the cache holds, up to what
        the owner said it can evict (the owner's evictor frees those into the cache first).
        With ``min_id`` > 0 only cached ids >= ``min_id`` (an elastic pool's groups being
        drained; O(cached) to count them), and nothing is evicted for it. Returns how many it
        will return; the worker is woken for them."""
        if self.dead is not None or n <= 0:
            return 0
        if min_id > 0:
            above = int(count_nonzero(self.ring.cached_ids() >= min_id))
            k = max(0, min(n, above - self.give_back))
            self.give_back += k
        else:
            from_cache = max(0, min(n, self.cached - self.give_back))
            from_evict = max(0, min(n - from_cache, self.evictable - self.evict_wanted))
            self.give_back += from_cache + from_evict
            self.evict_wanted += from_evict
            k = from_cache + from_evict
        if k:
            self.kick()
        return k

    def set_evictable(self, n: int) -> None:
        """How many ids in use the owner's evictor can free now (ignored without one)."""
        if self.can_evict:
            self.evictable = max(0, int(n))

    def evict_due(self) -> int:
        """How many ids the owner's evictor must free into the cache now (for give-backs asked
        past what the cache held); the shell runs the evictor with it."""
        want, self.evict_wanted = self.evict_wanted, 0
        self.evictable = max(0, self.evictable - want)
        return want

    def evict_failed(self, want: int, err: BaseException) -> None:
        """The evictor raised: the give-back still waiting for its ids gives up on them (the
        daemon's Allocate that asked stops waiting when the lease reports again)."""
        self.give_back = max(0, self.give_back - want)
        self.last_error = err if isinstance(err, KVPoolError) else FailedPrecondition(
            f"the evictor of the page cache of {self.label} failed: {err!r}")

    def report(self) -> tuple[int, int, int]:
        """``(cached, in_use, evictable)`` for the lease's KeepAlive report (ids an ``alloc``
        waiting on the daemon took out of the ring count as in use; evictable ids are in use,
        and not yet asked for)."""
        in_use = self.ring.n_in_use + self.ring.reserved
        return (self.cached, in_use,
                max(0, min(self.evictable - self.evict_wanted, in_use)))

    def work(self, now: float, lost: KVPoolError | None) -> tuple[str, Any] | float | None:
        """The worker's (or ``maintain``'s) next step, given why the lease can no longer hold
        ids (``lease_lost``; None while it is alive): a job to run now, counted in
        ``rpc_calls`` (``(GIVE_BACK | RETURN, ids)``, taken out of the ring, or
        ``(REFILL, count)``), else how long to sleep (``idle``), else None: stop."""
        if self.dead is None and lost is not None:
            self.lose(lost)
        job = self.pick_job(now)
        if job is None:
            return self.idle(now)
        self.rpc_calls += 1
        return job

    def pick_job(self, now: float) -> tuple[str, Any] | None:
        if self.dead is not None:
            return None
        ring = self.ring
        if self.give_back > 0:
            k = min(self.give_back, self.cached)
            # what is left waits only for the owner's evictor (asked after it last ran)
            self.give_back = min(self.give_back - k, self.evict_wanted)
            if k:
                ids = ring.take_highest(k)
                self.returning += k
                return GIVE_BACK, ids
        cached = self.cached
        if cached > self.high and now >= self.return_retry.at:
            keep = max(self.low, self.high - self.batch)
            ids = ring.take_newest(cached - keep)
            self.returning += ids.shape[0]
            return RETURN, ids
        if self.refill_due(cached) and now >= max(self.refill_retry.at, self.hold_until):
            return REFILL, min(self.high - cached, self.refill_cap)
        return None

    def job_done(self, kind: str, arg: Any, result: Any, now: float) -> None:
        """The job's RPC succeeded (``result``: a refill's ids)."""
        if kind == REFILL:
            self.refill_retry.succeeded()
            self.ring.push(result)
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
                self.hold_until = now + GIVE_BACK_HOLD_S

    def job_error(self, kind: str, err: BaseException) -> KVPoolError:
        """What a failed job's RPC means to the cache: the daemon's error as it is; anything
        else (a bug, a broken channel) logged with its traceback, as FailedPrecondition. Call
        it inside the ``except`` block."""
        if isinstance(err, KVPoolError):
            return err
        log.exception("page cache %s: %s failed", self.label, kind)
        return FailedPrecondition(str(err))

    def job_failed(self, kind: str, arg: Any, err: KVPoolError, now: float) -> None:
        """The job's RPC failed: a return's ids go back into the ring (still the lease's); a
        refusal backs off (a refill refused for room asks for half at once)."""
        self.last_error = err
        retry = self.refill_retry if kind == REFILL else self.return_retry
        if kind != REFILL:
            self.returning -= arg.shape[0]
            self.ring.push(arg)  # still the lease's
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

    def idle(self, now: float) -> float | None:
        """The worker found nothing to do: how long it sleeps (None: it stops, the cache is
        closed or lost). Sets ``kicked`` and ``kicked_return`` for what it will retry by itself
        when it wakes, and calls ``on_settled`` when nothing ``settle`` waits for is left."""
        if self.dead is not None:
            self.kicked = self.kicked_return = False
            self.on_settled()
            return None
        refill_at, return_at = self.deferred(now)
        # While it waits to retry, ``alloc`` (refills) or ``free`` (returns) need not wake it.
        self.kicked = refill_at != float("inf")
        self.kicked_return = return_at != float("inf")
        if self.settled():
            self.on_settled()
        return min(LEASE_POLL_S, min(refill_at, return_at) - now)

    # -- settle -------------------------------------------------------------------------------

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
        if self.returning or (self.give_back and self.cached):
            return False
        cached = self.cached
        rnd = self.settle_round
        if cached > self.high and self.return_retry.refused_in < rnd:
            return False
        return not (self.refill_due(cached) and self.refill_retry.refused_in < rnd)

    def settle_pause(self, now: float, deadline: float | None) -> bool | float:
        """For a cache without a worker, after a ``maintain``: True when settled, False when
        ``deadline`` (time.monotonic) has passed, else how long to sleep before the next
        ``maintain`` (until a held-back job may run, at most ``LEASE_POLL_S``)."""
        if self.settled():
            return True
        until = min(min(self.deferred(now)), now + LEASE_POLL_S)
        if deadline is not None:
            if now >= deadline:
                return False
            until = min(until, deadline)
        return max(0.0, until - now)

    # -- end ----------------------------------------------------------------------------------

    def close(self) -> bool:
        """Mark the cache closed; False if it already was."""
        if self.closed:
            return False
        self.closed = True
        if self.dead is None:
            self.dead = FailedPrecondition(f"the page cache of {self.label} is closed",
                                           field="cache")
        return True

    def drain(self) -> np.ndarray:
        """Every cached id, taken out of the ring (``close``; none once the lease is gone)."""
        ids = self.ring.drain()
        return ids if self.lost is None else ids[:0]

    def lose(self, err: KVPoolError) -> None:
        """The lease or pool is gone, and with it every id this cache had."""
        if self.lost is None:
            self.lost = err
            self.dead = err
            self.ring.drain()
            log.error("page cache %s lost its ids: %s", self.label, err)

    def __repr__(self) -> str:
        return (f"{self.label}, low={self.low}, high={self.high}, batch={self.batch}, "
                f"in_use={self.in_use}, cached={self.cached}")


def lease_lost(lease: Any) -> KVPoolError | None:
    """Why the lease can no longer hold ids: its keep-alive was told NotFound (it expired), or
    it was closed; None while it is alive."""
    err = lease.error
    if isinstance(err, NotFound):
        return err
    if lease.closed:
        return lease_closed(lease.lease_id)
    return None



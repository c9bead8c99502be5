"""The page cache's policy: when to refill, return and give back, how to back off, and whether
the lease still holds what the cache counts. No I/O, no locking.

:class:`PageCacheCore` is an :class:`~kvpool.cache.ring.IdRing` (the ids) with this policy on
top; both page caches (``kvpool.cache.page_cache``, ``kvpool.cache.aio_page_cache``) are thin
shells around one: they lock (the sync one) or not (the asyncio one), make the RPCs the core
asks for, and hand it the replies. See ``kvpool.cache.page_cache`` for the behaviour.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.cache.ring import SLOT_WINDOW, IdRing, no_worker
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


class PageCacheCore(IdRing):
    """A page cache's ring (:class:`~kvpool.cache.ring.IdRing`) and its policy: when to
    refill, return and give back, how to back off, whether the lease still holds what the cache
    counts; no I/O, no locking.

    The sync :class:`PageCache` calls it under its lock, the asyncio ``AsyncPageCache`` from
    its event loop. Besides the ring's three places (cached, handed out, reserved by a miss),
    ids may be being returned by the worker (``returning``); all of them are held by the lease.
    """

    def __init__(self, pool: str, space: str, capacity: int, low: int, high: int,
                 batch: int, window: int = SLOT_WINDOW, rebase_at: int | None = None) -> None:
        super().__init__(f"{pool}/{space}", capacity, low, high, window, rebase_at)
        self.pool = pool
        self.space = space
        self.batch = batch
        self.returning = 0
        self.refills = 0
        self.returns = 0
        self.rpc_calls = 0
        self.waits = 0
        self.fetched = 0
        self.returned = 0
        self.gave_back = 0
        self.checks = 0
        self.check_due = False  # a reply said the lease holds fewer ids than the cache counts
        # RPCs of this cache in flight, and started in all: a reply's ``held`` is compared only
        # when no other RPC of the cache ran at the same time (``rpc_begin``/``rpc_end``).
        self.active = 0
        self.starts = 0
        self.give_back = 0  # ids the daemon asked back, not yet taken out of the ring
        # Ids in use that the owner frees on demand (an engine's prefix cache: ``evictable``,
        # set by the owner; 0 without an evictor), and of the give-backs asked, how many the
        # owner's evictor must free into the ring first (``PageCache.maintain`` does).
        self.can_evict = False
        self.evictable = 0
        self.evict_wanted = 0
        self.hold_until = 0.0  # no background refill before (after a give-back)
        self.closed = False
        self.lost: KVPoolError | None = None  # the lease or pool is gone
        self.refill_retry = Backoff()
        self.return_retry = Backoff()
        self.settle_round = 0  # ``begin_settle`` calls
        self.refill_cap = high
        self.prefill = True  # the first refill fills to ``high`` even when ``low`` is 0
        self.last_error: KVPoolError | None = None
        self.on_settled: Callable[[], object] = no_worker  # tells ``settle`` (the shell's)

    # -- what the shells do around the ring ---------------------------------------------------

    def miss_begin(self) -> tuple[int, bool]:
        """An ``alloc`` the ring could not serve calls Allocate: counted, and its RPC token."""
        self.rpc_calls += 1
        return self.rpc_begin()

    def miss_failed(self, reserved: np.ndarray, err: BaseException) -> None:
        """That ``alloc`` failed (the daemon refused, or anything else): its reserved ids go
        back into the ring."""
        self.waits += 1
        self.unreserve(reserved)
        if isinstance(err, NotFound):
            self.lose(err)

    def miss_done(self, reserved: np.ndarray, got: np.ndarray, n: int,
                  token: tuple[int, bool], held: int | None) -> np.ndarray:
        """The ``n`` ids of that ``alloc`` (see ``IdRing.hand_out``), counted as a refill; the
        worker is woken if the watermarks now ask for work."""
        self.waits += 1
        ids = self.hand_out(reserved, got, n)
        self.refills += 1
        self.fetched += got.shape[0]
        self.rpc_end(token, held)
        if self.wants_work():
            self.kick()
        return ids

    def send_freed(self, ids: np.ndarray) -> bool:
        """Ids ``free_ids`` did not cache (the cache is closed or lost): whether the shell
        Frees them at the daemon now (counted in ``rpc_calls``): not once the lease is gone,
        which took them."""
        send = self.lost is None and ids.shape[0] > 0
        if send:
            self.rpc_calls += 1
        return send

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
        cache (never ids in use), and past what the cache holds, up to what the owner said it
        can evict (the owner's evictor frees those into the cache first). Returns how many it
        will return."""
        if self.dead is not None or n <= 0:
            return 0
        from_cache = max(0, min(n, self.cached - self.give_back))
        from_evict = max(0, min(n - from_cache, self.evictable - self.evict_wanted))
        self.give_back += from_cache + from_evict
        self.evict_wanted += from_evict
        return from_cache + from_evict

    def report(self) -> tuple[int, int, int]:
        """``(cached, in_use, evictable)`` for the lease's KeepAlive report (ids an ``alloc``
        waiting on the daemon took out of the ring count as in use; evictable ids are in use,
        and not yet asked for)."""
        in_use = self.n_in_use - self.unheld_in_use + self.reserved
        return (self.cached, in_use,
                max(0, min(self.evictable - self.evict_wanted, in_use)))

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
            # what is left waits only for the owner's evictor (asked after it last ran)
            self.give_back = min(self.give_back - k, self.evict_wanted)
            if k:
                ids = self.take_highest(k)
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

    def work(self, lease: Any) -> tuple[str, Any] | float | None:
        """The worker's next step: a job to run (``next_job``), else how long to sleep
        (``idle``), else None: stop."""
        now = time.monotonic()
        job = self.next_job(now, lease)
        return job if job is not None else self.idle(now)

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



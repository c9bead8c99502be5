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

The only path: while a cache is open its lease refuses its own Allocate and Free of the
cache's space (``FailedPrecondition`` naming the cache), and a cache opens only on a space of
which the lease holds nothing; so what the lease holds of the space is exactly what the cache
counts (in use, cached, on their way to or from the daemon), and nothing frees an id behind
the cache's back.

"Does not fit" is a value: ``try_alloc(n)`` returns None when the cache and the daemon
together have fewer than ``n`` (the cache as it was); ``alloc(n)`` is ``try_alloc`` raising
the daemon's ``ResourceExhausted`` instead, for callers written against exceptions.

Order: ``alloc`` hands out the ids cached longest first (FIFO): it takes a slice from the head
of a ring and writes nothing per id, so it costs what an in-process free list costs;
``free`` and refills append at the tail, returns to the daemon take the newest from the tail.

Spaces: any id space that no other space follows and that follows none (``kv`` of MHA, MLA,
DSA and hybrid linear pools; ``req``, ``state``, ``c4_state``, ``c128_state``). Paired pages
(``kv`` of hybrid SWA and DeepSeek-V4 pools, which ``swa`` follows, and ``swa``) are refused for
now: a page's ``swa`` side is released through the daemon as the window slides (``Free`` of
``swa``), so a cached pair can go stale; see docs/api.md, "Page cache".

Shape: the behaviour is a sans-IO core (``kvpool.cache.policy.PageCacheCore``, over the ring
of ``kvpool.cache.ring``); this module and ``kvpool.cache.aio_page_cache`` are its thread and
asyncio shells: they lock, make the calls the core asks for, and hand it the replies. Read
the cache's state from its core (``cache.core.cached``, ``cache.core.in_use``, ...).

Locking (the sync cache): one lock guards the core (the ring, the slots, the counters);
``alloc`` and ``free`` hold it for a few numpy operations. No RPC is ever made with it held:
the worker and a missing ``alloc`` take ids out of the ring under the lock, call the daemon
unlocked, and put the result back under the lock. The lock is innermost (nothing else is
acquired under it but the worker's ``threading.Event``); the lease's keep-alive thread takes
it briefly, holding nothing else, to read the counts it reports and to pass on a give-back
(docs/api.md, "Page cache", pressure).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

import numpy as np

from kvpool.cache.policy import (
    JOB_CALLS,
    PageCacheCore,
    PageCacheCounters,
    lease_lost,
    refuse_held,
    space_capacity,
    watermarks,
)
from kvpool.contract.errors import (
    FailedPrecondition,
    KVPoolError,
    NotFound,
    ResourceExhausted,
)

log = logging.getLogger(__name__)


class Lease(Protocol):
    """What a page cache needs of its lease (``kvpool.clients.client.Lease`` is one): the
    cache depends on this, not on the clients, which depend on the cache."""

    lease_id: int
    client: Any  # its ``stats(pool)`` sizes the cache

    @property
    def closed(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    def report_now(self, timeout_s: float = ...) -> bool: ...

    def _cache_allocate(self, pool: str, space: str, count: int) -> np.ndarray: ...

    def _cache_free(self, pool: str, space: str, ids: Any) -> int: ...

    def _register_cache(self, cache: Any) -> None: ...

    def _unregister_cache(self, cache: Any) -> None: ...

    def _report_soon(self) -> None: ...


class PageCache:
    """Ids of one (lease, pool, id space) served from a local queue; see the module docstring.

    Made by :meth:`kvpool.clients.client.Lease.page_cache`; a context manager (``close`` on exit).
    Thread-safe: ``alloc``, ``free`` and the counters may be used from any thread. Its state
    is its core's (``core``: read it, never change it).
    """

    def __init__(self, lease: Lease, pool: str, space: str, capacity: int, *,
                 low: int | None = None, high: int | None = None,
                 batch: int | None = None, background: bool = True,
                 fill: bool = True, held: Any = None) -> None:
        lo, hi, ba = watermarks(capacity, low, high, batch)
        self._lease = lease
        self._evictor: Callable[[int], object] | None = None
        self.core = core = PageCacheCore(pool, space, capacity, lo, hi, ba)
        if held is not None:  # ids the lease holds already (adopted): in use, before any fill
            core.adopt(held)
        # fill=False: no first fill to ``high`` (an elastic pool's engine grows its cache on
        # demand instead of asking the daemon for ``high`` pages at once).
        core.prefill = fill
        self._lock = threading.Lock()
        self._wake = threading.Event()
        core.wake = self._wake.set
        self._idle = threading.Event()
        core.on_settled = self._idle.set
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvpool-page-cache-{pool}-{space}")
        core.kick()  # the first refill, to ``high``
        # background=False: no worker thread; the engine calls ``maintain`` (between steps,
        # while its forward pass runs), so no refill or return ever lands inside its calls.
        self.background = background
        # The lease reports the cache on KeepAlive, routes give-backs, refuses its own
        # Allocate and Free of the space, and says when it ends.
        lease._register_cache(self)
        lost = lease_lost(lease)
        if lost is not None:  # closed or lost before the registration
            self.lease_gone(lost)
        if background:
            self._thread.start()
        else:
            self.maintain()

    @classmethod
    def open(cls, lease: Lease, pool: str, space: str = "kv", *, low: int | None = None,
             high: int | None = None, batch: int | None = None,
             background: bool = True, fill: bool = True, held: Any = None) -> PageCache:
        """A cache over ``pool``'s ``space`` for ``lease``: one Stats call learns the space's
        capacity (and whether it is paired) and that the lease holds none of it (or exactly
        ``held``: ids it adopted, in use from the start); the cache is then filled to
        ``high`` (by the worker, or at once without one).

        Raises:
            NotFound, InvalidArgument: see ``space_capacity``. FailedPrecondition: the lease
                holds ids of the space other than ``held`` (see ``refuse_held``).
        """
        stats = lease.client.stats(pool)
        capacity = space_capacity(stats, pool, space)
        refuse_held(stats, lease.lease_id, pool, space,
                    expected=0 if held is None else len(held))
        return cls(lease, pool, space, capacity, low=low, high=high, batch=batch,
                   background=background, fill=fill, held=held)

    def maintain(self) -> int:
        """Do now, in this thread, the refills, returns and give-backs the watermarks ask for
        (what the worker does in the background); for a cache opened with
        ``background=False``, call it once per engine step, outside the step's allocs and
        frees (a give-back the daemon asks for also waits for it). Without work it costs a
        lock and a few comparisons.

        Returns:
            The RPCs made.

        Raises:
            Exception: what the evictor raised (the give-back it was to serve is given up;
                the cache stays usable, and the next ``maintain`` does the rest).
        """
        core = self._run_evictor()
        done = 0
        while True:
            with self._lock:
                step = core.work(time.monotonic(), lease_lost(self._lease))
            if type(step) is not tuple:
                return done
            self._do_job(step)
            done += 1

    def _run_evictor(self) -> PageCacheCore:
        """Run the evictor for the give-backs waiting on it (``maintain``'s first part)."""
        core = self.core
        evict = self._evictor
        if evict is not None and core.evict_wanted:
            with self._lock:
                want = core.evict_due()
            try:
                evict(want)  # frees into this cache: the give-back takes them
            except BaseException as err:
                with self._lock:
                    core.evict_failed(want, err)
                raise
        return core

    def set_evictor(self, evict: Callable[[int], object] | None) -> None:
        """Let the daemon's give-backs reach ids in use that the owner can free on demand (an
        engine's prefix cache): ``evict(n)`` frees up to ``n`` ids into this cache (with
        ``free``), called from :meth:`maintain` when a give-back asks for more than the cache
        holds; :meth:`set_evictable` says how many there are. Only for a cache opened with
        ``background=False`` (the evictor runs in the owner's thread, between its steps).

        Raises:
            FailedPrecondition: the cache has a worker thread.
        """
        if evict is not None and self.background:
            raise FailedPrecondition(
                f"the page cache of {self.core.label} has a worker thread: an evictor needs "
                "a cache opened with background=False (it runs in maintain)", field="evictor")
        with self._lock:
            self._evictor = evict
            self.core.can_evict = evict is not None
            if evict is None:
                self.core.evictable = 0

    def set_evictable(self, n: int) -> None:
        """How many of the ids this cache handed out the owner's evictor can free now (the
        lease reports it; a give-back may ask for them). Ignored without an evictor."""
        with self._lock:
            self.core.set_evictable(n)

    # -- the hot path -------------------------------------------------------------------------

    def try_alloc(self, n: int) -> np.ndarray | None:
        """``n`` ids (int32), from the cache when it has them, else with one Allocate (two
        when the pool is nearly full); None when the cache and the daemon together have fewer
        than ``n`` (the cache is left as it was).

        Raises:
            FailedPrecondition: the cache is closed. NotFound / FailedPrecondition: the lease
                expired or was closed, or the pool was dropped (the cache's ids are gone with
                it). InvalidArgument: ``n`` not an integer >= 0.
        """
        got = self._get(n)
        return got if type(got) is np.ndarray else None

    def alloc(self, n: int) -> np.ndarray:
        """:meth:`try_alloc`, raising instead of returning None.

        Raises:
            ResourceExhausted: the daemon's refusal, when the cache and the daemon together
                have fewer than ``n``. Otherwise as :meth:`try_alloc`.
        """
        got = self._get(n)
        if type(got) is not np.ndarray:
            raise got
        return got

    def _get(self, n: int) -> np.ndarray | ResourceExhausted:
        """The ids, or the daemon's refusal (``try_alloc`` and ``alloc``)."""
        core = self.core
        if type(n) is not int or n < 0:
            n = core.check_count(n)
        lock = self._lock
        # acquire/release, not ``with``: ~1 us less on a cold path (after the forward pass).
        lock.acquire()
        try:
            # The lease marks the core dead (``lease_gone``) before its CloseLease takes back
            # every id, and when its keep-alive learns that it expired: ``take`` raises.
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
        core = self.core
        lock = self._lock
        lock.acquire()
        try:
            arr, send = core.free(ids)
        finally:
            lock.release()
        if send:
            try:
                self._lease._cache_free(core.pool, core.space, arr)
            except KVPoolError as err:
                if not isinstance(err, NotFound):
                    with lock:
                        core.unfree(arr)  # still the lease's and in use: free them again
                raise
        return arr.shape[0]

    def release(self, ids: Any) -> np.ndarray:
        """Take back ids this cache handed out without caching them: the caller gives them
        back to the daemon itself, with :meth:`return_ids` (an engine's sealed pages, which
        this cache must never hand out again). Checked as :meth:`free` checks.

        Returns:
            The ids (until returned they are still the lease's, counted by neither side).
        """
        with self._lock:
            return self.core.release(ids)

    def return_ids(self, ids: Any) -> int:
        """Free ids :meth:`release` took back at the daemon (one Free; a sealed page goes to
        the pool's directory). Any thread; a lease or pool already gone took them: 0."""
        try:
            return self._lease._cache_free(self.core.pool, self.core.space, ids)
        except NotFound:
            return 0

    def adopt(self, ids: Any) -> None:
        """Ids the lease came to hold outside this cache (``Lease.adopt``'s sealed pages): in
        use from now on, freed with :meth:`free` or :meth:`release`.

        Raises:
            InvalidArgument / FailedPrecondition: an id out of range, repeated, or already
                this cache's. Nothing is changed.
        """
        with self._lock:
            self.core.adopt(ids)

    # -- state --------------------------------------------------------------------------------

    def counters(self) -> PageCacheCounters:
        """All counters at one instant."""
        with self._lock:
            return self.core.counters()

    # Kept for client/kvpool/integrations/sglang/allocator.py (other work), which reads these
    # of the cache; everything else reads ``cache.core``.
    @property
    def cached(self) -> int:
        return self.core.cached

    @property
    def in_use(self) -> int:
        return self.core.in_use

    @property
    def batch(self) -> int:
        return self.core.batch

    def in_use_of(self, ids: Any) -> np.ndarray:
        return self.core.in_use_of(ids)

    def handed_out(self) -> np.ndarray:
        return self.core.handed_out()

    def settle(self, timeout_s: float | None = None) -> bool:
        """Wait until no refill, return or give-back is due or in flight. For tests and
        shutdown; never needed for correctness.

        What the worker holds back it tries at once (a refill or return waiting out a refusal's
        backoff, a refill held off after a give-back). Settled means: no give-back asked and not
        done, at most ``high`` cached, and at least ``low`` (``high`` before the first refill),
        each unless the daemon refused that refill or return since this call began (it is
        retried after its backoff: the daemon has no room, or cannot be reached). Frees and
        allocs made meanwhile, and give-backs the daemon asks later, may make new work.
        Without a worker (``background=False``) it runs :meth:`maintain` itself until then.

        A give-back reaches the cache on the lease's KeepAlive stream: one the daemon asked
        that is still on its way is not waited for. To include every give-back asked so far,
        call ``lease.report_now()`` first (its answer comes after them), then ``settle()``.
        Another lease's Allocate can ask for more at any time, so the counts of two caches on
        one pool are still only once neither lease makes an RPC (tests/e2e/test_two_engines.py).

        Returns:
            True when settled (or the cache is closed or lost); False if ``timeout_s`` passed
            first.
        """
        core = self.core
        if not self.background:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            with self._lock:
                core.begin_settle()
            while True:
                self.maintain()
                with self._lock:
                    pause = core.settle_pause(time.monotonic(), deadline)
                if type(pause) is bool:
                    return pause
                time.sleep(pause)
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
        core = self.core
        with self._lock:
            if not core.close():
                return 0
        self._lease._unregister_cache(self)
        self._wake.set()
        if self.background:
            self._thread.join()
        with self._lock:
            ids = core.drain()
            if not ids.shape[0]:
                return 0
            core.rpc_calls += 1
        try:
            self._lease._cache_free(core.pool, core.space, ids)
        except NotFound:
            return 0  # the lease (or pool) is gone and the ids with it
        return ids.shape[0]

    def __enter__(self) -> PageCache:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PageCache({self.core!r}, lease={self._lease.lease_id})"

    # -- the lease's keep-alive thread --------------------------------------------------------

    def lease_gone(self, err: KVPoolError) -> None:
        """The lease is closing or expired: every id of the cache goes with it (``alloc``
        raises ``err`` from now on; ``free`` only unmarks)."""
        with self._lock:
            self.core.lose(err)
        self._wake.set()

    def _report(self) -> tuple[int, int, int]:
        """``(cached, in_use, evictable)`` now, for the lease's KeepAlive."""
        with self._lock:
            return self.core.report()

    def _give_back(self, n: int, min_id: int = 0) -> int:
        """The daemon asked for ``n`` cached ids (only ids >= ``min_id`` when it is > 0); the
        worker returns up to that many (one Free), then the lease reports the new counts.
        Returns how many it will return."""
        with self._lock:
            return self.core.ask_give_back(n, min_id)

    # -- the slow paths -----------------------------------------------------------------------

    def _miss(self, n: int, reserved: np.ndarray) -> np.ndarray | ResourceExhausted:
        """Allocate what the cache lacked (plus a refill), unlocked; see the module docstring.
        Returns the ids, or the daemon's last refusal."""
        core = self.core
        calls = 0
        refusal: ResourceExhausted | None = None
        try:
            for count in core.miss_counts(n, reserved):
                calls += 1
                try:
                    got = self._lease._cache_allocate(core.pool, core.space, count)
                except ResourceExhausted as err:
                    refusal = err
                    continue
                with self._lock:
                    ids = core.miss_done(reserved, got, n, calls)
                self._lease._report_soon()
                return ids
        except BaseException as err:  # any failure (an interrupt too): the reserved ids go back
            with self._lock:
                core.miss_failed(reserved, err, calls)
            raise
        assert refusal is not None
        with self._lock:
            core.miss_failed(reserved, refusal, calls)
        return refusal

    def _do_job(self, job: tuple[str, Any]) -> None:
        """One refill or return RPC for the worker or ``maintain`` (called unlocked)."""
        core = self.core
        kind, arg = job
        try:
            result = getattr(self._lease, JOB_CALLS[kind])(core.pool, core.space, arg)
        except Exception as err:  # never let the worker die silently
            with self._lock:
                core.job_failed(kind, arg, core.job_error(kind, err), time.monotonic())
        else:
            with self._lock:
                core.job_done(kind, arg, result, time.monotonic())
            self._lease._report_soon()

    def _run(self) -> None:
        """The worker: refill below ``low``, return above ``high``; one RPC at a time."""
        core = self.core
        while True:
            with self._lock:
                step = core.work(time.monotonic(), lease_lost(self._lease))
            if step is None:
                return
            if type(step) is tuple:
                self._do_job(step)
            else:
                self._wake.wait(step)
                self._wake.clear()

"""``AsyncPageCache``: the page cache (``kvpool.cache.page_cache``) for asyncio engines.

    async with await lease.page_cache("llama") as cache:   # lease: an AsyncLease
        pages = await cache.alloc(16)      # served from the cache without suspending
        await cache.free(pages)

The asyncio shell of the same sans-IO core (``kvpool.cache.policy.PageCacheCore``) as the
thread one: ``alloc``/``try_alloc`` and ``free`` run to completion without yielding to the
event loop when the cache serves them; only a miss awaits an Allocate. The refill and return
worker is a task on the same loop, or, with ``background=False``, the engine awaits
``maintain()`` once per step. Not thread-safe: use a cache from its event loop's thread only
(the state is changed only between awaits, so no lock is needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
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
from kvpool.contract.errors import FailedPrecondition, KVPoolError, NotFound, ResourceExhausted


class AsyncLease(Protocol):
    """What an asyncio page cache needs of its lease (``kvpool.clients.aio.AsyncLease`` is
    one); see ``kvpool.cache.page_cache.Lease``."""

    lease_id: int
    client: Any  # its ``await stats(pool)`` sizes the cache

    @property
    def closed(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    async def _cache_allocate(self, pool: str, space: str, count: int) -> np.ndarray: ...

    async def _cache_free(self, pool: str, space: str, ids: Any) -> int: ...

    def _register_cache(self, cache: Any) -> None: ...

    def _unregister_cache(self, cache: Any) -> None: ...

    def _report_soon(self) -> None: ...


class AsyncPageCache:
    """Ids of one (lease, pool, id space) served from a local queue; see
    ``kvpool.cache.page_cache``. Its state is its core's (``core``).

    Made by :meth:`kvpool.clients.aio.AsyncLease.page_cache`; ``async with`` closes it.
    """

    def __init__(self, lease: AsyncLease, pool: str, space: str, capacity: int, *,
                 low: int | None = None, high: int | None = None,
                 batch: int | None = None, background: bool = True,
                 fill: bool = True, held: Any = None) -> None:
        lo, hi, ba = watermarks(capacity, low, high, batch)
        self._lease = lease
        self._evictor: Callable[[int], object] | None = None
        self.core = core = PageCacheCore(pool, space, capacity, lo, hi, ba)
        core.prefill = fill  # see PageCache.__init__
        if held is not None:  # ids the lease holds already (adopted): in use, before any fill
            core.adopt(held)
        self._wake = asyncio.Event()
        core.wake = self._wake.set
        self._idle = asyncio.Event()
        core.on_settled = self._idle.set
        core.kick()  # the first refill, to ``high``
        self.background = background
        self._task: asyncio.Task[None] | None = None
        lease._register_cache(self)  # see PageCache.__init__
        lost = lease_lost(lease)
        if lost is not None:
            self.lease_gone(lost)
        if background:
            self._task = asyncio.create_task(self._run(),
                                             name=f"kvpool-page-cache-{pool}-{space}")

    @classmethod
    async def open(cls, lease: AsyncLease, pool: str, space: str = "kv", *,
                   low: int | None = None, high: int | None = None,
                   batch: int | None = None, background: bool = True,
                   fill: bool = True, held: Any = None) -> AsyncPageCache:
        """See ``PageCache.open`` (``held``: ids the lease adopted, in use from the start;
        without a worker, the first fill is awaited here)."""
        stats = await lease.client.stats(pool)
        capacity = space_capacity(stats, pool, space)
        refuse_held(stats, lease.lease_id, pool, space,
                    expected=0 if held is None else len(held))
        cache = cls(lease, pool, space, capacity, low=low, high=high, batch=batch,
                    background=background, fill=fill, held=held)
        if not background:
            await cache.maintain()
        return cache

    async def maintain(self) -> int:
        """See ``PageCache.maintain``; the evictor may be a coroutine function.

        Returns:
            The RPCs made.
        """
        core = self.core
        evict = self._evictor
        if evict is not None and core.evict_wanted:
            want = core.evict_due()
            try:
                done = evict(want)  # frees into this cache: the give-back takes them
                if inspect.isawaitable(done):
                    await done
            except BaseException as err:
                core.evict_failed(want, err)
                raise
        made = 0
        while True:
            step = core.work(time.monotonic(), lease_lost(self._lease))
            if type(step) is not tuple:
                return made
            await self._do_job(step)
            made += 1

    def set_evictor(self, evict: Callable[[int], object] | None) -> None:
        """See ``PageCache.set_evictor``.

        Raises:
            FailedPrecondition: the cache has a worker task.
        """
        if evict is not None and self.background:
            raise FailedPrecondition(
                f"the page cache of {self.core.label} has a worker task: an evictor needs "
                "a cache opened with background=False (it runs in maintain)", field="evictor")
        self._evictor = evict
        self.core.can_evict = evict is not None
        if evict is None:
            self.core.evictable = 0

    def set_evictable(self, n: int) -> None:
        """See ``PageCache.set_evictable``."""
        self.core.set_evictable(n)

    # -- the hot path -------------------------------------------------------------------------

    async def try_alloc(self, n: int) -> np.ndarray | None:
        """``n`` ids (int32); awaits only when the cache cannot serve them; None when the
        cache and the daemon together have fewer. Raises as ``PageCache.try_alloc``."""
        got = await self._get(n)
        return got if type(got) is np.ndarray else None

    async def alloc(self, n: int) -> np.ndarray:
        """:meth:`try_alloc`, raising the daemon's ``ResourceExhausted`` instead of returning
        None. Raises as ``PageCache.alloc``."""
        got = await self._get(n)
        if type(got) is not np.ndarray:
            raise got
        return got

    async def _get(self, n: int) -> np.ndarray | ResourceExhausted:
        """The ids, or the daemon's refusal (``try_alloc`` and ``alloc``)."""
        core = self.core
        if type(n) is not int or n < 0:
            n = core.check_count(n)
        ids = core.take(n)  # raises once the lease marked the core dead (``lease_gone``)
        if ids is not None:
            return ids
        return await self._miss(n, core.reserve(n))

    async def free(self, ids: Any) -> int:
        """Give back ids this cache handed out, without awaiting (after ``close``: one Free).
        Raises as ``PageCache.free``."""
        core = self.core
        arr, send = core.free(ids)
        if send:
            try:
                await self._lease._cache_free(core.pool, core.space, arr)
            except KVPoolError as err:
                if not isinstance(err, NotFound):
                    core.unfree(arr)  # still in use: free them again
                raise
        return arr.shape[0]

    def release(self, ids: Any) -> np.ndarray:
        """See ``PageCache.release``: ids taken back uncached, for :meth:`return_ids`."""
        return self.core.release(ids)

    async def return_ids(self, ids: Any) -> int:
        """See ``PageCache.return_ids`` (one Free; a lease or pool already gone: 0)."""
        try:
            return await self._lease._cache_free(self.core.pool, self.core.space, ids)
        except NotFound:
            return 0

    def adopt(self, ids: Any) -> None:
        """See ``PageCache.adopt``: ids the lease came to hold outside this cache."""
        self.core.adopt(ids)

    # -- state --------------------------------------------------------------------------------

    def counters(self) -> PageCacheCounters:
        return self.core.counters()

    async def settle(self, timeout_s: float | None = None) -> bool:
        """See ``PageCache.settle``.

        Returns:
            True when settled (or the cache is closed or lost); False if ``timeout_s`` passed
            first.
        """
        core = self.core
        if self._task is None:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            core.begin_settle()
            while True:
                await self.maintain()
                pause = core.settle_pause(time.monotonic(), deadline)
                if type(pause) is bool:
                    return pause
                await asyncio.sleep(pause)
        if core.dead is not None or self._task.done():
            return True
        self._idle.clear()
        core.begin_settle()
        core.kick()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> int:
        """Stop the worker, return every cached id (one Free); see ``PageCache.close``."""
        core = self.core
        if not core.close():
            return 0
        self._lease._unregister_cache(self)
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        ids = core.drain()
        if not ids.shape[0]:
            return 0
        core.rpc_calls += 1
        try:
            await self._lease._cache_free(core.pool, core.space, ids)
        except NotFound:
            return 0
        return ids.shape[0]

    async def __aenter__(self) -> AsyncPageCache:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncPageCache({self.core!r}, lease={self._lease.lease_id})"

    # -- the lease's keep-alive task ----------------------------------------------------------

    def lease_gone(self, err: KVPoolError) -> None:
        """See ``PageCache.lease_gone``."""
        self.core.lose(err)
        self._wake.set()

    def _report(self) -> tuple[int, int, int]:
        return self.core.report()

    def _give_back(self, n: int, min_id: int = 0) -> int:
        """See ``PageCache._give_back``."""
        return self.core.ask_give_back(n, min_id)

    # -- the slow paths -----------------------------------------------------------------------

    async def _miss(self, n: int, reserved: np.ndarray) -> np.ndarray | ResourceExhausted:
        """See ``PageCache._miss``."""
        core = self.core
        calls = 0
        refusal: ResourceExhausted | None = None
        try:
            for count in core.miss_counts(n, reserved):
                calls += 1
                try:
                    got = await self._lease._cache_allocate(core.pool, core.space, count)
                except ResourceExhausted as err:
                    refusal = err
                    continue
                ids = core.miss_done(reserved, got, n, calls)
                self._lease._report_soon()
                return ids
        except BaseException as err:  # cancelled too: the reserved ids go back
            core.miss_failed(reserved, err, calls)
            raise
        assert refusal is not None
        core.miss_failed(reserved, refusal, calls)
        return refusal

    async def _run(self) -> None:
        """The worker task: refill below ``low``, return above ``high``; one RPC at a time."""
        core = self.core
        while True:
            step = core.work(time.monotonic(), lease_lost(self._lease))
            if step is None:
                return
            if type(step) is tuple:
                await self._do_job(step)
            else:
                if step > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), step)
                self._wake.clear()

    async def _do_job(self, job: tuple[str, Any]) -> None:
        """One refill or return RPC of the worker or ``maintain``; see ``PageCache._do_job``."""
        core = self.core
        kind, arg = job
        try:
            result = await getattr(self._lease, JOB_CALLS[kind])(core.pool, core.space, arg)
        except asyncio.CancelledError:
            core.job_failed(kind, arg, FailedPrecondition("cancelled"), time.monotonic())
            raise
        except Exception as err:  # never let the worker die silently
            core.job_failed(kind, arg, core.job_error(kind, err), time.monotonic())
        else:
            core.job_done(kind, arg, result, time.monotonic())
            self._lease._report_soon()

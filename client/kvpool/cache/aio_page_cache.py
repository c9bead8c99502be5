"""``AsyncPageCache``: the page cache (``kvpool.cache.page_cache``) for asyncio engines.

    async with await lease.page_cache("llama") as cache:   # lease: an AsyncLease
        pages = await cache.alloc(16)      # served from the cache without suspending
        await cache.free(pages)

``alloc`` and ``free`` run to completion without yielding to the event loop when the cache
serves them; only a miss awaits an Allocate. The refill and return worker is a task on the same
loop. Not thread-safe: use a cache from its event loop's thread only (the state is changed only
between awaits, so no lock is needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import TracebackType
from typing import Any, Protocol

import numpy as np

from kvpool.cache.page_cache import CacheState
from kvpool.cache.policy import (
    JOB_CALLS,
    PageCacheCore,
    PageCacheCounters,
    lease_lost,
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

    async def free(self, pool: str, space: str, ids: Any) -> int: ...

    async def _allocate_held(self, pool: str, space: str, count: int
                             ) -> tuple[np.ndarray, int | None]: ...

    async def _free_held(self, pool: str, space: str, ids: Any) -> tuple[int, int | None]: ...

    async def _check_held(self, pool: str, space: str, ids: Any
                          ) -> tuple[np.ndarray, int | None]: ...

    def _register_cache(self, cache: Any) -> None: ...

    def _unregister_cache(self, cache: Any) -> None: ...

log = logging.getLogger("kvpool.cache.page_cache")


class AsyncPageCache(CacheState):
    """Ids of one (lease, pool, id space) served from a local queue; see
    ``kvpool.cache.page_cache``.

    Made by :meth:`kvpool.clients.aio.AsyncLease.page_cache`; ``async with`` closes it.
    """

    def __init__(self, lease: AsyncLease, pool: str, space: str, capacity: int, *,
                 low: int | None = None, high: int | None = None,
                 batch: int | None = None) -> None:
        lo, hi, ba = watermarks(capacity, low, high, batch)
        self._lease = lease
        self._core = PageCacheCore(pool, space, capacity, lo, hi, ba)
        self._wake = asyncio.Event()
        self._core.wake = self._wake.set
        self._idle = asyncio.Event()
        self._core.on_settled = self._idle.set
        self._core.kick()  # the first refill, to ``high``
        self._task = asyncio.create_task(self._run(), name=f"kvpool-page-cache-{pool}-{space}")
        lease._register_cache(self)  # see PageCache.__init__
        lost = lease_lost(lease)
        if lost is not None:
            self.lease_gone(lost)

    @classmethod
    async def open(cls, lease: AsyncLease, pool: str, space: str = "kv", *,
                   low: int | None = None, high: int | None = None,
                   batch: int | None = None) -> AsyncPageCache:
        """See ``PageCache.open``."""
        stats = await lease.client.stats(pool)
        capacity = space_capacity(stats, pool, space)
        return cls(lease, pool, space, capacity, low=low, high=high, batch=batch)

    # -- the hot path -------------------------------------------------------------------------

    async def alloc(self, n: int) -> np.ndarray:
        """``n`` ids (int32); awaits only when the cache cannot serve them. Raises as
        ``PageCache.alloc``."""
        core = self._core
        if type(n) is not int or n < 0:
            n = core.check_count(n)
        if core.dead is not None:  # the lease marks it (``lease_gone``), see PageCache.alloc
            self._raise_dead()
        ids = core.take(n)
        if ids is not None:
            return ids
        return await self._miss(n, core.reserve(n))

    async def free(self, ids: Any) -> int:
        """Give back ids this cache handed out, without awaiting (after ``close``: one Free).
        Raises as ``PageCache.free``."""
        core = self._core
        arr, cached = core.free_ids(ids)
        send = not cached and core.send_freed(arr)
        if send:
            try:
                await self._lease.free(core.pool, core.space, arr)
            except KVPoolError as err:
                if not isinstance(err, NotFound):
                    core.unforget(arr)  # still in use: free them again
                raise
        return arr.shape[0]

    # -- state --------------------------------------------------------------------------------

    def counters(self) -> PageCacheCounters:
        return self._core.counters()

    async def settle(self) -> None:
        """Wait until no refill, return or give-back is due or in flight, as
        ``PageCache.settle`` (what the worker holds back it tries at once; a refill or return
        the daemon refused since this call began counts as done until its retry)."""
        core = self._core
        if core.dead is not None or self._task.done():
            return
        self._idle.clear()
        core.begin_settle()
        core.kick()
        await self._idle.wait()

    async def close(self) -> int:
        """Stop the worker, return every cached id (one Free); see ``PageCache.close``."""
        core = self._core
        if core.closed:
            return 0
        core.close()
        self._lease._unregister_cache(self)
        self._wake.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        ids = core.drain()
        if not ids.shape[0] or core.lost is not None:
            return 0
        core.rpc_calls += 1
        try:
            await self._lease.free(core.pool, core.space, ids)
        except NotFound:
            return 0
        return ids.shape[0]

    async def __aenter__(self) -> AsyncPageCache:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def __repr__(self) -> str:
        c = self._core
        return (f"AsyncPageCache({c.label}, lease={self._lease.lease_id}, low={c.low}, "
                f"high={c.high}, batch={c.batch}, in_use={c.n_in_use}, cached={c.cached})")

    # -- the lease's keep-alive task ----------------------------------------------------------

    def lease_gone(self, err: KVPoolError) -> None:
        """See ``PageCache.lease_gone``."""
        self._core.lose(err)
        self._wake.set()

    def _report(self) -> tuple[int, int, int]:
        return self._core.report()

    def _give_back(self, n: int, min_id: int = 0) -> int:
        """See ``PageCache._give_back``."""
        k = self._core.ask_give_back(n, min_id)
        if k:
            self._core.kick()
        return k

    # -- the slow paths -----------------------------------------------------------------------


    async def _miss(self, n: int, reserved: np.ndarray) -> np.ndarray:
        core = self._core
        need = n - reserved.shape[0]
        ask = max(need, core.batch)
        try:
            try:
                got, token, held = await self._allocate(ask)
            except ResourceExhausted:
                if ask == need:
                    raise
                got, token, held = await self._allocate(need)
        except BaseException as err:  # cancelled too: the reserved ids go back
            core.miss_failed(reserved, err)
            raise
        ids = core.miss_done(reserved, got, n, token, held)
        self._report_soon()
        return ids

    async def _allocate(self, count: int) -> tuple[np.ndarray, tuple[int, bool], int | None]:
        """See ``PageCache._allocate``."""
        core = self._core
        token = core.miss_begin()
        try:
            got, held = await self._lease._allocate_held(core.pool, core.space, count)
        except BaseException:
            core.rpc_end(token, None)
            raise
        return got, token, held

    async def _run(self) -> None:
        """The worker task: refill below ``low``, return above ``high``; one RPC at a time."""
        core = self._core
        while True:
            step = core.work(self._lease)
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
        """One refill, return or check RPC of the worker; see ``PageCache._do_job``."""
        core = self._core
        kind, arg = job
        token = core.rpc_begin()
        held = None
        try:
            result, held = await getattr(self._lease, JOB_CALLS[kind])(core.pool, core.space, arg)
        except asyncio.CancelledError:
            core.job_failed(kind, arg, FailedPrecondition("cancelled"), time.monotonic())
            raise
        except Exception as err:  # never let the worker die silently
            core.job_failed(kind, arg, core.job_error(kind, err), time.monotonic())
        else:
            core.job_done(kind, arg, result)
            self._report_soon()
        finally:
            core.rpc_end(token, held)

"""The elastic pools' executor: a group's memory committed or freed in a worker thread, its
state moved in the pool's ledger around it (committing -> open or closed; releasing -> closed or
failed), the budget's decisions reported back to the arbiter. It decides nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kvpool.contract.errors import KVPoolError
from kvpoold.elastic.arbiter import Arbiter
from kvpoold.elastic.elastic_pool import ElasticPool, Hooks, Unmapping

log = logging.getLogger("kvpoold.elastic")


class GroupMover:
    """Commits and frees the memory of elastic groups off the loop.

    Args:
        arbiter: the budget's shares (told what could not be backed, what was released).
        hooks: the daemon's side (wakes Allocates when pages open).
        clock: monotonic seconds (reclaim latencies).
        sync_budget: refreshes the arbiter's view of the rest of the budget.
        pools: the elastic pools by name (an asker a release was promised to).
    """

    def __init__(self, arbiter: Arbiter, hooks: Hooks, clock: Callable[[], float],
                 sync_budget: Callable[[], None], pools: dict[str, ElasticPool]) -> None:
        self.arbiter = arbiter
        self._hooks = hooks
        self._clock = clock
        self._sync_budget = sync_budget
        self._pools = pools
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("elastic task failed: %r", task.exception(),
                      extra={"fields": {"event": "elastic_error"}})

    async def grant(self, ep: ElasticPool, n: int, *, raise_errors: bool = False) -> int:
        """Back ``n`` closed groups of ``ep`` (lowest first) off the loop, then open them.
        The arbiter has counted them already; what cannot be backed is handed back."""
        if n <= 0:
            return 0
        space, pool = ep.space, ep.pool
        picks = space.closed_groups().tolist()[:n]
        if len(picks) < n:
            self.arbiter.failed(ep.name, n - len(picks))
        for g in picks:
            space.commit(g)
        release = pool.acquire("elastic grant")
        done: list[int] = []
        error: BaseException | None = None
        try:
            for g in picks:
                await asyncio.to_thread(ep.backing.grant, g)
                done.append(g)
        except (KVPoolError, OSError) as exc:
            error = exc
        finally:
            if pool.live:  # a dropped pool's groups go with its region
                for g in picks:
                    if g in done:
                        space.open_group(g)
                    else:
                        space.abort(g)
            release()
        if not pool.live:
            return 0
        ep.grants += len(done)
        if len(done) < len(picks):
            self.arbiter.failed(ep.name, len(picks) - len(done))
            log.error("elastic grant failed", extra={"fields": {
                "event": "elastic_grant_failed", "pool": ep.name,
                "groups": len(picks) - len(done), "error": str(error)}})
            if raise_errors and error is not None:
                raise error
        self._hooks.notify_freed()  # granted or failed: Allocates waiting on it look again
        return len(done)

    async def finish(self, u: Unmapping) -> None:
        """Every process unmapped ``u``'s groups (or a failed release is retried): free their
        memory, close them, and grant the freed budget to the pool it was promised to. A group
        whose memory cannot be freed is ``failed``: charged, counted, retried by the sweep."""
        ep = self._pools.get(u.pool)
        if ep is None:
            return
        space, pool = ep.space, ep.pool
        for g in u.groups:
            space.release(g)
        release = pool.acquire("elastic release")
        freed: list[int] = []
        error: BaseException | None = None
        try:
            for g in u.groups:
                try:
                    await asyncio.to_thread(ep.backing.release, g)
                except (KVPoolError, OSError) as exc:
                    error = exc
                else:
                    freed.append(g)
        finally:
            if pool.live:
                for g in u.groups:
                    if g in freed:
                        space.close_group(g)
                    else:
                        space.fail(g)
            release()
        if not pool.live:
            return
        failed = tuple(g for g in u.groups if g not in freed)
        if failed:
            ep.failures += len(failed)
            ep.retry.append(Unmapping(u.reclaim_id, u.pool, failed, set(), u.deadline,
                                      u.started, u.asker))
            log.error("elastic release failed: retried on the next sweep", extra={"fields": {
                "event": "elastic_release_failed", "pool": u.pool, "groups": list(failed),
                "reclaim": u.reclaim_id, "error": f"{type(error).__name__}: {error}"}})
        if not freed:
            return
        took = self._clock() - u.started
        ep.reclaims += len(freed)
        ep.reclaim_sum += took * len(freed)  # per group, as reclaims counts them
        ep.reclaim_max = max(ep.reclaim_max, took)
        self._sync_budget()
        granted = self.arbiter.released(u.pool, len(freed), u.asker)
        log.info("elastic released", extra={"fields": {
            "event": "elastic_released", "pool": u.pool, "groups": len(freed),
            "reclaim": u.reclaim_id, "seconds": round(took, 6), "for": u.asker or "",
            "granted": granted}})
        asker = self._pools.get(u.asker) if u.asker else None
        if asker is not None and granted:
            await self.grant(asker, granted)
        self._hooks.notify_freed()

    async def close(self) -> None:
        """Stop: cancel what is running (shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

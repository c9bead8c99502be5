"""What the elastic pools ask of the rest of the daemon (``kvpoold.elastic.manager.Hooks``),
each answered by the collaborator that owns it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvpoold.pools.pool_registry import PoolRegistry
from kvpoold.server.attachments import AttachmentTable
from kvpoold.server.give_back import CachePressure
from kvpoold.server.leases import LeaseTable

log = logging.getLogger("kvpoold.elastic")


class ElasticHooks:
    """The daemon's side of the elastic pools.

    Args:
        leases: the lease table (KeepAlive asks to unmap).
        attachments: who maps each pool.
        revoke: ends a lease that did not unmap in time.
        pressure: give-backs of page caches, and the wake-ups of waiting Allocates.
        registry: the pools (their kv spaces, their fixed charges).
    """

    def __init__(self, leases: LeaseTable, attachments: AttachmentTable,
                 revoke: Callable[[int, str], None], pressure: CachePressure,
                 registry: PoolRegistry) -> None:
        self._leases = leases
        self._attachments = attachments
        self.revoke = revoke
        self._pressure = pressure
        self._registry = registry

    def attached_leases(self, pool: str) -> set[int]:
        return self._attachments.leases_of_pool(pool)

    def descriptor_holders(self, pool: str) -> dict[int, set[int]]:
        return self._attachments.holders(pool)

    def ask_unmap(self, lease_id: int, pool: str, groups: tuple[int, ...], reclaim: int,
                  deadline_s: float) -> bool:
        lease = self._leases.find(lease_id)
        if lease is None:
            return False
        lease.ask_unmap(pool, groups, reclaim, deadline_s)
        return True

    def notify_freed(self) -> None:
        self._pressure.notify_freed()

    def ask_give_back(self, pool: str, count: int, min_id: int = 0) -> int:
        """The pool's kept sealed pages (ids ``>= min_id``) are evicted first, at once; the
        page caches are asked for the rest. Returns the pages evicted and asked."""
        entry = self._registry.get(pool)
        if entry is None:
            return 0
        evicted = entry.give_back_sealed(count, min_id)
        if evicted:
            log.info("sealed pages given back to an elastic reclaim", extra={"fields": {
                "event": "sealed_reclaim", "pool": pool, "pages": evicted,
                "min_id": min_id}})
            self._freed_soon()
        rest = count - evicted
        asked = self._pressure.ask(pool, entry.space_kv, rest, 0, cover=True,
                                   min_id=min_id) if rest > 0 else 0
        return evicted + asked

    def _freed_soon(self) -> None:
        """Ids came back: tell the waiters on the next loop turn (never inside the elastic
        manager's own step that asked)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a sweep catches up)
            return
        loop.call_soon(self._pressure.notify_freed)

    def cached(self, pool: str) -> int:
        """Pages the pool could give back without touching a live one: its page caches'
        cached ids and its directory's kept sealed pages."""
        entry = self._registry.get(pool)
        if entry is None:
            return 0
        return (self._pressure.cached_elsewhere(pool, entry.space_kv, 0)
                + entry.kept_sealed)

    def other_bytes(self) -> int:
        return self._registry.fixed_bytes() + self._registry.reserved_bytes

    def lease_name(self, lease_id: int) -> str:
        lease = self._leases.find(lease_id)
        return "" if lease is None else lease.name

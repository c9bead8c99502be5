"""The pools of one daemon by name, and what they take of its device budget.

One :class:`PoolRegistry` per daemon, on its event loop. A name is in exactly one of three
places: being built (``building``: its bytes reserved), live (``pools``), or dropped and waiting
for its last use to end (``dropping``: its bytes still charged). The registry alone moves a
name between them, and alone releases a dropped pool's region: in a worker thread (unlinking
and unmapping a large region takes long enough to stall the loop), the budget freed when that
returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvpool.contract.errors import Internal
from kvpool.contract.plan import PoolPlan
from kvpoold.pools.pool import Pool

log = logging.getLogger("kvpoold.pools")


def fixed_part(p: PoolPlan) -> int:
    """Budget bytes a pool takes whatever it is granted: a fixed pool's whole region, an
    elastic pool's fixed part (its groups are counted by the arbiter)."""
    return p.backing_bytes if p.elastic is None else p.elastic.fixed_bytes


class PoolRegistry:
    """Names, lifecycles and the fixed charges of a daemon's pools.

    Args:
        on_released: called on the loop with a dropped pool once its region is released
            (NIXL deregistration, waking Allocates that wait for budget).
    """

    def __init__(self, on_released: Callable[[Pool], None] = lambda _p: None) -> None:
        self.pools: dict[str, Pool] = {}
        self.building: dict[str, asyncio.Event] = {}
        self.reserved_bytes = 0
        self.dropping: dict[str, Pool] = {}
        # Ids of the live pool with the most (all its spaces): the most one Free can name,
        # which bounds its message before it is parsed (kvpoold.server.intake). Kept on each
        # change of ``pools`` so that a call reads it in O(1).
        self.most_ids = 0
        self._on_released = on_released
        self._closing: set[asyncio.Future[None]] = set()

    def get(self, name: str) -> Pool | None:
        """The live pool ``name``, or None (O(1))."""
        return self.pools.get(name)

    def fixed_bytes(self) -> int:
        """Budget bytes the pools take apart from elastic groups: live pools' fixed parts and
        dropped pools not yet released (O(pools))."""
        return (sum(fixed_part(p.plan) for p in self.pools.values())
                + sum(p.charged_bytes for p in self.dropping.values()))

    # -- building ---------------------------------------------------------------------------

    def reserve(self, name: str, nbytes: int) -> asyncio.Event:
        """Claim ``name`` and ``nbytes`` for a build; the event is set when it ends."""
        done = asyncio.Event()
        self.building[name] = done
        self.reserved_bytes += nbytes
        return done

    def built(self, name: str, nbytes: int, pool: Pool | None) -> None:
        """The build of ``name`` ended: ``pool`` is live (None: it failed)."""
        self.reserved_bytes -= nbytes
        done = self.building.pop(name)
        if pool is not None:
            self.pools[name] = pool
            self._count_ids()
        done.set()

    # -- dropping ---------------------------------------------------------------------------

    async def drop(self, name: str, charged_bytes: int) -> bool:
        """Drop the live pool ``name``: it leaves ``pools`` now; its region is released (in a
        worker thread) once no use holds it, ``charged_bytes`` charged until then. Returns
        whether it was released before this returns.

        Raises:
            Internal: no live pool ``name``.
        """
        pool = self.pools.pop(name, None)
        if pool is None:
            raise Internal(f"drop of pool {name!r}, which is not live")
        self._count_ids()
        self.dropping[name] = pool
        released: asyncio.Future[None] | None = None

        def idle(p: Pool) -> None:
            nonlocal released
            released = asyncio.ensure_future(self._release(p))
            self._closing.add(released)
            released.add_done_callback(self._closing.discard)

        pool.drop(charged_bytes, idle)
        if released is not None:  # nothing used it: released before Drop answers
            await asyncio.shield(released)
            return True
        return False

    async def _release(self, pool: Pool) -> None:
        try:
            await asyncio.to_thread(pool.close)
        finally:
            self.dropping.pop(pool.name, None)
            log.info("dropped pool released", extra={"fields": {
                "event": "drop_released", "pool": pool.name,
                "released_bytes": pool.charged_bytes}})
            self._on_released(pool)

    def close(self) -> None:
        """Release every pool's region now (shutdown): live, being dropped, whatever uses
        them."""
        for pool in [*self.pools.values(), *self.dropping.values()]:
            pool.close()
        self.pools.clear()
        self.dropping.clear()
        self._count_ids()

    def _count_ids(self) -> None:
        self.most_ids = max((sum(s.capacity for s in p.plan.id_spaces)
                             for p in self.pools.values()), default=0)

    def audit(self) -> None:
        """Every pool's invariants, and the registry's: a name in one place only, dropped pools
        dropping, live pools live.

        Raises:
            Internal: naming the first broken one.
        """
        both = (set(self.pools) & set(self.dropping)) | (set(self.building) & set(self.pools))
        if both:
            raise Internal(f"pools in two places at once: {sorted(both)}")
        for pool in self.pools.values():
            if pool.state != "live":
                raise Internal(f"pool {pool.name!r} is listed live but is {pool.state}")
            pool.audit()
        for pool in self.dropping.values():
            if pool.state == "live":
                raise Internal(f"pool {pool.name!r} is listed dropping but is live")
            pool.audit()
        most = self.most_ids
        self._count_ids()
        if most != self.most_ids:
            raise Internal(f"most_ids was {most:,}, the live pools' largest is {self.most_ids:,}")
        if self.reserved_bytes < 0 or (self.reserved_bytes and not self.building):
            raise Internal(f"{self.reserved_bytes} B reserved with no build running")

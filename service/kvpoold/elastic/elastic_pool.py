"""One elastic pool as the elastic wing keeps it, the handshakes in flight for it, and what the
wing asks of the rest of the daemon (:class:`Hooks`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvpool.contract.plan import PoolPlan
from kvpoold.ids.grouped import GroupedSpace
from kvpoold.pools.pool import Pool
from kvpoold.sharing.base import GroupBacking


class Hooks(Protocol):
    """What the manager needs of the daemon."""

    def attached_leases(self, pool: str) -> set[int]:
        """Leases with an attachment of ``pool`` now."""
        ...

    def ask_unmap(self, lease_id: int, pool: str, groups: tuple[int, ...], reclaim: int,
                  deadline_s: float) -> bool:
        """Queue an Unmap on the lease's KeepAlive stream; False when the lease is gone."""
        ...

    def revoke(self, lease_id: int, why: str) -> None:
        """End a lease that did not unmap in time (its ids and attachments come back)."""
        ...

    def notify_freed(self) -> None:
        """Wake Allocates waiting for ids."""
        ...

    def ask_give_back(self, pool: str, count: int, min_id: int = 0) -> int:
        """Ask page caches of ``pool`` to give back ``count`` kv pages (only ids >= ``min_id``
        when it is > 0); returns those asked."""
        ...

    def cached(self, pool: str) -> int:
        """kv pages of ``pool`` page caches report holding unused (backed by holdings)."""
        ...

    def other_bytes(self) -> int:
        """Budget bytes taken by everything but the elastic pools' groups."""
        ...

    def lease_name(self, lease_id: int) -> str:
        """The lease's name ("" when it is gone)."""
        ...


@dataclass
class ElasticPool:
    """One elastic pool as the manager keeps it: the pool aggregate and the counters."""

    pool: Pool
    allocs: int = 0  # Allocates since the arbiter last looked (0: idle)
    grants: int = 0
    reclaims: int = 0
    reclaim_sum: float = 0.0
    reclaim_max: float = 0.0
    revoked: int = 0
    failures: int = 0  # releases that failed (each retried)
    retry: list[Unmapping] = field(default_factory=list)  # failed groups, retried on sweeps

    @property
    def name(self) -> str:
        return self.pool.name

    @property
    def plan(self) -> PoolPlan:
        return self.pool.plan

    @property
    def backing(self) -> GroupBacking:
        return self.pool.backing  # type: ignore[return-value]

    @property
    def space(self) -> GroupedSpace:
        return self.pool.space_kv

    @property
    def pages_per_group(self) -> int:
        return self.space.pages_per_group

    def moving(self) -> int:
        """Groups whose memory a worker thread commits or frees now (O(1))."""
        return self.space.count("committing") + self.space.count("releasing")


@dataclass
class Unmapping:
    """Groups of ``pool`` drained and waiting for ``waiting`` leases to unmap them."""

    reclaim_id: int
    pool: str
    groups: tuple[int, ...]
    waiting: set[int]
    deadline: float
    started: float
    asker: str | None


@dataclass
class CachedAsk:
    """``groups`` of ``pool`` asked back through its page caches, until ``deadline``."""

    pool: str
    groups: int
    asker: str | None
    deadline: float
    started: float


@dataclass
class BusyDrain:
    """``groups`` of ``pool`` (pages in use) drained for ``asker``, until ``deadline``."""

    pool: str
    groups: list[int]
    asker: str | None
    deadline: float
    started: float

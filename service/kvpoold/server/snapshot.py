"""Stats: one consistent picture of the daemon, its pools and its leases, taken on the loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpoold.server.records import (
    DaemonSnapshot,
    HeldCount,
    LeaseSnapshot,
    PoolSnapshot,
    Snapshot,
)

if TYPE_CHECKING:
    from kvpoold.server.daemon import Daemon


def take_snapshot(daemon: Daemon, pool: str = "") -> Snapshot:
    """Stats now; with ``pool`` only that pool, and leases show only what they hold in it.

    Args:
        daemon: the daemon (read only).
        pool: a known pool name, or "" for all.
    """
    now = daemon.now()
    entries = [daemon.pools[pool]] if pool else list(daemon.pools.values())
    held: dict[int, list[HeldCount]] = {}
    pools = []
    for entry in entries:
        for owner, kinds in entry.allocator.held_by_owner().items():
            held.setdefault(owner, []).extend(
                HeldCount(entry.name, kind, count) for kind, count in kinds.items()
            )
        pools.append(PoolSnapshot(
            name=entry.name,
            fingerprint=entry.fingerprint,
            plan=entry.plan,
            kinds=entry.counters(),
            attached=daemon.attachments.count_pool(entry.name),
            age_s=now - entry.created_at,
            handle_kind=entry.handle_kind,
        ))
    leases = tuple(
        LeaseSnapshot(
            lease_id=lease.lease_id,
            name=lease.name,
            ttl_s=lease.ttl_s,
            expires_in_s=lease.expires_in(now),
            held=tuple(held.get(lease.owner, ())),
            attached=daemon.attachments.count_lease(lease.lease_id),
        )
        for lease in daemon.leases
    )
    table = daemon.leases
    return Snapshot(
        daemon=DaemonSnapshot(
            version=daemon.version,
            device=daemon.device,
            budget_bytes=daemon.budget_bytes,
            used_bytes=daemon.used_bytes,
            uptime_s=now - daemon.started_at,
            num_pools=len(daemon.pools),
            num_leases=len(table),
            leases_opened=table.opened,
            leases_closed=table.closed,
            leases_expired=table.expired,
        ),
        pools=tuple(pools),
        leases=leases,
    )

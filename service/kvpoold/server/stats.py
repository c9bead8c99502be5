"""Stats: one consistent picture of the daemon, its pools and its leases, taken on the loop.

Built once, in the shape clients decode (``kvpool.contract.records.Stats``): the servicer encodes
it with
``kvpool.contract.codec`` and ``/metrics`` reads the same record (as the daemon's own, admin, view).

What a caller sees (docs/security.md): an admin sees everything; any other caller sees the pools
its scope covers and its own identity's leases, the others' only counted
(``daemon.other_leases``), and no peers (they name other tenants' transfers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool.contract.records import DaemonStats, HeldMap, LeaseStats, PoolStats, Stats

if TYPE_CHECKING:
    from kvpoold.server.auth import Caller
    from kvpoold.server.daemon import Daemon


def take_stats(daemon: Daemon, caller: Caller, pool: str = "") -> Stats:
    """Stats now, as ``caller`` may see them; with ``pool`` only that pool, and leases show
    only what they hold in it.

    Args:
        daemon: the daemon (read only).
        caller: who asks: an admin sees every pool, lease and peer; anyone else the pools its
            scope covers and its own identity's leases.
        pool: a known pool name the caller may see, or "" for all.
    """
    now = daemon.now()
    entries = [daemon.pools[pool]] if pool else [
        e for e in daemon.pools.values() if caller.sees(e.name)]
    held: dict[int, HeldMap] = {}
    pools = []
    for entry in entries:
        for owner, spaces in entry.ids.held_by_owner().items():
            held.setdefault(owner, {})[entry.name] = spaces
        pools.append(PoolStats(
            name=entry.name,
            fingerprint=entry.fingerprint,
            architecture=entry.plan.architecture,
            kv_cache_dtype=entry.plan.kv_cache_dtype,
            page_size=entry.plan.page_size,
            max_total_num_tokens=entry.plan.max_total_num_tokens,
            max_running_requests=entry.plan.max_running_requests,
            backing_bytes=entry.plan.backing_bytes,
            spaces=entry.ids.counters(),
            attached=daemon.attachments.count_pool(entry.name),
            age_seconds=now - entry.created_at,
            sharing=entry.sharing,
        ))
    leases = []
    lease_now = daemon.leases.now()  # lease deadlines are on the lease clock
    others = 0
    for lease in daemon.leases:
        if not caller.admin and lease.identity != caller.identity:
            others += 1
            continue
        lease_held = held.get(lease.owner, {})
        leases.append(LeaseStats(
            lease_id=lease.lease_id,
            name=lease.name,
            ttl_seconds=lease.ttl_s,
            expires_in_seconds=lease.expires_in(lease_now),
            held=lease_held,
            attached=daemon.attachments.count_lease(lease.lease_id),
            cached=cached_of(lease.reports, lease_held),
        ))
    table = daemon.leases
    return Stats(
        daemon=DaemonStats(
            version=daemon.version,
            device=daemon.device,
            budget_bytes=daemon.budget_bytes,
            used_bytes=daemon.used_bytes,
            uptime_seconds=now - daemon.started_at,
            num_pools=len(daemon.pools),
            num_leases=len(table),
            leases_opened=table.opened,
            leases_closed=table.closed,
            leases_expired=table.expired,
            nixl_agent=agent.name if (agent := daemon.transfers.agent) is not None else "",
            other_leases=others,
            **stall_fields(daemon),
        ),
        pools=pools,
        leases=leases,
        peers=list(daemon.transfers.peers.values())
        if caller.admin else [],
    )


def stall_fields(daemon: Daemon) -> dict[str, Any]:
    """The event-loop stall counters of DaemonStats (zero without a stall clock)."""
    clock = daemon.stall_clock
    if clock is None:
        return {}
    return {"loop_stalls": clock.stalls, "loop_stalled_seconds": clock.stalled_s,
            "loop_longest_stall_seconds": clock.longest_stall_s}


def cached_of(reports: dict[tuple[str, str], tuple[int, int]], held: HeldMap) -> HeldMap:
    """The reported cached ids of the pools and spaces the lease holds ids in (never more than
    it holds: a report can be a renewal old)."""
    out: HeldMap = {}
    for (pool, space), (cached, _in_use) in reports.items():
        n = min(cached, held.get(pool, {}).get(space, 0))
        if n:
            out.setdefault(pool, {})[space] = n
    return out

"""Stats: the daemon, its pools and its leases as a caller may see them, in the shape clients
decode (``kvpool.contract.records.Stats``).

A picture is taken in two parts (:class:`StatsView`): at once, on the loop, what is O(pools):
the daemon's and the pools' counters, the peers, and which leases to list; then one
:class:`~kvpool.contract.records.LeaseStats` per listed lease (:func:`lease_stats`,
O(pools x spaces) each). :func:`take_stats` does both at once (``Daemon.stats``);
:func:`gather_stats` (``/metrics``, as the daemon's own, admin, view) and the servicer
(``kvpoold.server.stats_replies``) read the leases in slices between which the loop serves
other calls (:func:`lease_slices`), so a lease's entry can be a little newer than the counters.

What a caller sees (docs/security.md): an admin sees everything; any other caller sees the pools
its scope covers and its own identity's leases (``LeaseTable.of_identity``: O(its own leases),
the others only counted in ``daemon.other_leases``), and no peers (they name other tenants'
transfers).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.records import DaemonStats, HeldMap, LeaseStats, PoolStats, Stats
from kvpoold.server.seal_service import directory_stats
from kvpoold.settings import (  # daemon.py imports it from here
    MAX_WATCH_STREAMS_PER_IDENTITY as MAX_WATCH_STREAMS_PER_IDENTITY,
)
from kvpoold.settings import WATCH_MIN_INTERVAL_S

if TYPE_CHECKING:
    from kvpoold.access import Caller
    from kvpoold.elastic.manager import ElasticPools
    from kvpoold.pools.pool import Pool
    from kvpoold.server.attachments import AttachmentTable
    from kvpoold.server.leases import CacheCounts, Lease, LeaseTable
    from kvpoold.server.loop_clock import StallClock
    from kvpoold.transfer import Transfers


class Daemon(Protocol):
    """What Stats reads of the daemon (``kvpoold.server.daemon.Daemon`` is it; this module does
    not import that one, which calls these functions)."""

    version: str
    device: str
    budget_bytes: int
    started_at: float
    pools: dict[str, Pool]
    leases: LeaseTable
    attachments: AttachmentTable
    transfers: Transfers
    stall_clock: StallClock | None
    elastic: ElasticPools

    @property
    def used_bytes(self) -> int: ...

    def now(self) -> float: ...

    def pool(self, name: str, caller: Caller | None = None) -> Pool: ...

# WatchStats: the interval of a request that leaves it 0 and the longest one accepted (the
# defaults of --watch-min-interval and --max-watch-streams-per-identity are kvpoold.settings').
DEFAULT_WATCH_INTERVAL_S = 1.0
MAX_WATCH_INTERVAL_S = 3600.0
# Lease entries read per slice of a picture taken in slices: ~3 us each to read (~10 us with
# encoding), so a slice holds the loop well under a millisecond.
SLICE_LEASES = 32


def watch_interval(asked: float, minimum: float = WATCH_MIN_INTERVAL_S) -> float:
    """The interval a WatchStats stream is served at: ``asked`` (0: the default), raised to
    ``minimum`` (the daemon's ``--watch-min-interval``) when shorter.

    Raises:
        InvalidArgument: negative, NaN, or longer than MAX_WATCH_INTERVAL_S.
    """
    interval = asked or DEFAULT_WATCH_INTERVAL_S
    if not 0.0 < interval <= MAX_WATCH_INTERVAL_S:  # NaN fails both comparisons
        raise InvalidArgument(
            f"interval_seconds {asked} is outside 0..{MAX_WATCH_INTERVAL_S:g} (0: the default "
            f"{DEFAULT_WATCH_INTERVAL_S:g} s; an interval under {minimum:g} s, the daemon's "
            "--watch-min-interval, is served at that minimum)",
            field="interval_seconds",
        )
    return max(interval, minimum)


@dataclass(frozen=True, slots=True)
class StatsView:
    """One picture's first part: everything but the lease entries, and which leases to list.

    ``stats`` has no leases yet; ``leases`` are the leases it lists (every open lease for an
    admin, else the caller's own), ``entries`` the pools whose holdings each lease entry shows.
    """

    stats: Stats
    leases: list[Lease]
    entries: list[Pool]


def view_key(caller: Caller, pool: str) -> Hashable:
    """What makes two callers' pictures the same: every admin sees one view (per ``pool``);
    anyone else its identity's, through its scope."""
    return ("admin", pool) if caller.admin else ("caller", caller, pool)


def take_view(daemon: Daemon, caller: Caller, pool: str = "") -> StatsView:
    """The first part of a picture, now: O(pools x spaces + the leases listed) (the leases are
    only collected: an admin's listing is a copy of the table's, another caller's its own).

    Args:
        daemon: the daemon (read only).
        caller: who asks.
        pool: a pool name the caller may see, or "" for all.

    Raises:
        NotFound: ``pool`` given and not (or no longer) a pool.
    """
    now = daemon.now()
    entries = [daemon.pool(pool)] if pool else [
        e for e in daemon.pools.values() if caller.sees(e.name)]
    pools = [PoolStats(
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
        elastic=daemon.elastic.stats(entry.name),
        sealed=directory_stats(entry, rank=None if daemon.kv_events is None
                               else daemon.kv_events.rank_of(entry.name)),
    ) for entry in entries]
    table = daemon.leases
    leases = list(table) if caller.admin else table.of_identity(caller.identity)
    stats = Stats(
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
            other_leases=len(table) - len(leases),
            **stall_fields(daemon),
            **(daemon.kv_events.stats_fields() if daemon.kv_events is not None else {}),
        ),
        pools=pools,
        leases=[],
        peers=list(daemon.transfers.peers.values()) if caller.admin else [],
    )
    return StatsView(stats, leases, entries)


def lease_stats(daemon: Daemon, view: StatsView, lease: Lease, lease_now: float) -> LeaseStats:
    """The entry of one listed lease, read now: what it holds in the view's pools, its attachments
    and its caches' report; O(pools x spaces).

    Args:
        lease_now: the lease clock now (``daemon.leases.now()``: deadlines are on it).
    """
    held: HeldMap = {}
    for entry in view.entries:
        spaces = entry.ids.held_of(lease.owner)
        if spaces:
            held[entry.name] = spaces
    return LeaseStats(
        lease_id=lease.lease_id,
        name=lease.name,
        ttl_seconds=lease.ttl_s,
        expires_in_seconds=lease.expires_in(lease_now),
        held=held,
        attached=daemon.attachments.count_lease(lease.lease_id),
        cached=cached_of(lease.reports, held),
    )


def take_stats(daemon: Daemon, caller: Caller, pool: str = "") -> Stats:
    """Stats now, as ``caller`` may see them, in one go: O(pools x spaces x the leases listed);
    with ``pool`` only that pool, and leases show only what they hold in it.

    Args:
        daemon: the daemon (read only).
        caller: who asks: an admin sees every pool, lease and peer; anyone else the pools its
            scope covers and its own identity's leases.
        pool: a known pool name the caller may see, or "" for all.

    Raises:
        NotFound: ``pool`` given and not a pool.
    """
    view = take_view(daemon, caller, pool)
    lease_now = daemon.leases.now()
    return msgspec.structs.replace(
        view.stats, leases=[lease_stats(daemon, view, x, lease_now) for x in view.leases])


async def lease_slices(daemon: Daemon, view: StatsView, slice_leases: int = SLICE_LEASES
                       ) -> AsyncIterator[list[LeaseStats]]:
    """The view's lease entries, ``slice_leases`` at a time, each slice read when it is built
    (a lease closed meanwhile is left out), yielding the loop between slices."""
    table = daemon.leases
    for start in range(0, len(view.leases), slice_leases):
        if start:
            await asyncio.sleep(0)
        now = table.now()
        part = [lease_stats(daemon, view, x, now)
                for x in view.leases[start:start + slice_leases] if table.find(x.lease_id) is x]
        if part:
            yield part


async def gather_stats(daemon: Daemon, caller: Caller, pool: str = "",
                       slice_leases: int = SLICE_LEASES) -> Stats:
    """:func:`take_stats` with the lease entries read in slices (:func:`lease_slices`), the
    loop serving other calls between them: what ``/metrics`` scrapes.

    Raises:
        NotFound: ``pool`` given and not a pool.
    """
    view = take_view(daemon, caller, pool)
    leases = [x async for part in lease_slices(daemon, view, slice_leases) for x in part]
    return msgspec.structs.replace(view.stats, leases=leases)


def stall_fields(daemon: Daemon) -> dict[str, Any]:
    """The event-loop stall counters of DaemonStats (zero without a stall clock)."""
    clock = daemon.stall_clock
    if clock is None:
        return {}
    return {"loop_stalls": clock.stalls, "loop_stalled_seconds": clock.stalled_s,
            "loop_longest_stall_seconds": clock.longest_stall_s}


def cached_of(reports: dict[tuple[str, str], CacheCounts], held: HeldMap) -> HeldMap:
    """The reported cached ids of the pools and spaces the lease holds ids in (never more than
    it holds: a report can be a renewal old)."""
    out: HeldMap = {}
    for (pool, space), (cached, _in_use, _evictable) in reports.items():
        n = min(cached, held.get(pool, {}).get(space, 0))
        if n:
            out.setdefault(pool, {})[space] = n
    return out

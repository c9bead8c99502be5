"""What ``kvpool top`` knows of each daemon, as plain data: its latest snapshot, the rates
between two snapshots, or why it is unreachable. No I/O: ``kvpool.tools.top`` fills it from the
daemons, ``kvpool.tools.top_render`` draws it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.contract.records import Stats


@dataclass(frozen=True)
class Rate:
    """Ids of one pool and space allocated and freed per second between two snapshots."""

    allocs_per_s: float
    frees_per_s: float


def rates(previous: Stats | None, current: Stats) -> dict[tuple[str, str], Rate]:
    """Allocations and frees per second per ``(pool, space)`` between two snapshots of a daemon.

    The time between them is the difference of the daemon's uptime (its monotonic clock). A row
    gets no rate when there is no earlier snapshot, the daemon restarted (uptime went down), the
    pool is younger than the interval (dropped and configured again) or a counter went down.

    Args:
        previous: the snapshot before ``current`` (None: the first one).
        current: the latest snapshot.

    Returns:
        ``{(pool, space): Rate}`` for every row with a rate.
    """
    if previous is None:
        return {}
    dt = current.daemon.uptime_seconds - previous.daemon.uptime_seconds
    if dt <= 0:
        return {}
    before = {(p.name, space): k for p in previous.pools for space, k in p.spaces.items()}
    out: dict[tuple[str, str], Rate] = {}
    for pool in current.pools:
        if pool.age_seconds < dt:
            continue
        for space, k in pool.spaces.items():
            old = before.get((pool.name, space))
            if old is None or k.allocs < old.allocs or k.frees < old.frees:
                continue
            out[(pool.name, space)] = Rate((k.allocs - old.allocs) / dt, (k.frees - old.frees) / dt)
    return out


@dataclass
class DaemonView:
    """What top knows of one daemon: its latest snapshot and rates, or why it is unreachable.

    Written by the daemon's follow task (or the ``--once`` fetch), read by the renderer; both run
    on the same event loop.
    """

    target: str
    stats: Stats | None = None
    rates: dict[tuple[str, str], Rate] = field(default_factory=dict)
    error: str | None = None
    updated_at: float | None = None  # time.monotonic() of the latest snapshot

    def update(self, stats: Stats, now: float) -> None:
        """Take a new snapshot received at ``now``; rates come from the one before it."""
        self.rates = rates(self.stats, stats)
        self.stats = stats
        self.error = None
        self.updated_at = now

    def down(self, reason: str) -> None:
        """Mark the daemon unreachable (the last snapshot is kept only for its age)."""
        self.error = reason
        self.rates = {}

"""Rendering of ``kvpool top``: one rich frame of panels, pool and lease tables, usage bars.

Pure presentation of :class:`kvpool.tools.top_model.DaemonView` values: no I/O, no gRPC. rich
is imported inside the functions, so importing this module stays light.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.text import Text

    from kvpool.contract.records import LeaseStats, PeerStats, PoolStats, Stats
    from kvpool.tools.top_model import DaemonView, Rate

DEFAULT_INTERVAL_S = 1.0
DEFAULT_WIDTH = 120
DEFAULT_MAX_LEASES = 20
BAR_WIDTH = 16
MIN_BAR_WIDTH = len("USAGE")  # narrower, the header would widen the column anyway
PANEL_MARGIN = 4  # a panel's borders and padding
POOL_COLUMNS = ("POOL", "SPACE", "USED", "CAPACITY", "USE%", "HIGH", "ALLOC/S", "FREE/S",
                "FAILED", "BYTES", "ATT")
# When the numbers do not fit, these go first, in this order (after the usage bar).
OPTIONAL_COLUMNS = ("ATT", "BYTES", "FAILED")
# A daemon silent for this many intervals is flagged stale (hung, or the network is).
STALE_INTERVALS = 3.0


def retry_interval(interval_s: float) -> float:
    """How long top waits before reconnecting to an unreachable daemon (its panel says so)."""
    return max(1.0, interval_s)


def render(views: Sequence[DaemonView], now: float, *, width: int = DEFAULT_WIDTH,
           interval_s: float = DEFAULT_INTERVAL_S, max_leases: int = DEFAULT_MAX_LEASES,
           live: bool = True) -> RenderableType:
    """One frame: a panel per daemon, in ``--target`` order.

    Args:
        views: the daemons.
        now: ``time.monotonic()`` now, for ages.
        width: the columns it will be printed in (the usage bars shrink, then go, below 100).
        interval_s: the refresh interval (for the retry and staleness notes).
        max_leases: leases listed per daemon, most ids held first.
        live: part of a live view (retry and staleness notes) rather than ``--once``.

    Returns:
        A rich renderable to print or hand to ``Live``.
    """
    from rich.console import Group

    return Group(*(_daemon_panel(v, now, interval_s, max_leases, live, width) for v in views))


def _daemon_panel(view: DaemonView, now: float, interval_s: float, max_leases: int,
                  live: bool, width: int) -> RenderableType:
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    if view.error is not None or view.stats is None:
        lines = Text()
        lines.append("unreachable", style="bold red")
        lines.append(f": {view.error or 'no answer yet'}")
        notes = [f"retrying every {retry_interval(interval_s):g} s"] if live else []
        if view.updated_at is not None:
            notes.append(f"last snapshot {_duration(now - view.updated_at)} ago")
        if notes:
            lines.append("\n" + "; ".join(notes), style="dim")
        return Panel(lines, title=view.target, title_align="left", border_style="red")
    stats = view.stats
    parts: list[RenderableType] = [_header(stats, BAR_WIDTH if width >= 100 else 0)]
    age = now - view.updated_at if view.updated_at is not None else 0.0
    if live and age > STALE_INTERVALS * max(interval_s, 1.0):
        parts.append(Text(f"stale: no snapshot for {_duration(age)}", style="bold yellow"))
    parts.append(_pools_table(stats.pools, view.rates, width - PANEL_MARGIN))
    parts.append(_leases_table(stats.leases, max_leases))
    if stats.peers:  # PD transfers (docs/pd-transfer.md); admins only see them
        parts.append(_peers_table(stats.peers))
    return Panel(Group(*parts), title=view.target, title_align="left")


def _header(stats: Stats, bar_width: int) -> Text:
    """Two lines: the daemon and its budget; its pools and leases."""
    from rich.text import Text

    d = stats.daemon
    text = Text()
    text.append(f"kvpoold {d.version}", style="bold")
    text.append(f" on {d.device}   up {_duration(d.uptime_seconds)}   budget ")
    if bar_width:
        text.append_text(_bar(d.used_bytes, d.budget_bytes, d.used_bytes, bar_width))
        text.append(" ")
    text.append(f"{_size(d.used_bytes)} / {_size(d.budget_bytes)} "
                f"({_percent(d.used_bytes, d.budget_bytes)})\n")
    text.append(f"pools {d.num_pools}   leases {d.num_leases} open: {d.leases_opened} opened, "
                f"{d.leases_closed} closed, {d.leases_expired} expired")
    if d.loop_stalls:
        text.append(f"   loop stalls {d.loop_stalls} (longest "
                    f"{d.loop_longest_stall_seconds:.2f} s)", style="yellow")
    return text


def _pools_table(pools: Sequence[PoolStats], pool_rates: Mapping[tuple[str, str], Rate],
                 width: int) -> RenderableType:
    """A row per pool and space in ``width`` columns: numbers are never cut; the usage bar
    shrinks and goes first, then the ``OPTIONAL_COLUMNS``, then long pool names are cut."""
    from rich.table import Table
    from rich.text import Text

    if not pools:
        return Text("no pools (kvpool configure POOL ...)", style="dim")
    rows: list[tuple[dict[str, str], tuple[int, int, int]]] = []
    for pool in pools:
        for i, (space, k) in enumerate(pool.spaces.items()):
            rate = pool_rates.get((pool.name, space))
            first = i == 0
            cells = dict(zip(POOL_COLUMNS, (
                pool.name if first else "",
                space,
                f"{k.used:,}",
                f"{k.capacity:,}",
                _percent(k.used, k.capacity),
                f"{k.high_water:,}",
                f"{rate.allocs_per_s:,.1f}" if rate else "-",
                f"{rate.frees_per_s:,.1f}" if rate else "-",
                f"{k.failed_allocs:,}",
                _size(pool.backing_bytes) if first else "",
                str(pool.attached) if first else "",
            ), strict=True))
            rows.append((cells, (k.used, k.capacity, k.high_water)))
    natural = {c: max(len(c), *(len(r[c]) for r, _ in rows)) for c in POOL_COLUMNS}
    columns = list(POOL_COLUMNS)

    def room() -> int:  # columns left for the bar, after the others and one space between
        return width - sum(natural[c] for c in columns) - len(columns)

    for optional in OPTIONAL_COLUMNS:
        if room() >= 0:
            break
        columns.remove(optional)
    bar_width = min(BAR_WIDTH, room() - 1)  # the bar column and one more space
    bar_width = bar_width if bar_width >= MIN_BAR_WIDTH else 0

    table = Table(box=None, pad_edge=False, collapse_padding=True, header_style="bold",
                  show_edge=False)
    for name in columns:
        table.add_column(name, justify="left" if name in ("POOL", "SPACE") else "right",
                         no_wrap=True, overflow="ellipsis",
                         min_width=None if name == "POOL" else natural[name])
        if name == "SPACE" and bar_width:
            table.add_column("USAGE", no_wrap=True, min_width=bar_width)
    for cells, (used, capacity, high_water) in rows:
        values: list[RenderableType] = [cells[c] for c in columns]
        if bar_width:
            values.insert(2, _bar(used, capacity, high_water, bar_width))
        table.add_row(*values)
    return table


def _leases_table(leases: Sequence[LeaseStats], max_leases: int) -> RenderableType:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if not leases:
        return Text("no open leases", style="dim")
    # The biggest holders first: the question top answers is "who holds the memory".
    ordered = sorted(leases, key=lambda x: (-_held_total(x), x.name, x.lease_id))
    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    for name in ("LEASE", "NAME", "EXPIRES IN", "TTL", "ATT", "HELD"):
        table.add_column(name, justify="right" if name in ("EXPIRES IN", "TTL", "ATT") else "left",
                         no_wrap=name != "HELD", overflow="ellipsis" if name != "HELD" else "fold")
    for lease in ordered[:max_leases]:
        held = lease.held_text()
        table.add_row(str(lease.lease_id), lease.name, f"{lease.expires_in_seconds:.1f}s",
                      f"{lease.ttl_seconds:g}s", str(lease.attached), held)
    rest = len(ordered) - max_leases
    if rest > 0:
        return Group(table, Text(f"... and {rest} more leases (kvpool leases lists all)",
                                 style="dim"))
    return table


def _peers_table(peers: Sequence[PeerStats]) -> RenderableType:
    """KV-page transfers with each peer daemon since start: completed, bytes, failed, each way."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    table.add_column("PEER", no_wrap=True, overflow="ellipsis")
    for name in ("SENT", "SENT BYTES", "SEND FAILED", "RECEIVED", "RECV BYTES", "RECV FAILED"):
        table.add_column(name, justify="right", no_wrap=True)
    for p in sorted(peers, key=lambda x: x.peer):
        table.add_row(p.peer, f"{p.sent:,}", _size(p.sent_bytes), f"{p.send_failures:,}",
                      f"{p.received:,}", _size(p.received_bytes), f"{p.receive_failures:,}")
    return table


def _held_total(lease: LeaseStats) -> int:
    return sum(n for spaces in lease.held.values() for n in spaces.values())


def _bar(used: int, capacity: int, high_water: int, width: int = BAR_WIDTH) -> Text:
    """``█`` used, ``▒`` up to the high-water mark, ``░`` never used; coloured by fill."""
    from rich.text import Text

    if capacity <= 0:
        return Text("░" * width, style="dim")
    fill = min(width, round(width * used / capacity))
    high = max(fill, min(width, round(width * high_water / capacity)))
    share = used / capacity
    colour = "green" if share < 0.7 else "yellow" if share < 0.9 else "red"
    text = Text()
    text.append("█" * fill, style=colour)
    text.append("▒" * (high - fill), style=f"dim {colour}")
    text.append("░" * (width - high), style="dim")
    return text


def _percent(used: int, total: int) -> str:
    return f"{100.0 * used / total:.1f}%" if total else "-"


def _size(nbytes: int) -> str:
    from kvpool.contract.sizes import format_size  # pure: no torch

    return format_size(nbytes)


def _duration(seconds: float) -> str:
    """``2.5`` -> ``2.5s``; ``62`` -> ``1m02s``; ``3725`` -> ``1h02m``; ``90061`` -> ``1d01h``."""
    s = max(0, int(seconds))
    if s < 10:
        return f"{max(0.0, seconds):.1f}s"
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"

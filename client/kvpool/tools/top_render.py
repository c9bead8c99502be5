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

    from kvpool.contract.records import ElasticStats, LeaseStats, PeerStats, PoolStats, Stats
    from kvpool.tools.top_model import DaemonView, Rate

DEFAULT_INTERVAL_S = 1.0
DEFAULT_WIDTH = 120
DEFAULT_MAX_LEASES = 20
BAR_WIDTH = 16
MIN_BAR_WIDTH = len("USAGE")  # narrower, the header would widen the column anyway
PANEL_MARGIN = 4  # a panel's borders and padding
POOL_COLUMNS = ("POOL", "SPACE", "USED", "CAPACITY", "USE%", "HIGH", "ALLOC/S", "FREE/S",
                "FAILED", "BYTES", "ATT")
# When the numbers do not fit, these go first, in this order (after the usage bar); the rates
# and HIGH only in the narrowest frames (40 columns).
OPTIONAL_COLUMNS = ("ATT", "BYTES", "FAILED", "FREE/S", "ALLOC/S", "HIGH")
# A daemon silent for this many intervals is flagged stale (hung, or the network is).
STALE_INTERVALS = 3.0


def retry_interval(interval_s: float) -> float:
    """How long top waits before reconnecting to an unreachable daemon (its panel says so)."""
    return max(1.0, interval_s)


def render(views: Sequence[DaemonView], now: float, *, width: int = DEFAULT_WIDTH,
           interval_s: float = DEFAULT_INTERVAL_S, max_leases: int = DEFAULT_MAX_LEASES,
           live: bool = True, height: int | None = None) -> RenderableType:
    """One frame: a panel per daemon, in ``--target`` order.

    With a ``height`` the frame fits in that many lines: every daemon gets its header and pool
    rows first, then the lease rows are shared out one at a time, round robin (the daemons with
    the fewest leases first), so one daemon's leases never push the others off screen (each
    says ``+N more leases`` for what it could not show). When even that does not fit, the
    daemons that do come first and one last line names the others (``+N more daemons
    below``). Every lease is one line: its HELD text is
    cut, never wrapped, and its id never cut.

    Args:
        views: the daemons.
        now: ``time.monotonic()`` now, for ages.
        width: the columns it will be printed in (the usage bars shrink, then go, below 100).
        interval_s: the refresh interval (for the retry and staleness notes).
        max_leases: leases listed per daemon at most, most ids held first.
        live: part of a live view (retry and staleness notes) rather than ``--once``.
        height: the lines it must fit in (the terminal's); None: no limit.

    Returns:
        A rich renderable to print or hand to ``Live``.
    """
    from rich.console import Group

    panels = [_DaemonPanel(v, now, interval_s, live, width) for v in views]
    if height is None:
        return Group(*(p.build(min(max_leases, p.total)) for p in panels))
    return Group(*_fit(panels, width, height, max_leases))


def _fit(panels: Sequence[_DaemonPanel], width: int, height: int,
         max_leases: int) -> list[RenderableType]:
    """The panels (and, if some do not fit, a last line naming them) in ``height`` lines."""
    from rich.text import Text

    least = [_lines(p.build(0), width) for p in panels]
    shown = len(panels)
    while shown and sum(least[:shown]) + (shown < len(panels)) > height:
        shown -= 1
    spare = height - sum(least[:shown]) - (shown < len(panels))
    counts = [0] * shown
    wanted = [min(max_leases, p.total) for p in panels[:shown]]
    # Level by level (one more lease each), the daemons with the fewest leases first: a daemon
    # shown whole needs no "+N more" line, and a crowded one cannot starve the others.
    order = sorted(range(shown), key=lambda i: (wanted[i], i))
    for level in range(1, max(wanted, default=0) + 1):
        for i in order:
            goal = min(level, wanted[i])
            cost = _lease_lines(goal, panels[i].total) - _lease_lines(counts[i],
                                                                       panels[i].total)
            if goal > counts[i] and cost <= spare:
                counts[i] = goal
                spare -= cost
    out: list[RenderableType] = [p.build(k) for p, k in zip(panels, counts, strict=False)]
    hidden = panels[shown:]
    if hidden:
        names = ", ".join(p.view.target + (" (unreachable)" if p.unreachable else "")
                          for p in hidden)
        out.append(Text(f"+{len(hidden)} more daemon{'s' if len(hidden) != 1 else ''} below, "
                        f"not shown in {height} lines: {names}", style="bold yellow",
                        no_wrap=True, overflow="ellipsis"))
    return out


def _lease_lines(shown: int, total: int) -> int:
    """Lines of a daemon's lease section listing ``shown`` of its ``total`` leases (one line per
    lease: see :func:`_leases_table`)."""
    if total == 0 or shown == 0:
        return 1  # "no open leases" or "+N more leases"
    return 1 + shown + (shown < total)


def _lines(renderable: RenderableType, width: int) -> int:
    """How many lines ``renderable`` takes printed ``width`` columns wide."""
    import io

    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), force_terminal=False, color_system=None,
                      highlight=False, emoji=False)
    return len(console.render_lines(renderable, console.options.update(width=width),
                                    pad=False))


class _DaemonPanel:
    """One daemon's panel, buildable with any number of its leases listed."""

    def __init__(self, view: DaemonView, now: float, interval_s: float, live: bool,
                 width: int) -> None:
        self.view, self.now, self.interval_s, self.live, self.width = (
            view, now, interval_s, live, width)
        self.unreachable = view.error is not None or view.stats is None
        self.total = 0 if view.stats is None or self.unreachable else len(view.stats.leases)

    def build(self, leases_shown: int) -> RenderableType:
        from rich.console import Group
        from rich.panel import Panel
        from rich.text import Text

        view, now, interval_s = self.view, self.now, self.interval_s
        if self.unreachable or view.stats is None:
            lines = [Text.assemble(("unreachable", "bold red"),
                                   f": {view.error or 'no answer yet'}",
                                   no_wrap=True, overflow="ellipsis")]
            notes = [f"retrying every {retry_interval(interval_s):g} s"] if self.live else []
            if view.updated_at is not None:
                notes.append(f"last snapshot {_duration(now - view.updated_at)} ago")
            if notes:
                lines.append(Text("; ".join(notes), style="dim", no_wrap=True,
                                  overflow="ellipsis"))
            return Panel(Group(*lines), title=view.target, title_align="left",
                         border_style="red")
        stats = view.stats
        inner = self.width - PANEL_MARGIN
        parts: list[RenderableType] = [_header(stats, BAR_WIDTH if self.width >= 100 else 0)]
        age = now - view.updated_at if view.updated_at is not None else 0.0
        if self.live and age > STALE_INTERVALS * max(interval_s, 1.0):
            parts.append(Text(f"stale: no snapshot for {_duration(age)}", style="bold yellow"))
        parts.append(_pools_table(stats.pools, view.rates, inner))
        parts.extend(_elastic_line(p.name, p.elastic, inner) for p in stats.pools
                     if p.elastic is not None)
        parts.append(_leases_table(stats.leases, leases_shown, inner))
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
                # an elastic pool's virtual range is not memory: what the budget pays for it
                _size(pool.backing_bytes if pool.elastic is None
                      else pool.elastic.granted_bytes) if first else "",
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


def _elastic_line(name: str, e: ElasticStats, width: int) -> Text:
    """One line under the pools table for an elastic pool, in ``width`` columns:
    ``chat: 12/64 groups, 1.5 of 8.0 GiB, reclaiming 2, floor 4, cap 64, weight 2, backed
    1.5 GiB`` (granted of all groups; the bytes the budget pays of the virtual range). When it
    does not fit, the last parts go first (backed, weight, cap, floor, revoked, reclaiming, the
    bytes); the numbers that stay are never cut, a long pool name is (to keep the bytes and
    reclaiming)."""
    from rich.text import Text

    core = f": {e.granted_groups:,}/{e.groups:,} groups"
    parts: list[tuple[str, str]] = [
        (_size_of(e.granted_bytes, e.virtual_bytes), ""),
        (f"reclaiming {e.reclaiming_groups:,}", "yellow" if e.reclaiming_groups else "")]
    if e.failed_groups:  # memory the daemon could not free: charged, retried
        parts.append((f"failed {e.failed_groups:,}", "bold red"))
    if e.revoked_leases:  # a client did not unmap in time: the daemon ended its lease
        parts.append((f"revoked {e.revoked_leases:,} lease"
                      + ("s" if e.revoked_leases != 1 else ""), "bold red"))
    parts += [(f"floor {e.floor_groups:,}", ""), (f"cap {e.cap_groups:,}", ""),
              (f"weight {e.weight:g}", ""), (f"backed {_size_of(e.backed_bytes)}", "dim")]
    sep = ", "
    name_w = max(4, width - len(core) - sum(len(sep) + len(x) for x, _ in parts[:2]))
    shown = name if len(name) <= name_w else name[:name_w - 1] + "…"
    used = len(shown) + len(core)
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(shown, style="bold")
    text.append(core)
    for part, style in parts:
        if used + len(sep) + len(part) > width:
            break
        text.append(sep)
        text.append(part, style=style)
        used += len(sep) + len(part)
    return text


def _size_of(part: int, whole: int | None = None) -> str:
    """``part`` with one decimal, in the unit of ``whole`` when given (``1.5 of 8.0 GiB``)."""
    scale = abs(whole if whole is not None else part)
    unit, step = "B", 1
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if scale < step * 1024:
            break
        unit, step = name, step * 1024

    def one(n: int) -> str:
        return f"{n:,}" if step == 1 else f"{n / step:,.1f}"

    if whole is None:
        return f"{one(part)} {unit}"
    return f"{one(part)} of {one(whole)} {unit}"


# Lease columns that go, in this order, when a lease's line does not fit; the id never goes
# and is never cut, NAME and HELD are cut (with an ellipsis) last.
OPTIONAL_LEASE_COLUMNS = ("TTL", "ATT", "EXPIRES IN")
LEASE_NAME_WIDTH = 24


def _leases_table(leases: Sequence[LeaseStats], shown: int, width: int) -> RenderableType:
    """The ``shown`` leases holding the most ids, one line each, in ``width`` columns, and a
    ``+N more leases`` line for the others."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if not leases:
        return Text("no open leases", style="dim")
    # The biggest holders first: the question top answers is "who holds the memory".
    ordered = sorted(leases, key=lambda x: (-_held_total(x), x.name, x.lease_id))[:shown]
    rest = len(leases) - len(ordered)
    more = Text(f"+{rest} more lease{'s' if rest != 1 else ''} (kvpool leases lists all)",
                style="dim", no_wrap=True, overflow="ellipsis")
    if not ordered:
        return more
    rows = [dict(zip(("LEASE", "NAME", "EXPIRES IN", "TTL", "ATT", "HELD"), (
        str(x.lease_id), x.name, f"{x.expires_in_seconds:.1f}s", f"{x.ttl_seconds:g}s",
        str(x.attached), x.held_text()), strict=True)) for x in ordered]
    natural = {c: max(len(c), *(len(r[c]) for r in rows)) for c in rows[0]}
    natural["NAME"] = min(natural["NAME"], LEASE_NAME_WIDTH)
    columns = list(rows[0])

    def room(name_w: int, held_w: int) -> int:  # columns left over; one space between columns
        fixed = sum(natural[c] for c in columns if c not in ("NAME", "HELD"))
        return width - fixed - name_w - held_w - (len(columns) - 1)

    for optional in OPTIONAL_LEASE_COLUMNS:
        if room(min(natural["NAME"], 8), min(natural["HELD"], 12)) >= 0:
            break
        columns.remove(optional)
    left = room(0, 0)  # for NAME and HELD together
    name_w = max(4, min(natural["NAME"], left // 3))
    held_w = max(4, min(natural["HELD"], left - name_w))

    table = Table(box=None, pad_edge=False, collapse_padding=True, header_style="bold",
                  show_edge=False)
    for name in columns:
        size = name_w if name == "NAME" else held_w if name == "HELD" else natural[name]
        table.add_column(name, justify="right" if name in ("EXPIRES IN", "TTL", "ATT") else "left",
                         no_wrap=True, overflow="ellipsis", width=size,
                         min_width=size if name == "LEASE" else None)
    for row in rows:
        table.add_row(*(row[c] for c in columns))
    return Group(table, more) if rest > 0 else table


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

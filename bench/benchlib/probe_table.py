"""The table of a latency probe's windows against the first (the baseline), which
``bench/stats_under_load.py`` and ``bench/lease_expiry.py`` print."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def print_probe_table(rows: list[dict[str, Any]], title: str, width: int = 28,
                      extra: tuple[str, Callable[[dict[str, Any]], str]] | None = None) -> None:
    """One line per row: the probe's p50/p99/max (ms), their ratio to the first row's, its
    calls and failures and the daemon's loop stalls meanwhile, then the probe's first errors.

    Args:
        rows: ``{"name", "probe": {"p50_ms", "p99_ms", "max_ms", "calls", "errors"[,
            "failed"]}, "stalled_s"}`` each; ``failed`` counts the failures where ``errors``
            lists only the first few.
        title: the heading of the name column.
        width: the name column's width.
        extra: a last column: its heading and what it shows for a row.
    """
    base = rows[0]["probe"]
    head, show = extra if extra is not None else ("", lambda _row: "")
    print(f"\n{title:<{width}} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p50/base':>9} "
          f"{'p99/base':>9} {'probe calls':>11} {'errors':>6} {'stalled s':>9}  {head}".rstrip())
    for row in rows:
        p = row["probe"]
        failed = p.get("failed", len(p["errors"]))
        print(f"{row['name']:<{width}} {p['p50_ms']:8.2f} {p['p99_ms']:8.2f} {p['max_ms']:8.1f} "
              f"{p['p50_ms'] / base['p50_ms']:9.1f} {p['p99_ms'] / base['p99_ms']:9.1f} "
              f"{p['calls']:11,} {failed:6} {row['stalled_s']:9.2f}  {show(row)}".rstrip())
        for error in p["errors"]:
            print(f"    probe error: {error}")

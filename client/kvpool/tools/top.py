"""``kvpool top``: a live terminal view of one or several daemons, refreshed from WatchStats.

Per daemon (``--target``, repeatable) a panel shows a header (version, device, uptime, budget
used of total, leases opened/closed/expired), one row per pool and space (a usage bar with the
high-water mark, used/capacity, allocations and frees per second, refused allocations, the
pool's bytes and attached clients), the leases holding the most ids (what they hold per pool
and space, when they expire), and, for a daemon that moved pages to or from peers, transfers
per peer each way. Rates are differences of the daemon's own counters between two
successive snapshots, divided by the difference of its uptime, so network delay does not skew
them.

Each daemon is followed by its own task over a ``WatchStats`` stream; one that cannot be reached
or goes away is shown as unreachable and retried, and the others keep updating. Ctrl-C ends the
view (exit 0, terminal restored). ``--once`` prints one frame to stdout without a live display
(one ``Stats`` per daemon, so no rates), for scripts and tests; it exits 1 when a daemon did not
answer.

Rendering is in :mod:`kvpool.tools.top_render`. rich is imported only when ``top`` runs, and torch
never, so the other ``kvpool`` subcommands start as fast as before.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.clients.targets import channel_target, default_target, token_from
from kvpool.contract.errors import InvalidArgument
from kvpool.tools.top_model import DaemonView, Rate, rates

# Rendering lives in its own module; render and its column names stay importable from here.
from kvpool.tools.top_render import (
    DEFAULT_INTERVAL_S,
    DEFAULT_MAX_LEASES,
    DEFAULT_WIDTH,
    POOL_COLUMNS,
    render,
    retry_interval,
)

if TYPE_CHECKING:
    from rich.console import Console, RenderableType


__all__ = [
    "DEFAULT_INTERVAL_S",
    "DEFAULT_MAX_LEASES",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WIDTH",
    "MAX_INTERVAL_S",
    "MIN_HEIGHT",
    "MIN_INTERVAL_S",
    "POOL_COLUMNS",
    "DaemonView",
    "Rate",
    "add_top",
    "check_args",
    "fetch_once",
    "follow",
    "rates",
    "render",
    "retry_interval",
    "run_top",
    "watch",
]

# What top asks for; the daemon's WatchStats serves up to 1 h, and anything under its
# --watch-min-interval (0.5 s by default) at that minimum.
MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 3600.0
DEFAULT_TIMEOUT_S = 5.0
MIN_HEIGHT = 3


# -- fetching -----------------------------------------------------------------------------------


async def fetch_once(views: Sequence[DaemonView], token: str | None, timeout_s: float) -> None:
    """One ``Stats`` per daemon, concurrently; a failure marks that view unreachable."""
    await asyncio.gather(*(_fetch(v, token, timeout_s) for v in views))


async def _fetch(view: DaemonView, token: str | None, timeout_s: float) -> None:
    from kvpool.clients.aio import AsyncKVPoolClient

    try:
        async with AsyncKVPoolClient(view.target, token=token, timeout_s=timeout_s) as client:
            view.update(await client.stats(), time.monotonic())
    except Exception as exc:  # any failure of one daemon is shown, never fatal
        view.down(_reason(exc))


async def follow(view: DaemonView, token: str | None, interval_s: float,
                 changed: asyncio.Event) -> None:
    """Keep ``view`` current from a WatchStats stream, reconnecting after a failure; runs until
    cancelled.

    Args:
        view: the daemon's view, updated in place.
        token: bearer token for a TCP listener.
        interval_s: the stream's interval.
        changed: set after every update, so the screen redraws at once.
    """
    from kvpool.clients.aio import AsyncKVPoolClient

    while True:
        try:
            async with AsyncKVPoolClient(view.target, token=token) as client:
                async for stats in client.watch_stats(interval_s=interval_s):
                    view.update(stats, time.monotonic())
                    changed.set()
            view.down("the daemon ended the stream (shutting down?)")
        except Exception as exc:  # one daemon failing must not stop the view of the others
            view.down(_reason(exc))
        changed.set()
        await asyncio.sleep(retry_interval(interval_s))


def _reason(exc: BaseException) -> str:
    code = getattr(exc, "code_name", None) or getattr(exc, "code", None)
    return f"{code}: {exc}" if isinstance(code, str) else f"{type(exc).__name__}: {exc}"


async def watch(views: Sequence[DaemonView], console: Console, *, token: str | None,
                interval_s: float, max_leases: int) -> None:
    """Show ``views`` live until cancelled (Ctrl-C), one follow task per daemon.

    The screen is redrawn when a snapshot arrives and at least every ``interval_s`` (so ages
    and the unreachable state stay current); the alternate screen is left on exit. When the
    output is not a terminal (a pipe, a file) a frame is printed every ``interval_s`` instead,
    like ``top -b``.
    """
    from rich.live import Live

    def frame() -> RenderableType:
        # On a terminal the frame fits its height (every daemon stays on screen); a pipe
        # gets every frame whole.
        return render(views, time.monotonic(), width=console.width, interval_s=interval_s,
                      max_leases=max_leases,
                      height=console.height if console.is_terminal else None)

    changed = asyncio.Event()
    tasks = [asyncio.create_task(follow(v, token, interval_s, changed)) for v in views]
    try:
        if not console.is_terminal:
            while True:
                await asyncio.sleep(interval_s)
                console.print(frame())
        with Live(frame(), console=console, screen=True, auto_refresh=False) as live:
            while True:
                try:
                    await asyncio.wait_for(changed.wait(), interval_s)
                except TimeoutError:
                    pass
                changed.clear()
                live.update(frame(), refresh=True)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- command line -------------------------------------------------------------------------------


def add_top(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``kvpool top``; its ``--target`` repeats, so it does not take ``common``'s."""
    p = sub.add_parser(
        "top", help="live view of one or several daemons",
        description="A live view of daemons: budget, pools with usage bars and allocation "
                    "rates, leases with what they hold. Refreshes from WatchStats; Ctrl-C quits. "
                    "An unreachable daemon is shown as such and retried.")
    p.add_argument("--target", action="append", metavar="ADDR",
                   help="unix:///path.sock or host:port; repeat for several daemons (default "
                        f"{default_target()})")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token", metavar="SECRET", help="bearer token for TCP listeners")
    token.add_argument("--token-file", type=Path, metavar="PATH", help="read the token here")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
                   help=f"seconds between snapshots (default {DEFAULT_INTERVAL_S:g}; "
                        f"{MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g})")
    p.add_argument("--max-leases", type=int, default=DEFAULT_MAX_LEASES, metavar="N",
                   help=f"leases listed per daemon, most ids held first (default "
                        f"{DEFAULT_MAX_LEASES})")
    p.add_argument("--once", action="store_true",
                   help="print one frame to stdout and exit (no live view, no rates); exit 1 if "
                        "a daemon did not answer")
    p.add_argument("--width", type=int, default=DEFAULT_WIDTH, metavar="COLS",
                   help=f"with --once: columns of the frame (default {DEFAULT_WIDTH})")
    p.add_argument("--height", type=int, default=None, metavar="ROWS",
                   help="with --once: fit the frame in ROWS lines, as the live view fits the "
                        "terminal (leases shared out per daemon, '+N more'); default no limit")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"with --once: deadline of each Stats call (default {DEFAULT_TIMEOUT_S:g})")
    p.set_defaults(func=run_top)
    return p


def check_args(args: argparse.Namespace) -> list[str]:
    """The targets to show, after checking every option.

    Raises:
        InvalidArgument: a malformed target, or an interval, width or lease count out of range.
    """
    targets = list(args.target or [default_target()])
    for target in targets:
        channel_target(target)
    if not MIN_INTERVAL_S <= args.interval <= MAX_INTERVAL_S:
        raise InvalidArgument(f"--interval {args.interval} is outside {MIN_INTERVAL_S:g}.."
                              f"{MAX_INTERVAL_S:g} s", field="interval")
    if args.width < 40:
        raise InvalidArgument(f"--width {args.width} is under 40 columns", field="width")
    if args.height is not None and args.height < MIN_HEIGHT:
        raise InvalidArgument(f"--height {args.height} is under {MIN_HEIGHT} lines",
                              field="height")
    if args.max_leases < 0:
        raise InvalidArgument(f"--max-leases {args.max_leases} is negative", field="max_leases")
    if args.timeout <= 0:
        raise InvalidArgument(f"--timeout {args.timeout} must be positive", field="timeout")
    return targets


def run_top(args: argparse.Namespace) -> int:
    """Entry of ``kvpool top``: exit 0 (Ctrl-C in the live view, or every daemon answered
    ``--once``), 1 when ``--once`` could not reach a daemon.

    Raises:
        InvalidArgument: bad options (see :func:`check_args`).
    """
    from kvpool.tools.cli_run import console as console_for

    targets = check_args(args)
    token = token_from(args.token, args.token_file)
    views = [DaemonView(t) for t in targets]
    if args.once:
        asyncio.run(fetch_once(views, token, args.timeout))
        console = console_for(file=sys.stdout, width=args.width, force_terminal=False,
                              color_system=None, highlight=False, emoji=False)
        console.print(render(views, time.monotonic(), width=args.width,
                             interval_s=args.interval, max_leases=args.max_leases, live=False,
                             height=args.height))
        return 0 if all(v.error is None for v in views) else 1
    try:
        asyncio.run(watch(views, console_for(), token=token, interval_s=args.interval,
                          max_leases=args.max_leases))
    except KeyboardInterrupt:
        pass  # Ctrl-C is how top ends; Live has already restored the terminal
    return 0

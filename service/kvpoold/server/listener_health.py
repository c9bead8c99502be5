"""Listeners that survive descriptor exhaustion: the soft limit raised at start, a watch on the
process's descriptors, and health NOT_SERVING while a listener cannot accept.

A process out of descriptors (EMFILE: its own limit; ENFILE: the system's) cannot accept a
connection on any listener. gRPC's listeners retry by themselves (grpc core logs "File
descriptor limit reached. Retrying." and tries again a second later); the descriptor socket's
accept loop backs off and retries (``kvpoold.elastic.fd_server``). :class:`ListenerHealth` is
told by both (:func:`watch_descriptors` probes for the gRPC side, the descriptor socket reports
itself) and reports NOT_SERVING on the health service while any listener is down, SERVING again
once all are back; it logs one warning when an episode starts and one line when it ends, with
how long it lasted, whatever happens in between.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import time
from collections.abc import Callable

from grpc_health.v1 import health, health_pb2

from kvpoold.elastic.fd_server import EXHAUSTED_ERRNOS

log = logging.getLogger("kvpoold.server")

# How often the descriptor watch probes (one open/close of /dev/null): health follows an
# episode's start and end within this.
WATCH_INTERVAL_S = 0.1
# Descriptors the daemon needs besides its listeners' connections (pools' files, NIXL, logs,
# gRPC's own), for the start-up warning below.
RESERVED_FDS = 256


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (a service manager's default
    soft limit, often 1,024, is what a few hundred held connections exhaust).

    Returns:
        ``(soft, hard)`` after the change.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # an unlimited hard limit the kernel caps lower
            log.warning("cannot raise the descriptor limit", extra={"fields": {
                "event": "nofile_unchanged", "soft": soft, "hard": hard, "error": str(exc)}})
    return soft, hard


def fit_connection_cap(limit: int, asked: int, listeners: int) -> int:
    """The connection cap each of ``listeners`` listeners gets: ``asked`` (``--max-connections``),
    lowered when all of them together could hold every descriptor, so that held connections
    never exhaust the daemon (an EMFILE episode makes gRPC's own accept loop wait a fixed
    second before it retries: the cap keeps it from starting). Logs a warning when it lowers.

    Args:
        limit: the soft RLIMIT_NOFILE (after :func:`raise_descriptor_limit`).
        asked: the cap asked for each listener.
        listeners: listeners accepting connections (the Unix gRPC sockets, the TCP ones, the
            descriptor socket).

    Returns:
        The cap per listener, at least 1.
    """
    reserved = min(RESERVED_FDS, limit // 2)  # the daemon's own files, NIXL, pools' regions
    if listeners < 1 or asked * listeners + reserved <= limit:
        return asked
    cap = max(1, (limit - reserved) // listeners)
    log.warning(
        f"--max-connections {asked:,} lowered to {cap:,} per listener: the descriptor limit "
        f"({limit:,}) must hold {listeners} listeners' connections plus {reserved} for the "
        "daemon, or held connections exhaust it; raise the hard limit (LimitNOFILE=, "
        "ulimit -Hn) to accept more", extra={"fields": {
            "event": "nofile_low", "limit": limit, "asked": asked, "cap": cap,
            "listeners": listeners}})
    return cap


class ListenerHealth:
    """Which listeners cannot accept now; health NOT_SERVING while any cannot.

    Args:
        servicer: the health service the daemon serves.
        services: the service names whose status follows (``""`` and the KVPool service).
    """

    def __init__(self, servicer: health.aio.HealthServicer, services: tuple[str, ...]) -> None:
        self._servicer = servicer
        self._services = services
        self._down: dict[str, float] = {}  # listener -> since (time.monotonic)
        self._started = False
        self._publishing: set[asyncio.Task[None]] = set()

    @property
    def serving(self) -> bool:
        """Whether every listener accepts (health SERVING, once started)."""
        return not self._down

    def down_listeners(self) -> list[str]:
        """The listeners that cannot accept now."""
        return sorted(self._down)

    async def start(self) -> None:
        """Report the current status (SERVING unless a listener is down already)."""
        self._started = True
        await self._publish()

    def report(self, listener: str) -> Callable[[bool, str], None]:
        """The callback a listener calls on each change: ``(accepting, why)``.

        Args:
            listener: its name in logs (``descriptors``, ``fd socket /run/...``).
        """
        return lambda accepting, why: self.set(listener, accepting, why)

    def set(self, listener: str, accepting: bool, why: str = "") -> None:
        """Record whether ``listener`` accepts; logs and republishes only on a change.

        Args:
            listener: the listener's name.
            accepting: whether it can accept now.
            why: what stops it (logged when it goes down).
        """
        if not accepting and listener not in self._down:
            self._down[listener] = time.monotonic()
            log.warning(f"{listener} cannot accept connections: {why}; health reports "
                        "NOT_SERVING until it can", extra={"fields": {
                            "event": "listener_down", "listener": listener, "reason": why}})
        elif accepting and listener in self._down:
            lasted = time.monotonic() - self._down.pop(listener)
            log.info(f"{listener} accepts connections again after {lasted:.2f} s",
                     extra={"fields": {"event": "listener_up", "listener": listener,
                                       "down_s": round(lasted, 3)}})
        else:
            return
        if self._started:
            task = asyncio.get_running_loop().create_task(self._publish())
            self._publishing.add(task)
            task.add_done_callback(self._publishing.discard)

    async def _publish(self) -> None:
        # After enter_graceful_shutdown the servicer ignores set(): shutdown's NOT_SERVING stays.
        status = (health_pb2.HealthCheckResponse.SERVING if self.serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self._services:
            await self._servicer.set(name, status)


async def watch_descriptors(report: Callable[[bool, str], None],
                            interval_s: float = WATCH_INTERVAL_S) -> None:
    """Probe every ``interval_s`` whether this process can open a descriptor (an open and a
    close of /dev/null: O(1)); report each change until cancelled.

    Args:
        report: ``ListenerHealth.report("descriptors")``.
        interval_s: the probe period.
    """
    accepting = True
    while True:
        try:
            os.close(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            now = True
            why = ""
        except OSError as exc:
            if exc.errno not in EXHAUSTED_ERRNOS:
                raise
            now = False
            why = (f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: the process is out of "
                   f"descriptors (limit {resource.getrlimit(resource.RLIMIT_NOFILE)[0]:,})")
        if now != accepting:
            accepting = now
            report(accepting, why)
        await asyncio.sleep(interval_s)

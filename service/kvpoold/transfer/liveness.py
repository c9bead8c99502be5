"""Whether a sending daemon's process has exited: a fact from the kernel (a pidfd), never a clock.

A sender names its process in PeerReceive (:class:`ProcessId`: boot id, pid namespace, pid,
start time). A receiver on the same boot and in the same pid namespace opens a pidfd for it,
checks the start time (a reused pid is another process: the named one has exited), and the
event loop reads the pidfd: it becomes readable when the process exits, and not before, however
long it is stopped (SIGSTOP) or stalled. Elsewhere (another host, another pid namespace) the
process cannot be watched and :meth:`ProcessWatch.watch` says so (None).

The pidfds are one per watched process, shared by its writes, closed with the last.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

log = logging.getLogger("kvpoold.transfer")

MAX_BOOT_ID_CHARS = 64


@dataclass(frozen=True)
class ProcessId:
    """A process, told apart from any later one with the same pid."""

    boot_id: str
    pid_namespace: int
    pid: int
    start_ticks: int


def _start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time since boot, in clock ticks); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return int(stat[stat.rindex(b")") + 2:].split()[19])


@cache
def this_process() -> ProcessId:
    """This daemon's own :class:`ProcessId` (what its PeerReceive requests carry)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    pid = os.getpid()
    return ProcessId(boot, os.stat("/proc/self/ns/pid").st_ino, pid, _start_ticks(pid) or 0)


@dataclass(eq=False)
class _Watched:
    fd: int
    exited: dict[int, Callable[[], None]] = field(default_factory=dict)


class ProcessWatch:
    """Calls back when watched processes exit; state owned by the daemon's event loop."""

    def __init__(self) -> None:
        self._watched: dict[ProcessId, _Watched] = {}
        self._keys = iter(range(1, 1 << 62))

    @property
    def processes(self) -> int:
        """Processes watched now (one pidfd each)."""
        return len(self._watched)

    def watch(self, proc: ProcessId, exited: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``exited`` (once, on the loop) when ``proc`` exits; at the next loop turn when
        it already has.

        Returns:
            What stops watching (before the exit), or None when ``proc`` cannot be watched
            from here (another boot or pid namespace, or no pidfd support).
        """
        mine = this_process()
        if (proc.boot_id != mine.boot_id or proc.pid_namespace != mine.pid_namespace
                or proc.pid <= 0 or not hasattr(os, "pidfd_open")):
            return None
        loop = asyncio.get_running_loop()
        entry = self._watched.get(proc)
        if entry is None:
            try:
                fd = os.pidfd_open(proc.pid)
            except ProcessLookupError:
                loop.call_soon(exited)  # gone already
                return lambda: None
            except OSError:
                log.warning("pidfd_open(%d) failed; the process is not watched", proc.pid,
                            exc_info=True)
                return None
            if _start_ticks(proc.pid) != proc.start_ticks:
                os.close(fd)  # the pid is another process's now: the named one exited
                loop.call_soon(exited)
                return lambda: None
            entry = self._watched[proc] = _Watched(fd)
            loop.add_reader(fd, self._exited, proc)
        key = next(self._keys)
        entry.exited[key] = exited

        def unwatch() -> None:
            current = self._watched.get(proc)
            if current is entry and entry.exited.pop(key, None) is not None \
                    and not entry.exited:
                self._close(proc)

        return unwatch

    def _exited(self, proc: ProcessId) -> None:
        entry = self._watched.get(proc)
        if entry is None:
            return
        self._close(proc)
        for exited in list(entry.exited.values()):
            try:
                exited()
            except Exception:
                log.exception("handling the exit of process %d failed", proc.pid)

    def _close(self, proc: ProcessId) -> None:
        entry = self._watched.pop(proc)
        asyncio.get_running_loop().remove_reader(entry.fd)
        os.close(entry.fd)

    def close(self) -> None:
        """Stop watching everything (shutdown)."""
        for proc in list(self._watched):
            self._close(proc)

"""Stray memory in elastic pools' sparse files on CPU: found, freed, and its writer's lease ended.

A process that attached an elastic pool can map its file whole and touch ranges the daemon
never granted or punched since: each touch takes a page of tmpfs (a read too), outside the
budget and unseen by the arbiter. On every sweep (every 0.2 s at most,
``kvpoold.server.run.SWEEP_INTERVAL_S``) :meth:`BackingAudit.sweep` compares each pool's
``st_blocks`` with what the daemon committed (O(1) a pool). Only when there is more, an audit in
a worker thread (:func:`audit`), holding the backing's lock so no grant or release runs
meanwhile:

1. finds the touched pages in the holes with ``SEEK_DATA``/``SEEK_HOLE`` (O(granted ranges)
   ``lseek`` calls, no page scanned);
2. finds who touched them: the processes mapping the file (``/proc/<pid>/maps``, by device and
   inode) whose page tables have those pages present (``/proc/<pid>/pagemap``, read over the
   stray pages only). A hole punch unmaps a range from every process, so a page present there
   was touched after the punch, by that process;
3. punches them, then every hole if memory committed with ``fallocate`` (which no page table
   and no ``SEEK_DATA`` shows) remains.

Back on the loop, the leases that did it are ended (``Hooks.revoke``: their ids and attachments
come back). Which lease a process holds the pool under is a fact the daemon recorded: the
client maps an elastic CPU pool from the descriptor the side socket hands it
(``kvpoold.elastic.fd_server``), which tells the daemon the process's pid (``SO_PEERCRED``)
and proves the lease by its secret (``Hooks.descriptor_holders``). A process found in step 2
that took the descriptor is blamed exactly: the lease(s) it took it under. One that opened the
file by its path instead (any process of the daemon's user may) is tied to a lease only by the
lease's name, ``<this host>:<pid>`` (the client's default). When neither ties any lease (a
renamed lease of a process that opened the path, or memory committed with ``fallocate``), every
lease attached to the pool is ended, and the log says so.

What it cannot do: unmap another process's mapping. A process whose lease was ended can go on
touching holes; each sweep punches them again (the excess lasts a sweep and an audit) and
blames no other lease for it: the pids already blamed are remembered per pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.contract.errors import KVPoolError
from kvpoold.sharing.sparse_groups import SparseBacking

log = logging.getLogger("kvpoold.elastic")

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_PRESENT = 1 << 63  # pagemap: the page is in the process's page tables


class AuditHooks(Protocol):
    """What the audit needs of the daemon (a part of ``kvpoold.elastic.manager.Hooks``)."""

    def attached_leases(self, pool: str) -> set[int]: ...

    def descriptor_holders(self, pool: str) -> dict[int, set[int]]:
        """pid -> the leases under which that process took the pool's descriptor."""
        ...

    def revoke(self, lease_id: int, why: str) -> None: ...

    def lease_name(self, lease_id: int) -> str:
        """The lease's name ("" when it is gone)."""
        ...


class Audited(Protocol):
    """An elastic pool as the manager keeps it: its region and its revocation counter."""

    backing: object
    revoked: int


@dataclass(frozen=True)
class Rebacking:
    """What one audit found and did.

    Attributes:
        excess_bytes: memory behind the file beyond what the daemon committed, found.
        strays: ``(offset, length)`` of the touched pages in holes.
        touched: pid -> bytes of those pages present in its page tables.
        mappers: every other process mapping the file (pids).
        unreadable: mappers whose page tables could not be read (another user).
        left_bytes: the excess after the punches (0, unless a process touched it again).
    """

    excess_bytes: int
    strays: tuple[tuple[int, int], ...]
    touched: dict[int, int]
    mappers: frozenset[int]
    unreadable: frozenset[int]
    left_bytes: int


def _mappings(pid: int, dev: int, ino: int) -> list[tuple[int, int, int]]:
    """``(start, end, file offset)`` of ``pid``'s mappings of the file ``dev:ino``."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x} {ino} "
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) >= 5 and f"{parts[3]} {parts[4]} " == want:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, int(parts[2], 16)))
    return out


def _present_bytes(pid: int, maps: list[tuple[int, int, int]],
                   extents: list[tuple[int, int]]) -> int:
    """Bytes of ``extents`` (file ranges) present in ``pid``'s page tables."""
    present = 0
    with open(f"/proc/{pid}/pagemap", "rb") as pm:
        for lo, hi, off in maps:
            for start, length in extents:
                a = max(start, off)
                b = min(start + length, off + (hi - lo))
                if a >= b:
                    continue
                pm.seek((lo + a - off) // PAGE_BYTES * 8)
                raw = pm.read((b - a) // PAGE_BYTES * 8)
                present += sum(1 for (e,) in struct.iter_unpack("<Q", raw) if e & _PRESENT)
    return present * PAGE_BYTES


def find_touchers(fd: int, extents: list[tuple[int, int]]
                  ) -> tuple[dict[int, int], set[int], set[int]]:
    """Who maps the file ``fd`` and who has pages of ``extents`` present (this process
    excluded): O(processes) ``maps`` reads, ``pagemap`` read over ``extents`` only.

    Returns:
        ``(touched, mappers, unreadable)``: pid -> present bytes (those above 0), every pid
        mapping the file, the pids whose page tables could not be read.
    """
    st = os.fstat(fd)
    me = os.getpid()
    touched: dict[int, int] = {}
    mappers: set[int] = set()
    unreadable: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            maps = _mappings(pid, st.st_dev, st.st_ino)
        except OSError:  # gone, or another user's: it cannot have opened our 0600 file
            continue
        if not maps:
            continue
        mappers.add(pid)
        try:
            got = _present_bytes(pid, maps, extents)
        except OSError:
            unreadable.add(pid)
            continue
        if got:
            touched[pid] = got
    return touched, mappers, unreadable


def audit(groups: SparseBacking) -> Rebacking | None:
    """Find, attribute and free memory in ``groups``' holes (blocking: a worker thread).

    Returns:
        What it found and did, or None when the file holds no more than committed.
    """
    with groups.lock:
        if groups.closed:
            return None
        excess = groups.excess_bytes()
        if excess <= 0:  # a commit that was finishing when the sweep looked
            return None
        gaps = groups.gaps()
        strays = groups.stray_extents(gaps)
        touched, mappers, unreadable = find_touchers(groups.fd, strays)
        groups.punch_strays(strays)
        if groups.excess_bytes() > 0:  # committed by fallocate: no page table shows it
            groups.punch_gaps(gaps)
        left = max(0, groups.excess_bytes())
    return Rebacking(excess, tuple(strays), touched, frozenset(mappers), frozenset(unreadable),
                     left)


def _claimed_pid(name: str, host: str) -> int | None:
    """The pid in a lease name ``<host>:<pid>`` of this host (the client's default name)."""
    h, _, pid = name.rpartition(":")
    return int(pid) if h == host and pid.isdigit() else None


@dataclass
class BackingAudit:
    """The audits of every elastic pool with a sparse file: at most one running a pool.

    Attributes:
        found: pool -> audits that found stray memory.
        stray_bytes: pool -> stray bytes found, in all.
    """

    found: dict[str, int] = field(default_factory=dict)
    stray_bytes: dict[str, int] = field(default_factory=dict)
    _running: set[str] = field(default_factory=set)
    _ended: dict[str, set[int]] = field(default_factory=dict)  # pool -> pids blamed
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def sweep(self, pools: Mapping[str, Audited], hooks: AuditHooks) -> None:
        """Start an audit of each pool whose file holds more than committed (O(pools): one
        ``fstat`` each). Call on the event loop."""
        for gone in self._ended.keys() - pools.keys():
            del self._ended[gone]
        for name, ep in pools.items():
            groups = getattr(ep.backing, "groups", None)
            if not isinstance(groups, SparseBacking) or name in self._running:
                continue
            try:
                if groups.closed or groups.excess_bytes() <= 0:
                    continue
            except OSError:
                continue
            self._running.add(name)
            task = asyncio.get_running_loop().create_task(self._run(name, ep, groups, hooks))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, name: str, ep: Audited, groups: SparseBacking,
                   hooks: AuditHooks) -> None:
        try:
            found = await asyncio.to_thread(audit, groups)
        except OSError as exc:
            log.error("elastic audit failed", extra={"fields": {
                "event": "elastic_audit_error", "pool": name, "error": str(exc)}})
            return
        finally:
            self._running.discard(name)
        if found is not None:
            self._blame(name, ep, found, hooks)

    def _blame(self, name: str, ep: Audited, found: Rebacking, hooks: AuditHooks) -> None:
        """End the leases that put memory in ``name``'s holes."""
        self.found[name] = self.found.get(name, 0) + 1
        self.stray_bytes[name] = self.stray_bytes.get(name, 0) + found.excess_bytes
        attached = hooks.attached_leases(name)
        holders = hooks.descriptor_holders(name)
        exact = {pid: holders.get(pid, set()) & attached for pid in found.touched}
        blamed = set().union(*exact.values())
        explained = {pid for pid, leases in exact.items() if leases}
        how = ("its process took the pool's descriptor under it and had the pages in its page "
               "tables")
        host = socket.gethostname()
        named = {lease for lease in attached
                 if _claimed_pid(hooks.lease_name(lease), host) in set(found.touched) - explained}
        if named:
            blamed |= named
            explained |= {_claimed_pid(hooks.lease_name(lease), host) for lease in named}
            how += (" (or, for a process that opened the file by its path, its name says "
                    "that process's pid)")
        ended = self._ended.setdefault(name, set())
        unknown = set(found.touched) - ended - explained
        if not blamed and (unknown or not found.touched):
            blamed = attached
            how = ("no attached lease could be told from the others (no process with the "
                   "pages mapped took the descriptor under a lease, and no lease is named "
                   f"{host}:<pid> of one: pids {sorted(found.touched)}), so every lease "
                   "attached to the pool")
        # a process whose lease was ended keeps its mapping: what it touches again is punched
        # again, and blames no one else
        ended.update(found.touched)
        log.warning("elastic pool memory outside its groups", extra={"fields": {
            "event": "elastic_stray_memory", "pool": name, "bytes": found.excess_bytes,
            "strays": len(found.strays), "touched": found.touched,
            "mappers": sorted(found.mappers), "unreadable": sorted(found.unreadable),
            "left_bytes": found.left_bytes, "revoked": sorted(blamed)}})
        for lease in sorted(blamed):
            ep.revoked += 1
            with contextlib.suppress(KVPoolError):
                hooks.revoke(lease, (
                    f"{found.excess_bytes:,} B of elastic pool {name!r} were backed outside "
                    f"the groups the daemon granted (a mapping touched ranges it punched or "
                    f"never granted); blamed: {how}; the memory was freed"))

    async def close(self) -> None:
        """Wait for the audits running (shutdown)."""
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

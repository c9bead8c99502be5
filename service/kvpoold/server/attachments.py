"""Attachments: clients that mapped a pool (Attach without Detach), indexed by pool and lease,
and counted per caller identity (for the per-identity cap; only that identity may Detach it).

A pool with attachments is not dropped unless forced (an importer may still map its memory);
an attachment made under a lease ends with the lease, so a crashed client does not pin a pool.
Not thread-safe: the daemon calls it from its event loop only.
"""

from __future__ import annotations

import os
import secrets
import select
from dataclasses import dataclass

from kvpool.contract.errors import ResourceExhausted
from kvpoold.settings import (  # daemon.py imports it from here
    MAX_ATTACHMENTS_PER_IDENTITY as MAX_ATTACHMENTS_PER_IDENTITY,
)

# Processes one lease may register as mapping one pool (an engine's scheduler and TP workers).
MAX_HOLDERS_PER_LEASE = 256


@dataclass(frozen=True)
class Attachment:
    attach_id: int
    pool: str
    lease_id: int  # 0: not tied to a lease
    identity: str = "local"  # the caller that attached (``kvpoold.server.auth``)


class AttachmentTable:
    """Every attachment, by id, with the ids per pool and per lease."""

    def __init__(self) -> None:
        self._by_id: dict[int, Attachment] = {}
        self._by_pool: dict[str, set[int]] = {}
        self._by_lease: dict[int, set[int]] = {}
        self._per_identity: dict[str, int] = {}
        # pool -> lease -> {pid: pidfd}: the processes the descriptor side socket served under
        # the lease (the kernel's SO_PEERCRED pid, its pidfd opened then, so a reused pid is
        # never taken for it): who can write the memory, as a fact
        self._holders: dict[str, dict[int, dict[int, int]]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, pool: str, lease_id: int = 0, identity: str = "local") -> Attachment:
        """Record a new attachment to ``pool`` (under ``lease_id`` if not 0) by ``identity``."""
        attach_id = 0
        while attach_id == 0 or attach_id in self._by_id:
            attach_id = secrets.randbits(63)
        att = Attachment(attach_id, pool, lease_id, identity)
        self._by_id[attach_id] = att
        self._per_identity[identity] = self._per_identity.get(identity, 0) + 1
        self._by_pool.setdefault(pool, set()).add(attach_id)
        if lease_id:
            self._by_lease.setdefault(lease_id, set()).add(attach_id)
        return att

    def remove(self, attach_id: int) -> Attachment | None:
        """End one attachment; None if there is no such attachment."""
        att = self._by_id.pop(attach_id, None)
        if att is None:
            return None
        _discard(self._by_pool, att.pool, attach_id)
        left = self._per_identity[att.identity] - 1
        if left:
            self._per_identity[att.identity] = left
        else:
            del self._per_identity[att.identity]
        if att.lease_id:
            # The lease's processes stay recorded as its pool's writers until the lease ends
            # (take_writers): a detach is the client's word that it unmapped, not a fact.
            _discard(self._by_lease, att.lease_id, attach_id)
        return att

    def add_holder(self, pool: str, lease_id: int, pid: int) -> None:
        """Record that process ``pid`` (connected now: the kernel's) took ``pool``'s descriptor,
        or registered, under ``lease_id`` (which holds an attachment of it); forgotten when the
        lease ends (:meth:`take_writers`), or the pool goes.

        Raises:
            ResourceExhausted: the lease registered MAX_HOLDERS_PER_LEASE processes that still
                live already.
        """
        pids = self._holders.setdefault(pool, {}).setdefault(lease_id, {})
        if pid in pids:
            return
        if len(pids) >= MAX_HOLDERS_PER_LEASE:  # forget those that exited: they write nothing
            for gone in [p for p, fd in pids.items() if select.select([fd], [], [], 0)[0]]:
                os.close(pids.pop(gone))
        if len(pids) >= MAX_HOLDERS_PER_LEASE:
            raise ResourceExhausted(
                f"lease {lease_id} has {len(pids)} processes mapping pool {pool!r}, at most "
                f"{MAX_HOLDERS_PER_LEASE}", field="lease_id")
        try:
            pids[pid] = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already: it writes nothing
            pass

    def take_writers(self, pool: str, lease_id: int) -> dict[int, int]:
        """Hand over (the caller closes them) the pidfds of the processes that mapped ``pool``
        under ``lease_id``, attached still or not: ``{pid: pidfd}`` (at the lease's end)."""
        holders = self._holders.get(pool)
        if holders is None:
            return {}
        out = holders.pop(lease_id, {})
        if not holders:
            del self._holders[pool]
        return out

    def holders(self, pool: str) -> dict[int, set[int]]:
        """pid -> the leases under which that process took ``pool``'s descriptor."""
        out: dict[int, set[int]] = {}
        for lease_id, pids in self._holders.get(pool, {}).items():
            for pid in pids:
                out.setdefault(pid, set()).add(lease_id)
        return out

    def remove_pool(self, pool: str) -> int:
        """End every attachment to ``pool`` and forget its writers; returns how many."""
        n = sum(self.remove(a) is not None for a in list(self._by_pool.get(pool, ())))
        for pids in self._holders.pop(pool, {}).values():
            _close_all(pids)
        return n

    def writer_pools(self, lease_id: int) -> list[str]:
        """The pools of which processes registered under ``lease_id`` (O(pools))."""
        return [pool for pool, leases in self._holders.items() if lease_id in leases]

    def remove_lease(self, lease_id: int) -> int:
        """End every attachment made under ``lease_id``; returns how many."""
        return sum(self.remove(a) is not None for a in list(self._by_lease.get(lease_id, ())))

    def leases_of_pool(self, pool: str) -> set[int]:
        """Leases with an attachment of ``pool`` (O(its attachments))."""
        return {self._by_id[a].lease_id for a in self._by_pool.get(pool, ())
                if self._by_id[a].lease_id}

    def count_pool(self, pool: str) -> int:
        return len(self._by_pool.get(pool, ()))

    def count_lease(self, lease_id: int) -> int:
        return len(self._by_lease.get(lease_id, ()))

    def count_identity(self, identity: str) -> int:
        return self._per_identity.get(identity, 0)

    def get(self, attach_id: int) -> Attachment | None:
        return self._by_id.get(attach_id)

    def clear(self) -> None:
        self._by_id.clear()
        self._by_pool.clear()
        self._by_lease.clear()
        self._per_identity.clear()
        for holders in self._holders.values():
            for pids in holders.values():
                _close_all(pids)
        self._holders.clear()


def _close_all(pidfds: dict[int, int]) -> None:
    for fd in pidfds.values():
        os.close(fd)


def _discard(index: dict, key: object, attach_id: int) -> None:
    ids = index.get(key)
    if ids is not None:
        ids.discard(attach_id)
        if not ids:
            del index[key]

"""Leases as callers use them: open, prove, renew (with the page caches' report), close,
expire and revoke; a lease's end gives back everything it held, in every pool."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from kvpool.contract.records import HeldMap, Released
from kvpoold.access import Caller
from kvpoold.elastic.manager import ElasticPools
from kvpoold.pools.pool_registry import PoolRegistry
from kvpoold.server.args import LeaseRef
from kvpoold.server.attachments import AttachmentTable
from kvpoold.server.give_back import CachePressure
from kvpoold.server.leases import CacheCounts, Lease, LeaseTable
from kvpoold.transfer import Transfers

log = logging.getLogger("kvpoold.daemon")


class LeaseService:
    """The daemon's lease calls.

    Args:
        leases: the lease table.
        registry: the pools (a lease's end reclaims its ids in each).
        attachments: the attachments (they end with their lease).
        transfers: grants and sends (a lease's end ends its own).
        elastic: the elastic pools (unmaps reported on KeepAlive; shrinks at a lease's end).
        pressure: woken when a lease's end frees ids.
    """

    def __init__(self, leases: LeaseTable, registry: PoolRegistry,
                 attachments: AttachmentTable, transfers: Transfers, elastic: ElasticPools,
                 pressure: CachePressure) -> None:
        self.leases = leases
        self._registry = registry
        self._attachments = attachments
        self._transfers = transfers
        self._elastic = elastic
        self._pressure = pressure

    def open(self, caller: Caller, name: str, ttl_s: float) -> Lease:
        """Open a lease of the caller's identity (see :class:`LeaseTable`).

        Raises:
            InvalidArgument: bad name or TTL.
            ResourceExhausted: the daemon's lease limit, or the identity's cap.
        """
        lease = self.leases.open(name, ttl_s, caller.identity)
        log.info("lease opened", extra={"fields": {
            "event": "lease_open", "lease_id": lease.lease_id, "owner": lease.owner,
            "name": lease.name, "ttl_s": lease.ttl_s, "identity": lease.identity,
        }})
        return lease

    def prove(self, caller: Caller, ref: LeaseRef) -> Lease:
        """The open lease ``ref`` names, proven by its secret, of the caller's identity.

        Raises:
            NotFound: unknown, closed or expired, or not proven (the same answer).
        """
        return self.leases.prove(ref.lease_id, ref.secret, caller.identity)

    def renew(self, caller: Caller, ref: LeaseRef,
              reports: dict[tuple[str, str], CacheCounts] | None = None,
              unmapped: Sequence[int] = ()) -> Lease:
        """Renew a lease and keep its page caches' report (``(pool, space) -> CacheCounts``;
        it replaces the last one), as far as the lease's holdings back it
        (:meth:`_backed`); ``unmapped``: the elastic reclaims its process carried out.

        Raises:
            NotFound: unknown, closed or expired lease, or not proven.
        """
        lease = self.leases.renew(self.prove(caller, ref).lease_id)
        if reports is not None:
            self.leases.set_reports(lease, self._backed(lease, reports))
        if unmapped:
            self._elastic.unmapped(lease.lease_id, unmapped)
        return lease

    def _backed(self, lease: Lease, reports: dict[tuple[str, str], CacheCounts]
                ) -> dict[tuple[str, str], CacheCounts]:
        """The part of a cache report the lease's holdings back: a cache holds only ids its
        lease holds, so each count is capped at what the lease holds in that pool and space
        now, and a report of a pool or space that does not exist is not kept (what a lease may
        store stays O(pools x spaces)). O(reports)."""
        out: dict[tuple[str, str], CacheCounts] = {}
        for (pool, name), (cached, in_use, evictable) in reports.items():
            entry = self._registry.get(pool)
            if entry is None or name not in entry.ids.names:
                continue
            held = entry.ids.space(name, "caches").held(lease.owner)
            in_use = min(in_use, held)
            out[(pool, name)] = CacheCounts(min(cached, held), in_use, min(evictable, in_use))
        return out

    def close(self, caller: Caller, ref: LeaseRef) -> Released:
        """End a lease; everything it holds comes back and its attachments end.

        Raises:
            NotFound: unknown, closed or expired lease, or not proven.
        """
        lease = self.leases.close(self.prove(caller, ref).lease_id)
        result = self.release(lease)
        log.info("lease closed", extra={"fields": {
            "event": "lease_close", "lease_id": lease.lease_id, "name": lease.name,
            "released": result.total, "detached": result.detached,
        }})
        return result

    def expire(self, max_leases: int | None = None, max_ids: int | None = None, *,
               timers: bool = True) -> list[tuple[Lease, Released]]:
        """Expire leases past their deadline and reclaim what they held; logs each.

        A sweep of thousands of leases is done in slices (``kvpoold.server.run.sweep_leases``
        yields to the event loop between them): this call stops after ``max_leases`` leases,
        or once the leases it reclaimed released ``max_ids`` ids in all, whichever comes first
        (a lease is never split: one holding more than ``max_ids`` is a slice of its own).
        What is left stays due (``leases.next_deadline()`` <= now) and, its deadline passed,
        can be neither renewed nor used meanwhile (``LeaseTable.get``).

        Args:
            max_leases: at most this many leases (None: no bound).
            max_ids: stop once this many ids are released (None: no bound).
            timers: also end receive grants and elastic unmaps whose deadline passed (the
                sweep's first slice; the slices that carry on a sweep pass False).

        Returns:
            The leases expired by this call, by deadline, with what each released.
        """
        if timers:
            self._transfers.expire()  # receive grants past their expiry end on this sweep
            self._elastic.sweep()  # unmap deadlines: leases that did not unmap are ended here
        out: list[tuple[Lease, Released]] = []
        released = 0
        while ((max_leases is None or len(out) < max_leases)
               and (max_ids is None or released < max_ids)):
            room = None if max_leases is None else max_leases - len(out)
            # One lease at a time under max_ids: what a lease holds is known once reclaimed.
            popped = self.leases.pop_expired(limit=1 if max_ids is not None else room)
            if not popped:
                break
            for lease in popped:
                result = self.release(lease)
                released += result.total
                out.append((lease, result))
                log.warning("lease expired", extra={"fields": {
                    "event": "lease_expired", "lease_id": lease.lease_id, "name": lease.name,
                    "ttl_s": lease.ttl_s, "released": result.total,
                    "detached": result.detached,
                    "held": {f"{pool}/{space}": n for pool, spaces in result.held.items()
                             for space, n in spaces.items()},
                }})
        return out

    def release(self, lease: Lease) -> Released:
        """Give back everything an ended lease held: its ids in every pool, its attachments,
        its transfers, its elastic handshakes."""
        self._transfers.lease_gone(lease.owner, f"lease {lease.lease_id} ({lease.name}) ended")
        released: HeldMap = {}
        for name, entry in self._registry.pools.items():
            counts = {s: n for s, n in entry.reclaim(lease.owner).items() if n}
            if counts:
                released[name] = counts
        # the processes that could write each pool's pages under it, detached or not: the
        # sealed directory's to wait on, or closed
        for name in self._attachments.writer_pools(lease.lease_id):
            writers = self._attachments.take_writers(name, lease.lease_id)
            entry = self._registry.pools.get(name)
            if entry is not None and entry.sealed is not None:
                entry.sealed.lease_ended(lease.lease_id, writers)
            else:
                for fd in writers.values():
                    os.close(fd)
        detached = self._attachments.remove_lease(lease.lease_id)
        if released:
            self._pressure.notify_freed()
        self._elastic.lease_gone(lease.lease_id)
        return Released(released, detached)

    def revoke(self, lease_id: int, why: str) -> None:
        """End lease ``lease_id`` for ``why`` (it did not unmap in time); no-op when it ended
        already."""
        if self.leases.find(lease_id) is None:
            return
        lease = self.leases.close(lease_id)
        result = self.release(lease)
        log.warning("lease ended", extra={"fields": {
            "event": "lease_revoked", "lease_id": lease.lease_id, "name": lease.name,
            "why": why, "released": result.total, "detached": result.detached}})

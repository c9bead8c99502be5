"""Seal, Unseal, Adopt and Sealed: the daemon's side of pages that outlive their engine.

The pool aggregate's :class:`~kvpoold.pools.sealed.SealedDirectory` holds the state and alone
changes it; this module checks the caller, the lease and the arguments, reads the checksums of
a CPU pool's pages in a worker thread (never on the loop), and hands the directory typed
values. See docs/restart.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np

from kvpool.contract.errors import PermissionDenied
from kvpool.contract.limits import MAX_ADOPT_PAGES
from kvpool.contract.records import Adopted, SealedStats
from kvpoold.access import Caller
from kvpoold.ids.faults import Asked
from kvpoold.pools.pool import Pool
from kvpoold.pools.sealed import SealedDirectory, check_seal_args, checksums, kv_extents
from kvpoold.server.args import LeaseRef
from kvpoold.server.kv_stream import KvEvents
from kvpoold.server.leases import Lease

log = logging.getLogger("kvpoold.daemon")


class Sealing:
    """Seal, Adopt and the directory's listing.

    Args:
        pool: the pool lookup, checked against the caller's scope.
        lease: the lease proof of a caller.
        clock: seconds (the directory's ages).
        events: the KV events stream, told of each directory made (None: not published).
    """

    def __init__(self, pool: Callable[[str, Caller], Pool],
                 lease: Callable[[Caller, LeaseRef], Lease], clock: Callable[[], float],
                 events: KvEvents | None = None) -> None:
        self._pool = pool
        self._lease = lease
        self._clock = clock
        self.events = events

    def _directory(self, entry: Pool) -> SealedDirectory:
        """The pool's directory (made at the first use), its changes published from then on
        when the daemon publishes KV events."""
        d = entry.directory(self._clock)
        if self.events is not None and d.sink is None and entry.live:
            self.events.attach(entry.name, entry.buffers.device.type, d)
        return d

    async def _sums(self, entry: Pool, ids: list[int]) -> list[bytes] | None:
        """The pages' checksums on CPU (in a worker thread, holding a use of the pool so its
        memory stays while they are read); None on a GPU (nothing re-read there)."""
        if entry.buffers.device.type != "cpu":
            return None
        if not ids:
            return []
        extents = kv_extents(entry.plan)
        with entry.use("sealing"):
            return await asyncio.to_thread(checksums, entry.buffers.backing, extents, ids)

    async def seal(self, caller: Caller, pool: str, ref: LeaseRef, layout: str,
                   ids: np.ndarray, raw_keys: bytes, raw_parents: bytes,
                   raw_tokens: np.ndarray) -> int:
        """Seal pages the lease holds (checked: held, not in a transfer); returns how many
        were sealed now.

        Raises:
            NotFound / PermissionDenied: the pool or the lease.
            FailedPrecondition: the pool cannot be sealed (elastic, hybrid, hybrid vLLM), or a
                page is not the lease's.
            InvalidArgument: an id out of range or repeated.
        """
        entry = self._pool(pool, caller)
        lease = self._lease(caller, ref)
        # every check before the directory is made: a refused Seal changes nothing
        entry.check_sealable()
        keys, parents, tokens = check_seal_args(layout, ids, raw_keys, raw_parents, raw_tokens,
                                                entry.plan.page_size)
        space = entry.kv_space()
        fault = space.check(lease.owner, ids.astype(np.intp))
        if fault is not None:  # the same words as a refused Free
            raise space.free_error(lease.owner, ids, Asked(
                f"seal {pool} (kv)", "page_ids", "nothing was sealed"))
        d = self._directory(entry)
        sums = await self._sums(entry, ids.tolist())
        # the lease may have let go of a page while the sums were read: seal what it still holds
        owners = d.space.owner_of(ids)
        still = owners == lease.owner
        pick = np.flatnonzero(still)
        return d.seal(lease.lease_id, layout, ids[pick], [keys[i] for i in pick],
                      [parents[i] for i in pick], tokens[pick],
                      [] if sums is None else [sums[i] for i in pick])

    def unseal(self, caller: Caller, pool: str, ref: LeaseRef, ids: np.ndarray) -> int:
        """Unseal pages the lease holds, before it writes them again (they stay the lease's);
        returns how many were sealed. O(pages asked).

        Raises:
            NotFound / PermissionDenied: the pool or the lease.
            FailedPrecondition: a page is not the lease's (nothing is unsealed).
            InvalidArgument: an id out of range or repeated.
        """
        entry = self._pool(pool, caller)
        lease = self._lease(caller, ref)
        space = entry.kv_space()
        fault = space.check(lease.owner, ids.astype(np.intp))
        if fault is not None:  # the same words as a refused Free
            raise space.free_error(lease.owner, ids, Asked(
                f"unseal {pool} (kv)", "page_ids", "nothing was unsealed"))
        d = entry.sealed
        return 0 if d is None else d.unseal(ids.astype(np.intp))

    async def adopt(self, caller: Caller, pool: str, ref: LeaseRef, layout: str) -> Adopted:
        """Hand the lease the directory's pages of ``layout`` whose writers are proven gone
        (on CPU, whose bytes are as sealed).

        Raises:
            NotFound / PermissionDenied: the pool or the lease.
            FailedPrecondition: the pool cannot be sealed.
        """
        entry = self._pool(pool, caller)
        lease = self._lease(caller, ref)
        d = self._directory(entry)
        ids, unfenced, other = entry.adoptable(d, layout)
        ids = ids[:MAX_ADOPT_PAGES]  # the rest on the next call
        sums = await self._sums(entry, ids)
        # the directory may have changed while the sums were read (an eviction): look again
        still, unfenced, other = entry.adoptable(d, layout)
        keep = set(still)
        pairs = [(u, sums[i] if sums is not None else b"") for i, u in enumerate(ids)
                 if u in keep]
        got = d.adopt(lease.owner, lease.lease_id, layout, [u for u, _ in pairs],
                      None if sums is None else [s for _, s in pairs], unfenced, other)
        log.info("sealed pages adopted", extra={"fields": {
            "event": "adopt", "pool": pool, "lease_id": lease.lease_id, "layout": layout,
            "pages": int(got.ids.shape[0]), "unfenced": got.unfenced, "corrupt": got.corrupt,
            "other_layout": got.other_layout, "epoch": got.epoch}})
        return got

    def sealed(self, caller: Caller, pool: str, evict: bool = False) -> SealedStats:
        """The pool's directory; with ``evict`` (the pool's admin), every page it keeps given
        back first.

        Raises:
            NotFound / PermissionDenied: the pool, or an evict by a caller who is not admin.
        """
        entry = self._pool(pool, caller)
        d = entry.sealed
        evicted = 0
        if evict:
            if not caller.admin:
                raise PermissionDenied(f"evicting pool {pool!r}'s sealed pages needs an admin "
                                       "token", field="evict")
            if d is not None:
                evicted = d.evict_all()
                log.info("sealed pages evicted", extra={"fields": {
                    "event": "sealed_evict", "pool": pool, "pages": evicted}})
        rank = self.events.rank_of(pool) if self.events is not None else None
        if d is None:
            return SealedStats(evicted=evicted, events_rank=rank)
        stats = directory_stats(entry, listing=True, evicted=evicted, rank=rank)
        assert stats is not None
        return stats


def directory_stats(entry: Pool, *, listing: bool = False, evicted: int = 0,
                    rank: int | None = None) -> SealedStats | None:
    """The pool's sealed-page directory in numbers (None before its first Seal). Without
    ``listing`` O(1), for Stats and metrics: the counts and totals; with it (the Sealed RPC) also
    the kept pages' ages and layouts, O(kept). ``rank``: its KV events' rank, if published."""
    d = entry.sealed
    if d is None:
        return None
    oldest, newest = d.ages() if listing else (0.0, 0.0)
    kept = len(d.orphans)
    return SealedStats(
        held=len(d.entries) - kept, kept=kept,
        kept_bytes=kept * sum(length for _, _, length in kv_extents(entry.plan)),
        oldest_seconds=oldest, newest_seconds=newest, sealed_total=d.sealed_total,
        adopted_total=d.adopted_total, evicted_total=d.evicted_total,
        corrupt_total=d.corrupt_total, epoch=d.epoch, evicted=evicted,
        layouts=tuple(sorted({d.entries[u].layout for u in d.orphans})) if listing else (),
        events_rank=rank)


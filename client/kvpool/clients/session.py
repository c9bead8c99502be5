"""The keep-alive session of one lease, without I/O: what to send next on its KeepAlive stream,
what an answer means, what a failure means.

A lease renews itself over one bidirectional KeepAlive stream: every ``ttl / 3`` (or at once
when kicked) it sends a request carrying its page caches' counts, and the daemon answers each
one (echoing its ``seq``) and may, unasked, ask the caches to give ids back, or (elastic pools)
ask the lease's attached regions to unmap groups it is taking back. The rules of that
exchange live here, once; the blocking ``Lease`` drives a session from a thread, the asyncio
``AsyncLease`` from a task, and each only moves messages (the h11 shape: a protocol core with
thin sync and async shells).

An unmap is acknowledged only once carried out: the reclaim id goes in the ``unmapped`` of
every request until the daemon answers one that carried it (a request lost with its stream is
sent again). An unmap that fails is logged and never acknowledged; the daemon then ends the
lease at the reclaim's deadline, which is the safe outcome (no process keeps memory mapped that
another pool is given).

While a page cache of a (pool, space) is registered, the lease refuses its own Allocate and
Free of that space (:meth:`~KeepAliveSession.refuse_cached`): the cache is the only path to
it, so what the lease holds of the space is what the cache counts.

A session is not thread-safe: the blocking shell calls it under its lock, except
:meth:`~KeepAliveSession.on_failure` and :meth:`~KeepAliveSession.end`, which only set
``error``, tell a copy of the cache list that the lease is gone and close a copy of the region
list (each cache and region takes its own lock for that, and may then take the lease's: a
region unregisters). The lock order is lease, then region: :meth:`on_response` unmaps under the
lease's lock, and a region calls back into the lease only after releasing its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvpool.contract.codec import groups_from_bytes
from kvpool.contract.errors import FailedPrecondition, KVPoolError, NotFound
from kvpool.v1 import kvpool_pb2 as pb

log = logging.getLogger("kvpool.clients.session")


def keepalive_interval(ttl_s: float) -> float:
    """Renew three times per TTL: one lost renewal does not expire the lease."""
    return max(0.03, ttl_s / 3)


class KeepAliveSession:
    """The protocol state of one lease's renewals.

    Args:
        lease_id: the lease.
        secret: its secret (every request carries it).
        ttl_s: its TTL; requests go out every :attr:`interval` seconds.
    """

    def __init__(self, lease_id: int, secret: bytes, ttl_s: float) -> None:
        self.lease_id = lease_id
        self._secret = secret
        self.interval = keepalive_interval(ttl_s)
        self.caches: list[Any] = []  # the lease's open page caches (sync or asyncio)
        self.regions: list[Any] = []  # elastic regions attached under the lease (ElasticRegion)
        # Reclaim id -> seq of the last request that carried it (0: not sent yet); dropped
        # once the daemon answers that request.
        self.unmapped: dict[int, int] = {}
        self.seq = 0  # of the last request made
        self.acked_seq = 0  # the highest seq the daemon answered
        self.error: KVPoolError | None = None  # why the stream last failed

    def add_cache(self, cache: Any) -> None:
        self.caches.append(cache)

    def remove_cache(self, cache: Any) -> None:
        if cache in self.caches:
            self.caches.remove(cache)

    def refuse_cached(self, pool: str, spaces: Iterable[str], call: str) -> None:
        """Refuse the lease's own ``call`` (allocate, free) of ``spaces`` of ``pool`` where a
        page cache of the lease serves one of them. O(spaces x caches).

        Raises:
            FailedPrecondition: naming the space and the cache.
        """
        for space in spaces:
            for cache in self.caches:
                core = cache.core
                if core.pool == pool and core.space == space:
                    raise FailedPrecondition(
                        f"lease {self.lease_id}: {call} of {pool}/{space} refused: the lease's "
                        f"page cache {cache!r} serves that space and must be its only path "
                        "(use cache.alloc / cache.free, or close the cache first)",
                        field="space")

    def add_region(self, region: Any) -> None:
        self.regions.append(region)

    def remove_region(self, region: Any) -> None:
        if region in self.regions:
            self.regions.remove(region)

    def next_request(self) -> pb.KeepAliveRequest:
        """The next renewal: a new ``seq``, the caches' counts summed per (pool, space), and
        the reclaims carried out and not yet answered."""
        self.seq += 1
        for reclaim in self.unmapped:
            self.unmapped[reclaim] = self.seq
        return pb.KeepAliveRequest(lease_id=self.lease_id, lease_secret=self._secret,
                                   seq=self.seq, caches=cache_reports(self.caches),
                                   unmapped=list(self.unmapped))

    def on_response(self, resp: pb.KeepAliveResponse) -> bool:
        """Take one answer: route its give-backs to the caches of their pool and space (each
        returns cached ids only, up to what is asked of it), its unmaps to the regions of their
        pool, note the seq it answers.

        Returns:
            Whether to send a renewal at once (a give-back changed the counts, or an unmap is
            to be acknowledged).
        """
        for item in resp.give_back:
            left = item.count
            for cache in self.caches:
                if left <= 0:
                    break
                if cache.core.pool == item.pool and cache.core.space == item.space:
                    left -= cache._give_back(left, item.min_id)
        if resp.seq:
            self.acked_seq = max(self.acked_seq, resp.seq)
            self.unmapped = {r: s for r, s in self.unmapped.items()
                             if not 0 < s <= resp.seq}
        done = [self._unmap(item) for item in resp.unmap]
        return bool(resp.give_back) or any(done)

    def _unmap(self, item: pb.Unmap) -> bool:
        """Unmap ``item``'s groups in every region of its pool; whether it is to be
        acknowledged (not when an unmap failed: the daemon then ends the lease)."""
        try:
            groups = groups_from_bytes(item.groups)
            for region in list(self.regions):
                if region.pool == item.pool:
                    region.unmap_groups(groups)
        except Exception:
            log.exception("lease %d could not unmap groups of pool %s (reclaim %d); not "
                          "acknowledging it: the daemon ends the lease in %.1f s",
                          self.lease_id, item.pool, item.reclaim, item.deadline_seconds)
            return False
        self.unmapped.setdefault(item.reclaim, 0)
        return True

    def acked(self, seq: int) -> bool:
        """Whether the daemon has answered request ``seq`` (or a later one)."""
        return self.acked_seq >= seq

    def on_failure(self, err: KVPoolError) -> bool:
        """The stream failed with ``err``.

        Returns:
            Whether to retry (after half an interval): not when the daemon says the lease is
            gone (NotFound: it expired or was closed), and then the caches stop handing out
            ids at once.
        """
        self.error = err
        if isinstance(err, NotFound):
            log.error("lease %d lost: %s", self.lease_id, err)
            self.end(err)
            return False
        log.warning("keep-alive of lease %d failed, retrying: %s", self.lease_id, err)
        return True

    def end(self, err: KVPoolError) -> None:
        """The lease is closing or lost: its page caches stop handing out ids (``err``), and
        its elastic regions close (the daemon may take their groups back without asking once
        the lease is gone: a touch must fault, never reach memory given to another pool)."""
        for cache in list(self.caches):
            cache.lease_gone(err)
        for region in list(self.regions):
            try:
                region.close()
            except Exception:
                log.exception("lease %d ended: closing its region of pool %s failed",
                              self.lease_id, region.pool)


def cache_reports(caches: list[Any]) -> list[pb.CacheReport]:
    """The KeepAlive report of a lease's page caches: ``(cached, in_use, evictable)`` summed
    per (pool, space)."""
    sums: dict[tuple[str, str], list[int]] = {}
    for cache in caches:
        counts = sums.setdefault((cache.core.pool, cache.core.space), [0, 0, 0])
        for i, n in enumerate(cache._report()):
            counts[i] += n
    return [pb.CacheReport(pool=pool, space=space, cached=c, in_use=u, evictable=e)
            for (pool, space), (c, u, e) in sums.items()]

"""A page cache and sealed pages (a real ``kvpoold serve``): ``release`` takes handed-out ids
back without caching them and ``return_ids`` gives them to the daemon (a sealed page then
passes to the pool's directory), and ``adopt`` counts ids the lease adopted outside the cache
as its own, so what the lease holds stays exactly what the cache counts."""

from __future__ import annotations

import hashlib
import signal

import numpy as np
import pytest

from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from tests.e2e.test_sealed import LAYOUT, PAGE, daemon, start_engine, wait_lease_gone

__all__ = ["daemon"]  # the fixture, from the sealed pages' tests


def test_release_gives_sealed_pages_to_the_directory_not_the_cache(daemon) -> None:  # type: ignore[no-untyped-def]
    _d, client = daemon
    with client.lease("engine", ttl_s=30) as lease, \
            lease.page_cache("tiny", low=0, high=64, batch=8, background=False,
                             fill=False) as cache:
        ids = cache.alloc(4)
        keys = [hashlib.sha256(bytes([i])).digest() for i in range(2)]
        assert lease.seal("tiny", LAYOUT, ids[:2], keys, [bytes(32)] * 2,
                          np.arange(2 * PAGE, dtype=np.int32)) == 2
        cached = cache.core.cached
        assert cache.return_ids(cache.release(ids[:2])) == 2  # one Free
        assert (cache.core.in_use, cache.core.cached) == (2, cached)  # not cached
        assert client.sealed("tiny").kept == 2
        with pytest.raises(FailedPrecondition, match="not in use"):
            cache.release(ids[:1])  # released already: refused, nothing changed
        assert cache.core.in_use == 2
        cache.free(ids[2:])
        assert cache.core.in_use == 0


def test_adopt_counts_adopted_pages_as_the_caches(daemon) -> None:  # type: ignore[no-untyped-def]
    d, client = daemon
    engine, got = start_engine(d.target, 3)
    engine.proc.send_signal(signal.SIGKILL)
    engine.proc.wait(30)
    wait_lease_gone(client, got["lease_id"])
    with client.lease("next", ttl_s=30) as lease, \
            lease.page_cache("tiny", low=0, high=64, batch=8, background=False,
                             fill=False) as cache:
        own = cache.alloc(2)
        with pytest.raises(FailedPrecondition, match="already cached or in use"):
            cache.adopt(own[:1])
        with pytest.raises(InvalidArgument, match="repeated"):
            cache.adopt(np.array([5, 5]))
        adopted = lease.adopt("tiny", LAYOUT)
        assert adopted.ids.shape[0] == 3
        cache.adopt(adopted.ids)
        assert cache.core.in_use == 5
        assert bool(cache.in_use_of(adopted.ids).all())
        lease.report_now()
        mine = next(x for x in client.stats().leases if x.lease_id == lease.lease_id)
        assert mine.held["tiny"]["kv"] == cache.core.in_use + cache.core.cached
        # sealed still: kept by the directory again
        assert cache.return_ids(cache.release(adopted.ids)) == 3
        assert client.sealed("tiny").kept == 3 and cache.core.in_use == 2

"""The page cache's paths for pages an engine seals (docs/restart.md): ids its lease holds
from outside the cache (adopted sealed pages) counted as in use from the cache's opening
(``held``) or later (``adopt``), and ids taken back without being cached (``release``), which
the owner frees at the daemon (``return_ids``). Against a real ``kvpoold serve``; every case
checks what the daemon says the lease holds."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool import KVPoolClient
from kvpool.cache.policy import PageCacheCore
from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from tests.unit.test_page_cache import client, daemon, pool

# The daemon (one per module), a client and a fresh pool per test: the page cache tests'.
__all__ = ["client", "daemon", "pool"]


def held(client: KVPoolClient, pool: str, lease_id: int) -> int:
    for x in client.stats(pool).leases:
        if x.lease_id == lease_id:
            return int(x.held.get(pool, {}).get("kv", 0))
    return 0


def test_held_ids_are_in_use_from_the_opening(client: KVPoolClient, pool: str) -> None:
    with client.lease("engine") as lease:
        own = lease.allocate(pool, "kv", 3)
        with pytest.raises(FailedPrecondition, match="holds 3 ids"):
            lease.page_cache(pool, held=own[:2])  # one not handed to the cache
        with lease.page_cache(pool, low=0, high=4, batch=4, held=own) as cache:
            assert cache.settle(30)
            assert cache.core.in_use == 3 and cache.in_use_of(own).all()
            # never handed out again: the fill took other ids
            assert not np.isin(cache.core.ring.cached_ids(), own).any()
            assert held(client, pool, lease.lease_id) == 3 + cache.core.cached
            cache.free(own[:1])  # a held id frees like any other: into the cache
            assert cache.settle(30) and cache.core.in_use == 2
            assert held(client, pool, lease.lease_id) == 2 + cache.core.cached


def test_release_takes_ids_back_uncached_and_the_owner_frees_them(client: KVPoolClient,
                                                                  pool: str) -> None:
    with client.lease("engine") as lease, \
            lease.page_cache(pool, low=0, high=8, batch=8) as cache:
        ids = cache.alloc(5)
        assert cache.settle(30)
        before = held(client, pool, lease.lease_id)
        back = cache.release(ids[:2])
        assert cache.core.in_use == 3 and not cache.in_use_of(ids[:2]).any()
        assert not np.isin(cache.core.ring.cached_ids(), ids[:2]).any()
        with pytest.raises(FailedPrecondition, match="not in use"):
            cache.release(ids[:1])  # twice: refused, nothing changed
        assert held(client, pool, lease.lease_id) == before  # the lease's until freed
        assert cache.return_ids(back) == 2
        assert held(client, pool, lease.lease_id) == before - 2
        again = cache.alloc(cache.core.cached)
        assert not np.isin(again, back).any()


def test_adopt_counts_ids_from_outside_as_in_use() -> None:
    core = PageCacheCore("p", "kv", 16, 0, 8, 4)
    core.ring.push(np.asarray([1, 2, 3], dtype=np.int32))
    core.adopt(np.asarray([7, 9], dtype=np.int32))
    assert core.in_use == 2 and core.cached == 3
    assert core.in_use_of([7, 9, 1]).tolist() == [True, True, False]
    for bad, err in (([7], FailedPrecondition), ([2], FailedPrecondition),
                     ([0], InvalidArgument), ([17], InvalidArgument),
                     ([5, 5], InvalidArgument)):
        with pytest.raises(err):
            core.adopt(np.asarray(bad, dtype=np.int32))
    assert core.in_use == 2 and core.cached == 3  # refusals changed nothing
    assert core.release(np.asarray([9], dtype=np.int32)).tolist() == [9]
    _, send = core.free(np.asarray([7], dtype=np.int32))
    assert not send and core.cached == 4 and core.in_use == 0

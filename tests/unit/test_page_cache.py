"""The client page cache (``kvpool.cache.page_cache``, ``kvpool.cache.aio_page_cache``) against a
real ``kvpoold serve`` process: watermarks, misses, refusals that change nothing, close, counters.

Every case waits for the background worker with ``settle()`` (no sleeps, no timed asserts)
and checks what the daemon's Stats say the lease holds: every id in the cache (in use or
cached) is held by the lease, and nothing else.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool import AsyncKVPoolClient, KVPoolClient
from kvpool.cache.page_cache import PageCache
from kvpool.cache.policy import PageCacheCounters, watermarks
from kvpool.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVPoolError,
    NotFound,
    ResourceExhausted,
)
from tests.conftest import TINY_OPTIONS, TINY_PAGES, TINY_SPEC, DaemonProcess, run_daemon, temp_dir

SWA_SPEC = {"num_layers": 4, "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
            "context_length": 256, "sliding_window": {"window": 32, "layers": [0, 2]}}
_names = itertools.count()


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with temp_dir() as path, run_daemon(path) as proc:
        yield proc


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[KVPoolClient]:
    with KVPoolClient(daemon.target) as c:
        yield c


@pytest.fixture
def pool(client: KVPoolClient) -> Iterator[str]:
    """A fresh 256-page pool (TINY_SPEC), dropped afterwards."""
    name = f"pc{next(_names)}"
    client.configure(name, spec=TINY_SPEC, **TINY_OPTIONS)
    yield name
    client.drop(name, force=True)


def held(client: KVPoolClient, pool: str, lease_id: int, space: str = "kv") -> int:
    """What the daemon says ``lease_id`` holds of ``pool``'s ``space``."""
    for x in client.stats(pool).leases:
        if x.lease_id == lease_id:
            return x.held.get(pool, {}).get(space, 0)
    raise AssertionError(f"no lease {lease_id}")


def snapshot(cache: PageCache) -> tuple[PageCacheCounters, list[int], np.ndarray]:
    """Everything a refused call must leave alone: counters, the cached ids in the order they
    are handed out, the ids in use."""
    return cache.counters(), cache.core.ring.cached_ids().tolist(), cache.core.handed_out()


def assert_unchanged(cache: PageCache, before: tuple) -> None:
    after = snapshot(cache)
    assert after[0] == before[0] and after[1] == before[1]
    assert np.array_equal(after[2], before[2])


# -- watermarks -----------------------------------------------------------------------------

def test_refills_to_high_when_below_low_and_returns_above_high(client: KVPoolClient,
                                                               pool: str) -> None:
    with client.lease("engine") as lease, lease.page_cache(pool, low=4, high=16,
                                                           batch=8) as cache:
        assert cache.settle(30)
        core = cache.core
        assert (core.cached, core.in_use, core.refills, core.rpc_calls) == (16, 0, 1, 1)
        assert held(client, pool, lease.lease_id) == 16
        a = cache.alloc(12)  # leaves 4: not below low, no refill
        assert cache.settle(30)
        assert (cache.core.cached, cache.core.refills) == (4, 1)
        b = cache.alloc(1)  # leaves 3 < low: the worker tops up to high
        assert cache.settle(30)
        assert (core.cached, core.in_use, core.refills, core.rpc_calls) == (16, 13, 2, 2)
        assert cache.core.waits == 0
        assert held(client, pool, lease.lease_id) == 29
        cache.free(a)  # 28 cached > high: the worker returns 20, down to high - batch
        assert cache.settle(30)
        c = cache.counters()
        assert (c.cached, c.in_use, c.returns, c.returned, c.rpc_calls) == (8, 1, 1, 20, 3)
        assert held(client, pool, lease.lease_id) == 9
        cache.free(b)  # 9 cached: between the marks, nothing moves
        assert cache.settle(30)
        assert (core.cached, core.in_use, core.returns, core.rpc_calls) == (9, 0, 1, 3)
        assert held(client, pool, lease.lease_id) == 9


def test_ids_are_the_daemons_and_reused_in_the_order_freed(client: KVPoolClient,
                                                          pool: str) -> None:
    with client.lease("engine") as lease, lease.page_cache(pool, low=0, high=8,
                                                           batch=8) as cache:
        cache.settle(30)
        ids = cache.alloc(8)
        assert ids.dtype == np.int32 and len(set(ids.tolist())) == 8
        assert all(1 <= i <= TINY_PAGES for i in ids.tolist())
        # The lease holds these ids: the daemon refuses them to anyone else's Free.
        with client.lease("other") as other, pytest.raises(FailedPrecondition):
            other.free(pool, "kv", ids[:1])
        cache.free(ids[3:4])
        cache.free(ids[5:6])
        # The cache was empty: the two freed come back in the order they were freed (FIFO).
        assert cache.alloc(2).tolist() == [ids[3], ids[5]]
        cache.free(ids[6:8])
        cache.free(ids[0:1])
        assert cache.alloc(1).tolist() == [ids[6]]
        assert cache.alloc(2).tolist() == [ids[7], ids[0]]
        assert cache.alloc(0).shape == (0,)


def test_alloc_larger_than_the_cache_calls_the_daemon_once(client: KVPoolClient,
                                                           pool: str) -> None:
    with client.lease("engine") as lease, lease.page_cache(pool, low=0, high=16,
                                                           batch=8) as cache:
        cache.settle(30)
        assert (cache.core.cached, cache.core.rpc_calls) == (16, 1)
        ids = cache.alloc(40)  # 16 cached, 24 from one Allocate
        assert len(set(ids.tolist())) == 40
        core = cache.core
        assert (core.cached, core.in_use, core.rpc_calls, core.waits) == (0, 40, 2, 1)
        more = cache.alloc(2)  # a miss asks for batch = 8: 2 handed out, 6 cached
        assert (core.cached, core.in_use, core.rpc_calls, core.waits) == (6, 42, 3, 2)
        assert not set(more.tolist()) & set(ids.tolist())
        assert cache.settle(30)
        assert cache.core.rpc_calls == 3  # low = 0: no background refill
        assert held(client, pool, lease.lease_id) == 48


def test_resource_exhausted_leaves_the_cache_as_it_was(client: KVPoolClient,
                                                       pool: str) -> None:
    with client.lease("engine") as lease, lease.page_cache(pool, low=0, high=8,
                                                           batch=8) as cache, \
            client.lease("hog") as hog:
        cache.settle(30)
        cache.alloc(4)
        # 16 free: the pressure line (capacity / 16) is not crossed, so nobody is asked to
        # give cached ids back and the cache's 4 cached ids stay put
        hog.allocate(pool, "kv", TINY_PAGES - 24)
        before = snapshot(cache)
        with pytest.raises(ResourceExhausted) as info:
            cache.alloc(21)  # 4 cached, asks for max(17, 8) = 17 of the 16 free: refused
        assert "asked for 17" in str(info.value)
        counters, cached, in_use = snapshot(cache)
        assert cached == before[1] and np.array_equal(in_use, before[2])
        assert (counters.in_use, counters.cached) == (4, 4)
        assert (counters.rpc_calls, counters.waits) == (before[0].rpc_calls + 1, 1)
        assert held(client, pool, lease.lease_id) == 8
        assert len(cache.alloc(4)) == 4  # the cache still serves


def test_a_miss_that_fails_in_any_way_puts_its_reserved_ids_back(client: KVPoolClient,
                                                                 pool: str) -> None:
    """An interrupt (or any error that is not the daemon's) during a miss's Allocate leaves
    the cache as it was, as a refusal does: the sync and asyncio caches alike (the sync one
    once kept only KVPoolError from stranding the ids it had reserved for the alloc)."""
    with client.lease("engine") as lease, lease.page_cache(pool, low=0, high=8,
                                                           batch=8) as cache:
        cache.settle(30)
        cache.alloc(4)
        before = snapshot(cache)
        real = lease._cache_allocate

        def interrupted(*args: object) -> object:
            raise KeyboardInterrupt

        lease._cache_allocate = interrupted  # type: ignore[method-assign]
        try:
            with pytest.raises(KeyboardInterrupt):
                cache.alloc(21)  # 4 cached: a miss, which reserves them first
        finally:
            lease._cache_allocate = real  # type: ignore[method-assign]
        counters, cached, in_use = snapshot(cache)
        assert cached == before[1] and np.array_equal(in_use, before[2])
        assert (counters.in_use, counters.cached) == (4, 4)
        assert len(cache.alloc(8)) == 8  # the reserved ids were put back, and serve


def test_refill_on_a_full_pool_takes_what_there_is(client: KVPoolClient, pool: str) -> None:
    """The worker halves a refused refill until the daemon can give it."""
    with client.lease("hog") as hog, client.lease("engine") as lease:
        hog.allocate(pool, "kv", TINY_PAGES - 5)
        with lease.page_cache(pool, low=8, high=16, batch=4) as cache:
            assert cache.settle(30)
            # 16 and 8 refused, 4 given; then 12, 6, 3 refused, 1 given; then it waits
            assert (cache.core.cached, cache.core.refills) == (5, 2)
            assert cache.core.rpc_calls >= 11  # 3 + 4 + then 11, 5, 2, 1 refused: it backs off
            assert held(client, pool, lease.lease_id) == 5


# -- settle ---------------------------------------------------------------------------------

def test_a_refused_refill_does_not_hold_a_return_back(client: KVPoolClient,
                                                      pool: str) -> None:
    """Issue 28: the worker was waiting out the backoff of a refill the full pool refused
    when frees left the cache above ``high``. The return is due at once (refills and returns
    back off apart), and ``settle()`` returns only once it is done: the lease then holds
    exactly what the cache says, as a report tells the daemon."""
    with client.lease("hog") as hog, client.lease("engine") as lease:
        hogged = hog.allocate(pool, "kv", TINY_PAGES - 16)
        with lease.page_cache(pool, low=8, high=16, batch=4) as cache:
            assert cache.settle(30) and cache.core.cached == 16
            ids = cache.alloc(12)  # 4 left: refills of 12, 6, 3, 1 refused, then it waits
            assert cache.settle(30) and cache.core.cached == 4
            assert isinstance(cache.core.last_error, ResourceExhausted)
            hog.free(pool, "kv", hogged)
            more = cache.alloc(100)  # a miss: the 4 cached and 96 from the daemon
            cache.free(ids)
            cache.free(more)  # 112 cached, far above high
            assert cache.settle(30)
            assert cache.core.cached <= cache.core.high and cache.core.returns == 1
            assert lease.report_now()
            mine = next(x for x in client.stats(pool).leases if x.lease_id == lease.lease_id)
            assert mine.held[pool]["kv"] == cache.core.in_use + cache.core.cached
            assert cache.core.in_use == 0
            assert mine.cached[pool]["kv"] == cache.core.cached


def test_settle_retries_a_refill_waiting_out_a_refusal(client: KVPoolClient,
                                                       pool: str) -> None:
    """A refill the full pool refused before ``settle()`` was called is tried again by it
    rather than after the backoff: once the hog has freed, ``settle()`` returns with the cache
    filled to ``high``."""
    with client.lease("hog") as hog, client.lease("engine") as lease:
        hogged = hog.allocate(pool, "kv", TINY_PAGES - 16)
        with lease.page_cache(pool, low=8, high=16, batch=4) as cache:
            assert cache.settle(30)
            cache.alloc(12)
            assert cache.settle(30) and cache.core.cached == 4  # refused: it settles, below low
            hog.free(pool, "kv", hogged)
            assert cache.settle(30)
            assert cache.core.cached == 16
            assert held(client, pool, lease.lease_id) == 12 + 16


# -- the only path to its space (issue 38): held == cached + in use by construction ---------

def test_the_lease_refuses_its_own_allocate_and_free_of_a_cached_space(client: KVPoolClient,
                                                                       pool: str) -> None:
    """While a cache is open the lease's own Allocate and Free of its space are refused,
    naming the cache (other spaces of the pool are not); nothing reaches the daemon, so what
    the lease holds of the space is what the cache counts. Once the cache is closed the lease
    may use the space itself again."""
    with client.lease("engine") as lease:
        with lease.page_cache(pool, low=4, high=16, batch=8) as cache:
            assert cache.settle(30)
            ids = cache.alloc(5)
            for call in (lambda: lease.allocate(pool, "kv", 1),
                         lambda: lease.allocate_batch(pool, [("req", 1), ("kv", 1)]),
                         lambda: lease.free(pool, "kv", ids[:1]),
                         lambda: lease.free_batch(pool, [("kv", ids[:1])])):
                with pytest.raises(FailedPrecondition,
                                   match=rf"{pool}/kv refused.*PageCache\(") as info:
                    call()
                assert info.value.field == "space"
            assert cache.core.in_use_of(ids).all()
            rows = lease.allocate(pool, "req", 2)  # another space: the lease's own
            assert lease.free(pool, "req", rows) == 2
            assert cache.settle(30)
            assert held(client, pool, lease.lease_id) == cache.core.in_use + cache.core.cached
        assert cache.free(ids) == 5  # after close: straight to the daemon, not refused
        got = lease.allocate(pool, "kv", 3)
        assert lease.free(pool, "kv", got) == 3
        assert held(client, pool, lease.lease_id) == 0


def test_a_cache_opens_only_on_a_space_its_lease_holds_none_of(client: KVPoolClient,
                                                               pool: str) -> None:
    """A lease holding ids of the space (its own Allocate, or another open cache of it) gets
    no cache of it: the cache would not count them."""
    with client.lease("engine") as lease:
        own = lease.allocate(pool, "kv", 3)
        with pytest.raises(FailedPrecondition, match=r"holds 3 ids of .*/kv outside") as info:
            lease.page_cache(pool)
        assert info.value.field == "space"
        lease.free(pool, "kv", own)
        with lease.page_cache(pool, low=0, high=4, batch=4) as cache:
            assert cache.settle(30)
            with pytest.raises(FailedPrecondition, match="another open page cache"):
                lease.page_cache(pool)
        with lease.page_cache(pool, low=0, high=4, batch=4):  # closed, nothing in use: fine
            pass


async def test_async_the_lease_refuses_its_own_calls_of_a_cached_space(
        daemon: DaemonProcess, client: KVPoolClient, pool: str) -> None:
    """``AsyncLease``: as the sync test."""
    async with AsyncKVPoolClient(daemon.target) as aclient, \
            await aclient.lease("engine") as lease:
        async with await lease.page_cache(pool, low=0, high=8, batch=8) as cache:
            ids = await cache.alloc(2)
            with pytest.raises(FailedPrecondition, match="AsyncPageCache"):
                await lease.allocate(pool, "kv", 1)
            with pytest.raises(FailedPrecondition, match="AsyncPageCache"):
                await lease.free(pool, "kv", ids)
            assert await cache.settle(30)
            assert held(client, pool, lease.lease_id) == cache.core.in_use + cache.core.cached
        await cache.free(ids)
        assert held(client, pool, lease.lease_id) == 0


# -- try_alloc: "does not fit" is a value ----------------------------------------------------

def test_try_alloc_returns_none_when_it_does_not_fit(client: KVPoolClient, pool: str) -> None:
    """The cache and the daemon together short of ``n``: None, the cache as it was (its
    cached ids not handed out, none held more), and counted in ``refused``; what fits is
    handed out as ``alloc`` would."""
    with client.lease("engine") as lease, lease.page_cache(pool, low=0, high=8,
                                                           batch=8) as cache, \
            client.lease("hog") as hog:
        assert cache.settle(30)
        cache.alloc(4)
        hog.allocate(pool, "kv", TINY_PAGES - 24)  # 16 free: no give-back is asked
        before = snapshot(cache)
        assert cache.try_alloc(21) is None  # 4 cached + 17 asked of the 16 free
        counters, cached, in_use = snapshot(cache)
        assert cached == before[1] and np.array_equal(in_use, before[2])
        assert (counters.refused, counters.waits) == (1, 1)
        assert counters.rpc_calls == before[0].rpc_calls + 1  # asked exactly what it lacked
        assert held(client, pool, lease.lease_id) == 8
        got = cache.try_alloc(20)  # 4 cached + 16 free: fits exactly
        assert got is not None and len(set(got.tolist())) == 20
        assert cache.core.counters().refused == 1


async def test_async_try_alloc_returns_none_when_it_does_not_fit(
        daemon: DaemonProcess, client: KVPoolClient, pool: str) -> None:
    async with AsyncKVPoolClient(daemon.target) as aclient, \
            await aclient.lease("engine") as lease, await aclient.lease("hog") as hog, \
            await lease.page_cache(pool, low=0, high=8, batch=8) as cache:
        await cache.settle()
        await hog.allocate(pool, "kv", TINY_PAGES - 24)
        before = snapshot(cache)
        assert await cache.try_alloc(30) is None
        assert snapshot(cache)[1] == before[1] and cache.core.refused == 1
        assert (await cache.try_alloc(3)).shape == (3,)  # type: ignore[union-attr]
        with pytest.raises(FailedPrecondition, match="background=False"):
            cache.set_evictor(lambda n: None)  # a worker task: no evictor


async def test_async_without_a_worker_maintain_and_the_evictor(
        daemon: DaemonProcess, client: KVPoolClient, pool: str) -> None:
    """``AsyncPageCache(background=False)``: no task; the first fill happens at open, later
    refills, returns and give-backs only in ``await maintain()``, whose evictor (a coroutine
    function here) frees what a give-back asks past the cache; ``settle(timeout_s)`` runs
    ``maintain`` itself."""
    async with AsyncKVPoolClient(daemon.target) as aclient, \
            await aclient.lease("engine") as lease, \
            await lease.page_cache(pool, low=4, high=16, batch=8, background=False) as cache:
        assert (cache.core.cached, cache.core.rpc_calls) == (16, 1)
        ids = await cache.alloc(14)
        assert cache.core.cached == 2 and await cache.maintain() == 1
        assert cache.core.cached == 16
        tree = ids.tolist()

        async def evict(n: int) -> None:
            gone = [tree.pop() for _ in range(min(n, len(tree)))]
            await cache.free(np.array(gone, dtype=np.int32))

        cache.set_evictor(evict)
        cache.set_evictable(len(tree))
        assert cache._give_back(20) == 20  # 16 cached + 4 the evictor frees
        assert await cache.maintain() == 1 and cache.core.gave_back == 20  # one Free
        assert cache.core.in_use == 10 and len(tree) == 10
        assert await cache.settle(30)  # the refill held off after the give-back, now
        assert cache.core.cached == 16
        assert held(client, pool, lease.lease_id) == 26


# -- local checks ---------------------------------------------------------------------------

def test_double_free_and_foreign_ids_are_refused_and_change_nothing(
        client: KVPoolClient, pool: str) -> None:
    with client.lease("engine") as lease, lease.page_cache(pool, low=0, high=16,
                                                           batch=8) as cache:
        cache.settle(30)
        ids = cache.alloc(4)
        with client.lease("other") as other:
            direct = other.allocate(pool, "kv", 1)  # another lease's
        cached_id = int(cache.core.ring.cached_ids()[0])  # held, never handed out
        cache.free(ids[:1])
        cases: list[tuple[object, type[KVPoolError], str]] = [
            ([ids[1], ids[0]], FailedPrecondition, "ids[1]"),  # a double free
            ([ids[1], ids[2], ids[1]], InvalidArgument, "ids[2]"),  # repeated in one call
            ([ids[3], ids[3], ids[3], ids[2]], InvalidArgument, "ids[1]"),  # three times
            ([ids[3]] * (TINY_PAGES + 1), InvalidArgument, "ids[1]"),  # more than capacity
            # 256 listings on the sentinel mark 0: a one-byte mark would wrap back to 0
            ([0] * TINY_PAGES, InvalidArgument, "ids[0]"),
            (np.array([ids[2], 2**63 + 5], dtype=np.uint64), InvalidArgument, "ids[1]"),
            ([ids[1], 0], InvalidArgument, "ids[1]"),
            ([TINY_PAGES + 1], InvalidArgument, "ids[0]"),
            ([-3, ids[1]], InvalidArgument, "ids[0]"),
            ([ids[1], direct[0]], FailedPrecondition, "ids[1]"),
            ([cached_id], FailedPrecondition, "ids[0]"),
            (np.array([ids[2], ids[3]], dtype=np.float32), InvalidArgument, "ids"),
            (np.array([[ids[2]]]), InvalidArgument, "ids"),
        ]
        for bad, cls, field in cases:
            before = snapshot(cache)
            with pytest.raises(cls) as info:
                cache.free(bad)
            assert type(info.value) is cls and info.value.field == field, (bad, info.value)
            assert_unchanged(cache, before)
        with pytest.raises(FailedPrecondition, match=rf"ids\[0\]={ids[0]}.*double free"):
            cache.free(ids[:1])
        assert cache.free(ids[1:]) == 3  # all still in use: freed at once
        assert cache.core.in_use == 0
        for count in (-1, 1.5, "2"):
            with pytest.raises(InvalidArgument) as info:
                cache.alloc(count)
            assert info.value.field == "count"


def test_checks_are_exact_at_the_range_ends(client: KVPoolClient, pool: str) -> None:
    """Range ends and the sentinels: 0 and capacity + 1 are never in use."""
    with client.lease("engine") as lease, lease.page_cache(pool, low=0, high=TINY_PAGES - 8,
                                                           batch=8) as cache:
        cache.settle(30)
        ids = cache.alloc(cache.core.cached)
        for value in (0, TINY_PAGES + 1, 2**31, -(2**31)):
            with pytest.raises(InvalidArgument, match="out of range"):
                cache.free(np.array([value], dtype=np.int64))
        assert cache.free(np.asarray(ids, dtype=np.int64)) == len(ids)
        assert cache.free([]) == 0


# -- close, lease end -----------------------------------------------------------------------

def test_close_returns_the_cached_ids_and_keeps_those_in_use(client: KVPoolClient,
                                                            pool: str) -> None:
    with client.lease("engine") as lease:
        with lease.page_cache(pool, low=4, high=16, batch=8) as cache:
            cache.settle(30)
            ids = cache.alloc(5)
            cache.settle(30)
            assert held(client, pool, lease.lease_id) == 5 + cache.core.cached
        assert cache.core.closed and cache.core.cached == 0 and cache.core.in_use == 5
        assert held(client, pool, lease.lease_id) == 5
        assert cache.close() == 0  # idempotent
        with pytest.raises(FailedPrecondition, match="closed"):
            cache.alloc(1)
        calls = cache.core.rpc_calls
        assert cache.free(ids[:2]) == 2  # after close: straight to the daemon
        assert cache.core.rpc_calls == calls + 1
        assert held(client, pool, lease.lease_id) == 3
        with pytest.raises(FailedPrecondition):
            cache.free(ids[:1])


def test_closing_the_lease_ends_the_cache(client: KVPoolClient, pool: str) -> None:
    lease = client.lease("engine")
    cache = lease.page_cache(pool, low=4, high=16, batch=8)
    cache.settle(30)
    ids = cache.alloc(2)
    assert lease.close().held == {pool: {"kv": 16}}
    with pytest.raises(FailedPrecondition, match=r"lease \d+ is closed"):
        cache.alloc(1)  # the cached ids went back with the lease
    assert isinstance(cache.core.error, FailedPrecondition) and cache.core.cached == 0
    assert cache.free(ids) == 2  # bookkeeping only
    assert cache.close() == 0
    assert client.stats(pool).pool(pool).spaces["kv"].used == 0


def test_a_lease_ended_elsewhere_ends_its_cache(client: KVPoolClient, pool: str) -> None:
    """The keep-alive learns that the lease is gone (NotFound) and tells its caches: an alloc
    the cache could serve raises instead of handing out ids the daemon took back."""
    from kvpool.v1 import kvpool_pb2 as pb

    lease = client.lease("engine", ttl_s=0.3)
    cache = lease.page_cache(pool, low=4, high=16, batch=8, background=False)
    assert cache.core.cached == 16
    client.call("CloseLease", pb.CloseLeaseRequest(lease_id=lease.lease_id,
                                                     lease_secret=lease.secret))
    deadline = time.monotonic() + 5.0
    while cache.core.error is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the next renewal (every 0.1 s) is answered NotFound
    assert isinstance(cache.core.error, NotFound) and cache.core.cached == 0
    with pytest.raises(NotFound):
        cache.alloc(1)
    assert cache.maintain() == 0  # nothing to refill for a lost lease
    with pytest.raises(NotFound):
        lease.close()  # CloseLease of a lease that is gone
    assert client.stats(pool).pool(pool).spaces["kv"].used == 0


def test_dropped_pool_is_lost(client: KVPoolClient) -> None:
    client.configure("pcdrop", spec=TINY_SPEC, **TINY_OPTIONS)
    with client.lease("engine") as lease, lease.page_cache("pcdrop", low=0, high=4,
                                                           batch=4) as cache:
        cache.settle(30)
        cache.alloc(4)
        client.drop("pcdrop", force=True)
        with pytest.raises(NotFound):
            cache.alloc(1)  # a miss: the daemon says the pool is gone
        assert isinstance(cache.core.error, NotFound)
        with pytest.raises(NotFound):
            cache.alloc(1)


# -- what can be cached ---------------------------------------------------------------------

def test_spaces_and_watermarks_are_checked(client: KVPoolClient, pool: str) -> None:
    client.configure("pcswa", spec=SWA_SPEC, **TINY_OPTIONS)
    try:
        with client.lease("engine") as lease:
            with pytest.raises(InvalidArgument, match=r"paired with swa.*not serve paired") as info:
                lease.page_cache("pcswa", "kv")
            assert info.value.field == "space"
            with pytest.raises(InvalidArgument, match="follows 'kv'"):
                lease.page_cache("pcswa", "swa")
            with lease.page_cache("pcswa", "req", low=1, high=4, batch=2) as rows:
                assert rows.core.capacity == TINY_OPTIONS["max_running_requests"]
                assert len(rows.alloc(3)) == 3
            with pytest.raises(InvalidArgument, match="no id space 'state'"):
                lease.page_cache(pool, "state")
            with pytest.raises(NotFound):
                lease.page_cache("nosuchpool")
            for kwargs, field in (({"low": 9, "high": 8}, "low"),
                                  ({"high": TINY_PAGES + 1}, "high"),
                                  ({"high": 0}, "high"),
                                  ({"high": 8, "batch": 9}, "batch"),
                                  ({"batch": 0}, "batch"),
                                  ({"low": 2.0}, "low")):
                with pytest.raises(InvalidArgument) as info:
                    lease.page_cache(pool, **kwargs)
                assert info.value.field == field
    finally:
        client.drop("pcswa", force=True)


def test_default_watermarks() -> None:
    assert watermarks(1 << 20, None, None, None) == (64, 512, 128)
    assert watermarks(256, None, None, None) == (8, 64, 16)
    assert watermarks(3, None, None, None) == (0, 1, 1)
    assert watermarks(256, 0, 1, 1) == (0, 1, 1)


# -- threads --------------------------------------------------------------------------------

def test_threads_share_a_cache(client: KVPoolClient, pool: str) -> None:
    """Four threads alloc and free at once: no id is handed out twice, and afterwards the
    daemon's count for the lease is exactly in use + cached."""
    with client.lease("engine") as lease, lease.page_cache(pool, low=4, high=24,
                                                           batch=8) as cache:
        owners: dict[int, int] = {}
        guard = threading.Lock()
        errors: list[BaseException] = []

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            mine: list[int] = []
            try:
                for _ in range(400):
                    if mine and rng.random() < 0.5:
                        k = int(rng.integers(1, len(mine) + 1))
                        out, mine[:] = mine[:k], mine[k:]
                        with guard:
                            for i in out:
                                del owners[i]
                        cache.free(out)
                    elif len(mine) < 40:
                        ids = cache.alloc(int(rng.integers(1, 6))).tolist()
                        with guard:
                            for i in ids:
                                assert i not in owners, f"id {i} handed out twice"
                                owners[i] = seed
                        mine += ids
                cache.free(mine[: len(mine) // 2])
                with guard:
                    for i in mine[: len(mine) // 2]:
                        del owners[i]
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert cache.settle(30)
        assert cache.core.in_use == len(owners)
        assert cache.core.low <= cache.core.cached <= cache.core.high
        assert held(client, pool, lease.lease_id) == cache.core.in_use + cache.core.cached


# -- asyncio --------------------------------------------------------------------------------

async def test_async_watermarks_and_counters(daemon: DaemonProcess, client: KVPoolClient,
                                             pool: str) -> None:
    async with AsyncKVPoolClient(daemon.target) as aclient, \
            await aclient.lease("engine") as lease, \
            await lease.page_cache(pool, low=4, high=16, batch=8) as cache:
        await cache.settle()
        assert (cache.core.cached, cache.core.refills, cache.core.rpc_calls) == (16, 1, 1)
        a = await cache.alloc(13)
        await cache.settle()
        assert (cache.core.cached, cache.core.in_use, cache.core.refills) == (16, 13, 2)
        assert (await aclient.stats(pool)).leases[0].held[pool]["kv"] == 29
        await cache.free(a)
        await cache.settle()
        c = cache.counters()
        assert (c.cached, c.in_use, c.returns, c.returned, c.rpc_calls, c.waits) == (
            8, 0, 1, 21, 3, 0)
        big = await cache.alloc(20)  # one Allocate for the 12 the cache lacks
        assert (cache.core.in_use, cache.core.waits, cache.core.rpc_calls) == (20, 1, 4)
        assert len(set(big.tolist())) == 20
        await cache.settle()
        assert held(client, pool, lease.lease_id) == cache.core.in_use + cache.core.cached
    assert client.stats(pool).pool(pool).spaces["kv"].used == 0


async def test_async_hit_does_not_suspend(daemon: DaemonProcess, pool: str) -> None:
    """A hit runs to completion in one step of the coroutine: no await reaches the loop."""
    async with AsyncKVPoolClient(daemon.target) as aclient, \
            await aclient.lease("engine") as lease, \
            await lease.page_cache(pool, low=0, high=8, batch=8) as cache:
        await cache.settle()
        coro = cache.alloc(3)
        with pytest.raises(StopIteration) as stop:
            coro.send(None)
        ids = stop.value.value
        assert len(ids) == 3 and cache.core.in_use == 3
        coro = cache.free(ids)
        with pytest.raises(StopIteration) as stop:
            coro.send(None)
        assert stop.value.value == 3 and cache.core.in_use == 0


async def test_async_refusals_change_nothing(daemon: DaemonProcess, client: KVPoolClient,
                                             pool: str) -> None:
    async with AsyncKVPoolClient(daemon.target) as aclient, \
            await aclient.lease("engine") as lease, \
            await aclient.lease("hog") as hog, \
            await lease.page_cache(pool, low=0, high=8, batch=8) as cache:
        await cache.settle()
        ids = await cache.alloc(4)
        await cache.free(ids[:1])
        # 16 free: above the pressure line (capacity / 16), so no give-back is asked of us
        await hog.allocate(pool, "kv", TINY_PAGES - 24)
        core = cache.core
        before = snapshot(cache)
        with pytest.raises(FailedPrecondition) as info:
            await cache.free([ids[1], ids[0]])
        assert info.value.field == "ids[1]"
        with pytest.raises(InvalidArgument) as info:
            await cache.free([ids[1], ids[1]])
        assert info.value.field == "ids[1]"
        assert_unchanged(cache, before)
        with pytest.raises(ResourceExhausted):
            await cache.alloc(22)  # 5 cached, 17 more asked of the 16 free
        assert core.ring.cached_ids().tolist() == before[1]
        assert (cache.core.in_use, cache.core.cached, cache.core.waits) == (3, 5, 1)
        assert (await cache.alloc(5)).shape == (5,)


async def test_async_close_returns_cached(daemon: DaemonProcess, client: KVPoolClient,
                                          pool: str) -> None:
    async with AsyncKVPoolClient(daemon.target) as aclient, \
            await aclient.lease("engine") as lease:
        async with await lease.page_cache(pool, low=4, high=16, batch=8) as cache:
            await cache.settle()
            ids = await cache.alloc(6)
            await cache.settle()
        assert cache.core.closed and cache.core.cached == 0
        assert held(client, pool, lease.lease_id) == 6
        with pytest.raises(FailedPrecondition, match="closed"):
            await cache.alloc(1)
        assert await cache.free(ids) == 6
        assert held(client, pool, lease.lease_id) == 0
        with pytest.raises(InvalidArgument, match="no id space 'state'"):
            await lease.page_cache(pool, "state")


async def test_async_a_refused_refill_does_not_hold_a_return_back(
        daemon: DaemonProcess, client: KVPoolClient, pool: str) -> None:
    """Issue 28 for ``AsyncPageCache``: see the sync test of the same name."""
    async with AsyncKVPoolClient(daemon.target) as aclient, \
            await aclient.lease("hog") as hog, await aclient.lease("engine") as lease:
        hogged = await hog.allocate(pool, "kv", TINY_PAGES - 16)
        async with await lease.page_cache(pool, low=8, high=16, batch=4) as cache:
            await cache.settle()
            ids = await cache.alloc(12)
            await cache.settle()
            assert cache.core.cached == 4
            await hog.free(pool, "kv", hogged)
            more = await cache.alloc(100)
            await cache.free(ids)
            await cache.free(more)
            await cache.settle()
            assert cache.core.cached <= cache.core.high and cache.core.returns == 1
            assert held(client, pool, lease.lease_id) == cache.core.cached


def test_without_a_worker_the_engine_drives_refills_and_returns(client: KVPoolClient,
                                                                pool: str) -> None:
    """``background=False``: no thread; the cache is filled to ``high`` when the cache opens,
    and later refills and returns happen only inside ``maintain()``, one RPC each."""
    with client.lease("engine") as lease, lease.page_cache(
            pool, low=4, high=16, batch=8, background=False) as cache:
        assert (cache.core.cached, cache.core.rpc_calls) == (16, 1)
        ids = cache.alloc(14)  # 2 left, below low: nothing happens until maintain
        assert (cache.core.cached, cache.core.rpc_calls) == (2, 1)
        assert held(client, pool, lease.lease_id) == 16
        assert cache.maintain() == 1  # one refill to high
        assert (cache.core.cached, cache.core.refills) == (16, 2)
        cache.free(ids)  # 30 cached, above high: returned only by maintain
        assert cache.core.cached == 30 and held(client, pool, lease.lease_id) == 30
        assert cache.maintain() == 1  # down to max(low, high - batch) = 8
        assert cache.core.cached == 8 and held(client, pool, lease.lease_id) == 8
        assert cache.maintain() == 0


def test_in_use_of_and_handed_out_read_the_caches_marks(client: KVPoolClient,
                                                        pool: str) -> None:
    """What the SGLang adapter asks instead of keeping a bitmap of its own: which ids are
    handed out and not freed (out-of-range ids are not), and all of them at once."""
    with client.lease("engine") as lease, lease.page_cache(pool, low=0, high=8,
                                                           batch=8) as cache:
        cache.settle(30)
        ids = cache.alloc(5)
        cache.free(ids[1:3])
        probe = np.array([ids[0], ids[1], 0, -3, TINY_PAGES + 1, 1 << 40], dtype=np.int64)
        assert cache.core.in_use_of(probe).tolist() == [True, False, False, False, False, False]
        assert cache.core.handed_out().tolist() == sorted([ids[0], ids[3], ids[4]])
        assert cache.core.handed_out().dtype == np.int32
        cache.free(cache.core.handed_out())
        assert cache.core.handed_out().size == 0 and cache.core.in_use == 0


def test_a_give_back_reaches_ids_the_owner_can_evict(client: KVPoolClient, pool: str) -> None:
    """An engine's prefix cache keeps ids in use after their requests end; the owner says how
    many it can free on demand (``set_evictable``) and how (``set_evictor``). Another lease's
    Allocate short of free ids then gets them: the daemon asks a give-back past what the cache
    holds unused, the owner's next ``maintain`` evicts that many and the cache gives them back;
    ids the owner did not offer are never taken."""
    with client.lease("engine") as lease, lease.page_cache(
            pool, low=0, high=TINY_PAGES, batch=8, background=False, fill=False) as cache, \
            client.lease("taker") as taker:
        tree = list(cache.alloc(TINY_PAGES - 6).tolist())  # a prefix cache holding them all
        busy = tree[:50]  # ... of which 50 a running request uses
        del tree[:50]

        def evict(n: int) -> None:  # the oldest entries first, as a radix tree's LRU would
            gone = [tree.pop() for _ in range(min(n, len(tree)))]
            cache.free(np.array(gone, dtype=np.int32))

        cache.set_evictor(evict)
        cache.set_evictable(len(tree))
        assert lease.report_now()
        mine = next(x for x in client.stats(pool).leases if x.lease_id == lease.lease_id)
        assert mine.held[pool]["kv"] == TINY_PAGES - 6
        got: list[np.ndarray] = []
        t = threading.Thread(target=lambda: got.append(taker.allocate(pool, "kv", 40)))
        t.start()
        deadline = time.monotonic() + 10
        while t.is_alive() and time.monotonic() < deadline:  # the engine's steps
            cache.maintain()
            time.sleep(0.01)
        t.join(1)
        assert got and got[0].shape[0] == 40
        assert not set(got[0].tolist()) & set(busy) and not set(got[0].tolist()) & set(tree)
        assert cache.core.in_use == len(busy) + len(tree) and cache.core.gave_back >= 34
        assert set(cache.core.handed_out().tolist()) == set(busy) | set(tree)
        # more than the owner offers is never asked of it: one id past the free ones is
        # refused, and the prefix cache keeps every id it still holds
        cache.set_evictable(0)
        assert lease.report_now()
        free = client.stats(pool).pool(pool).spaces["kv"].free
        with pytest.raises(ResourceExhausted):
            taker.allocate(pool, "kv", free + 1)
        cache.maintain()
        assert set(cache.core.handed_out().tolist()) == set(busy) | set(tree)


def test_an_evictor_needs_a_cache_without_a_worker(client: KVPoolClient, pool: str) -> None:
    with client.lease("engine") as lease, lease.page_cache(pool, high=8) as cache, \
            pytest.raises(FailedPrecondition, match="background=False"):
        cache.set_evictor(lambda n: None)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_sealed_pages_leave_the_cache_for_the_directory_and_adopted_ones_enter_it(
        daemon: DaemonProcess, client: KVPoolClient, pool: str, kind: str) -> None:
    """An engine's sealed pages: ``release`` takes them out of the cache uncached,
    ``return_ids`` frees them at the daemon (its directory keeps them, the cache never hands
    them out again; the cache does not know which pages are sealed: its user releases them),
    ``Lease.unseal`` lets the lease write one again (freed, it is cached), and ``adopt``
    counts ids the lease holds outside the cache as in use. Both caches, one behaviour."""
    import hashlib

    keys = [hashlib.sha256(f"{kind}{i}".encode()).digest() for i in range(4)]
    tokens = np.zeros(4 * 16, dtype=np.int32)
    if kind == "sync":
        with client.lease("engine") as lease:
            cache = lease.page_cache(pool, low=0, high=8, batch=8)
            ids = cache.alloc(4)
            assert lease.seal(pool, "L", ids, keys, [bytes(32)] * 4, tokens) == 4
            assert lease.unseal(pool, ids[3:]) == 1  # about to write it again
            assert cache.return_ids(cache.release(ids[:2])) == 2
            assert cache.core.in_use == 2
            with pytest.raises(FailedPrecondition):
                cache.free(ids[:1])  # released: not the cache's any more
            cache.adopt(cache.release(ids[2:3]))  # held outside the cache, then adopted
            assert cache.core.in_use == 2
            cached = cache.core.cached
            assert cache.return_ids(cache.release(ids[2:3])) == 1  # sealed: to the daemon
            assert cache.free(ids[3:]) == 1  # unsealed: cached, handed out again
            assert cache.core.cached == cached + 1
            cache.close()
            more = lease.allocate(pool, "kv", 2)  # as adopted pages: held before the cache
            cache = lease.page_cache(pool, low=0, high=4, batch=4, held=more)
            assert cache.core.in_use == 2 and cache.free(more) == 2
            cache.close()
    else:
        async with AsyncKVPoolClient(daemon.target) as aclient, \
                await aclient.lease("aengine") as lease:
            cache = await lease.page_cache(pool, low=0, high=8, batch=8)
            ids = await cache.alloc(4)
            assert await lease.seal(pool, "L", ids, keys, [bytes(32)] * 4, tokens) == 4
            assert await lease.unseal(pool, ids[3:]) == 1
            assert await cache.return_ids(cache.release(ids[:2])) == 2
            assert cache.core.in_use == 2
            with pytest.raises(FailedPrecondition):
                await cache.free(ids[:1])
            cache.adopt(cache.release(ids[2:3]))
            assert cache.core.in_use == 2
            cached = cache.core.cached
            assert await cache.return_ids(cache.release(ids[2:3])) == 1  # sealed: to the daemon
            assert await cache.free(ids[3:]) == 1  # unsealed: cached, handed out again
            assert cache.core.cached == cached + 1
            await cache.close()
            more = await lease.allocate(pool, "kv", 2)
            cache = await lease.page_cache(pool, low=0, high=4, batch=4, held=more)
            assert cache.core.in_use == 2 and await cache.free(more) == 2
            await cache.close()
    s = client.sealed(pool)
    assert (s.kept, s.held) == (3, 0)  # the sealed pages let go of are the directory's

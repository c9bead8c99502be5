"""Pressure moves cached pages from one process to another (issue 12).

A real ``kvpoold serve`` process; an engine process holds most of the pool in its page cache
(some in use, most cached) and has reported them; this process's Allocate of more than the
pool has free succeeds because the daemon asks the engine to give cached pages back over its
KeepAlive stream. The engine's in-use pages stay its own, and every page is accounted for.
"""

from __future__ import annotations

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import TINY_OPTIONS, TINY_PAGES, TINY_SPEC, run_daemon, temp_dir
from tests.procs import Child

# Open a cache holding 200 of the pool's ids (20 in use), report them, then on "check" say
# what the cache has now and check its in-use ids are still its own (a free of each works).
ENGINE = r"""
from kvpool.clients.client import KVPoolClient

msg = recv()
with KVPoolClient(msg["target"]) as client, client.lease("engine", ttl_s=10.0) as lease:
    with lease.page_cache("tiny", "kv", low=0, high=200, batch=200) as cache:
        cache.settle(10.0)
        in_use = cache.alloc(20)
        cache.settle(10.0)
        lease.report_now()
        send({"lease_id": lease.lease_id, "cached": cache.core.cached, "in_use": cache.core.in_use})
        assert recv() == "check"
        cache.settle(10.0)
        lease.report_now()
        core = cache.core
        send({"cached": core.cached, "in_use": core.in_use, "gave_back": core.gave_back})
        cache.free(in_use)  # still this cache's: the free is accepted
        assert recv() == "done"
send("closed")
"""


@pytest.mark.timeout(120)
def test_a_short_allocate_takes_cached_pages_from_another_process() -> None:
    with temp_dir() as path, run_daemon(path) as daemon, KVPoolClient(daemon.target) as client:
        client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        with Child(ENGINE) as engine:
            engine.send({"target": daemon.target})
            first = engine.recv()
            assert first["in_use"] == 20 and first["cached"] >= 150, first
            stats = client.stats("tiny")
            (held,) = [x for x in stats.leases if x.lease_id == first["lease_id"]]
            assert held.held["tiny"]["kv"] == first["cached"] + first["in_use"]
            assert held.cached["tiny"]["kv"] == first["cached"]
            free_before = stats.pool("tiny").spaces["kv"].free
            want = free_before + 100  # more than is free: only the engine's cache can cover it
            with client.lease("taker", ttl_s=10.0) as taker:
                got = taker.allocate("tiny", "kv", want)
                assert len(got) == want
                engine.send("check")
                after = engine.recv()
                assert after["in_use"] == 20  # never an id in use
                assert after["gave_back"] >= 100 and after["cached"] <= first["cached"] - 100
                kv = client.stats("tiny").pool("tiny").spaces["kv"]
                assert kv.used + kv.free == kv.capacity == TINY_PAGES
                engine.send("done")
                assert engine.recv() == "closed"
                engine.wait_ok()
                taker.free("tiny", "kv", got)
        kv = client.stats("tiny").pool("tiny").spaces["kv"]
        assert kv.used == 0 and kv.free == TINY_PAGES

"""A client process with a page cache is SIGKILLed: every id of its cache, handed out or
cached, is the lease's in the daemon, so all come back when the lease expires."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import TINY_OPTIONS, TINY_SPEC, DaemonProcess, run_daemon, temp_dir
from tests.procs import Child

TTL_S = 1.0

# The engine: a page cache (low 4, high 32), 10 ids handed out, 2 freed; reports, then waits
# to be killed.
SYNC_ENGINE = r"""
import time
from kvpool.clients.client import KVPoolClient

first = recv()
client = KVPoolClient(first["target"])
lease = client.lease("cached-engine", ttl_s=first["ttl"])
cache = lease.page_cache(first["pool"], low=4, high=32, batch=8)
cache.settle(30)
ids = cache.alloc(10)
cache.free(ids[:2])
cache.settle(30)
send({"lease_id": lease.lease_id, "in_use": cache.core.in_use, "cached": cache.core.cached})
while True:
    time.sleep(60)
"""

ASYNC_ENGINE = r"""
import asyncio
from kvpool.clients.aio import AsyncKVPoolClient

async def main():
    first = recv()
    client = AsyncKVPoolClient(first["target"])
    lease = await client.lease("cached-engine", ttl_s=first["ttl"])
    cache = await lease.page_cache(first["pool"], low=4, high=32, batch=8)
    await cache.settle()
    ids = await cache.alloc(10)
    await cache.free(ids[:2])
    await cache.settle()
    send({"lease_id": lease.lease_id, "in_use": cache.core.in_use, "cached": cache.core.cached})
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with temp_dir() as path, run_daemon(path) as proc:
        yield proc


@pytest.mark.parametrize("script", [SYNC_ENGINE, ASYNC_ENGINE], ids=["sync", "asyncio"])
def test_sigkilled_cache_holder_loses_every_id_within_ttl_plus_1s(
        daemon: DaemonProcess, script: str) -> None:
    pool = "crashcache" if script is SYNC_ENGINE else "crashcacheaio"
    with KVPoolClient(daemon.target) as client:
        client.configure(pool, spec=TINY_SPEC, **TINY_OPTIONS)
        with Child(script, first={"target": daemon.target, "pool": pool,
                                  "ttl": TTL_S}) as child:
            report = child.recv()
            assert (report["in_use"], report["cached"]) == (8, 24)
            lease = next(x for x in client.stats(pool).leases
                         if x.lease_id == report["lease_id"])
            assert lease.held == {pool: {"kv": 32}}  # in use and cached: all the lease's
            assert client.stats(pool).pool(pool).spaces["kv"].used == 32
            child.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            child.proc.wait(10)
            # Poll: the sweeper frees a lease at most TTL + 0.2 s after its last renewal.
            while client.stats(pool).pool(pool).spaces["kv"].used:
                assert time.monotonic() - killed < 60.0, "ids never came back"
                time.sleep(0.05)
        stats = client.stats(pool)
        assert all(x.lease_id != report["lease_id"] for x in stats.leases)
        assert stats.daemon.leases_expired >= 1
        client.drop(pool)

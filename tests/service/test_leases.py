"""Leases: KeepAlive renews, expiry reclaims (logged and counted), the sweeper's timing."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.wire import allocate_request
from kvpoold.server.server import sweep_leases
from tests.service.conftest import Served


async def test_keep_alive_moves_the_deadline(served: Served) -> None:
    """TTL 3 s: 2 s pass, a renewal answers expires_in 3 s; 2 s more and it has not expired."""
    lease = await served.lease(ttl=3.0)
    served.clock.advance(2.0)
    stream = served.stub.KeepAlive()
    await stream.write(pb.KeepAliveRequest(lease_id=lease))
    resp = await stream.read()
    assert (resp.lease_id, resp.ttl_seconds, resp.expires_in_seconds) == (lease, 3.0, 3.0)
    served.clock.advance(2.0)
    assert served.daemon.expire_leases() == []
    await stream.write(pb.KeepAliveRequest(lease_id=lease))
    assert (await stream.read()).expires_in_seconds == 3.0
    await stream.done_writing()
    assert await stream.read() == grpc.aio.EOF


async def test_expiry_reclaims_everything_and_is_logged(served: Served,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    await served.configure()
    lease = await served.lease("doomed", ttl=1.0)
    await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 7), ("req", 2)]))
    served.clock.advance(0.99)
    assert served.daemon.expire_leases() == []
    served.clock.advance(0.02)
    with caplog.at_level(logging.WARNING, logger="kvpoold"):
        ((gone, result),) = served.daemon.expire_leases()
    assert gone.lease_id == lease
    assert sorted((h.kind.value, h.count) for h in result.released) == [("kv", 7), ("req", 2)]
    (record,) = [r for r in caplog.records if r.getMessage() == "lease expired"]
    assert record.fields["lease_id"] == lease and record.fields["released"] == 9
    stats = await served.stub.Stats(pb.StatsRequest())
    assert stats.daemon.leases_expired == 1 and stats.daemon.num_leases == 0
    assert [k.used for k in stats.pools[0].kinds] == [0, 0]


async def test_keep_alive_of_an_expired_lease_is_not_found(served: Served) -> None:
    lease = await served.lease(ttl=1.0)
    served.clock.advance(5.0)
    served.daemon.expire_leases()
    stream = served.stub.KeepAlive()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.write(pb.KeepAliveRequest(lease_id=lease))
        await stream.read()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "renew it within its TTL" in info.value.details()


async def test_sweeper_expires_within_ttl_plus_its_interval(served: Served) -> None:
    """The sweeper checks every 0.2 s (here 0.01 s of real time on the manual clock)."""
    await served.configure()
    lease = await served.lease(ttl=1.0)
    await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 3)]))
    task = asyncio.create_task(sweep_leases(served.daemon, interval_s=0.01))
    try:
        await asyncio.sleep(0.05)
        assert served.daemon.leases.find(lease) is not None
        served.clock.advance(1.0)
        await asyncio.sleep(0.05)
        assert served.daemon.leases.find(lease) is None
    finally:
        task.cancel()
    stats = await served.stub.Stats(pb.StatsRequest())
    assert stats.pools[0].kinds[0].used == 0


async def test_shutdown_ends_keep_alive_streams(served: Served) -> None:
    lease = await served.lease()
    stream = served.stub.KeepAlive()
    await stream.write(pb.KeepAliveRequest(lease_id=lease))
    await stream.read()
    served.server.closing.set()
    assert await asyncio.wait_for(stream.read(), 2.0) == grpc.aio.EOF

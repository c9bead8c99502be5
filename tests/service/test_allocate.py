"""Allocate and Free over gRPC: int32 bytes on the wire, all-or-nothing, ownership."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvpool.contract.codec import ids_from_bytes, stats_from_pb
from kvpool.contract.wire import allocate_request, free_request
from kvpool.v1 import kvpool_pb2 as pb
from tests.conftest import TINY_PAGES
from tests.service.conftest import Served, proof


async def kinds_used(served: Served) -> dict[str, int]:
    stats = await served.stub.Stats(pb.StatsRequest(pool="tiny"))
    return {k.space: k.used for k in stats.pools[0].spaces}


async def test_allocate_returns_little_endian_int32_ids(served: Served) -> None:
    """A fresh pool hands out page ids from 1 (0 is the padding page), 4 bytes each."""
    await served.configure()
    lease = await served.lease()
    resp = await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 3), ("req", 2)]))
    assert [item.space for item in resp.items] == ["kv", "req"]
    assert len(resp.items[0].ids) == 3 * 4
    pages, rows = (ids_from_bytes(item.ids) for item in resp.items)
    assert pages.dtype == np.dtype("<i4")
    assert sorted(pages.tolist()) == [1, 2, 3]
    assert sorted(rows.tolist()) == [1, 2]
    assert resp.items[0].paired_ids == b""
    assert await kinds_used(served) == {"kv": 3, "req": 2}


async def test_free_returns_ids_and_they_come_back(served: Served) -> None:
    await served.configure()
    lease = await served.lease()
    resp = await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 5)]))
    pages = ids_from_bytes(resp.items[0].ids)
    freed = await served.stub.Free(free_request("tiny", lease, [("kv", pages[:2])]))
    assert freed.freed == 2
    assert await kinds_used(served) == {"kv": 3, "req": 0}
    again = await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 2)]))
    assert set(ids_from_bytes(again.items[0].ids).tolist()) == set(pages[:2].tolist())


async def test_allocate_is_all_or_nothing(served: Served) -> None:
    """256 pages and 8 rows: asking 10 pages + 9 rows fails on the rows, and no page is
    taken either; asking exactly what is free succeeds."""
    await served.configure()
    lease = await served.lease()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 10), ("req", 9)]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("kvpool-field", "items[1].count") in tuple(info.value.trailing_metadata())
    assert await kinds_used(served) == {"kv": 0, "req": 0}
    resp = await served.stub.Allocate(
        allocate_request("tiny", lease, [("kv", TINY_PAGES), ("req", 8)])
    )
    assert len(resp.items[0].ids) == 4 * TINY_PAGES
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 1)]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "0 of 256 free" in info.value.details()


async def test_free_of_another_lease_ids_is_refused_and_changes_nothing(served: Served) -> None:
    await served.configure()
    a, b = await served.lease("a"), await served.lease("b")
    pages_a = ids_from_bytes((await served.stub.Allocate(allocate_request("tiny", a, [("kv", 2)])))
                        .items[0].ids)
    pages_b = ids_from_bytes((await served.stub.Allocate(allocate_request("tiny", b, [("kv", 2)])))
                        .items[0].ids)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Free(free_request("tiny", a, [("kv", pages_a), ("kv", pages_b[:1])]))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "held by another lease" in info.value.details()
    assert ("kvpool-field", "items[1].ids[0]") in tuple(info.value.trailing_metadata())
    assert await kinds_used(served) == {"kv": 4, "req": 0}


async def test_close_lease_returns_everything_it_holds(served: Served) -> None:
    await served.configure()
    await served.configure("other")
    lease = await served.lease()
    await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 4), ("req", 1)]))
    await served.stub.Allocate(allocate_request("other", lease, [("kv", 2)]))
    resp = await served.stub.CloseLease(pb.CloseLeaseRequest(**proof(lease)))
    got = sorted((h.pool, h.space, h.count) for h in resp.released)
    assert got == [("other", "kv", 2), ("tiny", "kv", 4), ("tiny", "req", 1)]
    assert await kinds_used(served) == {"kv": 0, "req": 0}
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 1)]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_stats_shows_what_each_lease_holds(served: Served) -> None:
    await served.configure()
    lease = await served.lease("engine-0", ttl=7.0)
    await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 6), ("req", 1)]))
    served.clock.advance(2.0)
    stats = await served.stub.Stats(pb.StatsRequest())
    (entry,) = stats.leases
    assert (entry.lease_id, entry.name, entry.ttl_seconds) == (lease.lease_id, "engine-0", 7.0)
    assert entry.expires_in_seconds == pytest.approx(5.0)
    assert sorted((h.pool, h.space, h.count) for h in entry.held) == [
        ("tiny", "kv", 6), ("tiny", "req", 1)]
    kv = stats.pools[0].spaces[0]
    assert (kv.space, kv.capacity, kv.used, kv.high_water, kv.frees) == ("kv", 256, 6, 6, 0)
    record = stats_from_pb(stats).pool("tiny").spaces["kv"]
    assert (record.free, record.allocs) == (250, 6)

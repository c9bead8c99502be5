"""Drop (refused while in use unless forced) and Attach/Detach (counted per pool and lease)."""

from __future__ import annotations

import grpc
import pytest

from kvpool.contract.plan import PoolPlan
from kvpool.contract.wire import allocate_request
from kvpool.v1 import kvpool_pb2 as pb
from tests.service.conftest import BUDGET_BYTES, Served, proof


async def attached(served: Served, pool: str = "tiny") -> int:
    return (await served.stub.Stats(pb.StatsRequest(pool=pool))).pools[0].attached


async def test_drop_releases_memory_and_budget(served: Served) -> None:
    await served.configure()
    resp = await served.stub.Drop(pb.DropRequest(pool="tiny"))
    assert resp.released_bytes == 1_062_032 and list(resp.reclaimed) == []
    stats = await served.stub.Stats(pb.StatsRequest())
    assert (stats.daemon.used_bytes, len(stats.pools)) == (0, 0)
    assert served.daemon.available_bytes() == BUDGET_BYTES


async def test_drop_is_refused_while_a_lease_holds_pages_unless_forced(served: Served) -> None:
    await served.configure()
    lease = await served.lease("engine-0")
    await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 4)]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Drop(pb.DropRequest(pool="tiny"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # the holder as users know it: its name and public lease id, never the internal owner
    assert f"engine-0 (lease {lease.lease_id}, 4 ids)" in info.value.details()
    assert "owner" not in info.value.details()
    resp = await served.stub.Drop(pb.DropRequest(pool="tiny", force=True))
    assert [(h.pool, h.space, h.count) for h in resp.reclaimed] == [("tiny", "kv", 4)]
    # the lease lives on, holding nothing
    stats = await served.stub.Stats(pb.StatsRequest())
    assert [list(x.held) for x in stats.leases] == [[]]


async def test_attach_hands_out_layout_and_handle(served: Served) -> None:
    configured = await served.configure()
    resp = await served.stub.Attach(
        pb.AttachRequest(pool="tiny", expected_fingerprint=configured.fingerprint)
    )
    assert resp.fingerprint == configured.fingerprint
    assert PoolPlan.from_json(resp.plan_json).fingerprint() == configured.fingerprint
    # PlainBackingFactory: not shareable, the size is the whole region
    assert (resp.handle.sharing, resp.handle.size) == ("none", 1_062_032)
    assert resp.device == "cpu" and resp.attach_id != 0
    assert await attached(served) == 1
    await served.stub.Detach(pb.DetachRequest(attach_id=resp.attach_id))
    assert await attached(served) == 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Detach(pb.DetachRequest(attach_id=resp.attach_id))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_drop_is_refused_while_attached_unless_forced(served: Served) -> None:
    await served.configure()
    resp = await served.stub.Attach(pb.AttachRequest(pool="tiny"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Drop(pb.DropRequest(pool="tiny"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "1 client attached" in info.value.details()
    dropped = await served.stub.Drop(pb.DropRequest(pool="tiny", force=True))
    assert dropped.detached == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Detach(pb.DetachRequest(attach_id=resp.attach_id))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_attachments_under_a_lease_end_with_it(served: Served) -> None:
    """An attachment tied to a lease ends when the lease closes or expires, so a crashed
    client does not pin the pool forever."""
    await served.configure()
    a, b = await served.lease("a", ttl=1.0), await served.lease("b", ttl=5.0)
    await served.stub.Attach(pb.AttachRequest(pool="tiny", **proof(a)))
    await served.stub.Attach(pb.AttachRequest(pool="tiny", **proof(b)))
    await served.stub.Attach(pb.AttachRequest(pool="tiny", **proof(b)))
    stats = await served.stub.Stats(pb.StatsRequest())
    assert stats.pools[0].attached == 3
    assert sorted(x.attached for x in stats.leases) == [1, 2]
    closed = await served.stub.CloseLease(pb.CloseLeaseRequest(**proof(b)))
    assert closed.detached == 2
    served.clock.advance(1.5)
    ((_, result),) = served.daemon.expire_leases()
    assert result.detached == 1
    assert await attached(served) == 0
    await served.stub.Drop(pb.DropRequest(pool="tiny"))

"""The daemon's own tables without gRPC: leases (ids, owners, expiry) and attachments; plus
server reflection listing the API."""

from __future__ import annotations

import pytest
from grpc import aio
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvpool.contract.errors import InvalidArgument, NotFound, ResourceExhausted
from kvpoold.server.attachments import AttachmentTable
from kvpoold.server.leases import OWNER_MAX, LeaseTable
from tests.service.conftest import ManualClock, Served


def test_leases_get_random_ids_and_small_owners() -> None:
    clock = ManualClock()
    table = LeaseTable(clock)
    a, b = table.open("a", 1.0), table.open("b", 2.0)
    assert (a.owner, b.owner) == (1, 2)
    assert a.lease_id != b.lease_id and a.lease_id > 0
    clock.advance(1.0)
    assert [x.name for x in table.pop_expired()] == ["a"]
    assert table.renew(b.lease_id).deadline == clock() + 2.0
    with pytest.raises(NotFound):
        table.renew(a.lease_id)
    assert (table.opened, table.expired, table.closed) == (2, 1, 0)
    table.close(b.lease_id)
    assert len(table) == 0 and table.closed == 1


def test_owners_wrap_and_skip_the_ones_in_use() -> None:
    """After owner 2**31 - 1 the next is 1 again, unless lease 1 is still open."""
    table = LeaseTable(ManualClock())
    first = table.open("first", 5.0)
    table._next_owner = OWNER_MAX
    assert table.open("last", 5.0).owner == OWNER_MAX
    assert first.owner == 1 and table.open("wrapped", 5.0).owner == 2


def test_lease_limit_and_bad_values() -> None:
    table = LeaseTable(ManualClock(), max_leases=1)
    table.open("one", 1.0)
    with pytest.raises(ResourceExhausted, match="limit is 1"):
        table.open("two", 1.0)
    for name, ttl in (("", 1.0), ("x" * 129, 1.0), ("tab\t", 1.0), ("ok", 0.05),
                      ("ok", float("inf"))):
        with pytest.raises(InvalidArgument):
            LeaseTable(ManualClock()).open(name, ttl)


def test_leases_by_identity_follow_open_close_and_expiry() -> None:
    """``of_identity`` lists an identity's open leases in opening order (what a tenant's Stats
    lists) and ``count_identity`` counts them, through closes and expiries."""
    clock = ManualClock()
    table = LeaseTable(clock)
    a1, b1 = table.open("a1", 1.0, "a"), table.open("b1", 5.0, "b")
    a2, a3 = table.open("a2", 5.0, "a"), table.open("a3", 5.0, "a")
    assert [x.name for x in table.of_identity("a")] == ["a1", "a2", "a3"]
    assert [x.name for x in table.of_identity("b")] == ["b1"]
    assert table.of_identity("c") == [] and table.count_identity("c") == 0
    table.close(a2.lease_id)
    clock.advance(1.0)
    assert table.pop_expired() == [a1]
    assert table.of_identity("a") == [a3] and table.count_identity("a") == 1
    table.close(a3.lease_id)
    table.close(b1.lease_id)
    assert (table.of_identity("a"), table.of_identity("b")) == ([], [])
    assert table._by_identity == {}  # identities without leases are not kept


def test_attachment_indexes() -> None:
    table = AttachmentTable()
    a = table.add("p", 7)
    b = table.add("p")
    c = table.add("q", 7)
    assert (table.count_pool("p"), table.count_pool("q"), table.count_lease(7)) == (2, 1, 2)
    assert table.remove_lease(7) == 2
    assert (table.count_pool("p"), table.count_pool("q")) == (1, 0)
    assert table.remove(a.attach_id) is None and table.remove(c.attach_id) is None
    assert table.remove_pool("p") == 1 and table.remove(b.attach_id) is None
    assert len(table) == 0


async def test_reflection_lists_the_services(served: Served) -> None:
    async with aio.insecure_channel(served.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        resp = await call.read()
        await call.done_writing()
    names = {s.name for s in resp.list_services_response.service}
    assert {"kvpool.v1.KVPool", "grpc.health.v1.Health"} <= names

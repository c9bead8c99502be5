"""Leases: KeepAlive renews, expiry reclaims (logged and counted), the sweeper's timing, and
the deadline heap that makes a sweep cost what expired, not every lease."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from kvpool.contract.wire import allocate_request
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.server.leases import CacheCounts, LeaseTable
from kvpoold.server.run import sweep_leases
from tests.service.conftest import ManualClock, Served, proof


async def test_keep_alive_moves_the_deadline(served: Served) -> None:
    """TTL 3 s: 2 s pass, a renewal answers expires_in 3 s; 2 s more and it has not expired."""
    lease = await served.lease(ttl=3.0)
    served.clock.advance(2.0)
    stream = served.stub.KeepAlive()
    await stream.write(pb.KeepAliveRequest(**proof(lease)))
    resp = await stream.read()
    assert (resp.lease_id, resp.ttl_seconds, resp.expires_in_seconds) == (lease.lease_id, 3.0, 3.0)
    served.clock.advance(2.0)
    assert served.daemon.expire_leases() == []
    await stream.write(pb.KeepAliveRequest(**proof(lease)))
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
    assert gone.lease_id == lease.lease_id
    assert result.held == {"tiny": {"kv": 7, "req": 2}}
    (record,) = [r for r in caplog.records if r.getMessage() == "lease expired"]
    assert record.fields["lease_id"] == lease.lease_id and record.fields["released"] == 9
    stats = await served.stub.Stats(pb.StatsRequest())
    assert stats.daemon.leases_expired == 1 and stats.daemon.num_leases == 0
    assert [k.used for k in stats.pools[0].spaces] == [0, 0]


async def test_keep_alive_of_an_expired_lease_is_not_found(served: Served) -> None:
    lease = await served.lease(ttl=1.0)
    served.clock.advance(5.0)
    served.daemon.expire_leases()
    stream = served.stub.KeepAlive()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.write(pb.KeepAliveRequest(**proof(lease)))
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
        assert served.daemon.leases.find(lease.lease_id) is not None
        served.clock.advance(1.0)
        await asyncio.sleep(0.05)
        assert served.daemon.leases.find(lease.lease_id) is None
    finally:
        task.cancel()
    stats = await served.stub.Stats(pb.StatsRequest())
    assert stats.pools[0].spaces[0].used == 0


async def test_shutdown_ends_keep_alive_streams(served: Served) -> None:
    lease = await served.lease()
    stream = served.stub.KeepAlive()
    await stream.write(pb.KeepAliveRequest(**proof(lease)))
    await stream.read()
    served.server.closing.set()
    assert await asyncio.wait_for(stream.read(), 2.0) == grpc.aio.EOF


# -- the deadline heap ------------------------------------------------------------------------


def test_leases_expire_in_deadline_order() -> None:
    """Opened with TTLs 3, 1, 2 s: they expire 1, 2, 3, each once its deadline has passed."""
    clock = ManualClock()
    table = LeaseTable(clock)
    a, b, c = table.open("a", 3.0), table.open("b", 1.0), table.open("c", 2.0)
    assert table.next_deadline() == b.deadline
    clock.advance(0.5)
    assert table.pop_expired() == []
    clock.advance(1.0)
    assert [x.name for x in table.pop_expired()] == ["b"]
    assert table.next_deadline() == c.deadline
    clock.advance(5.0)
    assert [x.name for x in table.pop_expired()] == ["c", "a"]
    assert table.next_deadline() is None and len(table) == 0
    assert (table.opened, table.expired) == (3, 3)
    assert a.lease_id not in {x.lease_id for x in table}


def test_pop_expired_takes_the_time_to_expire_at() -> None:
    clock = ManualClock()
    table = LeaseTable(clock)
    lease = table.open("a", 1.0)
    assert table.pop_expired(clock() + 0.5) == []
    assert table.pop_expired(lease.deadline) == [lease]


def test_renew_pushes_the_deadline() -> None:
    """A renewal at 0.8 s of a 1 s lease moves its deadline to 1.8 s: the old entry at 1 s is
    stale and skipped, the lease expires only after 1.8 s."""
    clock = ManualClock()
    table = LeaseTable(clock)
    lease = table.open("a", 1.0)
    clock.advance(0.8)
    table.renew(lease.lease_id)
    assert table.next_deadline() == lease.deadline == clock() + 1.0
    clock.advance(0.5)
    assert table.pop_expired() == [] and len(table) == 1
    clock.advance(0.6)
    assert table.pop_expired() == [lease]
    assert table.heap_size == 0


def test_close_removes_the_lease_from_expiry() -> None:
    clock = ManualClock()
    table = LeaseTable(clock)
    a, b = table.open("a", 1.0), table.open("b", 2.0)
    table.close(a.lease_id)
    assert table.next_deadline() == b.deadline
    clock.advance(5.0)
    assert table.pop_expired() == [b]
    assert (table.closed, table.expired) == (1, 1)


def test_stale_heap_entries_stay_bounded() -> None:
    """Renewals and closes leave stale entries behind; the heap is rebuilt once they
    outnumber the open leases 2:1, so it never holds more than 3 entries per open lease."""
    clock = ManualClock()
    table = LeaseTable(clock)
    leases = [table.open(f"l{i}", 5.0) for i in range(10)]
    for _ in range(1000):
        clock.advance(0.001)
        for lease in leases:
            table.renew(lease.lease_id)
            assert table.heap_size <= 3 * len(table)
    for lease in leases[:9]:
        table.close(lease.lease_id)
        assert table.heap_size <= 3 * len(table)
    assert table.next_deadline() == leases[9].deadline
    table.close(leases[9].lease_id)
    assert table.heap_size == 0 and table.next_deadline() is None


def test_stale_entries_are_dropped_when_many_leases_expire() -> None:
    """10 long leases renewed 10 times each leave 100 stale entries, fine beside 100 open
    leases; once the 90 short ones expire they outnumber the 10 left, and the heap is rebuilt."""
    clock = ManualClock()
    table = LeaseTable(clock)
    for i in range(90):
        table.open(f"short-{i}", 1.0)
    long = [table.open(f"long-{i}", 100.0) for i in range(10)]
    for _ in range(10):
        for lease in long:
            table.renew(lease.lease_id)
    assert table.heap_size == 200
    clock.advance(2.0)
    assert len(table.pop_expired()) == 90
    assert table.heap_size == len(table) == 10


def test_a_sweep_examines_only_what_expired() -> None:
    """10,000 open leases and one expired: a sweep pops one heap entry, not 10,001 leases."""
    clock = ManualClock()
    table = LeaseTable(clock)
    for i in range(10_000):
        table.open(f"engine-{i}", 60.0)
    doomed = table.open("doomed", 1.0)
    clock.advance(2.0)
    before = table.examined
    assert table.pop_expired() == [doomed]
    assert table.examined - before == 1
    before = table.examined
    assert table.pop_expired() == []
    assert table.examined == before
    assert len(table) == 10_000


def test_the_cachers_index_follows_reports_closes_and_expiry() -> None:
    """Give-back visits the leases whose caches report cached ids of the pool and space; the
    index follows every report and forgets a lease when it closes or expires."""
    clock = ManualClock()
    table = LeaseTable(clock)
    a, b, c = (table.open(name, 1.0) for name in "abc")
    table.set_reports(a, {("p", "kv"): CacheCounts(5, 1), ("p", "req"): CacheCounts(2, 0)})
    table.set_reports(b, {("p", "kv"): CacheCounts(0, 9)})  # in use only: nothing to give back
    table.set_reports(c, {("p", "kv"): CacheCounts(3, 0)})
    assert {x.name for x in table.cachers("p", "kv")} == {"a", "c"}
    assert [x.name for x in table.cachers("p", "req")] == ["a"]
    # cached all used; req no longer reported
    table.set_reports(a, {("p", "kv"): CacheCounts(0, 6)})
    assert [x.name for x in table.cachers("p", "kv")] == ["c"]
    assert table.cachers("p", "req") == [] and table.cachers("q", "kv") == []
    table.close(c.lease_id)
    assert table.cachers("p", "kv") == []
    table.set_reports(b, {("p", "kv"): CacheCounts(4, 5)})
    # in use, but its holder frees some on demand: a give-back may take those (cached first)
    table.set_reports(a, {("p", "kv"): CacheCounts(0, 6, 4)})
    assert {x.name for x in table.cachers("p", "kv")} == {"a", "b"}
    assert a.cached("p", "kv") == 4
    b.ask_give_back("p", "kv", 6)  # 4 cached, then 2 of ... none: b has no evictable ids
    assert b.reports[("p", "kv")] == CacheCounts(0, 5, 0)
    a.ask_give_back("p", "kv", 3)
    assert a.reports[("p", "kv")] == CacheCounts(0, 6, 1) and a.cached("p", "kv") == 1
    clock.advance(2.0)
    assert {x.name for x in table.pop_expired()} == {"a", "b"}
    assert table.cachers("p", "kv") == []

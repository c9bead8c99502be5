"""The lease sweep in slices (issue 38): leases expiring together are reclaimed a bounded slice at
a time (by leases and by ids released), each exactly once, with Stats right after every slice;
a lease past its deadline is refused (not renewed, not used) while it waits for its slice; the
sweeper lets other tasks run between two slices."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvpool.contract.codec import ids_from_bytes
from kvpool.contract.errors import NotFound
from kvpool.contract.wire import LeaseKey, allocate_request, free_request
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.server.leases import LeaseTable
from kvpoold.server.run import sweep_leases
from tests.service.conftest import ManualClock, Served, proof

# -- the table ----------------------------------------------------------------------------------


def test_pop_expired_with_a_limit_hands_each_lease_once_in_deadline_order() -> None:
    """Ten leases due (TTLs 1.00..1.09 s; the first renewed, so its first heap entry is
    stale and it is due last): slices of 3 are 3, 3, 3, 1 leases, by deadline, the stale entry
    counted against no slice; the counters are right after each slice."""
    clock = ManualClock()
    table = LeaseTable(clock)
    leases = [table.open(f"l{i}", 1.0 + i * 0.01) for i in range(10)]
    clock.advance(0.5)
    table.renew(leases[0].lease_id)  # due at 1001.5 now, after the others
    clock.advance(5.0)
    slices = []
    while got := table.pop_expired(limit=3):
        slices.append(got)
        gone = sum(len(s) for s in slices)
        assert (len(table), table.expired) == (10 - gone, gone)
        assert (table.next_deadline() is not None) == (gone < 10)  # the rest stay due
    assert [len(s) for s in slices] == [3, 3, 3, 1]
    assert [x.name for s in slices for x in s] == [f"l{i}" for i in (*range(1, 10), 0)]
    assert table.examined == 11  # ten leases and the stale entry, each popped once
    assert table.pop_expired() == []


def test_a_lease_past_its_deadline_is_refused_while_it_waits_for_its_slice() -> None:
    """Deadline passed, not yet reclaimed: get, prove and renew say NotFound (its deadline
    does not move); it stays in the table (its owner taken, listed) until its slice."""
    clock = ManualClock()
    table = LeaseTable(clock)
    a, b = table.open("a", 1.0), table.open("b", 1.0)
    clock.advance(1.0)  # the deadline itself: due
    for lease in (a, b):
        with pytest.raises(NotFound):
            table.renew(lease.lease_id)
        with pytest.raises(NotFound):
            table.prove(lease.lease_id, lease.secret, lease.identity)
        with pytest.raises(NotFound):
            table.get(lease.lease_id)
        assert table.find(lease.lease_id) is lease and lease.deadline == clock.t
    assert (len(table), table.of_owner(b.owner)) == (2, b)
    assert table.pop_expired(limit=1) == [a]
    with pytest.raises(NotFound):
        table.renew(b.lease_id)  # still waiting: still refused
    assert table.pop_expired(limit=1) == [b]
    assert (len(table), table.expired, table.pop_expired()) == (0, 2, [])


def test_a_lease_before_its_deadline_is_still_served() -> None:
    clock = ManualClock()
    table = LeaseTable(clock)
    lease = table.open("a", 1.0)
    clock.advance(0.999)
    assert table.prove(lease.lease_id, lease.secret, lease.identity) is lease
    assert table.renew(lease.lease_id).deadline == clock.t + 1.0


# -- the daemon ---------------------------------------------------------------------------------

# Pages each doomed lease holds, in the order they are opened (and due: equal deadlines pop in
# the order they were pushed). Slices of at most 5 leases or 6 ids: [4, 4] (8 ids >= 6),
# [1, 1, 1, 1, 1] (5 leases), [1, 1, 1, 3] (6 ids), [2].
HOLDINGS = [4, 4, 1, 1, 1, 1, 1, 1, 1, 1, 3, 2]
SLICES = [2, 5, 4, 1]


async def _kv_used(served: Served) -> tuple[int, int, int]:
    """(kv pages used, leases open, leases expired) as Stats shows them."""
    stats = await served.stub.Stats(pb.StatsRequest())
    return stats.pools[0].spaces[0].used, stats.daemon.num_leases, stats.daemon.leases_expired


async def test_slices_release_everything_once_with_stats_right_after_each(served: Served
                                                                          ) -> None:
    await served.configure()
    bystander = await served.lease("bystander", ttl=100.0)
    await served.stub.Allocate(allocate_request("tiny", bystander, [("kv", 2)]))
    doomed: list[LeaseKey] = []
    held: list[list[int]] = []
    for i, pages in enumerate(HOLDINGS):
        lease = await served.lease(f"doomed-{i}", ttl=1.0)
        resp = await served.stub.Allocate(allocate_request("tiny", lease, [("kv", pages)]))
        doomed.append(lease)
        held.append(ids_from_bytes(resp.items[0].ids).tolist())
    served.clock.advance(1.0)

    # Waiting for its slice, a lease is neither renewed nor used, and nothing moves.
    stream = served.stub.KeepAlive()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.write(pb.KeepAliveRequest(**proof(doomed[-1])))
        await stream.read()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    for call in (served.stub.Allocate(allocate_request("tiny", doomed[-1], [("kv", 1)])),
                 served.stub.Free(free_request("tiny", doomed[-1], [("kv", held[-1])]))):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    total = 2 + sum(HOLDINGS)
    assert await _kv_used(served) == (total, 1 + len(HOLDINGS), 0)

    gone: list[int] = []
    sizes = []
    while out := served.daemon.expire_leases(max_leases=5, max_ids=6):
        sizes.append(len(out))
        for lease, result in out:
            i = [x.lease_id for x in doomed].index(lease.lease_id)
            assert result.held == {"tiny": {"kv": HOLDINGS[i]}}
            gone.append(i)
        left = sum(HOLDINGS[i] for i in range(len(HOLDINGS)) if i not in gone)
        assert await _kv_used(served) == (2 + left, 1 + len(HOLDINGS) - len(gone), len(gone))
    assert sizes == SLICES
    assert gone == list(range(len(HOLDINGS)))  # each once, by deadline
    # What they held is free again: the bystander can take all of it.
    again = await served.stub.Allocate(allocate_request("tiny", bystander,
                                                        [("kv", sum(HOLDINGS))]))
    assert set(ids_from_bytes(again.items[0].ids).tolist()) >= {x for ids in held for x in ids}


async def test_a_lease_holding_more_than_a_slice_is_a_slice_of_its_own(served: Served) -> None:
    await served.configure()
    big = await served.lease("big", ttl=1.0)
    small = await served.lease("small", ttl=1.0)
    await served.stub.Allocate(allocate_request("tiny", big, [("kv", 40)]))
    await served.stub.Allocate(allocate_request("tiny", small, [("kv", 1)]))
    served.clock.advance(1.0)
    ((first, result),) = served.daemon.expire_leases(max_leases=5, max_ids=8)
    assert (first.lease_id, result.total) == (big.lease_id, 40)
    ((second, _),) = served.daemon.expire_leases(max_leases=5, max_ids=8)
    assert second.lease_id == small.lease_id
    assert served.daemon.expire_leases(max_leases=5, max_ids=8) == []


async def test_the_sweeper_lets_other_tasks_run_between_slices(served: Served) -> None:
    """40 leases due at once, slices of 4: a task taking turns meanwhile sees the table at
    every count between (41 with the bystander, 37, ..., 5, 1), so the loop was never held for
    more than one slice."""
    await served.configure()
    await served.lease("bystander", ttl=100.0)
    for i in range(40):
        lease = await served.lease(f"doomed-{i}", ttl=1.0)
        await served.stub.Allocate(allocate_request("tiny", lease, [("kv", 1)]))
    sweeper = asyncio.create_task(sweep_leases(served.daemon, 0.01, slice_leases=4,
                                               slice_ids=1000))
    seen = set()

    async def watch() -> None:
        while len(served.daemon.leases) > 1:
            seen.add(len(served.daemon.leases))
            await asyncio.sleep(0)

    try:
        served.clock.advance(1.0)
        await asyncio.wait_for(watch(), 60.0)  # a guard against a sweeper that never ends
    finally:
        sweeper.cancel()
    assert seen >= set(range(5, 41, 4))
    assert served.daemon.leases.expired == 40
    assert (await _kv_used(served))[0] == 0

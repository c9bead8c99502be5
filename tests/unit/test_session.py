"""The sans-IO keep-alive session (``kvpool.clients.session``) and elastic pools: an Unmap in a
response unmaps the groups in the lease's regions of that pool, the next requests carry its
reclaim id until the daemon answers one of them, and a failed unmap is never acknowledged.
Real regions over the daemon's real sparse file on /dev/shm."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.clients.session import KeepAliveSession
from kvpool.contract.codec import groups_to_bytes
from kvpool.contract.errors import NotFound
from kvpool.contract.plan import PoolPlan
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.sharing.shm import ShmBackingFactory, SparseShmBacking
from tests.factories import elastic_llama_plan, map_elastic_backing


@pytest.fixture(scope="module")
def pool_plan() -> PoolPlan:
    return elastic_llama_plan()


@pytest.fixture
def backing(shm_dir: Path, pool_plan: PoolPlan) -> Iterator[SparseShmBacking]:
    factory = ShmBackingFactory(shm_dir)
    try:
        b = factory.create_elastic(pool_plan, "p")
        for g in (0, 2, 3):
            b.grant(g)
        yield b
    finally:
        factory.close()


def session() -> KeepAliveSession:
    return KeepAliveSession(lease_id=5, secret=b"s" * 16, ttl_s=3.0)


def unmap(groups: list[int], reclaim: int, pool: str = "p") -> pb.Unmap:
    return pb.Unmap(pool=pool, groups=groups_to_bytes(groups), reclaim=reclaim,
                    deadline_seconds=5.0)


def test_an_unmap_unmaps_the_pools_regions_and_the_next_request_acknowledges_it(
        backing, pool_plan) -> None:
    s = session()
    with map_elastic_backing(backing, pool_plan, (0, 2, 3)) as mine, \
            map_elastic_backing(backing, pool_plan, (0, 2, 3), pool="q") as other:
        s.add_region(mine)
        s.add_region(other)
        assert s.next_request().unmapped == []
        send_now = s.on_response(pb.KeepAliveResponse(unmap=[unmap([2, 3], reclaim=41)]))
        assert send_now  # acknowledged at once, as a give-back's new counts are
        assert mine.mapped_groups == {0}
        assert other.mapped_groups == {0, 2, 3}  # another pool's region: untouched
        first = s.next_request()
        assert list(first.unmapped) == [41]
        # Not answered yet (the stream may have lost it): the next request carries it again.
        second = s.next_request()
        assert list(second.unmapped) == [41]
        s.on_response(pb.KeepAliveResponse(seq=second.seq))
        assert s.next_request().unmapped == []


def test_a_reclaim_answered_before_it_was_carried_out_is_still_sent(backing, pool_plan) -> None:
    s = session()
    with map_elastic_backing(backing, pool_plan, (0, 2)) as region:
        s.add_region(region)
        req = s.next_request()
        # The answer to `req` and an unmap in one message: the reclaim is not in `req`.
        s.on_response(pb.KeepAliveResponse(seq=req.seq, unmap=[unmap([2], reclaim=7)]))
        assert list(s.next_request().unmapped) == [7]


def test_a_failed_unmap_is_not_acknowledged(backing, pool_plan, caplog) -> None:
    s = session()
    with map_elastic_backing(backing, pool_plan, (0, 2)) as region:
        s.add_region(region)
        bad = [unmap([2, 99], reclaim=8),  # group 99 is not in the pool
               pb.Unmap(pool="p", groups=b"\x01\x00\x00", reclaim=9)]  # not whole uint32s
        with caplog.at_level(logging.ERROR, logger="kvpool.clients.session"):
            assert not s.on_response(pb.KeepAliveResponse(unmap=bad))
        assert s.next_request().unmapped == []
        assert "reclaim 8" in caplog.text and "reclaim 9" in caplog.text
        assert "not acknowledging" in caplog.text
        assert region.mapped_groups == {0, 2}  # the bad list was refused before any unmap
        # One good unmap beside a bad one is acknowledged alone.
        s.on_response(pb.KeepAliveResponse(unmap=[unmap([99], reclaim=10),
                                                  unmap([2], reclaim=11)]))
        assert list(s.next_request().unmapped) == [11]
        assert region.mapped_groups == {0}


def test_an_unmap_of_a_pool_with_no_region_here_is_acknowledged() -> None:
    s = session()
    assert s.on_response(pb.KeepAliveResponse(unmap=[unmap([1], reclaim=3, pool="z")]))
    assert list(s.next_request().unmapped) == [3]


def test_a_closed_region_unregisters_and_the_lease_ending_closes_the_rest(
        backing, pool_plan) -> None:
    s = session()
    a = map_elastic_backing(backing, pool_plan, (0, 2))
    b = map_elastic_backing(backing, pool_plan, (0, 3))
    for region in (a, b):
        s.add_region(region)
        region.on_close(s.remove_region)
    a.close()
    assert s.regions == [b]
    s.on_failure(NotFound("lease 5 expired"))  # lost: the daemon may take the groups back
    assert b.closed and s.regions == []

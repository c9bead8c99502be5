"""The client's shells of an elastic pool (blocking ``Lease``, asyncio ``AsyncLease``) over a real
gRPC server on a Unix socket that plays the daemon's side of the elastic wire from a script:
Attach answers a real sparse region on /dev/shm, Allocate the ids the test names, KeepAlive
answers every request and pushes the Unmap the test asks for. What is under test is the client:
its attach, its allocations mapping groups, its keep-alive shells carrying unmap and the ack.
(The end-to-end test against kvpoold itself comes with the daemon side.)"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvpool import AsyncKVPoolClient, KVPoolClient
from kvpool.contract import codec
from kvpool.contract.errors import FailedPrecondition
from kvpool.contract.plan import PoolPlan
from kvpool.contract.records import AttachInfo
from kvpool.contract.wire import LeaseKey
from kvpool.mapping.elastic_map import ElasticRegion
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.sharing.shm import ShmBackingFactory, SparseShmBacking
from tests.factories import elastic_llama_plan

WAIT_S = 30.0  # a bound on waiting for the client's threads, never a timed assert


class ScriptedDaemon(kvpool_pb2_grpc.KVPoolServicer):
    """The daemon's answers, from a script: one lease, one elastic pool ``p``."""

    def __init__(self, backing: SparseShmBacking, plan: PoolPlan) -> None:
        self.info = AttachInfo(plan.fingerprint(), plan, plan.to_json().decode(),
                               backing.handle(), attach_id=3, device="cpu",
                               elastic_groups=(0,))
        self.next_ids: list[int] = []
        self.detached: list[int] = []
        self.requests: queue.Queue[pb.KeepAliveRequest] = queue.Queue()
        self._out: queue.Queue[pb.KeepAliveResponse | None] | None = None
        self._ready = threading.Event()

    def OpenLease(self, request: Any, context: Any) -> pb.OpenLeaseResponse:
        return pb.OpenLeaseResponse(lease_id=1, ttl_seconds=request.ttl_seconds,
                                    lease_secret=b"k" * 16)

    def CloseLease(self, request: Any, context: Any) -> pb.CloseLeaseResponse:
        return pb.CloseLeaseResponse()

    def Attach(self, request: Any, context: Any) -> pb.AttachResponse:
        return codec.attach_to_pb(self.info)

    def Detach(self, request: Any, context: Any) -> pb.DetachResponse:
        self.detached.append(request.attach_id)
        return pb.DetachResponse()

    def Allocate(self, request: Any, context: Any) -> pb.AllocateResponse:
        ids = np.array(self.next_ids, dtype=np.int32)
        return pb.AllocateResponse(items=[pb.IdList(ids=codec.ids_to_bytes(ids))])

    def KeepAlive(self, request_iterator: Any, context: Any) -> Iterator[pb.KeepAliveResponse]:
        out: queue.Queue[pb.KeepAliveResponse | None] = queue.Queue()

        def read() -> None:
            try:
                for req in request_iterator:
                    self.requests.put(req)
                    out.put(pb.KeepAliveResponse(lease_id=req.lease_id, ttl_seconds=30.0,
                                                 seq=req.seq))
            except grpc.RpcError:
                pass  # the client cancelled the stream (its lease closed)
            finally:
                out.put(None)  # the handler's thread ends with the stream

        context.add_callback(lambda: out.put(None))
        threading.Thread(target=read, daemon=True).start()
        self._out = out
        self._ready.set()
        while (item := out.get()) is not None:
            yield item

    def push_unmap(self, groups: list[int], reclaim: int) -> None:
        """Send an Unmap on the lease's stream, unasked (as the daemon's reclaim does)."""
        assert self._ready.wait(WAIT_S), "the lease never opened its KeepAlive stream"
        assert self._out is not None
        self._out.put(pb.KeepAliveResponse(unmap=[pb.Unmap(
            pool="p", groups=codec.groups_to_bytes(groups), reclaim=reclaim,
            deadline_seconds=10.0)]))

    def request_where(self, ok: Callable[[pb.KeepAliveRequest], bool]) -> pb.KeepAliveRequest:
        """The first KeepAlive request from now on that ``ok`` accepts."""
        while True:
            req = self.requests.get(timeout=WAIT_S)
            if ok(req):
                return req


@pytest.fixture(scope="module")
def pool_plan() -> PoolPlan:
    return elastic_llama_plan()


@pytest.fixture
def scripted(shm_dir: Path, socket_dir: Path, pool_plan: PoolPlan
             ) -> Iterator[tuple[ScriptedDaemon, str]]:
    factory = ShmBackingFactory(shm_dir)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    try:
        backing = factory.create_elastic(pool_plan, "p")
        for g in (0, 2):
            backing.grant(g)
        daemon = ScriptedDaemon(backing, pool_plan)
        kvpool_pb2_grpc.add_KVPoolServicer_to_server(daemon, server)
        target = f"unix://{socket_dir / 'k.sock'}"
        server.add_insecure_port(target)
        server.start()
        yield daemon, target
    finally:
        server.stop(0)
        factory.close()


def test_blocking_lease_maps_allocations_and_unmaps_on_the_daemons_ask(scripted) -> None:
    daemon, target = scripted
    with KVPoolClient(target) as client, client.lease("engine", ttl_s=30.0) as lease:
        with client.attach("p", lease=lease) as region:
            assert isinstance(region, ElasticRegion) and region.mapped_groups == {0}
            assert lease._session.regions == [region] and client._elastic == {"p": (region,)}
            daemon.next_ids = [2 * 1024 + 5]
            ids = lease.allocate("p", "kv", 1)
            assert region.mapped_groups == {0, 2}  # before allocate returned
            region.page("k.0", int(ids[0]))[:] = 1
            daemon.next_ids = [2 * 1024 + 6]
            lease._cache_allocate("p", "kv", 1)  # a page cache's refill: mapped the same way
            daemon.push_unmap([2], reclaim=77)
            daemon.request_where(lambda r: 77 in r.unmapped)
            assert region.mapped_groups == {0}
        assert daemon.detached == [3]
        assert lease._session.regions == [] and client._elastic == {}


def test_a_fixed_pools_allocation_maps_nothing(scripted) -> None:
    daemon, target = scripted
    with KVPoolClient(target) as client, client.lease("engine", ttl_s=30.0) as lease, \
            client.attach("p", lease=lease) as region:
        daemon.next_ids = [2 * 1024 + 5]
        lease.allocate("other", "kv", 1)  # another pool's ids: not this region's groups
        lease.allocate_batch("p", [("req", 1)])  # not the grouped space
        assert region.mapped_groups == {0}


def test_attach_without_a_lease_is_refused_and_detached(scripted) -> None:
    daemon, target = scripted
    with KVPoolClient(target) as client:
        for lease in (None, LeaseKey(1, b"k" * 16)):
            with pytest.raises(FailedPrecondition, match="under a lease"), \
                    client.attach("p", lease=lease):
                pass
    assert daemon.detached == [3, 3]


async def test_asyncio_lease_maps_allocations_and_unmaps_on_the_daemons_ask(scripted) -> None:
    import asyncio

    daemon, target = scripted
    async with AsyncKVPoolClient(target) as client, \
            await client.lease("engine", ttl_s=30.0) as lease:
        async with client.attach("p", lease=lease) as region:
            daemon.next_ids = [2 * 1024 + 9]
            await lease.allocate("p", "kv", 1)
            assert region.mapped_groups == {0, 2}
            daemon.push_unmap([2], reclaim=78)
            await asyncio.to_thread(daemon.request_where, lambda r: 78 in r.unmapped)
            assert region.mapped_groups == {0}
        assert lease._session.regions == [] and client._elastic == {}
    assert daemon.detached == [3]

"""The KVPool servicer: edge in, call the daemon, codec out; errors by one decorator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from grpc import aio

from kvpool import codec
from kvpool.errors import InvalidArgument
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.server import edge
from kvpoold.server.daemon import GIVE_BACK_WAIT_S, Daemon
from kvpoold.server.status import RpcObserver, rpc_errors, rpc_stream_errors

if TYPE_CHECKING:  # message types for annotations only; edge.py and kvpool.codec build them
    from kvpool.v1 import kvpool_pb2 as pb

Ctx = aio.ServicerContext
MIN_WATCH_INTERVAL_S = 0.05
MAX_WATCH_INTERVAL_S = 3600.0
DEFAULT_WATCH_INTERVAL_S = 1.0
DEADLINE_MARGIN_S = 0.05


def give_back_wait(context: Ctx) -> float:
    """How long an Allocate may wait for give-backs: GIVE_BACK_WAIT_S, or less under the call's
    own deadline (leaving it DEADLINE_MARGIN_S to answer RESOURCE_EXHAUSTED in time)."""
    remaining = context.time_remaining()
    if remaining is None:
        return GIVE_BACK_WAIT_S
    return max(0.0, min(GIVE_BACK_WAIT_S, remaining - DEADLINE_MARGIN_S))


class KVPoolServicer(kvpool_pb2_grpc.KVPoolServicer):
    """gRPC face of a :class:`Daemon`.

    Args:
        daemon: the state every call works on.
        closing: set at shutdown; long-lived streams (KeepAlive, WatchStats) end when it is,
            so the server's grace period only waits for short calls.
        rpc_observer: told each call's time and failures by the error decorators
            (``kvpoold.metrics.RpcMetrics``); None records nothing.
    """

    def __init__(self, daemon: Daemon, closing: asyncio.Event | None = None,
                 rpc_observer: RpcObserver | None = None) -> None:
        self._daemon = daemon
        self._closing = closing or asyncio.Event()
        self.rpc_observer = rpc_observer

    @rpc_errors
    async def Configure(self, request: pb.ConfigureRequest, context: Ctx
                        ) -> pb.ConfigureResponse:
        result = await self._daemon.configure(edge.configure_args(request))
        return codec.configure_to_pb(result)

    @rpc_errors
    async def OpenLease(self, request: pb.OpenLeaseRequest, context: Ctx
                        ) -> pb.OpenLeaseResponse:
        lease = self._daemon.open_lease(request.name, request.ttl_seconds)
        return edge.open_lease_response(lease)

    @rpc_stream_errors
    async def KeepAlive(self, request_iterator: AsyncIterator[pb.KeepAliveRequest], context: Ctx
                        ) -> AsyncIterator[pb.KeepAliveResponse]:
        """Answer each request (renew, keep its page-cache report); in between, send the
        lease's give-backs as soon as an Allocate asks for them."""
        iterator = request_iterator.__aiter__()
        closing = asyncio.ensure_future(self._closing.wait())
        nxt: asyncio.Future | None = None
        lease = None
        try:
            while not self._closing.is_set():
                if nxt is None:
                    nxt = asyncio.ensure_future(anext(iterator, None))
                waits: list[asyncio.Future] = [nxt, closing]
                if lease is not None:
                    waits.append(asyncio.ensure_future(lease.wake.wait()))
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits[2:]:
                        w.cancel()
                if closing.done():
                    return
                if nxt.done():
                    request, nxt = nxt.result(), None
                    if request is None:
                        return
                    lease = self._daemon.renew_lease(request.lease_id,
                                                     edge.cache_reports(request))
                    yield edge.keep_alive_response(lease, self._daemon.now(), request.seq,
                                                   lease.take_give_back())
                elif lease is not None and lease.give_back:
                    if self._daemon.leases.find(lease.lease_id) is not lease:
                        lease.take_give_back()  # closed or expired meanwhile
                        continue
                    yield edge.keep_alive_response(lease, self._daemon.now(), 0,
                                                   lease.take_give_back())
                elif lease is not None:
                    lease.wake.clear()
        finally:
            closing.cancel()
            if nxt is not None:
                nxt.cancel()

    @rpc_errors
    async def CloseLease(self, request: pb.CloseLeaseRequest, context: Ctx
                         ) -> pb.CloseLeaseResponse:
        return codec.close_lease_to_pb(self._daemon.close_lease(request.lease_id))

    @rpc_errors
    async def Allocate(self, request: pb.AllocateRequest, context: Ctx) -> pb.AllocateResponse:
        items = edge.allocate_items(request)
        return edge.allocate_response(await self._daemon.allocate_waiting(
            request.pool, request.lease_id, items, give_back_wait(context)))

    @rpc_errors
    async def Free(self, request: pb.FreeRequest, context: Ctx) -> pb.FreeResponse:
        items = edge.free_items(request)
        return edge.free_response(self._daemon.free(request.pool, request.lease_id, items))

    @rpc_errors
    async def Stats(self, request: pb.StatsRequest, context: Ctx) -> pb.StatsResponse:
        return codec.stats_to_pb(self._daemon.stats(request.pool))

    @rpc_stream_errors
    async def WatchStats(self, request: pb.WatchStatsRequest, context: Ctx
                         ) -> AsyncIterator[pb.StatsResponse]:
        interval = request.interval_seconds or DEFAULT_WATCH_INTERVAL_S
        if not MIN_WATCH_INTERVAL_S <= interval <= MAX_WATCH_INTERVAL_S:
            raise InvalidArgument(
                f"interval_seconds {interval} is outside "
                f"{MIN_WATCH_INTERVAL_S}..{MAX_WATCH_INTERVAL_S:g}",
                field="interval_seconds",
            )
        while not self._closing.is_set():
            yield codec.stats_to_pb(self._daemon.stats(request.pool))
            try:
                await asyncio.wait_for(self._closing.wait(), interval)
            except TimeoutError:
                pass

    @rpc_errors
    async def Drop(self, request: pb.DropRequest, context: Ctx) -> pb.DropResponse:
        return codec.drop_to_pb(self._daemon.drop(request.pool, request.force))

    @rpc_errors
    async def Attach(self, request: pb.AttachRequest, context: Ctx) -> pb.AttachResponse:
        result = self._daemon.attach(request.pool, request.expected_fingerprint,
                                     request.lease_id)
        return codec.attach_to_pb(result)

    @rpc_errors
    async def Detach(self, request: pb.DetachRequest, context: Ctx) -> pb.DetachResponse:
        self._daemon.detach(request.attach_id)
        return edge.detach_response()

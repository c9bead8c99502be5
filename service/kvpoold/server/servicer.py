"""The KVPool servicer: who calls, edge in, call the daemon, codec out; errors by one decorator.

Every method first asks the :class:`~kvpoold.server.auth.Authority` who the caller is (its
token's identity and scope, or the local identity on a trusted Unix socket) and hands that
:class:`~kvpoold.server.auth.Caller` to the daemon, which checks pools and leases against it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

from grpc import aio

from kvpool.contract import codec
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.access import Authority, Caller, Transport
from kvpoold.server import edge
from kvpoold.server.daemon import Daemon
from kvpoold.server.give_back import ELASTIC_WAIT_S, GIVE_BACK_WAIT_S
from kvpoold.server.intake import accept
from kvpoold.server.stats_replies import StatsReplies
from kvpoold.server.status import RpcObserver, rpc_errors
from kvpoold.transfer.grants import check_token

# Message types for annotations only; edge.py and kvpool.contract.codec build them.
if TYPE_CHECKING:
    from kvpool.v1 import kvpool_pb2 as pb

Ctx = aio.ServicerContext
DEADLINE_MARGIN_S = 0.05


def give_back_wait(context: Ctx, most: float = GIVE_BACK_WAIT_S) -> float:
    """How long an Allocate may wait: ``most`` (GIVE_BACK_WAIT_S for give-backs,
    ELASTIC_WAIT_S for groups on their way), or less under the call's own deadline (leaving
    it DEADLINE_MARGIN_S to answer RESOURCE_EXHAUSTED in time)."""
    remaining = context.time_remaining()
    if remaining is None:
        return most
    return max(0.0, min(most, remaining - DEADLINE_MARGIN_S))


class KVPoolServicer(kvpool_pb2_grpc.KVPoolServicer):
    """gRPC face of a :class:`Daemon`.

    Args:
        daemon: the state every call works on.
        closing: set at shutdown; long-lived streams (KeepAlive, WatchStats) end when it is,
            so the server's grace period only waits for short calls.
        rpc_observer: told each call's time and failures by the error decorators
            (``kvpoold.metrics.RpcMetrics``); None records nothing.
        authority: the daemon's tokens (default: none; Unix callers are the local admin).
        transport: the listeners this servicer serves (one servicer per server).
        replies: the daemon's Stats replies, shared by its servicers so that callers of both
            share builds (``kvpoold.server.stats_replies``; default: this servicer's own).
    """

    def __init__(self, daemon: Daemon, closing: asyncio.Event | None = None,
                 rpc_observer: RpcObserver | None = None, *,
                 authority: Authority | None = None, transport: Transport = "unix",
                 replies: StatsReplies | None = None) -> None:
        self._daemon = daemon
        self._replies = replies or StatsReplies(daemon)
        self._closing = closing or asyncio.Event()
        self.rpc_observer = rpc_observer
        self._authority = authority or Authority()
        self._transport: Transport = transport

    def _caller(self, context: Ctx) -> Caller:
        """Who makes this call (Unauthenticated for a token the daemon does not know)."""
        return self._authority.identify(context.invocation_metadata(), self._transport)

    @rpc_errors
    async def Configure(self, request: pb.ConfigureRequest, context: Ctx
                        ) -> pb.ConfigureResponse:
        result = await self._daemon.configure(self._caller(context),
                                              edge.configure_args(request))
        return codec.configure_to_pb(result)

    @rpc_errors
    async def OpenLease(self, request: pb.OpenLeaseRequest, context: Ctx
                        ) -> pb.OpenLeaseResponse:
        lease = self._daemon.open_lease(self._caller(context), request.name,
                                        request.ttl_seconds)
        return edge.open_lease_response(lease)

    @rpc_errors
    async def KeepAlive(self, request_iterator: AsyncIterator[pb.KeepAliveRequest], context: Ctx
                        ) -> AsyncIterator[pb.KeepAliveResponse]:
        """Answer each request (renew, keep its page-cache report); in between, send the
        lease's give-backs as soon as an Allocate asks for them."""
        caller = self._caller(context)
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
                    request = accept(request, "KeepAlive")
                    lease = self._daemon.renew_lease(
                        caller, edge.lease_ref(request.lease_id, request.lease_secret),
                        edge.cache_reports(request), edge.unmapped(request))
                    yield edge.keep_alive_response(lease, self._daemon.leases.now(),
                                                   request.seq, lease.take_give_back(),
                                                   lease.take_unmap())
                elif lease is not None and lease.pending:
                    if self._daemon.leases.find(lease.lease_id) is not lease:
                        lease.take_give_back()  # closed or expired meanwhile
                        lease.take_unmap()
                        continue
                    yield edge.keep_alive_response(lease, self._daemon.leases.now(), 0,
                                                   lease.take_give_back(), lease.take_unmap())
                elif lease is not None:
                    lease.wake.clear()
        finally:
            closing.cancel()
            if nxt is not None:
                nxt.cancel()

    @rpc_errors
    async def CloseLease(self, request: pb.CloseLeaseRequest, context: Ctx
                         ) -> pb.CloseLeaseResponse:
        ref = edge.lease_ref(request.lease_id, request.lease_secret)
        return codec.close_lease_to_pb(self._daemon.close_lease(self._caller(context), ref))

    @rpc_errors
    async def Allocate(self, request: pb.AllocateRequest, context: Ctx) -> pb.AllocateResponse:
        caller = self._caller(context)
        ref = edge.lease_ref(request.lease_id, request.lease_secret)
        items = edge.allocate_items(request)
        got = await self._daemon.allocate_waiting(caller, request.pool, ref, items,
                                                  give_back_wait(context),
                                                  give_back_wait(context, ELASTIC_WAIT_S))
        return edge.allocate_response(got)

    @rpc_errors
    async def Free(self, request: pb.FreeRequest, context: Ctx) -> pb.FreeResponse:
        caller = self._caller(context)
        ref = edge.lease_ref(request.lease_id, request.lease_secret)
        items = edge.free_items(request)
        freed = self._daemon.free(caller, request.pool, ref, items)
        await self._daemon.pool(request.pool, caller).device_written()
        return edge.free_response(freed)

    @rpc_errors
    async def Seal(self, request: pb.SealRequest, context: Ctx) -> pb.SealResponse:
        ref, ids, keys, parents, tokens = edge.seal_args(request)
        sealed = await self._daemon.sealing.seal(self._caller(context), request.pool, ref,
                                                 request.layout, ids, keys, parents, tokens)
        return edge.seal_response(sealed)

    @rpc_errors
    async def Unseal(self, request: pb.UnsealRequest, context: Ctx) -> pb.UnsealResponse:
        ref, ids = edge.unseal_args(request)
        return edge.unseal_response(self._daemon.sealing.unseal(
            self._caller(context), request.pool, ref, ids))

    @rpc_errors
    async def Adopt(self, request: pb.AdoptRequest, context: Ctx) -> pb.AdoptResponse:
        ref = edge.lease_ref(request.lease_id, request.lease_secret)
        got = await self._daemon.sealing.adopt(self._caller(context), request.pool, ref,
                                               request.layout)
        return codec.adopted_to_pb(got)

    @rpc_errors
    async def Sealed(self, request: pb.SealedRequest, context: Ctx) -> pb.SealedResponse:
        return codec.sealed_to_pb(self._daemon.sealing.sealed(
            self._caller(context), request.pool, request.evict))

    @rpc_errors
    async def Stats(self, request: pb.StatsRequest, context: Ctx) -> pb.StatsResponse:
        return await self._replies.reply(self._caller(context), request.pool)

    @rpc_errors
    async def WatchStats(self, request: pb.WatchStatsRequest, context: Ctx
                         ) -> AsyncIterator[pb.StatsResponse]:
        """Stats every interval (at least the daemon's ``--watch-min-interval``), on a stream
        counted against the identity's ``--max-watch-streams-per-identity`` while it is open."""
        caller = self._caller(context)
        with self._daemon.watching(caller, request.pool, request.interval_seconds) as interval:
            while not self._closing.is_set():
                yield await self._replies.reply(caller, request.pool)
                try:
                    await asyncio.wait_for(self._closing.wait(), interval)
                except TimeoutError:
                    pass

    @rpc_errors
    async def Drop(self, request: pb.DropRequest, context: Ctx) -> pb.DropResponse:
        return codec.drop_to_pb(await self._daemon.drop(self._caller(context), request.pool,
                                                        request.force))

    @rpc_errors
    async def Attach(self, request: pb.AttachRequest, context: Ctx) -> pb.AttachResponse:
        result = self._daemon.attach(self._caller(context), request.pool,
                                     request.expected_fingerprint,
                                     edge.optional_lease_ref(request.lease_id,
                                                             request.lease_secret))
        return codec.attach_to_pb(result)

    @rpc_errors
    async def Detach(self, request: pb.DetachRequest, context: Ctx) -> pb.DetachResponse:
        self._daemon.detach(self._caller(context), request.attach_id)
        return edge.detach_response()

    # -- transfers between daemons (kvpoold.transfer, docs/pd-transfer.md) ---------------------

    @rpc_errors
    async def GrantReceive(self, request: pb.GrantReceiveRequest, context: Ctx
                           ) -> pb.GrantReceiveResponse:
        grant = self._daemon.grant_receive(
            self._caller(context), edge.lease_ref(request.lease_id, request.lease_secret),
            edge.grant_args(request))
        return edge.grant_receive_response(grant, self._daemon.now())

    @rpc_errors
    async def Send(self, request: pb.SendRequest, context: Ctx) -> pb.SendResponse:
        args = edge.send_args(request)
        remaining = context.time_remaining()
        if remaining is not None and args.wait_s > 0:  # answer before the deadline hits
            args = replace(args, wait_s=max(0.0, min(args.wait_s,
                                                     remaining - DEADLINE_MARGIN_S)))
        out = await self._daemon.send(
            self._caller(context), edge.lease_ref(request.lease_id, request.lease_secret), args)
        # Only Unix callers are on this host, where the post channel's socket is.
        return edge.send_response(out, self._daemon.now(), self._daemon.post_socket
                                  if self._transport == "unix" else "")

    @rpc_errors
    async def WaitTransfer(self, request: pb.WaitTransferRequest, context: Ctx
                           ) -> pb.TransferStatus:
        caller = self._caller(context)
        args = edge.wait_args(request)
        remaining = context.time_remaining()
        if remaining is not None and args.timeout_s > 0:  # answer PENDING before the deadline
            args = replace(args, timeout_s=max(0.0, min(args.timeout_s,
                                                         remaining - DEADLINE_MARGIN_S)))
        status = await self._daemon.transfers.wait(args, None if caller.admin
                                                   else caller.identity)
        return codec.transfer_status_to_pb(status)

    @rpc_errors
    async def PeerReceive(self, request: pb.PeerReceiveRequest, context: Ctx
                          ) -> pb.PeerReceiveResponse:
        # Peer daemons only, never a tenant; the grant's token is then the capability.
        self._caller(context).check_peer("PeerReceive")
        acceptance = self._daemon.transfers.peer_receive(edge.peer_receive_args(request))
        return edge.peer_receive_response(acceptance)

    @rpc_errors
    async def PeerDone(self, request: pb.PeerDoneRequest, context: Ctx) -> pb.PeerDoneResponse:
        self._caller(context).check_peer("PeerDone")
        self._daemon.transfers.peer_done(edge.peer_done_args(request))
        return edge.peer_done_response()

    @rpc_errors
    async def CancelGrant(self, request: pb.CancelGrantRequest, context: Ctx
                          ) -> pb.CancelGrantResponse:
        lease = self._daemon.lease(self._caller(context),
                                   edge.lease_ref(request.lease_id, request.lease_secret))
        status, freed, fenced = self._daemon.transfers.cancel_grant(
            lease.owner, lease.lease_id, check_token(request.token))
        return edge.cancel_grant_response(status, freed, fenced)

"""The token check at the gRPC edge: the interceptor that refuses a call before it is read.

It refuses a call whose token the daemon's :class:`~kvpoold.access.Authority` does not accept,
before its message is read. The health service stays open so probes need no secret. The model
(identities, scopes, tokens) is :mod:`kvpoold.access`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from kvpool.contract.errors import Unauthenticated
from kvpoold.access import Authority, Transport

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)



class TokenAuthInterceptor(aio.ServerInterceptor):
    """Refuse a call whose token :class:`Authority` does not accept, before its message is read.

    Args:
        authority: the daemon's tokens.
        transport: the listeners of the server this intercepts.
    """

    def __init__(self, authority: Authority, transport: Transport) -> None:
        self._authority = authority
        self._transport: Transport = transport

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        try:
            self._authority.identify(handler_call_details.invocation_metadata, self._transport)
        except Unauthenticated as exc:
            return _deny(handler, exc.message)
        return handler


def _deny(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with UNAUTHENTICATED."""

    async def deny(_request: Any, context: aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    make = (
        grpc.unary_unary_rpc_method_handler if handler.unary_unary else
        grpc.unary_stream_rpc_method_handler if handler.unary_stream else
        grpc.stream_unary_rpc_method_handler if handler.stream_unary else
        grpc.stream_stream_rpc_method_handler
    )
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)

"""Shared-secret auth for TCP listeners: ``authorization: Bearer <token>`` or UNAUTHENTICATED.

Unix-socket callers are trusted by the socket's file permissions, so the interceptor is only
installed on the TCP server. The health service stays open so probes need no secret.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
AUTH_METADATA_KEY = "authorization"


class TokenAuthInterceptor(aio.ServerInterceptor):
    """Refuse every call without the right bearer token (constant-time comparison).

    Args:
        token: the shared secret.
    """

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value if isinstance(value, bytes) else value.encode()
                if hmac.compare_digest(given, self._expected):
                    return handler
                return _deny(handler, "the bearer token is wrong")
        return _deny(handler, "missing metadata 'authorization: Bearer <token>' (TCP listeners "
                              "need the daemon's --token)")


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

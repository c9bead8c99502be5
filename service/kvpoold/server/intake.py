"""Request intake: every request message's size is checked against its method's bound before it
is parsed, and a message that does not parse is refused as INVALID_ARGUMENT.

A method's bound is ``kvpool.contract.limits.MAX_REQUEST_BYTES[method]``, or what its
:data:`Bound` says now: Free's follows the live pools (``free_bound``: a lease cannot hold more
ids than the largest pool has), so a 60 MB Free to a pool of 16,384 pages is refused by its
length alone, before a byte of it is parsed or an id checked.

gRPC parses a request with the method's ``request_deserializer`` before the servicer runs, on
the event loop; a failure there would answer UNKNOWN/INTERNAL and log a traceback per message.
:class:`IntakeInterceptor` wraps each method's deserializer so that it never raises: a message
over ``kvpool.contract.limits.MAX_REQUEST_BYTES[method]`` (``MAX_REQUEST_MESSAGE_BYTES`` for
methods not listed) or one that is not valid protobuf becomes a :class:`Refused` value carrying the
``InvalidArgument`` to answer. The error decorators (``kvpoold.server.status``) raise it for
unary methods; stream-request methods (KeepAlive) raise it with :func:`accept`. Either way the
refusal costs O(1) (size) or one parse, and its log line is rate-limited there.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.limits import (
    FREE_OVERHEAD_BYTES,
    ID_DTYPE,
    MAX_REQUEST_BYTES,
    MAX_REQUEST_MESSAGE_BYTES,
    free_request_bytes,
)
from kvpoold.server.logs import LogLimiter

log = logging.getLogger("kvpoold.rpc")

T = TypeVar("T")
SERVICE_PREFIX = "/kvpool.v1.KVPool/"
# One line per method and minute for refused messages: a client looping on a bad message
# must not fill the log.
_LOG_LIMIT = LogLimiter(burst=1, every_s=60.0)
# A method's bound as it stands: (bytes, why that many: said in the refusal).
Bound = Callable[[], tuple[int, str]]


def fixed_bound(method: str) -> Bound:
    """``MAX_REQUEST_BYTES[method]`` (``MAX_REQUEST_MESSAGE_BYTES`` for a method not listed)."""
    limit = MAX_REQUEST_BYTES.get(method, MAX_REQUEST_MESSAGE_BYTES)
    why = f"at most {limit:,} B for {method} (docs/api.md, \"Limits\")"
    return lambda: (limit, why)


def free_bound(most_ids: Callable[[], int]) -> Bound:
    """Free's bound: :func:`~kvpool.contract.limits.free_request_bytes` of the live pool with
    the most ids, read at each call (O(1)).

    Args:
        most_ids: ids of the largest live pool (``PoolRegistry.most_ids``), 0 with none.
    """

    def bound() -> tuple[int, str]:
        ids = most_ids()
        limit = free_request_bytes(ids)
        if ids == 0:
            return limit, (f"at most {limit:,} B for Free while no pool is live: there are no "
                           "ids to free")
        return limit, (f"at most {limit:,} B for Free: the largest live pool has {ids:,} ids "
                       f"({ID_DTYPE.itemsize} B each on the wire, plus {FREE_OVERHEAD_BYTES:,} "
                       "B for the lease and the items), and a Free names each id it returns "
                       "once")

    return bound


class Refused:
    """A request message refused before the servicer saw it (too large, or not parsable)."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def accept(request: T | Refused, method: str) -> T:
    """The request, or raise the error of a :class:`Refused` one (logged, rate-limited)."""
    if isinstance(request, Refused):
        ok, suppressed = _LOG_LIMIT.allow(method)
        if ok:
            log.warning("request refused at intake", extra={"fields": {
                "event": "request_refused", "method": method, "reason": request.error.message,
                "suppressed": suppressed}})
        raise request.error
    return request


def checked_deserializer(method: str, parse: Callable[[bytes], Any],
                         bound: Bound) -> Callable[[bytes], Any]:
    """``parse`` behind a size check; never raises: a refusal is returned as :class:`Refused`.

    Args:
        method: the RPC name, for messages.
        parse: the generated ``FromString``.
        bound: the most bytes one message may have now, and why.
    """

    def deserialize(data: bytes) -> Any:
        limit, why = bound()
        if len(data) > limit:
            return Refused(InvalidArgument(
                f"the {method} request is {len(data):,} B, {why}; send fewer items or split "
                "the call", field="request"))
        try:
            return parse(data)
        except (DecodeError, RuntimeError, ValueError) as exc:
            return Refused(InvalidArgument(
                f"the {method} request ({len(data):,} B) is not a valid protobuf message of "
                f"this method ({type(exc).__name__}); is the client built from the same "
                "kvpool.v1 protos?", field="request"))

    return deserialize


class IntakeInterceptor(aio.ServerInterceptor):
    """Puts :func:`checked_deserializer` in front of every method's request parser.

    The wrapped handler is built once per method and cached (O(1) per call after that).

    Args:
        bounds: methods whose bound changes with the daemon's state (Free: :func:`free_bound`);
            the others keep :func:`fixed_bound`.
    """

    def __init__(self, bounds: dict[str, Bound] | None = None) -> None:
        self._bounds = dict(bounds or {})
        self._handlers: dict[tuple[str, int], grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails],
                               Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if (handler is None or handler.request_deserializer is None
                or not handler_call_details.method.startswith(SERVICE_PREFIX)):
            return handler  # health and reflection keep their own parsers
        key = (handler_call_details.method, id(handler))
        wrapped = self._handlers.get(key)
        if wrapped is None:
            method = handler_call_details.method.rpartition("/")[2]
            bound = self._bounds.get(method) or fixed_bound(method)
            wrapped = handler._replace(  # type: ignore[attr-defined]
                request_deserializer=checked_deserializer(
                    method, handler.request_deserializer, bound))
            if len(self._handlers) < 1024:  # methods are few; never grow without bound
                self._handlers[key] = wrapped
        return wrapped

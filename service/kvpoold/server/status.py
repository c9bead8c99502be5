"""``kvpool.contract.errors`` classes as gRPC status codes, applied by one decorator.

Every servicer method, unary or streaming, is wrapped by :func:`rpc_errors`: its request passes
the intake check first (``kvpoold.server.intake.accept``: a message refused before parsing is
INVALID_ARGUMENT), then a :class:`KVPoolError` becomes its status with the message as details and
the field at fault in the trailing metadata ``kvpool-field``; anything else is ``INTERNAL`` with
the traceback logged. The mapping is derived from ``kvpool.contract.errors.ERRORS_BY_CODE`` (the
one table; the client maps codes back with ``kvpool.contract.errors.error_from_code``).

The same decorator reports each call to the servicer's ``rpc_observer`` (``RpcMetrics`` when
``--metrics-port`` is given, else None): the time of every unary call, and the status code of
every call that fails, so no method carries its own instrumentation.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar, cast

import grpc
from grpc import aio

from kvpool.contract.errors import ERRORS_BY_CODE, KVPoolError
from kvpool.contract.limits import FIELD_METADATA_KEY
from kvpoold.server.intake import accept
from kvpoold.server.logs import LogLimiter

log = logging.getLogger("kvpoold.rpc")

# Refusals of these methods are logged (one line each, event=<name>): they change or would have
# changed what the daemon holds, and an operator asks "why did my Configure fail".
REFUSAL_EVENTS = {"Configure": "configure_refused", "Drop": "drop_refused"}
# Lines a client can cause at will are rate-limited per key: unexpected errors per (method,
# type), refusals per (method, code).
_INTERNAL_LOG = LogLimiter(burst=3, every_s=60.0)
_REFUSAL_LOG = LogLimiter(burst=20, every_s=1.0)
# The longest status message sent, and the longest reason a refusal's log line quotes (see
# bounded()).
MAX_DETAILS_CHARS = 2048
MAX_LOGGED_CHARS = 512

# Derived from the one table in ``kvpool.contract.errors`` (each class's ``code`` names its status).
STATUS_BY_ERROR: dict[type[KVPoolError], grpc.StatusCode] = {
    cls: grpc.StatusCode[cls.code] for cls in ERRORS_BY_CODE.values()
}

S = TypeVar("S")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


class RpcObserver(Protocol):
    """What the decorators report to (``kvpoold.metrics.RpcMetrics``)."""

    def observe(self, method: str, seconds: float) -> None: ...

    def failed(self, method: str, code: str) -> None: ...


def _observer(servicer: object) -> RpcObserver | None:
    # An attribute, not an argument: the decorators wrap the class's functions once, while the
    # observer belongs to the servicer instance (one per daemon).
    return getattr(servicer, "rpc_observer", None)


def _code_name(exc: BaseException) -> str:
    return status_of(exc).name if isinstance(exc, KVPoolError) else "INTERNAL"


def status_of(exc: KVPoolError) -> grpc.StatusCode:
    """The status code of ``exc``: its class or nearest registered base, else ``INTERNAL``."""
    for cls in type(exc).__mro__:
        code = STATUS_BY_ERROR.get(cls)  # type: ignore[call-overload]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: aio.ServicerContext, exc: BaseException, method: str) -> None:
    """End the call with the status for ``exc`` (always raises ``grpc.aio.AbortError``).

    Args:
        context: the call's context.
        exc: a KVPoolError (mapped by the table) or anything else (INTERNAL, traceback logged).
        method: the RPC name, for the log.
    """
    code, details, field = failure(exc, method)
    metadata = ((FIELD_METADATA_KEY, field),) if field else ()
    await context.abort(code, details, metadata)


def failure(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str, str]:
    """What a failed call of ``method`` is answered with: the status code, the details and
    the field at fault ("" for none), each bounded. A KVPoolError by the table (its refusal
    logged for the methods of :data:`REFUSAL_EVENTS`); anything else INTERNAL, its traceback
    logged (rate-limited). The gRPC edge and the post channel answer through this alone."""
    if isinstance(exc, KVPoolError):
        log_refusal(method, exc)
        return status_of(exc), bounded(str(exc)), bounded(exc.field, 200) if exc.field else ""
    ok, suppressed = _INTERNAL_LOG.allow((method, type(exc).__name__))
    if ok:
        log.error("unexpected error in %s", method, exc_info=exc,
                  extra={"fields": {"event": "rpc_error", "suppressed": suppressed}})
    return (grpc.StatusCode.INTERNAL,
            bounded(f"{method}: internal error ({type(exc).__name__}: {exc})"), "")


def bounded(text: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """``text`` cut to about ``limit`` characters, in the middle (an ellipsis and the length in
    its place): status details travel in a trailer whose size gRPC limits (8 KiB by default),
    and a message quoting a client's input must not outgrow it, nor a log line quoting one.
    The end stays: it says where the input was bad (msgspec's ``- at `$.dtype```) and which
    knob to turn. Messages quote input through ``kvpool.contract.errors.echo`` already; this is the
    net under them (a msgspec error quotes the bad value whole)."""
    if len(text) <= limit:
        return text
    tail = limit // 4
    return f"{text[:limit - tail]}\u2026 ({len(text):,} chars) \u2026{text[-tail:]}"


def log_refusal(method: str, exc: KVPoolError) -> None:
    """One line for a refused call of a method in :data:`REFUSAL_EVENTS` (rate-limited)."""
    event = REFUSAL_EVENTS.get(method)
    if event is None:
        return
    code = status_of(exc).name
    ok, suppressed = _REFUSAL_LOG.allow((method, code))
    if ok:
        log.warning("%s refused", method, extra={"fields": {
            "event": event, "code": code, "field": exc.field,
            "reason": bounded(exc.message, MAX_LOGGED_CHARS), "suppressed": suppressed}})


def release_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames in ``exc``'s traceback (and its cause's and
    context's), then drop the tracebacks.

    An error raised in the daemon keeps every frame it passed through, and their locals (a
    pool entry, its backing) with them; anything that keeps the error (the AbortError gRPC
    raises has it as ``__context__``, and a cycle through a frame holding the error keeps both)
    would keep a dropped pool's memory mapped until a garbage collection. Called once the
    error has been logged and answered. Frames still running are left alone.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        todo += (e.__cause__, e.__context__)


UnaryMethod = Callable[[S, Req, aio.ServicerContext], Awaitable[Resp]]
StreamMethod = Callable[[S, Req, aio.ServicerContext], AsyncIterator[Resp]]
M = TypeVar("M", bound=Callable[..., object])


async def _fail(servicer: object, context: aio.ServicerContext, exc: Exception,
                method: str) -> None:
    """End a failed call: its code to the observer, the status to the client (always raises
    ``grpc.aio.AbortError``), the error's frames released."""
    observer = _observer(servicer)
    if observer is not None:
        observer.failed(method, _code_name(exc))
    try:
        await abort_with(context, exc, method)
    finally:
        release_frames(exc)


def rpc_errors(method: M) -> M:
    """Decorate a servicer method with the intake check and the error table: a coroutine
    (unary reply) or an async generator (streamed reply, WatchStats and KeepAlive), the same
    way.

    The request goes through :func:`kvpoold.server.intake.accept` first (a message refused at
    intake is answered with its INVALID_ARGUMENT; a stream of requests, KeepAlive, accepts each
    message itself); a failure is answered by :func:`abort_with` and its code reported to the
    servicer's ``rpc_observer``, which is also told the time of every unary call (a stream's
    lifetime is not a latency, so it is not timed).
    """
    name = method.__name__
    if inspect.isasyncgenfunction(method):
        stream = cast("StreamMethod[Any, Any, Any]", method)

        @functools.wraps(method)
        async def streamed(self: Any, request: Any,
                           context: aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in stream(self, accept(request, name), context):
                    yield item
            except aio.AbortError:
                raise
            except Exception as exc:
                await _fail(self, context, exc, name)

        return cast("M", streamed)
    unary = cast("UnaryMethod[Any, Any, Any]", method)

    @functools.wraps(method)
    async def answered(self: Any, request: Any, context: aio.ServicerContext) -> Any:
        observer = _observer(self)
        start = time.perf_counter()
        try:
            return await unary(self, accept(request, name), context)
        except aio.AbortError:
            raise
        except Exception as exc:
            await _fail(self, context, exc, name)
            raise  # unreachable: abort raises
        finally:
            if observer is not None:
                observer.observe(name, time.perf_counter() - start)

    return cast("M", answered)

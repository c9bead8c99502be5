"""One exception hierarchy for daemon and client; each class carries its gRPC status code name.

This module is the one table between errors and gRPC status codes: every status code but ``OK``
has a class here (:data:`ERRORS_BY_CODE`), including the ones only the channel produces
(``UNAVAILABLE`` when no daemon listens, ``DEADLINE_EXCEEDED``, ``CANCELLED``). The daemon raises
these where a condition is detected and ``kvpoold.server.status`` turns them into statuses with
``grpc.StatusCode[cls.code]``; the client turns statuses back into the same classes
(:func:`error_from_code`). This module imports nothing from grpc so the pure parts of the daemon
(sizing, allocators) can use it without the RPC stack.
"""

from __future__ import annotations

from typing import ClassVar


class KVPoolError(Exception):
    """Base of every kvpool error.

    Args:
        message: what was asked, what was available, and which knob to turn.
        field: the input field at fault (``"page_size"``, ``"items[1].count"``), if any.

    Attributes:
        code: the class's gRPC status code name (``"NOT_FOUND"``); a bare ``KVPoolError``
            raised by the daemon is ``INTERNAL``.
        code_name: the status code name this error was built from: ``code``, except for an
            :class:`Unknown` made from a name this module does not know, which keeps that name.
    """

    code: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.code_name = self.code

    def __str__(self) -> str:
        if self.field and not self.message.startswith(self.field):
            return f"{self.field}: {self.message}"
        return self.message


class Cancelled(KVPoolError):
    """The call was cancelled (by the caller, or by the daemon ending a stream)."""

    code = "CANCELLED"


class Unknown(KVPoolError):
    """A status the client cannot place (also any code name this module does not know)."""

    code = "UNKNOWN"


class InvalidArgument(KVPoolError):
    """Malformed input: a bad name, size, index, dtype or config."""

    code = "INVALID_ARGUMENT"


class DeadlineExceeded(KVPoolError):
    """The call's deadline (``timeout_s``) passed before the daemon answered."""

    code = "DEADLINE_EXCEEDED"


class NotFound(KVPoolError):
    """Unknown pool, lease or other named object."""

    code = "NOT_FOUND"


class AlreadyExists(KVPoolError):
    """A pool with this name exists with a different layout."""

    code = "ALREADY_EXISTS"


class PermissionDenied(KVPoolError):
    """The caller may not do this."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(KVPoolError):
    """Not enough free pages, slots or device budget right now."""

    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(KVPoolError):
    """The request is well formed but the state forbids it (free of an id not held, drop in use)."""

    code = "FAILED_PRECONDITION"


class Aborted(KVPoolError):
    """The operation was aborted (a conflict); it may succeed if retried."""

    code = "ABORTED"


class OutOfRange(KVPoolError):
    """A value past the end of a valid range."""

    code = "OUT_OF_RANGE"


class Unimplemented(KVPoolError):
    """The daemon does not implement this method (an older kvpoold)."""

    code = "UNIMPLEMENTED"


class Internal(KVPoolError):
    """A bug or an unexpected failure inside the daemon."""

    code = "INTERNAL"


class Unavailable(KVPoolError):
    """The daemon cannot be reached (not running, socket gone) or is shutting down; retryable."""

    code = "UNAVAILABLE"


class DataLoss(KVPoolError):
    """Unrecoverable loss or corruption of data."""

    code = "DATA_LOSS"


class Unauthenticated(KVPoolError):
    """Missing or wrong token."""

    code = "UNAUTHENTICATED"


# The one table: gRPC status code name -> class, one entry for every code but OK, in the order
# of the codes' numbers. ``kvpoold.server.status`` derives the daemon's mapping from it.
ERRORS_BY_CODE: dict[str, type[KVPoolError]] = {
    cls.code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}


def echo(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, at most ``limit`` characters of it: a longer text
    is cut with an ellipsis and its length (``'aaaa…' (10,000 chars)``), so a message never
    grows with the input it quotes (``kvpool.contract.limits.MAX_ECHO_CHARS`` is the daemon's
    limit).
    """
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(value) if isinstance(value, str) else text
    shown = repr(text[:limit])
    return f"{shown[:-1]}\u2026{shown[-1]} ({len(text):,} chars)"


def lease_closed(lease_id: int) -> FailedPrecondition:
    """What a closed lease answers (its page caches' allocs, a second close's callers)."""
    return FailedPrecondition(f"lease {lease_id} is closed", field="lease")


def error_from_code(code_name: str, message: str, field: str | None = None) -> KVPoolError:
    """Build the exception class registered for a gRPC status code name (``"NOT_FOUND"``).

    A name with no class (not a gRPC code) comes back as :class:`Unknown` with that name kept in
    ``code_name``.
    """
    cls = ERRORS_BY_CODE.get(code_name)
    if cls is None:
        err: KVPoolError = Unknown(message, field=field)
        err.code_name = code_name
        return err
    return cls(message, field=field)

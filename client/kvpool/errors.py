"""One exception hierarchy for daemon and client; each class carries its gRPC status code name.

The daemon raises these where a condition is detected; one table (``kvpoold.server.status``)
turns them into gRPC statuses, and the client turns statuses back into the same classes
(``error_from_code``). This module imports nothing from grpc so the pure parts of the daemon
(sizing, allocators) can use it without the RPC stack.
"""

from __future__ import annotations

from typing import ClassVar


class KVPoolError(Exception):
    """Base of every kvpool error.

    Args:
        message: what was asked, what was available, and which knob to turn.
        field: the input field at fault (``"page_size"``, ``"items[1].count"``), if any.
    """

    code: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        if self.field and not self.message.startswith(self.field):
            return f"{self.field}: {self.message}"
        return self.message


class InvalidArgument(KVPoolError):
    """Malformed input: a bad name, size, index, dtype or config."""

    code = "INVALID_ARGUMENT"


class NotFound(KVPoolError):
    """Unknown pool, lease or other named object."""

    code = "NOT_FOUND"


class AlreadyExists(KVPoolError):
    """A pool with this name exists with a different layout."""

    code = "ALREADY_EXISTS"


class FailedPrecondition(KVPoolError):
    """The request is well formed but the state forbids it (free of an id not held, drop in use)."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(KVPoolError):
    """Not enough free pages, slots or device budget right now."""

    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(KVPoolError):
    """The caller may not do this."""

    code = "PERMISSION_DENIED"


class Unauthenticated(KVPoolError):
    """Missing or wrong token."""

    code = "UNAUTHENTICATED"


class Internal(KVPoolError):
    """A bug or an unexpected failure inside the daemon."""

    code = "INTERNAL"


ERRORS_BY_CODE: dict[str, type[KVPoolError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        PermissionDenied,
        Unauthenticated,
        Internal,
    )
}


def error_from_code(code_name: str, message: str, field: str | None = None) -> KVPoolError:
    """Build the exception class registered for a gRPC status code name (``"NOT_FOUND"``).

    Codes with no class of their own (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``...) come back as
    ``KVPoolError`` with that code kept in ``code_name``.
    """
    cls = ERRORS_BY_CODE.get(code_name)
    if cls is None:
        err = KVPoolError(message, field=field)
        err.code_name = code_name  # type: ignore[attr-defined]
        return err
    return cls(message, field=field)

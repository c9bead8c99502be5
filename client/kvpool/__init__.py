"""kvpool: client library and CLI for the kvpoold KV-cache pool daemon."""

from kvpool.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KVPoolError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)

__version__ = "0.1.0"

__all__ = [
    "AlreadyExists",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "KVPoolError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "__version__",
]

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
    "AsyncKVPoolClient",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "KVPoolClient",
    "KVPoolError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "__version__",
]


def __getattr__(name: str) -> object:
    # The clients import grpc and numpy: load them on first use so `import kvpool.errors`
    # (used by the daemon's pure modules) stays light.
    if name == "KVPoolClient":
        from kvpool.client import KVPoolClient

        return KVPoolClient
    if name == "AsyncKVPoolClient":
        from kvpool.aio import AsyncKVPoolClient

        return AsyncKVPoolClient
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")

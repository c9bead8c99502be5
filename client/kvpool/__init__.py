"""kvpool: client library and CLI for the kvpoold KV-cache pool daemon."""

from kvpool.contract.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KVPoolError,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)

__version__ = "1.0.0"
# The wire contract this build speaks (protos/kvpool/v1, its version): ``--version`` prints it
# and ``kvpool_build_info`` carries it.
WIRE_CONTRACT = "kvpool.v1 1.0"

__all__ = [
    "WIRE_CONTRACT",
    "Aborted",
    "AlreadyExists",
    "AsyncKVPoolClient",
    "Cancelled",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "KVPoolClient",
    "KVPoolError",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "__version__",
]


def __getattr__(name: str) -> object:
    # The clients import grpc and numpy: load them on first use so `import kvpool.contract.errors`
    # (used by the daemon's pure modules) stays light.
    if name == "KVPoolClient":
        from kvpool.clients.client import KVPoolClient

        return KVPoolClient
    if name == "AsyncKVPoolClient":
        from kvpool.clients.aio import AsyncKVPoolClient

        return AsyncKVPoolClient
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")

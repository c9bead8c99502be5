"""The side channel that hands an elastic pool's memory to a client as a file descriptor.

gRPC cannot carry file descriptors, so the daemon listens on a second AF_UNIX socket beside its
gRPC socket (``<socket>.fd``). One connection, one exchange:

1. the client sends one :class:`FdAsk` (msgspec JSON, at most :data:`MAX_ASK_BYTES`): the pool,
   its lease id and the lease secret;
2. the daemon checks the peer's credentials (``SO_PEERCRED``: a uid it serves) and the lease
   (it exists, the secret matches, it may use the pool), then answers one :class:`FdAnswer`
   with the pool's memfd attached (``SCM_RIGHTS``), or the refusal (a gRPC status code name and
   a message; no descriptor).

No pickles, no unbounded reads; the descriptor is the pool's sparse file (CPU) or a CUDA VMM
export (GPU), and a client maps only the groups granted to its pool.
"""

from __future__ import annotations

import msgspec

MAX_ASK_BYTES = 4096
MAX_ANSWER_BYTES = 4096
FD_SOCKET_SUFFIX = ".fd"


class FdAsk(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a client asks for: the memory of ``pool``, for lease ``lease_id`` (proved by
    ``secret``, hex)."""

    pool: str
    lease_id: int
    secret: str


class FdAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """The daemon's answer: ``code`` ``OK`` with a descriptor attached of ``size`` bytes, or a
    refusal's code name and message."""

    code: str
    message: str = ""
    size: int = 0
    kind: str = ""  # "memfd" (CPU sparse file) or "cuda_vmm"


def fd_socket_path(grpc_socket: str) -> str:
    """The side socket beside a gRPC Unix socket path."""
    return grpc_socket + FD_SOCKET_SUFFIX

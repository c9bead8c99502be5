"""The side channel that hands an elastic pool's memory to a client as a file descriptor.

gRPC cannot carry file descriptors, so the daemon listens on a second AF_UNIX socket beside its
gRPC socket (``<socket>.fd``). One connection, one exchange:

1. the client sends one :class:`FdAsk` (msgspec JSON, at most :data:`MAX_ASK_BYTES`): the pool,
   its lease id and the lease secret, and for a pool made of several allocations (CUDA VMM)
   which of them: ``groups`` and/or ``fixed``;
2. the daemon checks the peer's credentials (``SO_PEERCRED``: a uid it serves) and the lease
   (it exists, the secret matches, it may use the pool), then answers one :class:`FdAnswer`
   with the descriptors attached (``SCM_RIGHTS``, one message, at most
   :data:`MAX_FDS_PER_ANSWER`), or the refusal (a gRPC status code name and a message; no
   descriptor).

An ask without ``groups`` and ``fixed`` gets one descriptor: the pool's sparse file (CPU).
An ask naming parts gets one descriptor per allocation, in this order: the fixed part first
(when ``fixed``), then each group in the order asked, each group's views in the plan's
``elastic.views`` order; ``FdAnswer.ranges`` gives each descriptor's ``(offset, length)`` in
the region, in the same order. A client whose groups need more descriptors than one answer
carries asks again (:func:`groups_per_ask`).

No pickles, no unbounded reads; the descriptors are the pool's sparse file (CPU) or CUDA VMM
exports (GPU), and a client maps only the groups granted to its pool.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_ASK_BYTES = 4096
# Room for MAX_FDS_PER_ANSWER ranges of two 12-digit numbers each.
MAX_ANSWER_BYTES = 16384
FD_SOCKET_SUFFIX = ".fd"
# Descriptors in one answer: Linux's SCM_MAX_FD (a larger SCM_RIGHTS message is refused).
MAX_FDS_PER_ANSWER = 253
# Groups one ask may name (the ask stays far below MAX_ASK_BYTES).
MAX_GROUPS_PER_ASK = 253

GroupIndex = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class FdAsk(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a client asks for: the memory of ``pool``, for lease ``lease_id`` (proved by
    ``secret``, hex)."""

    pool: str
    lease_id: int
    secret: str
    # The allocations asked for (CUDA VMM); neither: the pool's one file.
    groups: Annotated[tuple[GroupIndex, ...], msgspec.Meta(max_length=MAX_GROUPS_PER_ASK)] = ()
    fixed: bool = False
    # No descriptor: only record that the asking process maps the pool under the lease (the
    # fence of sealed pages: the daemon learns its pid from the kernel and watches it).
    register: bool = False

    @property
    def parts(self) -> bool:
        """Whether the ask names parts of the pool (groups or the fixed part)."""
        return bool(self.groups) or self.fixed


class FdAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """The daemon's answer: ``code`` ``OK`` with descriptors attached (the region is ``size``
    bytes), or a refusal's code name and message.

    ``ranges``: for an ask of parts, each attached descriptor's ``(offset, length)`` in the
    region, in the order of the descriptors (see the module doc); empty for the one file.
    """

    code: str
    message: str = ""
    size: int = 0
    kind: str = ""  # "memfd" (CPU sparse file) or "cuda_vmm"
    ranges: tuple[tuple[int, int], ...] = ()


def groups_per_ask(views: int, fixed: bool = False) -> int:
    """How many groups of ``views`` allocations each one ask may name so that the answer
    carries at most :data:`MAX_FDS_PER_ANSWER` descriptors (``fixed``: the fixed part too).

    Raises:
        ValueError: ``views`` is not positive, or a single group does not fit.
    """
    if views <= 0:
        raise ValueError(f"a group has at least one view, got {views}")
    room = MAX_FDS_PER_ANSWER - (1 if fixed else 0)
    if views > room:
        raise ValueError(f"a group of {views} allocations needs more descriptors than one "
                         f"answer carries ({MAX_FDS_PER_ANSWER})")
    return min(MAX_GROUPS_PER_ASK, room // views)


def fd_socket_path(grpc_socket: str) -> str:
    """The side socket beside a gRPC Unix socket path."""
    return grpc_socket + FD_SOCKET_SUFFIX

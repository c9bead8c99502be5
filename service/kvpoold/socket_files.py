"""Unix socket files that nobody but the daemon's user can open until they have their final
group and mode.

A socket is bound under umask ``0177`` (the file is created ``0600``), then given the
``--socket-group`` and only then the mode ``0660``: creating it ``0660`` straight away would
open it to the daemon's own primary group until the chown. The gRPC listeners
(``kvpoold.server.listeners``) and the descriptor socket (``kvpoold.elastic.fd_server``) both
go through here, so ``--socket-group`` applies to every socket the daemon creates.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

# The umask around a bind: the socket file is created rw for its owner only.
OWNER_ONLY_UMASK = 0o177


@contextlib.contextmanager
def owner_only() -> Iterator[None]:
    """Bind sockets inside this block: their files are created ``0600``.

    The umask is the process's: binds happen on the event loop at start-up, before the threads
    that create files run.
    """
    old = os.umask(OWNER_ONLY_UMASK)
    try:
        yield
    finally:
        os.umask(old)


def socket_mode(gid: int | None) -> int:
    """``0660`` with a socket group, else ``0600``.

    Args:
        gid: the ``--socket-group``, or None.

    Returns:
        The socket file's mode.
    """
    return 0o660 if gid is not None else 0o600


def finish_socket(path: Path, gid: int | None) -> None:
    """Give a socket bound under :func:`owner_only` its group, then its final mode.

    Args:
        path: the socket file.
        gid: the ``--socket-group``, or None (the file stays ``0600``).
    """
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, socket_mode(gid))

"""Where the daemon listens and how: addresses, socket files and their modes, TLS, the TCP token.

A Unix socket is guarded by its file mode: ``0600`` (the daemon's user), or ``0660`` owned by
``--socket-group``, bound owner-only and given its group before its mode
(``kvpoold.socket_files``); its directory is created ``0700``/``0750`` and a stale socket left
by a dead daemon is removed, a live one refused. A TCP listener is guarded by the token
(:class:`~kvpoold.server.auth.TokenAuthInterceptor`) and optionally TLS; without a token it is
served on loopback only, unless ``--allow-insecure-tcp``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from kvpool.contract.errors import FailedPrecondition
from kvpoold.access import Authority, Transport
from kvpoold.listen import Listener, group_id, read_tls
from kvpoold.server.auth import TokenAuthInterceptor
from kvpoold.socket_files import finish_socket, owner_only

if TYPE_CHECKING:
    from grpc import aio

log = logging.getLogger("kvpoold.server")

# The parsed addresses are kvpoold.listen's; run.py imports these three from here.
__all__ = ["Listener", "auth_interceptors", "bind_tcp", "bind_unix", "group_id", "read_tls",
           "remove_sockets", "secure_sockets"]

def bind_unix(server: aio.Server, listeners: Sequence[Listener], gid: int | None) -> list[Path]:
    """Bind ``listeners`` (Unix sockets) on ``server``: each file is created ``0600`` and then
    given the group and ``0660`` (``kvpoold.socket_files``), never open to others meanwhile.

    Args:
        server: the (not yet started) server for the Unix sockets.
        listeners: Unix-socket listeners.
        gid: the ``--socket-group``, or None for owner-only sockets.

    Returns:
        The socket paths bound, for :func:`remove_sockets`; on an error those bound so far
        are removed before it is raised.

    Raises:
        FailedPrecondition: another daemon serves on a path, a path is not a socket, or a
            bind fails.
    """
    for x in listeners:
        prepare_socket_path(Path(x.address), gid)
    bound: list[Path] = []
    try:
        for x in listeners:
            with owner_only():
                _bind(server.add_insecure_port, x)
            bound.append(Path(x.address))
            finish_socket(Path(x.address), gid)
    except BaseException:
        remove_sockets(bound)
        raise
    return bound


def bind_tcp(server: aio.Server, listeners: Sequence[Listener],
             tls: tuple[bytes, bytes] | None) -> list[str]:
    """Bind ``listeners`` (TCP) on ``server``, over TLS when ``tls`` is given.

    Args:
        server: the (not yet started) server for TCP, built with :func:`auth_interceptors`.
        listeners: TCP listeners (port 0 picks a free port).
        tls: ``(private_key_pem, certificate_chain_pem)``, or None for plain TCP.

    Returns:
        The bound ``host:port`` addresses (real ports for port 0).

    Raises:
        FailedPrecondition: an address in use or not permitted.
    """
    add_port: Callable[[str], int] = server.add_insecure_port
    if tls is not None:
        add_port = functools.partial(server.add_secure_port,
                                     server_credentials=grpc.ssl_server_credentials([tls]))
    return [f"{x.address.rpartition(':')[0]}:{_bind(add_port, x)}" for x in listeners]


def auth_interceptors(authority: Authority, transport: Transport = "tcp"
                     ) -> tuple[aio.ServerInterceptor, ...]:
    """The interceptors of a server: the token check where a call can be refused for its token,
    else none (a TCP server without tokens is logged as insecure).

    Args:
        authority: the daemon's tokens.
        transport: the server's listeners.

    Returns:
        The interceptors to build the server with.
    """
    if authority.needs_check(transport):
        return (TokenAuthInterceptor(authority, transport),)
    if transport == "tcp":
        log.warning("tcp listeners without --token: anyone who can reach them may call",
                    extra={"fields": {"event": "insecure_tcp"}})
    return ()


def secure_sockets(paths: Sequence[Path], gid: int | None) -> None:
    """Set the bound socket files' group and mode (``0600``, or ``0660`` with ``gid``) again
    once the server has started (:func:`bind_unix` did already).

    Args:
        paths: the socket files.
        gid: the ``--socket-group``, or None.
    """
    for path in paths:
        finish_socket(path, gid)


def remove_sockets(paths: Sequence[Path]) -> None:
    """Remove the socket files; ones already gone are fine.

    Args:
        paths: the socket files.
    """
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def prepare_socket_path(path: Path, gid: int | None) -> None:
    """Create the socket's directory (0700, or 0750 for a group) and clear a stale socket.

    Args:
        path: the socket file to be.
        gid: the ``--socket-group``, or None.

    Raises:
        FailedPrecondition: another daemon answers on the socket, or the path is not a socket.
    """
    parent = path.parent
    if not parent.exists():
        try:
            parent.mkdir(parents=True, mode=0o750 if gid is not None else 0o700)
            os.chmod(parent, 0o750 if gid is not None else 0o700)  # mkdir obeys the umask
            if gid is not None:
                os.chown(parent, -1, gid)
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot create the socket directory {parent} for --listen unix://{path}: "
                f"{exc.strerror or exc}; create it first (as root: install -d -o $USER "
                f"-m 0700 {parent}), or listen under a directory you own (the default is "
                "$XDG_RUNTIME_DIR/kvpool or /tmp/kvpool-$UID)", field="listen") from None
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FailedPrecondition(f"{path} exists and is not a socket; remove it or choose "
                                 "another --listen path", field="listen")
    if _socket_alive(path):
        raise FailedPrecondition(f"another daemon is serving on {path}; stop it or choose "
                                 "another --listen path", field="listen")
    path.unlink()  # stale: left by a daemon that died


def _socket_alive(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _bind(add_port: Callable[[str], int], listener: Listener) -> int:
    try:
        return add_port(listener.grpc_address)
    except RuntimeError as exc:
        raise FailedPrecondition(
            f"cannot listen on {listener.grpc_address}: {exc} (in use, or not permitted)",
            field="listen",
        ) from exc

"""The ``--listen`` addresses, parsed, and the checks the settings make on where to listen.

Loopback or not, TCP off loopback refused without a token, the socket group and the TLS files
read. Nothing here binds a socket (:mod:`kvpoold.server.listeners` does).
"""

from __future__ import annotations

import grp
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpool.contract.errors import InvalidArgument
from kvpoold.access import Transport

LISTEN_FORMS = "unix:///abs/path.sock or tcp://host:port"


@dataclass(frozen=True)
class Listener:
    """One address to serve on: a Unix socket path or a TCP ``host:port``."""

    transport: Transport
    address: str  # the socket path, or host:port

    @property
    def grpc_address(self) -> str:
        """The address as gRPC takes it: ``unix:///abs/path.sock`` or ``host:port``."""
        return f"unix://{self.address}" if self.transport == "unix" else self.address


def parse_listen(text: str) -> Listener:
    """``unix:///abs/path.sock`` or ``tcp://host:port`` (``tcp://[::1]:50051`` for IPv6).

    Args:
        text: one ``--listen`` value.

    Returns:
        The listener.

    Raises:
        InvalidArgument: anything else, naming the accepted forms.
    """
    if text.startswith("unix://"):
        path = text[len("unix://"):]
        if not path.startswith("/") or path.endswith("/"):
            raise InvalidArgument(
                f"listen {text!r}: give an absolute socket path ({LISTEN_FORMS})", field="listen"
            )
        return Listener("unix", path)
    if text.startswith("tcp://"):
        address = text[len("tcp://"):]
        host, sep, port = address.rpartition(":")
        if sep and host and port.isdigit() and int(port) <= 65535:
            return Listener("tcp", address)
    raise InvalidArgument(f"cannot read listen address {text!r}; give {LISTEN_FORMS}",
                          field="listen")


def is_loopback(listener: Listener) -> bool:
    """A Unix socket, or TCP on localhost / a loopback address."""
    if listener.transport != "tcp":
        return True
    host = listener.address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_tcp_is_local(listeners: Sequence[Listener]) -> None:
    """Refuse TCP off loopback without a token: whoever reaches it could allocate and map pools.

    Args:
        listeners: every listener; Unix sockets pass.

    Raises:
        InvalidArgument: a non-loopback TCP listener, naming the ways out.
    """
    for x in listeners:
        if is_loopback(x):
            continue
        raise InvalidArgument(
            f"refusing to serve tcp://{x.address} without a token: anyone who can reach it "
            "could allocate pages and map pools; give --token-file (or --token), listen on "
            "127.0.0.1, or pass --allow-insecure-tcp if the network is trusted",
            field="listen",
        )


def group_id(group: str) -> int:
    """The id of a group given by name or number.

    Args:
        group: a group name or a numeric gid.

    Returns:
        The gid.

    Raises:
        InvalidArgument: no such group on this machine.
    """
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidArgument(f"unknown group {group!r} for --socket-group",
                              field="socket_group") from None


def read_tls(cert: str | Path | None, key: str | Path | None) -> tuple[bytes, bytes] | None:
    """The TLS files of the TCP listeners, read.

    Args:
        cert: the certificate chain (PEM), or None.
        key: its private key (PEM), or None.

    Returns:
        ``(private_key_pem, certificate_chain_pem)``, or None without TLS (either not given).

    Raises:
        InvalidArgument: a file cannot be read (names it and its flag).
    """
    if not (cert and key):
        return None
    pems = []
    for field, path in (("tls_key", Path(key)), ("tls_cert", Path(cert))):
        try:
            pems.append(path.read_bytes())
        except OSError as exc:
            flag = "--" + field.replace("_", "-")
            raise InvalidArgument(f"cannot read {flag} {path}: {exc.strerror or exc}",
                                  field=field) from exc
    return pems[0], pems[1]

"""The client's end of the descriptor side channel (see :mod:`kvpool.contract.fd_channel`)."""

from __future__ import annotations

import os
import socket

import msgspec

from kvpool.contract.errors import KVPoolError, Unavailable, error_from_code
from kvpool.contract.fd_channel import MAX_ANSWER_BYTES, FdAnswer, FdAsk


def fetch_fd(path: str, ask: FdAsk, timeout_s: float = 10.0) -> tuple[int, FdAnswer]:
    """Ask the daemon on ``path`` for a pool's descriptor; returns it (the caller owns and
    closes it) and the answer.

    Raises:
        Unavailable: nobody listens on ``path``.
        KVPoolError: the daemon's refusal, as its status code's class.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        try:
            conn.connect(path)
        except OSError as exc:
            raise Unavailable(f"no kvpoold descriptor socket at {path}: "
                              f"{exc.strerror or exc}", field="target") from None
        conn.sendall(msgspec.json.encode(ask))
        conn.shutdown(socket.SHUT_WR)
        data, fds, _flags, _addr = socket.recv_fds(conn, MAX_ANSWER_BYTES, 1)
    try:
        answer = msgspec.json.decode(data, type=FdAnswer)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        for fd in fds:
            os.close(fd)
        raise Unavailable(f"kvpoold answered garbage on {path}: {exc}") from None
    if answer.code != "OK" or not fds:
        for fd in fds:
            os.close(fd)
        err: KVPoolError = error_from_code(answer.code if answer.code != "OK" else "INTERNAL",
                                           answer.message or "no descriptor attached", "")
        raise err
    return fds[0], answer

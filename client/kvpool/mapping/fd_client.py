"""The client's end of the descriptor side channel (see :mod:`kvpool.contract.fd_channel`)."""

from __future__ import annotations

import os
import socket

import msgspec

from kvpool.contract.errors import KVPoolError, Unavailable, error_from_code
from kvpool.contract.fd_channel import MAX_ANSWER_BYTES, MAX_FDS_PER_ANSWER, FdAnswer, FdAsk


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def fetch_fds(path: str, ask: FdAsk, timeout_s: float = 10.0) -> tuple[list[int], FdAnswer]:
    """Ask the daemon on ``path`` for a pool's descriptors; returns them (the caller owns and
    closes them) and the answer, whose ``ranges`` (for an ask of parts) say where each goes.

    Raises:
        Unavailable: nobody listens on ``path``, it closed without an answer, the answer is
            garbage, or it carries another number of descriptors than ranges.
        KVPoolError: the daemon's refusal, as its status code's class.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        try:
            conn.connect(path)
        except OSError as exc:
            raise Unavailable(f"no kvpoold descriptor socket at {path}: "
                              f"{exc.strerror or exc}", field="target") from None
        try:
            conn.sendall(msgspec.json.encode(ask))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # a daemon over its connection caps answers before reading: read its answer
        try:
            data, fds, flags, _addr = socket.recv_fds(conn, MAX_ANSWER_BYTES,
                                                      MAX_FDS_PER_ANSWER)
        except OSError as exc:
            raise Unavailable(f"kvpoold on {path} closed the descriptor socket without an "
                              f"answer: {exc.strerror or exc}", field="target") from None
    try:
        answer = msgspec.json.decode(data, type=FdAnswer)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        _close_all(fds)
        raise Unavailable(f"kvpoold answered garbage on {path}: {exc}") from None
    if answer.code != "OK" or not fds:
        _close_all(fds)
        err: KVPoolError = error_from_code(answer.code if answer.code != "OK" else "INTERNAL",
                                           answer.message or "no descriptor attached", "")
        raise err
    if flags & socket.MSG_CTRUNC or (answer.ranges and len(answer.ranges) != len(fds)):
        _close_all(fds)
        raise Unavailable(f"kvpoold on {path} sent {len(fds)} descriptors for "
                          f"{len(answer.ranges)} ranges (truncated: "
                          f"{bool(flags & socket.MSG_CTRUNC)})")
    return fds, answer


def fetch_fd(path: str, ask: FdAsk, timeout_s: float = 10.0) -> tuple[int, FdAnswer]:
    """Ask the daemon on ``path`` for a pool's one descriptor (its sparse file); returns it
    (the caller owns and closes it) and the answer.

    Raises:
        As :func:`fetch_fds`; Unavailable when more than one descriptor came.
    """
    fds, answer = fetch_fds(path, ask, timeout_s)
    if len(fds) != 1:
        _close_all(fds)
        raise Unavailable(f"kvpoold on {path} sent {len(fds)} descriptors for an ask of one; "
                          "use fetch_fds")
    return fds[0], answer


def register(path: str, ask: FdAsk, timeout_s: float = 10.0) -> None:
    """Tell the daemon on ``path`` that this process maps ``ask.pool`` under ``ask``'s lease
    (``register`` is set here): the kernel gives it this process's pid, which the fence of
    sealed pages watches. No descriptor comes back.

    Raises:
        Unavailable: nobody listens on ``path`` or it answered garbage.
        KVPoolError: the daemon's refusal, as its status code's class.
    """
    ask = msgspec.structs.replace(ask, register=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        try:
            conn.connect(path)
            conn.sendall(msgspec.json.encode(ask))
            conn.shutdown(socket.SHUT_WR)
            data, fds, _flags, _addr = socket.recv_fds(conn, MAX_ANSWER_BYTES,
                                                       MAX_FDS_PER_ANSWER)
        except OSError as exc:
            raise Unavailable(f"kvpoold's descriptor socket {path}: {exc.strerror or exc}",
                              field="target") from None
    _close_all(fds)
    try:
        answer = msgspec.json.decode(data, type=FdAnswer)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Unavailable(f"kvpoold answered garbage on {path}: {exc}") from None
    if answer.code != "OK":
        raise error_from_code(answer.code, answer.message, "")


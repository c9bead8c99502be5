"""The daemon's end of the descriptor side channel (see :mod:`kvpool.contract.fd_channel`).

Runs on the daemon's event loop: accept, read one bounded ask (with a deadline, so a client
that connects and says nothing holds nothing), check the peer's uid and the lease through the
daemon's ``authorize`` callback, answer with the descriptors attached. The socket is 0600
(0660 with a group), like the gRPC socket it sits beside, and removed on close.

``authorize`` returns either ``(fd, size, kind)`` (one descriptor the daemon keeps open: a
pool's sparse file) or an :class:`FdGrant` (several descriptors, each with its range; when
``owned``, fresh exports the server closes once sent, whatever happens).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvpool.contract.errors import Internal, InvalidArgument, KVPoolError, PermissionDenied
from kvpool.contract.fd_channel import MAX_ASK_BYTES, MAX_FDS_PER_ANSWER, FdAnswer, FdAsk
from kvpoold.sharing.base import FdGrant

log = logging.getLogger("kvpoold.elastic")


# (ask, peer uid) -> (descriptor, size, kind) or FdGrant; raises a KVPoolError to refuse.
Authorize = Callable[[FdAsk, int], "tuple[int, int, str] | FdGrant"]
ASK_TIMEOUT_S = 5.0
DRAIN_BYTES = 1 << 16


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class FdServer:
    """Hands pool descriptors to authorized clients on ``path``.

    Args:
        path: the side socket (``<grpc socket>.fd``).
        authorize: the daemon's check of an ask; returns what to send.
        uids: the uids served (default: the daemon's own and root).
        mode: the socket file's mode.
    """

    def __init__(self, path: Path, authorize: Authorize, uids: frozenset[int] | None = None,
                 mode: int = 0o600) -> None:
        self.path = path
        self._authorize = authorize
        self._uids = uids if uids is not None else frozenset({os.getuid(), 0})
        self._mode = mode
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self.answered = 0
        self.refused = 0

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock.bind(str(self.path))
        os.chmod(self.path, self._mode)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            task = loop.create_task(self._serve(conn))
            self._serving.add(task)  # a reference until it ends (the loop keeps only weak ones)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            conn.setblocking(False)
            try:
                # read first, whoever asks: a refusal then reaches the client (closing on
                # unread bytes would reset the connection instead)
                raw = await asyncio.wait_for(self._read_ask(loop, conn), ASK_TIMEOUT_S)
                uid = peer_uid(conn)
                if uid not in self._uids:
                    raise PermissionDenied(f"uid {uid} may not map pools of this daemon",
                                           field="uid")
                try:
                    ask = msgspec.json.decode(raw, type=FdAsk)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise InvalidArgument(f"undecodable ask: {exc}", field="ask") from None
                grant = self._authorize(ask, uid)
                if not isinstance(grant, FdGrant):
                    fd, size, kind = grant
                    grant = FdGrant((fd,), (), size, kind, owned=False)
                try:
                    self._check(grant)
                except BaseException:
                    grant.close()
                    raise
            except TimeoutError:
                self.refused += 1
                return  # said nothing in time: nothing to answer
            except KVPoolError as exc:
                self.refused += 1
                self._send(conn, FdAnswer(code=exc.code, message=str(exc)), None)
                return
            except OSError:
                self.refused += 1
                return
            try:
                self._send(conn, FdAnswer(code="OK", size=grant.size, kind=grant.kind,
                                          ranges=grant.ranges), grant.fds)
            finally:
                grant.close()
            self.answered += 1

    @staticmethod
    def _check(grant: FdGrant) -> None:
        if not grant.fds or len(grant.fds) > MAX_FDS_PER_ANSWER:
            raise Internal(f"an answer carries 1..{MAX_FDS_PER_ANSWER} descriptors, the pool "
                           f"gave {len(grant.fds)}; ask for fewer groups at once "
                           "(kvpool.contract.fd_channel.groups_per_ask)")
        if grant.ranges and len(grant.ranges) != len(grant.fds):
            raise Internal(f"{len(grant.fds)} descriptors but {len(grant.ranges)} ranges")

    @staticmethod
    async def _read_ask(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
        """One ask: bytes until the client shuts its side down, at most MAX_ASK_BYTES. A longer
        one is read on (and dropped) up to DRAIN_BYTES, so the refusal reaches the client
        instead of a connection reset."""
        data = b""
        seen = 0
        while seen <= DRAIN_BYTES:
            chunk = await loop.sock_recv(conn, 65536)
            if not chunk:
                break
            seen += len(chunk)
            if len(data) <= MAX_ASK_BYTES:
                data += chunk
        if seen > MAX_ASK_BYTES:
            raise InvalidArgument(f"the ask is {seen:,} bytes or more, over {MAX_ASK_BYTES}",
                                  field="ask")
        return data

    @staticmethod
    def _send(conn: socket.socket, answer: FdAnswer, fds: tuple[int, ...] | None) -> None:
        payload = msgspec.json.encode(answer)
        with contextlib.suppress(OSError):  # the client went away: nothing to do
            if not fds:
                conn.send(payload)
            else:
                # the socket is non-blocking: a payload this small goes out in one message
                socket.send_fds(conn, [payload], list(fds))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

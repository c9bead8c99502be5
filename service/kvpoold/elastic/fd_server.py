"""The daemon's end of the descriptor side channel (see :mod:`kvpool.contract.fd_channel`).

Runs on the daemon's event loop: accept, read one bounded ask (with a deadline, so a client
that connects and says nothing holds nothing), check the peer's uid and the lease through the
daemon's ``authorize`` callback, answer with the descriptors attached. The socket is 0600
(0660 with the ``--socket-group``: then any uid that can open it is served, the lease secret
being the proof, as on the gRPC socket beside it), created owner-only and given its group
before its mode (``kvpoold.socket_files``), and removed on close.

Exhaustion: at most ``max_connections`` connections are served at once, and
``max_connections_per_uid`` per peer uid; one more is answered RESOURCE_EXHAUSTED at once and
closed. An accept that fails for want of descriptors (EMFILE, ENFILE, ENOBUFS, ENOMEM) does not
end the loop: it reports the socket down (``on_state``), backs off (10 ms doubling to 0.25 s)
and retries, and reports it up at the next accepted connection.

A connection that starts with the post channel's preamble
(:mod:`kvpool.contract.post_channel`) is handed, once its uid is checked, to ``post_channel``
(the daemon's :class:`kvpoold.server.post_service.PostChannel`): it then stays open for posts of
held sends, holding one of the connection slots until the client closes it.

``authorize`` returns either ``(fd, size, kind)`` (one descriptor the daemon keeps open: a
pool's sparse file) or an :class:`FdGrant` (several descriptors, each with its range; when
``owned``, fresh exports the server closes once sent, whatever happens).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from kvpool.contract.errors import (
    Internal,
    InvalidArgument,
    KVPoolError,
    PermissionDenied,
    ResourceExhausted,
)
from kvpool.contract.fd_channel import MAX_ASK_BYTES, MAX_FDS_PER_ANSWER, FdAnswer, FdAsk
from kvpool.contract.post_channel import PREAMBLE
from kvpoold.settings import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID
from kvpoold.sharing.base import FdGrant
from kvpoold.socket_files import finish_socket, owner_only

log = logging.getLogger("kvpoold.elastic")


# (ask, peer uid, peer pid) -> (descriptor, size, kind) or FdGrant; raises a KVPoolError to
# refuse. The pid is the kernel's (SO_PEERCRED): the daemon records who took a descriptor.
Authorize = Callable[[FdAsk, int, int], "tuple[int, int, str] | FdGrant"]
ASK_TIMEOUT_S = 5.0
# The kind of an answer to a registration (FdAsk.register): OK, no descriptor.
REGISTERED = "registered"
DRAIN_BYTES = 1 << 16
# Accept errors that mean "no descriptor or buffer now": back off and retry.
EXHAUSTED_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Accept errors of one connection (its peer gave up first): accept the next.
CONNECTION_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR})
BACKOFF_MIN_S = 0.01
BACKOFF_MAX_S = 0.25
# (accepting, why) on each change: the daemon's ListenerHealth.
StateReport = Callable[[bool, str], None]
# Serves a post channel connection (non-blocking) to its end, given the bytes read past the
# preamble; the server closes the connection after.
ChannelServe = Callable[[socket.socket, bytes], Awaitable[None]]


def peer_creds(conn: socket.socket) -> tuple[int, int]:
    """``(uid, pid)`` of the process at the other end (``SO_PEERCRED``: the kernel's, taken
    at connect)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid), int(pid)


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end (``SO_PEERCRED``)."""
    return peer_creds(conn)[0]


class FdServer:
    """Hands pool descriptors to authorized clients on ``path``.

    Args:
        path: the side socket (``<grpc socket>.fd``).
        authorize: the daemon's check of an ask; returns what to send.
        uids: the uids served without a group (default: the daemon's own and root).
        gid: the ``--socket-group``: the file becomes 0660 for it, and any uid that can open
            it is served (the lease secret is the proof); None: 0600.
        max_connections: connections served at once.
        max_connections_per_uid: connections of one peer uid served at once.
        on_state: told ``(accepting, why)`` when accepting stops or resumes.
        post_channel: serves connections that open with the post channel's preamble (None:
            they are refused as undecodable asks).
    """

    def __init__(self, path: Path, authorize: Authorize,
                 uids: frozenset[int] | None = None, *, gid: int | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 max_connections_per_uid: int = MAX_CONNECTIONS_PER_UID,
                 on_state: StateReport | None = None,
                 post_channel: ChannelServe | None = None) -> None:
        self.path = path
        self._post_channel = post_channel
        self._authorize = authorize
        # None: any uid (the file's group decides who can connect)
        self._uids = None if gid is not None else uids or frozenset({os.getuid(), 0})
        self._gid = gid
        self._max = max_connections
        self._max_per_uid = max_connections_per_uid
        self._on_state = on_state or (lambda _accepting, _why: None)
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._per_uid: dict[int, int] = {}
        self.answered = 0
        self.refused = 0
        self.accepting = True

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._serving)

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        try:
            with owner_only():
                sock.bind(str(self.path))
            finish_socket(self.path, self._gid)
            sock.listen(min(self._max, socket.SOMAXCONN))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        backoff = BACKOFF_MIN_S
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                if exc.errno in CONNECTION_ERRNOS:
                    continue
                if exc.errno not in EXHAUSTED_ERRNOS:  # unknown: logged, and never the end
                    log.exception("descriptor socket accept failed", extra={"fields": {
                        "event": "fd_accept_error", "path": str(self.path)}})
                    await asyncio.sleep(BACKOFF_MAX_S)
                    continue
                if self.accepting:
                    self.accepting = False
                    self._on_state(False, f"accept: {os.strerror(exc.errno or 0)}")
                await asyncio.sleep(backoff)  # the socket stays readable: never spin
                backoff = min(2 * backoff, BACKOFF_MAX_S)
                continue
            backoff = BACKOFF_MIN_S
            if not self.accepting:
                self.accepting = True
                self._on_state(True, "")
            self._admit(loop, conn)

    def _admit(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        """Serve ``conn`` in its own task, or refuse it at once when over a cap."""
        try:
            uid = peer_uid(conn)
        except OSError:
            conn.close()
            return
        held = self._per_uid.get(uid, 0)
        if len(self._serving) >= self._max or held >= self._max_per_uid:
            self._refuse_now(conn, uid, held)
            return
        self._per_uid[uid] = held + 1
        task = loop.create_task(self._serve(conn))
        self._serving.add(task)  # a reference until it ends (the loop keeps only weak ones)

        def done(t: asyncio.Task[None]) -> None:
            self._serving.discard(t)
            left = self._per_uid.pop(uid) - 1
            if left:
                self._per_uid[uid] = left

        task.add_done_callback(done)

    def _refuse_now(self, conn: socket.socket, uid: int, held: int) -> None:
        """Answer RESOURCE_EXHAUSTED and close, without waiting for the ask: whatever of it has
        arrived is read first, so that closing does not reset the connection."""
        self.refused += 1
        if len(self._serving) >= self._max:
            why = (f"the descriptor socket serves {len(self._serving):,} connections, at most "
                   f"{self._max:,} (kvpoold serve --max-connections); try again")
        else:
            why = (f"uid {uid} has {held:,} connections open on the descriptor socket, at most "
                   f"{self._max_per_uid:,} (kvpoold serve --max-connections-per-uid); close "
                   "some or try again")
        with conn:
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                conn.recv(MAX_ASK_BYTES + 1)
            err = ResourceExhausted(why, field="connections")
            self._send(conn, FdAnswer(code=err.code, message=str(err)), None)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            conn.setblocking(False)
            channel = self._post_channel
            try:
                # read first, whoever asks: a refusal then reaches the client (closing on
                # unread bytes would reset the connection instead)
                raw = await asyncio.wait_for(self._read_ask(loop, conn, channel is not None),
                                             ASK_TIMEOUT_S)
                uid, pid = peer_creds(conn)
                if self._uids is not None and uid not in self._uids:
                    raise PermissionDenied(f"uid {uid} may not map pools of this daemon",
                                           field="uid")
                if channel is not None and raw.startswith(PREAMBLE):
                    grant = None
                else:
                    grant = self._grant(raw, uid, pid)
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
            if grant is None:
                assert channel is not None
                await channel(conn, raw[len(PREAMBLE):])
                return
            try:
                self._send(conn, FdAnswer(code="OK", size=grant.size, kind=grant.kind,
                                          ranges=grant.ranges), grant.fds or None)
            finally:
                grant.close()
            self.answered += 1

    def _grant(self, raw: bytes, uid: int, pid: int) -> FdGrant:
        """What an ask of ``uid``'s process ``pid`` gets (raises a KVPoolError to refuse)."""
        try:
            ask = msgspec.json.decode(raw, type=FdAsk)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidArgument(f"undecodable ask: {exc}", field="ask") from None
        grant = self._authorize(ask, uid, pid)
        if not isinstance(grant, FdGrant):
            fd, size, kind = grant
            grant = FdGrant((fd,), (), size, kind, owned=False)
        try:
            self._check(grant)
        except BaseException:
            grant.close()
            raise
        return grant

    @staticmethod
    def _check(grant: FdGrant) -> None:
        if grant.kind == REGISTERED and not grant.fds:
            return  # a registration answers with no descriptor
        if not grant.fds or len(grant.fds) > MAX_FDS_PER_ANSWER:
            raise Internal(f"an answer carries 1..{MAX_FDS_PER_ANSWER} descriptors, the pool "
                           f"gave {len(grant.fds)}; ask for fewer groups at once "
                           "(kvpool.contract.fd_channel.groups_per_ask)")
        if grant.ranges and len(grant.ranges) != len(grant.fds):
            raise Internal(f"{len(grant.fds)} descriptors but {len(grant.ranges)} ranges")

    @staticmethod
    async def _read_ask(loop: asyncio.AbstractEventLoop, conn: socket.socket,
                        channels: bool = False) -> bytes:
        """One ask: bytes until the client shuts its side down, at most MAX_ASK_BYTES. A longer
        one is read on (and dropped) up to DRAIN_BYTES, so the refusal reaches the client
        instead of a connection reset. With ``channels``, what has arrived once it starts with
        the post channel's preamble (that client keeps its side open)."""
        data = b""
        seen = 0
        while seen <= DRAIN_BYTES:
            chunk = await loop.sock_recv(conn, 65536)
            if not chunk:
                break
            seen += len(chunk)
            if len(data) <= MAX_ASK_BYTES:
                data += chunk
            if channels and data.startswith(PREAMBLE):
                return data
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

"""The client's end of the post channel (:mod:`kvpool.contract.post_channel`): posts of held
sends over the daemon's Unix side socket, about 0.5 ms cheaper per post than a gRPC call.

A client keeps the connections it opened, idle ones per socket, and takes one per post (so
posts from several threads or tasks run side by side, each on its own connection). When the
channel cannot be opened (the socket is gone, the daemon refuses it: connection caps, uid),
:meth:`PostChannels.post` returns None and the handle posts with the ``Send`` RPC instead;
once a post went out, its errors are the daemon's (the same statuses ``Send`` answers) or
the connection's: ``Unavailable`` when it broke, ``DeadlineExceeded`` when no answer came in
time (as a gRPC call's).
"""

from __future__ import annotations

import asyncio
import socket
import threading

import msgspec

from kvpool.contract.errors import (
    DeadlineExceeded,
    ResourceExhausted,
    Unavailable,
    error_from_code,
)
from kvpool.contract.fd_channel import MAX_ANSWER_BYTES, FdAnswer
from kvpool.contract.post_channel import (
    LENGTH,
    PREAMBLE,
    PostAnswer,
    PostHello,
    frame,
    frame_length,
)
from kvpool.v1 import kvpool_pb2 as pb

# Idle connections kept per socket; more are closed once their post is answered.
MAX_IDLE = 4
# How long opening a connection (connect, hello, its answer) may take.
OPEN_TIMEOUT_S = 5.0


def hello(metadata: tuple[tuple[str, str], ...]) -> bytes:
    """The bytes that open a connection: the preamble and the hello carrying the
    ``authorization`` of the client's gRPC ``metadata`` (if any)."""
    auth = next((v for k, v in metadata if k == "authorization"), "")
    return PREAMBLE + frame(msgspec.json.encode(PostHello(authorization=auth)))


def refusal(head: bytes, rest: bytes) -> Exception:
    """The side socket's refusal of a connection before the channel started (connection cap,
    uid): a JSON FdAnswer instead of a frame (``head`` is its first 4 bytes)."""
    try:
        answer = msgspec.json.decode(head + rest, type=FdAnswer)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Unavailable("the daemon's side socket answered something that is not the post "
                           "channel's")
    return error_from_code(answer.code, answer.message)


def answered(body: bytes) -> pb.SendResponse:
    """The ``SendResponse`` of an answer frame, or its refusal raised."""
    answer = msgspec.msgpack.decode(body, type=PostAnswer)
    if answer.code != "OK":
        raise error_from_code(answer.code, answer.message, answer.field or None)
    return pb.SendResponse.FromString(answer.response)


class _Closed(Exception):
    """Opening the channel failed before any post went out (the caller posts by gRPC)."""


class PostChannels:
    """The post channel connections of one (sync) client.

    Args:
        metadata: the client's gRPC metadata (its bearer token goes in each hello).
    """

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._hello = hello(metadata)
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()  # a leaf
        self._unusable: set[str] = set()  # sockets that refused: gRPC from then on
        self.posts = 0  # posted over the channel (answered, refusals included)

    def post(self, path: str, request: pb.SendRequest, timeout_s: float | None
             ) -> pb.SendResponse | None:
        """Post ``request`` (a ``SendRequest`` naming a held send) on ``path``, answered
        within ``timeout_s`` (None: no limit); None when the channel cannot be opened.

        Raises:
            The daemon's refusal (as ``Send``'s), ``Unavailable`` (the connection broke),
            ``DeadlineExceeded`` (no answer in time).
        """
        try:
            conn = self._take(path)
        except _Closed:
            return None
        try:
            conn.settimeout(timeout_s)
            conn.sendall(frame(request.SerializeToString()))
            body = self._frame(conn)
        except TimeoutError:
            conn.close()
            raise DeadlineExceeded(f"the post of transfer {request.transfer_id} was not "
                                   f"answered within {timeout_s} s on {path}") from None
        except (OSError, ValueError) as exc:
            conn.close()
            raise Unavailable(f"the post channel {path} broke: {exc}") from None
        self.posts += 1
        self._give(path, conn)
        return answered(body)

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def _take(self, path: str) -> socket.socket:
        with self._lock:
            if path in self._unusable:
                raise _Closed
            conns = self._idle.get(path)
            if conns:
                return conns.pop()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(OPEN_TIMEOUT_S)
            conn.connect(path)
            conn.sendall(self._hello)
            answered_hello = msgspec.msgpack.decode(self._frame(conn), type=PostAnswer)
            if answered_hello.code != "OK":
                raise error_from_code(answered_hello.code, answered_hello.message)
        except Exception as exc:
            conn.close()
            if not isinstance(exc, ResourceExhausted):  # a cap passes: try again next time
                with self._lock:
                    self._unusable.add(path)
            raise _Closed from None
        return conn

    def _give(self, path: str, conn: socket.socket) -> None:
        with self._lock:
            conns = self._idle.setdefault(path, [])
            if len(conns) < MAX_IDLE:
                conns.append(conn)
                return
        conn.close()

    @staticmethod
    def _frame(conn: socket.socket) -> bytes:
        head = _recv_exactly(conn, LENGTH.size)
        if head[:1] == b"{":
            raise refusal(head, _recv_rest(conn))
        return _recv_exactly(conn, frame_length(head))


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("the daemon closed the post channel")
        buf += chunk
    return bytes(buf)


def _recv_rest(conn: socket.socket) -> bytes:
    buf = bytearray()
    while len(buf) <= MAX_ANSWER_BYTES:
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


class AsyncPostChannels:
    """:class:`PostChannels` for an asyncio client (its connections belong to its loop)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._hello = hello(metadata)
        self._idle: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._unusable: set[str] = set()
        self.posts = 0

    async def post(self, path: str, request: pb.SendRequest, timeout_s: float | None
                   ) -> pb.SendResponse | None:
        """As :meth:`PostChannels.post`."""
        try:
            reader, writer = await self._take(path)
        except _Closed:
            return None
        try:
            writer.write(frame(request.SerializeToString()))
            body = await asyncio.wait_for(self._frame(reader), timeout_s)
        except TimeoutError:
            writer.close()
            raise DeadlineExceeded(f"the post of transfer {request.transfer_id} was not "
                                   f"answered within {timeout_s} s on {path}") from None
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
            writer.close()
            raise Unavailable(f"the post channel {path} broke: {exc}") from None
        self.posts += 1
        conns = self._idle.setdefault(path, [])
        if len(conns) < MAX_IDLE:
            conns.append((reader, writer))
        else:
            writer.close()
        return answered(body)

    def close(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for _, writer in conns:
                writer.close()

    async def _take(self, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if path in self._unusable:
            raise _Closed
        conns = self._idle.get(path)
        if conns:
            return conns.pop()
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path),
                                                    OPEN_TIMEOUT_S)
        except Exception:
            self._unusable.add(path)
            raise _Closed from None
        try:
            writer.write(self._hello)
            answer = msgspec.msgpack.decode(
                await asyncio.wait_for(self._frame(reader), OPEN_TIMEOUT_S), type=PostAnswer)
            if answer.code != "OK":
                raise error_from_code(answer.code, answer.message)
        except Exception as exc:
            writer.close()
            if not isinstance(exc, ResourceExhausted):
                self._unusable.add(path)
            raise _Closed from None
        return reader, writer

    @staticmethod
    async def _frame(reader: asyncio.StreamReader) -> bytes:
        head = await reader.readexactly(LENGTH.size)
        if head[:1] == b"{":
            raise refusal(head, await reader.read(MAX_ANSWER_BYTES))
        return await reader.readexactly(frame_length(head))

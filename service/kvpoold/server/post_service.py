"""The daemon's end of the post channel (:mod:`kvpool.contract.post_channel`).

The side socket's server (``kvpoold.elastic.fd_server``) hands over a connection that opened
with the channel's preamble, its peer uid checked. This reads the hello (the bearer token,
checked by the daemon's :class:`~kvpoold.access.Authority` as the gRPC edge checks it), then
serves posts one after the other until the client closes: each frame is a ``SendRequest``
taken through the same edge as the gRPC ``Send`` (``edge.send_args``, the lease proof,
``Daemon.send``), answered with the same ``SendResponse`` or the same status the gRPC edge
would give (``status.failure``). Only posts of held sends travel here: a new send (pages, a
peer, a token) is refused, it goes by gRPC.

Runs on the event loop. A frame is bounded before it is read (``MAX_FRAME_BYTES``); a hello
that does not come within ``ASK_TIMEOUT_S`` ends the connection; a client gone mid-post loses
only its answer (the post goes on, as a gRPC call cancelled after its message arrived).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import msgspec
from google.protobuf.message import DecodeError

from kvpool.contract.errors import InvalidArgument, KVPoolError
from kvpool.contract.post_channel import (
    LENGTH,
    PostAnswer,
    PostHello,
    frame,
    frame_length,
)
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.access import AUTH_METADATA_KEY, Authority, Caller
from kvpoold.server import edge
from kvpoold.server.daemon import Daemon
from kvpoold.server.status import RpcObserver, failure, release_frames
from kvpoold.transfer.messages import PostArgs

log = logging.getLogger("kvpoold.rpc")

# The hello must arrive this long after the preamble (as an ask on the side socket).
HELLO_TIMEOUT_S = 5.0
# The method name posts are reported and logged under (they are Send calls).
METHOD = "Send"


class _Frames:
    """Frames read from a non-blocking socket, starting with ``pending`` bytes read already."""

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                 pending: bytes) -> None:
        self._loop = loop
        self._conn = conn
        self._buf = bytearray(pending)

    async def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            chunk = await self._loop.sock_recv(self._conn, 65536)
            if not chunk:
                return False
            self._buf += chunk
        return True

    async def next(self) -> bytes | None:
        """The next frame's body; None when the client closed between frames.

        Raises:
            InvalidArgument: a frame longer than ``MAX_FRAME_BYTES`` (not read), or one cut
                short by the client closing.
        """
        if not await self._fill(LENGTH.size):
            if self._buf:
                raise InvalidArgument("the connection closed inside a frame's length",
                                      field="frame")
            return None
        try:
            length = frame_length(bytes(self._buf[:LENGTH.size]))
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="frame") from None
        if not await self._fill(LENGTH.size + length):
            raise InvalidArgument(f"the connection closed inside a frame of {length:,} bytes",
                                  field="frame")
        body = bytes(self._buf[LENGTH.size:LENGTH.size + length])
        del self._buf[:LENGTH.size + length]
        return body


class PostChannel:
    """Serves post channel connections for one daemon.

    Args:
        daemon: the daemon whose held sends are posted.
        authority: the daemon's tokens (the hello's token is checked as on its Unix sockets).
        observer: told each post's time and failures, as the gRPC edge tells it of ``Send``.
    """

    def __init__(self, daemon: Daemon, authority: Authority,
                 observer: RpcObserver | None = None) -> None:
        self._daemon = daemon
        self._authority = authority
        self._observer = observer

    async def serve(self, conn: socket.socket, pending: bytes) -> None:
        """Serve one connection (non-blocking, its uid checked) to its end; ``pending``: the
        bytes read past the preamble. The caller closes the connection."""
        loop = asyncio.get_running_loop()
        frames = _Frames(loop, conn, pending)
        try:
            try:
                caller = await self._hello(frames)
            except KVPoolError as exc:
                await self._answer(loop, conn, self._refusal(exc))
                return
            if caller is None:
                return
            await self._answer(loop, conn, PostAnswer(code="OK"))
            while True:
                try:
                    body = await frames.next()
                except KVPoolError as exc:  # a frame too long or cut: answered, then closed
                    await self._answer(loop, conn, self._refusal(exc))
                    return
                if body is None:
                    return
                await self._answer(loop, conn, await self._post(caller, body))
        except (OSError, TimeoutError):
            return  # the client went away, or said nothing in time

    async def _hello(self, frames: _Frames) -> Caller | None:
        """The caller the hello proves (None: the client closed first).

        Raises:
            InvalidArgument: an undecodable hello. Unauthenticated: its token, as the gRPC
                edge refuses it. TimeoutError: no hello within HELLO_TIMEOUT_S.
        """
        body = await asyncio.wait_for(frames.next(), HELLO_TIMEOUT_S)
        if body is None:
            return None
        try:
            hello = msgspec.json.decode(body, type=PostHello)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidArgument(f"undecodable hello: {exc}", field="hello") from None
        metadata = ((AUTH_METADATA_KEY, hello.authorization),) if hello.authorization else ()
        return self._authority.identify(metadata, "unix")

    async def _post(self, caller: Caller, body: bytes) -> PostAnswer:
        start = time.perf_counter()
        try:
            try:
                req = pb.SendRequest.FromString(body)
            except DecodeError:
                raise InvalidArgument("the frame is not a SendRequest", field="request") from None
            args = edge.send_args(req)
            if not isinstance(args, PostArgs):
                raise InvalidArgument(
                    "the post channel posts held sends only (transfer_id set); make the send "
                    "itself with the Send RPC", field="transfer_id")
            out = await self._daemon.send(caller, edge.lease_ref(req.lease_id, req.lease_secret),
                                          args)
            response = edge.send_response(out, self._daemon.now()).SerializeToString()
            return PostAnswer(code="OK", response=response)
        except Exception as exc:
            answer = self._refusal(exc)
            release_frames(exc)
            if self._observer is not None:
                self._observer.failed(METHOD, answer.code)
            return answer
        finally:
            if self._observer is not None:
                self._observer.observe(METHOD, time.perf_counter() - start)

    @staticmethod
    def _refusal(exc: BaseException) -> PostAnswer:
        code, details, field = failure(exc, METHOD)
        return PostAnswer(code=code.name, message=details, field=field)

    @staticmethod
    async def _answer(loop: asyncio.AbstractEventLoop, conn: socket.socket,
                      answer: PostAnswer) -> None:
        # a bounded message and a small response: frame() refuses anything longer
        await loop.sock_sendall(conn, frame(msgspec.msgpack.encode(answer)))

"""The post channel: a held send posted over the daemon's Unix side socket instead of gRPC.

A held send (``send(..., hold=True)``) leaves one message on the hot path: "post it now, tell me
when the write ended". As a gRPC unary call that round trip costs about 0.6 ms of Python gRPC on
a small machine, more than a 16-page NIXL write (bench/transfer.py); over a plain Unix socket
it costs about 0.07 ms. So the daemon also takes posts on its side socket (``<socket>.fd``,
the one that hands out descriptors, with its mode, group, connection caps and exhaustion
handling), and a Send that held a write names that socket in ``SendResponse.post_socket``.

One connection carries posts one after the other (a client keeps a few open, one per post in
flight):

1. the client sends :data:`PREAMBLE` (8 bytes; an ask for descriptors starts with ``{``, so the
   two never mix), then one frame holding a :class:`PostHello` (msgspec JSON): the bearer
   token, when the daemon's Unix sockets need one;
2. the daemon checks the peer's uid (``SO_PEERCRED``) as for descriptors and the token as the
   gRPC edge does, and answers one :class:`PostAnswer` frame: ``OK``, or the refusal and
   closes;
3. then each request frame is a serialized ``kvpool.v1.SendRequest`` posting a held send (its
   lease id and secret, ``transfer_id``, ``wait_seconds``: exactly what ``Send`` takes for a
   post), answered by one :class:`PostAnswer` frame: ``OK`` with the serialized
   ``SendResponse`` (as ``Send`` answers), or a refusal's status code name, message and field.

A frame is a 4-byte little-endian length and that many bytes, at most
:data:`MAX_FRAME_BYTES` (refused before it is read, and the connection closed). No pickles;
protobuf and msgspec decode only into their declared types.
"""

from __future__ import annotations

import struct

import msgspec

# The first bytes of a post channel connection on the side socket.
PREAMBLE = b"KVPOST/1"
# The longest frame either side sends: a post is ~100 bytes; an answer carries a
# SendResponse and at most a status message's 2,048 characters.
MAX_FRAME_BYTES = 16384
LENGTH = struct.Struct("<I")


class PostHello(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The first frame: ``authorization`` as the gRPC metadata of that name
    (``Bearer <token>``), empty when the daemon trusts its Unix sockets."""

    authorization: str = ""


class PostAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """The daemon's answer: ``code`` ``OK`` (with ``response``, a serialized
    ``SendResponse``, for a post), or a refusal's gRPC status code name, message and the field
    at fault."""

    code: str
    message: str = ""
    field: str = ""
    response: bytes = b""


def frame(body: bytes) -> bytes:
    """``body`` with its length in front.

    Raises:
        ValueError: ``body`` is longer than :data:`MAX_FRAME_BYTES`.
    """
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"a post channel frame holds at most {MAX_FRAME_BYTES:,} bytes, "
                         f"got {len(body):,}")
    return LENGTH.pack(len(body)) + body


def frame_length(head: bytes) -> int:
    """The length a frame's 4-byte head announces.

    Raises:
        ValueError: longer than :data:`MAX_FRAME_BYTES` (the frame is not read).
    """
    (length,) = LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a post channel frame holds at most {MAX_FRAME_BYTES:,} bytes, "
                         f"this one announces {length:,}")
    return int(length)

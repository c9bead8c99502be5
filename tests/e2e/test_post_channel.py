"""The post channel's door on a real daemon that needs tokens on its Unix sockets
(``--unix-auth token``): the hello's token is checked as the gRPC edge checks it, and each post
then goes through the Send edge (the lease proof, the held send's lookup). Posting real held
sends over it, with NIXL, is tests/transfer/test_transfer.py."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvpool import KVPoolClient
from kvpool.contract.post_channel import LENGTH, PREAMBLE, PostAnswer, PostHello, frame
from kvpool.v1 import kvpool_pb2 as pb
from tests.conftest import DaemonProcess, run_daemon, temp_dir

TOKEN = "post-channel-admin-0123456789abcdef"


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with temp_dir() as path:
        token_file = Path(path) / "token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        with run_daemon(path, "--unix-auth", "token", "--token-file", str(token_file)) as d:
            yield d


def opened(d: DaemonProcess, hello: bytes) -> tuple[socket.socket, PostAnswer]:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)
    conn.connect(f"{d.socket}.fd")
    conn.sendall(PREAMBLE + frame(hello))
    return conn, answer(conn)


def answer(conn: socket.socket) -> PostAnswer:
    head = conn.recv(LENGTH.size, socket.MSG_WAITALL)
    body = conn.recv(LENGTH.unpack(head)[0], socket.MSG_WAITALL)
    return msgspec.msgpack.decode(body, type=PostAnswer)


@pytest.mark.parametrize(("hello", "code", "field"), [
    (PostHello(), "UNAUTHENTICATED", ""),
    (PostHello(authorization="Bearer not-the-token"), "UNAUTHENTICATED", ""),
    (PostHello(authorization=TOKEN), "UNAUTHENTICATED", ""),  # not "Bearer <token>"
    (b'{"authorization": 1}', "INVALID_ARGUMENT", "hello"),
    (b"not json", "INVALID_ARGUMENT", "hello"),
])
def test_a_hello_without_the_token_is_refused_and_closed(daemon: DaemonProcess,
                                                          hello: PostHello | bytes, code: str,
                                                          field: str) -> None:
    body = hello if isinstance(hello, bytes) else msgspec.json.encode(hello)
    conn, refused = opened(daemon, body)
    with conn:
        assert refused.code == code and refused.field == field, refused
        assert refused.message
        assert conn.recv(1) == b""  # the daemon closed it


def test_posts_after_the_token_go_through_the_send_edge(daemon: DaemonProcess) -> None:
    """With the token the channel opens; a post is then checked as Send checks it: the lease
    proof (a wrong secret is an unknown lease), the held send of that lease (an unknown one),
    the fields (a post names nothing of a send); each refusal leaves the channel open."""
    hello = msgspec.json.encode(PostHello(authorization=f"Bearer {TOKEN}"))
    with KVPoolClient(daemon.target, token=TOKEN) as client, client.lease("poster") as lease:
        conn, ok = opened(daemon, hello)
        with conn:
            assert ok.code == "OK", ok
            asks = [
                (pb.SendRequest(lease_id=lease.lease_id, lease_secret=b"\0" * 16,
                                transfer_id=7), {"NOT_FOUND"}),
                # NIXL missing: FAILED_PRECONDITION says so; present: no send 7 of the lease
                (pb.SendRequest(lease_id=lease.lease_id, lease_secret=lease.secret,
                                transfer_id=7), {"NOT_FOUND", "FAILED_PRECONDITION"}),
                (pb.SendRequest(lease_id=lease.lease_id, lease_secret=lease.secret,
                                transfer_id=7, hold=True), {"INVALID_ARGUMENT"}),
                (pb.SendRequest(lease_id=lease.lease_id, lease_secret=lease.secret,
                                transfer_id=7, wait_seconds=-1), {"INVALID_ARGUMENT"}),
            ]
            for request, codes in asks:
                conn.sendall(frame(request.SerializeToString()))
                refused = answer(conn)
                assert refused.code in codes and refused.message, (request, refused)
            refused_id = answer_to(conn, pb.SendRequest(transfer_id=7))
            assert refused_id.code == "INVALID_ARGUMENT" and refused_id.field == "lease_id"


def answer_to(conn: socket.socket, request: pb.SendRequest) -> PostAnswer:
    conn.sendall(frame(request.SerializeToString()))
    return answer(conn)


def test_the_client_falls_back_where_the_channel_cannot_open(daemon: DaemonProcess) -> None:
    """``PostChannels.post`` answers None (the handle then posts with the Send RPC) where no
    channel opens: no socket at the path, or a hello the daemon refuses (no token here); it
    does not try that socket again. With the token, the daemon's refusal of the post itself
    comes back as the typed error Send would raise."""
    from kvpool.clients.client import auth_metadata
    from kvpool.contract.errors import FailedPrecondition, NotFound
    from kvpool.pd.post_connections import PostChannels

    post = pb.SendRequest(lease_id=1, lease_secret=b"\0" * 16, transfer_id=7)
    channels = PostChannels(())
    assert channels.post(f"{daemon.socket}.missing", post, 5.0) is None
    assert channels.post(f"{daemon.socket}.fd", post, 5.0) is None  # hello without the token
    assert channels.posts == 0
    with KVPoolClient(daemon.target, token=TOKEN) as client, client.lease("poster") as lease:
        channels = PostChannels(auth_metadata(TOKEN))
        mine = pb.SendRequest(lease_id=lease.lease_id, lease_secret=lease.secret,
                              transfer_id=7)
        with pytest.raises((NotFound, FailedPrecondition)):
            channels.post(f"{daemon.socket}.fd", mine, 5.0)
        with pytest.raises(NotFound):  # the same connection, kept: a wrong secret
            channels.post(f"{daemon.socket}.fd", post, 5.0)
        assert channels.posts == 2
        channels.close()

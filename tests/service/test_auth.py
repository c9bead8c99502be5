"""TCP listeners: the bearer token (UNAUTHENTICATED without it), health open, TLS; the Unix
socket stays trusted and 0600."""

from __future__ import annotations

import shutil
import stat
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.server.daemon import Daemon
from kvpoold.server.run import KVPoolServer, create_server
from kvpoold.settings import Listener
from kvpoold.sharing.base import PlainBackingFactory

TOKEN = "s3cret-token"


@pytest.fixture
async def tcp_server(socket_dir: Path) -> AsyncIterator[tuple[KVPoolServer, str, Path]]:
    daemon = Daemon("cpu", 1 << 20, PlainBackingFactory(torch.device("cpu")))
    sock = socket_dir / "k.sock"
    server = create_server(daemon, [Listener("unix", str(sock)), Listener("tcp", "127.0.0.1:0")],
                           token=TOKEN)
    await server.start()
    try:
        yield server, server.addresses[1], sock
    finally:
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()


async def stats_with(target: str, metadata: tuple[tuple[str, str], ...] = ()) -> pb.StatsResponse:
    async with aio.insecure_channel(target) as channel:
        return await kvpool_pb2_grpc.KVPoolStub(channel).Stats(pb.StatsRequest(),
                                                               metadata=metadata)


async def test_tcp_needs_the_token(tcp_server: tuple[KVPoolServer, str, Path]) -> None:
    _, address, _ = tcp_server
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
        with pytest.raises(aio.AioRpcError) as info:
            await stats_with(address, metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ok = await stats_with(address, (("authorization", f"Bearer {TOKEN}"),))
    assert ok.daemon.device == "cpu"


async def test_streams_need_the_token_too(tcp_server: tuple[KVPoolServer, str, Path]) -> None:
    _, address, _ = tcp_server
    async with aio.insecure_channel(address) as channel:
        stream = kvpool_pb2_grpc.KVPoolStub(channel).KeepAlive()
        with pytest.raises(aio.AioRpcError) as info:  # the write may already see the abort
            await stream.write(pb.KeepAliveRequest(lease_id=1))
            await stream.read()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_health_is_open_and_unix_is_trusted(tcp_server: tuple[KVPoolServer, str, Path]
                                                  ) -> None:
    _, address, sock = tcp_server
    async with aio.insecure_channel(address) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    assert (await stats_with(f"unix://{sock}")).daemon.device == "cpu"
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary")
async def test_tls_listener(socket_dir: Path) -> None:
    key, cert = socket_dir / "tls.key", socket_dir / "tls.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    daemon = Daemon("cpu", 1 << 20, PlainBackingFactory(torch.device("cpu")))
    server = create_server(daemon, [Listener("tcp", "localhost:0")], token=TOKEN,
                           tls=(key.read_bytes(), cert.read_bytes()))
    await server.start()
    try:
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        async with aio.secure_channel(server.addresses[0], creds) as channel:
            resp = await kvpool_pb2_grpc.KVPoolStub(channel).Stats(
                pb.StatsRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert resp.daemon.budget_bytes == 1 << 20
    finally:
        await server.shutdown(0)
        daemon.close()

"""Shutdown order and non-blocking builds, with a backing factory the test can hold up; plus
socket permissions and the log formats."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import stat
import threading
from pathlib import Path

import grpc
import pytest
import torch
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.contract.wire import configure_request
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.server.daemon import Daemon
from kvpoold.server.logs import configure_logging
from kvpoold.server.run import create_server
from kvpoold.settings import Listener
from kvpoold.sharing.base import PlainBacking
from tests.conftest import TINY_OPTIONS, TINY_SPEC


class GatedFactory:
    """Plain cpu backings whose ``create`` waits until the test opens the gate: a slow build."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.closed: list[int] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def create(self, nbytes: int, pool_name: str) -> PlainBacking:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return PlainBacking(torch.zeros(nbytes, dtype=torch.uint8))

    def close(self) -> None:
        self.closed.append(1)


async def test_a_slow_build_does_not_stall_other_calls_and_drains_at_shutdown(
        socket_dir: Path) -> None:
    factory = GatedFactory()
    daemon = Daemon("cpu", 16 << 20, factory)
    sock = socket_dir / "k.sock"
    server = create_server(daemon, [Listener("unix", str(sock))])
    await server.start()
    channel = aio.insecure_channel(f"unix://{sock}")
    stub = kvpool_pb2_grpc.KVPoolStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    try:
        building = asyncio.ensure_future(
            stub.Configure(configure_request("slow", spec=TINY_SPEC, **TINY_OPTIONS)))
        await asyncio.to_thread(factory.entered.wait, 5)
        # the build is blocked in its worker thread; the loop still answers
        lease = await asyncio.wait_for(
            stub.OpenLease(pb.OpenLeaseRequest(name="x", ttl_seconds=5)), 2)
        stats = await asyncio.wait_for(stub.Stats(pb.StatsRequest()), 2)
        assert stats.daemon.num_pools == 0 and lease.lease_id
        shutdown = asyncio.ensure_future(server.shutdown(5.0))
        await asyncio.sleep(0.2)
        # draining: the in-flight build holds the shutdown; new calls are refused
        assert not shutdown.done()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Stats(pb.StatsRequest(), timeout=1)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        factory.gate.set()
        resp = await asyncio.wait_for(building, 5)
        assert resp.created  # the in-flight call finished
        await asyncio.wait_for(shutdown, 5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        factory.gate.set()
        await channel.close()
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()
    assert factory.closed == [1] and daemon.pools == {}
    assert not sock.exists()


async def test_health_goes_not_serving_first(socket_dir: Path) -> None:
    daemon = Daemon("cpu", 1 << 20, GatedFactory())
    sock = socket_dir / "k.sock"
    server = create_server(daemon, [Listener("unix", str(sock))])
    await server.start()
    try:
        await server.health.enter_graceful_shutdown()
        async with aio.insecure_channel(f"unix://{sock}") as channel:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvpool.v1.KVPool"))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await server.shutdown(0)
        server.remove_sockets()


async def test_socket_group_makes_it_0660(socket_dir: Path) -> None:
    gid = os.getgid()
    sock = socket_dir / "sub" / "k.sock"
    server = create_server(Daemon("cpu", 1 << 20, GatedFactory()),
                           [Listener("unix", str(sock))], socket_group=str(gid))
    await server.start()
    try:
        st = sock.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, gid)
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o750
    finally:
        await server.shutdown(0)
        server.remove_sockets()


def test_json_logs_carry_the_event_fields() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    try:
        logging.getLogger("kvpoold.daemon").info(
            "lease opened", extra={"fields": {"event": "lease_open", "lease_id": 7}})
        line = json.loads(stream.getvalue())
        assert (line["msg"], line["event"], line["lease_id"], line["level"]) == (
            "lease opened", "lease_open", "7", "INFO")
        configure_logging("info", "text", stream)
        logging.getLogger("kvpoold.daemon").warning(
            "lease expired", extra={"fields": {"event": "lease_expired", "name": "a b"}})
        assert stream.getvalue().splitlines()[-1].endswith(
            'msg="lease expired" event=lease_expired name="a b"')
    finally:
        logger = logging.getLogger("kvpoold")
        logger.handlers.clear()
        logger.propagate = True

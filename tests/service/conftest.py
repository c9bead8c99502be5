"""An in-process daemon on a temp Unix socket with real aio stubs, and a hand-moved clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from grpc import aio
from grpc_health.v1 import health_pb2_grpc

from kvpool.contract.wire import LeaseKey
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.server.daemon import Daemon
from kvpoold.server.run import KVPoolServer, create_server, sweep_leases
from kvpoold.settings import Listener
from kvpoold.sharing.base import PlainBackingFactory
from tests.conftest import TINY_OPTIONS, TINY_SPEC


class ManualClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class Served:
    daemon: Daemon
    server: KVPoolServer
    channel: aio.Channel
    stub: kvpool_pb2_grpc.KVPoolStub
    health: health_pb2_grpc.HealthStub
    clock: ManualClock
    target: str

    async def configure(self, pool: str = "tiny", **options: Any) -> pb.ConfigureResponse:
        """Configure the tiny model (conftest.TINY_SPEC) with TINY_OPTIONS plus ``options``."""
        from kvpool.contract.wire import configure_request

        return await self.stub.Configure(
            configure_request(pool, spec=TINY_SPEC, **{**TINY_OPTIONS, **options})
        )

    async def lease(self, name: str = "test", ttl: float = 10.0) -> LeaseKey:
        """A lease opened on the raw stub: its id and secret, for raw requests."""
        resp = await self.stub.OpenLease(pb.OpenLeaseRequest(name=name, ttl_seconds=ttl))
        return LeaseKey(resp.lease_id, resp.lease_secret)


def proof(lease: LeaseKey) -> dict[str, Any]:
    """The lease fields of a raw request: ``pb.CloseLeaseRequest(**proof(lease))``."""
    return {"lease_id": lease.lease_id, "lease_secret": lease.secret}


async def open_raw(stub: kvpool_pb2_grpc.KVPoolStub, name: str, ttl: float = 10.0) -> LeaseKey:
    """OpenLease on a raw stub: the new lease's id and secret."""
    resp = await stub.OpenLease(pb.OpenLeaseRequest(name=name, ttl_seconds=ttl))
    return LeaseKey(resp.lease_id, resp.lease_secret)


BUDGET_BYTES = 16 << 20


@pytest.fixture
async def served(socket_dir: Path) -> AsyncIterator[Served]:
    """A daemon (16 MiB budget, plain cpu memory, manual clock) served on a temp socket."""
    clock = ManualClock()
    daemon = Daemon("cpu", BUDGET_BYTES, PlainBackingFactory(torch.device("cpu")), clock=clock)
    path = socket_dir / "kvpool.sock"
    server = create_server(daemon, [Listener("unix", str(path))])
    await server.start()
    channel = aio.insecure_channel(f"unix://{path}")
    try:
        yield Served(daemon, server, channel, kvpool_pb2_grpc.KVPoolStub(channel),
                     health_pb2_grpc.HealthStub(channel), clock, f"unix://{path}")
    finally:
        await channel.close()
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()


@pytest.fixture
async def live(socket_dir: Path) -> AsyncIterator[tuple[Daemon, str]]:
    """A daemon on the real clock with its lease sweeper (every 0.05 s): ``(daemon, target)``."""
    daemon = Daemon("cpu", BUDGET_BYTES, PlainBackingFactory(torch.device("cpu")))
    sock = socket_dir / "k.sock"
    server = create_server(daemon, [Listener("unix", str(sock))])
    await server.start()
    sweeper = asyncio.create_task(sweep_leases(daemon, 0.05))
    try:
        yield daemon, f"unix://{sock}"
    finally:
        sweeper.cancel()
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()

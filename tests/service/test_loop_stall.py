"""The lease clock (``kvpoold.server.loop_clock``): a stalled event loop never expires a lease
whose renewals were waiting to be read; and Configure's budget hint names the request->token
table's knobs when that table is most of the bytes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import torch

from kvpool.clients.client import KVPoolClient
from kvpool.contract.wire import configure_request
from kvpoold.server.daemon import Daemon
from kvpoold.server.loop_clock import StallClock
from kvpoold.server.run import create_server, sweep_leases
from kvpoold.settings import Listener
from kvpoold.sharing.base import PlainBackingFactory
from tests.conftest import TINY_OPTIONS, TINY_SPEC
from tests.service.conftest import Served


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_stall_clock_stands_still_past_tick_plus_tolerance() -> None:
    base = Clock()
    clock = StallClock(base, tick_s=0.05, tolerance_s=0.05)
    assert clock() == 100.0  # no ticker: the base clock exactly
    clock.tick()  # the ticker ran at 100.0
    base.t = 100.08
    assert clock() == pytest.approx(100.08)  # within tick + tolerance: runs
    base.t = 105.0  # the loop was held for 5 s: the clock stopped at 100.1
    assert clock() == pytest.approx(100.1)
    assert clock.tick() == pytest.approx(4.9)  # the ticker comes back and folds the stall
    assert clock() == pytest.approx(100.1)
    base.t = 105.08
    assert clock() == pytest.approx(100.18)  # runs again from there
    assert clock.stalled_s == pytest.approx(4.9) and clock.longest_stall_s == pytest.approx(4.9)
    assert clock.stalls == 1


async def test_a_stalled_loop_does_not_expire_a_renewing_lease(socket_dir: Path) -> None:
    """A real daemon (real clocks, sweeper and ticker running) whose loop is held for 2 s while
    a client renews a 0.5 s lease from its own thread: the lease survives and keeps its pages."""
    lease_clock = StallClock()
    daemon = Daemon("cpu", 16 << 20, PlainBackingFactory(torch.device("cpu")),
                    lease_clock=lease_clock)
    path = socket_dir / "kvpool.sock"
    server = create_server(daemon, [Listener("unix", str(path))])
    await server.start()
    tasks = [asyncio.create_task(lease_clock.run()), asyncio.create_task(sweep_leases(daemon))]
    client = KVPoolClient(f"unix://{path}", timeout_s=30)
    try:
        await asyncio.to_thread(client.configure, "tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        lease = await asyncio.to_thread(client.lease, "victim", 0.5)
        await asyncio.to_thread(lease.allocate, "tiny", "kv", 4)
        await asyncio.sleep(0.3)
        time.sleep(2.0)  # hold the loop: renewals queue up unread, 4 TTLs long
        await asyncio.sleep(1.0)  # then 2 TTLs of normal service
        assert daemon.leases.expired == 0
        assert daemon.leases.find(lease.lease_id) is not None
        assert lease.error is None
        assert lease_clock.longest_stall_s > 1.0
        daemon_stats = (await asyncio.to_thread(client.stats)).daemon  # what operators see
        assert daemon_stats.loop_stalls == lease_clock.stalls >= 1
        assert daemon_stats.loop_longest_stall_seconds == lease_clock.longest_stall_s
        await asyncio.to_thread(lease.close)
    finally:
        client.close()
        for task in tasks:
            task.cancel()
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()


async def test_budget_hint_names_the_request_table_knobs(served: Served) -> None:
    """The request->token table (context length x running requests) is most of the bytes: the
    hint says to lower --context-length or --max-running-requests."""
    req = configure_request("wide", spec={**TINY_SPEC, "context_length": 1 << 20},
                            **{**TINY_OPTIONS, "max_running_requests": 64})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Configure(req)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = info.value.details()
    assert "request->token table" in details
    assert "--context-length" in details and "--max-running-requests" in details
    # a pool whose KV is the cost keeps the budget hint
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.configure("big", budget_bytes=64 << 20)
    assert "--context-length" not in info.value.details()
    assert "budget_bytes" in info.value.details()

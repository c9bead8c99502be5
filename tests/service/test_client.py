"""The client library against an in-process daemon on the real clock: typed results, leases
kept alive in the background, errors as ``kvpool.contract.errors`` classes with their field."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from kvpool import AsyncKVPoolClient, KVPoolClient
from kvpool.contract.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KVPoolError,
    NotFound,
    ResourceExhausted,
)
from kvpool.contract.plan import PoolPlan
from kvpoold.server.daemon import Daemon
from tests.conftest import TINY_OPTIONS, TINY_PAGES, TINY_SPEC


def sync_session(target: str) -> dict[str, object]:
    """Drive the blocking client (in a worker thread: the server runs on this test's loop)."""
    out: dict[str, object] = {}
    with KVPoolClient(target) as client:
        out["health"] = client.health()
        result = client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        out["configure"] = result
        out["again"] = client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS).created
        with client.lease("engine", ttl_s=0.3) as lease:
            pages = lease.allocate("tiny", "kv", 10)
            rows, more = lease.allocate_batch("tiny", [("req", 2), ("kv", 5)])
            out["more"] = more
            time.sleep(1.0)  # > 3 TTLs: only the keep-alive thread keeps it open
            out["held"] = client.stats().leases[0].held
            out["freed"] = lease.free("tiny", "kv", pages[:4])
            out["pages"], out["rows"] = pages, rows
            out["error"] = lease.error
        out["after"] = client.stats()
    return out


async def test_sync_client_session(live: tuple[Daemon, str]) -> None:
    out = await asyncio.to_thread(sync_session, live[1])
    assert out["health"] == "SERVING"
    result = out["configure"]
    assert result.created and isinstance(result.plan, PoolPlan)
    assert result.plan.num_pages == TINY_PAGES and result.fingerprint == result.plan.fingerprint()
    assert result.buffers == result.plan.buffers
    assert out["again"] is False
    assert out["pages"].dtype == np.int32 and len(out["pages"]) == 10
    assert sorted(out["rows"].tolist()) == [1, 2]
    assert not set(out["more"].tolist()) & set(out["pages"].tolist())
    assert out["held"] == {"tiny": {"kv": 15, "req": 2}}
    assert out["freed"] == 4 and out["error"] is None
    after = out["after"]
    assert after.leases == [] and after.daemon.leases_expired == 0
    assert after.daemon.leases_closed == 1
    assert after.pool("tiny").spaces["kv"].used == 0


def sync_errors(target: str) -> list[tuple[type, str | None, str]]:
    errors = []
    with KVPoolClient(target) as client:
        calls = [
            lambda: client.configure("tiny", spec=TINY_SPEC, **{**TINY_OPTIONS, "page_size": 0}),
            lambda: client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS),
            lambda: client.configure("tiny", spec=TINY_SPEC, **{**TINY_OPTIONS, "page_size": 8}),
            lambda: client.configure("big", spec=TINY_SPEC,
                                     **{**TINY_OPTIONS, "budget_bytes": 1 << 30}),
            lambda: client.drop("nope"),
            lambda: client.configure("x", spec=TINY_SPEC, flavour=1),
        ]
        with client.lease("e") as lease:
            calls += [
                lambda: lease.allocate("tiny", "kv", TINY_PAGES + 1),
                lambda: lease.free("tiny", "kv", [250]),
                lambda: lease.allocate("tiny", "bogus", 1),
            ]
            for call in calls:
                try:
                    call()
                except KVPoolError as exc:
                    errors.append((type(exc), exc.field, exc.code))
    return errors


async def test_sync_client_errors_keep_class_and_field(live: tuple[Daemon, str]) -> None:
    errors = await asyncio.to_thread(sync_errors, live[1])
    assert errors == [
        (InvalidArgument, "page_size", "INVALID_ARGUMENT"),
        # the second configure succeeds: no entry
        (AlreadyExists, "pool", "ALREADY_EXISTS"),
        (ResourceExhausted, "budget_bytes", "RESOURCE_EXHAUSTED"),
        (NotFound, "pool", "NOT_FOUND"),
        (InvalidArgument, "flavour", "INVALID_ARGUMENT"),
        (ResourceExhausted, "items[0].count", "RESOURCE_EXHAUSTED"),
        (FailedPrecondition, "items[0].ids[0]", "FAILED_PRECONDITION"),
        (InvalidArgument, "items[0].space", "INVALID_ARGUMENT"),  # refused by the client
    ]


def unreachable(target: str) -> KVPoolError:
    with KVPoolClient(target, timeout_s=1.0) as client:
        try:
            client.stats()
        except KVPoolError as exc:
            return exc
    raise AssertionError("stats() on a missing socket did not fail")


async def test_unreachable_daemon_says_so(socket_dir: Path) -> None:
    exc = await asyncio.to_thread(unreachable, f"unix://{socket_dir}/none.sock")
    assert exc.code_name == "UNAVAILABLE"  # type: ignore[attr-defined]
    assert "is `kvpoold serve` running?" in str(exc)


async def test_async_client_session(live: tuple[Daemon, str]) -> None:
    daemon, target = live
    async with AsyncKVPoolClient(target) as client:
        assert await client.health() == "SERVING"
        result = await client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        assert result.created
        async with await client.lease("async-engine", ttl_s=0.3) as lease:
            pages = await lease.allocate("tiny", "kv", 8)
            await asyncio.sleep(1.0)
            stats = await client.stats()
            assert stats.leases[0].held == {"tiny": {"kv": 8}}
            assert await lease.free("tiny", "kv", pages) == 8
            with pytest.raises(FailedPrecondition):
                await lease.free("tiny", "kv", pages)
        watched = []
        async for snapshot in client.watch_stats(interval_s=0.05):
            watched.append(snapshot)
            if len(watched) == 3:
                break
        assert [w.daemon.num_pools for w in watched] == [1, 1, 1]
        info = await client.attach_raw("tiny", result.fingerprint)
        assert info.plan == result.plan and info.handle.sharing == "none"
        assert (await client.stats()).pool("tiny").attached == 1
        await client.detach(info.attach_id)
        dropped = await client.drop("tiny")
        assert dropped.released_bytes == result.plan.backing_bytes
        assert daemon.leases.closed == 1 and daemon.leases.expired == 0


async def test_lease_without_keep_alive_expires(live: tuple[Daemon, str]) -> None:
    """A lease whose holder stops renewing loses its pages (TTL + the sweep interval, on a
    quiet machine; the daemon's loop clock moves deadlines by its stalls, so the test waits on
    the fact with only a ceiling for a hang)."""
    target = live[1]
    async with AsyncKVPoolClient(target) as client:
        await client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        lease = await client.lease("stalled", ttl_s=0.3)
        await lease.allocate("tiny", "kv", 5)
        lease._task.cancel()  # the holder stops renewing (as if frozen)
        start = time.monotonic()
        while (await client.stats()).leases:
            assert time.monotonic() - start < 60.0, "the stalled lease never expired"
            await asyncio.sleep(0.02)
        assert (await client.stats()).pool("tiny").spaces["kv"].used == 0
        with pytest.raises(NotFound):
            await lease.allocate("tiny", "kv", 1)

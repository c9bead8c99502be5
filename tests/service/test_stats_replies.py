"""Stats replies built in slices and shared (issue 20 item 7; ``kvpoold.server.stats_replies``),
on a real daemon (hand-moved clock), and the WatchStats limits through the real server.

No timing: what is asserted is what the replies hold, how many builds ran, and which calls were
refused; ``bench/stats_under_load.py`` measures what the loop is spared.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

from kvpool import AsyncKVPoolClient
from kvpool.contract import codec
from kvpool.contract.errors import (
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvpool.contract.records import Stats
from kvpool.contract.wire import configure_request
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.access import DAEMON_CALLER, Caller, Scope
from kvpoold.metrics import loop_snapshot
from kvpoold.server import edge
from kvpoold.server.args import LeaseRef
from kvpoold.server.daemon import Daemon
from kvpoold.server.leases import Lease
from kvpoold.server.stats import DEFAULT_WATCH_INTERVAL_S, MAX_WATCH_INTERVAL_S, gather_stats
from kvpoold.server.stats_replies import StatsReplies
from kvpoold.sharing.base import PlainBackingFactory
from tests.conftest import TINY_OPTIONS, TINY_SPEC
from tests.service.conftest import ManualClock
from tests.service.test_authorization import serve

TENANT = Caller("tenant", Scope(pools=("p", "q*")))
OTHER = Caller("other", Scope(pools=("p", "q")))


async def daemon_with(leases: dict[Caller, int], **options: object) -> Daemon:
    """A daemon (hand-moved clock) with pools p and q and, per caller, that many leases holding
    one page of p each (and the first of each two pages of q)."""
    daemon = Daemon("cpu", 64 << 20, PlainBackingFactory(torch.device("cpu")),
                    clock=ManualClock(), max_leases_per_identity=1024,
                    **options)  # type: ignore[arg-type]
    for pool in ("p", "q"):
        await daemon.configure(DAEMON_CALLER, edge.configure_args(configure_request(
            pool, spec=TINY_SPEC, **TINY_OPTIONS)))
    for caller, count in leases.items():
        for i in range(count):
            lease = daemon.open_lease(caller, f"{caller.identity}-{i}", 60.0)
            daemon.allocate(caller, "p", ref(lease), [("kv", 1)])
            if i == 0:
                daemon.allocate(caller, "q", ref(lease), [("kv", 2)])
    return daemon


def ref(lease: Lease) -> LeaseRef:
    return LeaseRef(lease.lease_id, lease.secret)


def decoded(reply: pb.StatsResponse) -> Stats:
    return codec.stats_from_pb(reply)


@pytest.mark.parametrize("caller", [DAEMON_CALLER, TENANT])
@pytest.mark.parametrize("pool", ["", "q"])
async def test_a_sliced_reply_is_the_picture_taken_at_once(caller: Caller, pool: str) -> None:
    """Built 3 leases a slice, the reply decodes to exactly what ``Daemon.stats`` says in one go
    (the clock stands still): every lease listed, with what it holds (in ``pool`` only), for an
    admin; the tenant's own leases only, the others counted."""
    daemon = await daemon_with({DAEMON_CALLER: 7, TENANT: 5, OTHER: 4})
    try:
        replies = StatsReplies(daemon, slice_leases=3)
        got = decoded(await replies.reply(caller, pool))
        assert got == daemon.stats(caller, pool)
        if caller.admin:
            assert len(got.leases) == 16 and got.daemon.other_leases == 0
        else:
            assert [x.name for x in got.leases] == [f"tenant-{i}" for i in range(5)]
            assert got.daemon.other_leases == 11 and got.daemon.num_leases == 16
            assert got.peers == []
        held = {"p": {"kv": 1}, "q": {"kv": 2}} if not pool else {"q": {"kv": 2}}
        assert got.leases[0].held == held
        assert replies.builds == 1
    finally:
        daemon.close()


async def test_callers_at_once_share_builds_and_see_their_own_writes() -> None:
    """Ten admins asking while a build runs share the next one (two builds in all); a caller
    that asks after an Allocate sees it even though the build running then began before it;
    tenants build their own views; one caller going away does not end the others' build."""
    daemon = await daemon_with({DAEMON_CALLER: 40, TENANT: 2})
    try:
        replies = StatsReplies(daemon, slice_leases=4)
        first = asyncio.create_task(replies.reply(DAEMON_CALLER))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the first build is under way (one slice or two)
        assert replies.builds == 1 and not first.done()
        mine = daemon.leases.of_identity(DAEMON_CALLER.identity)[-1]
        daemon.allocate(DAEMON_CALLER, "p", ref(mine), [("kv", 3)])
        later = [asyncio.create_task(replies.reply(DAEMON_CALLER)) for _ in range(10)]
        gone = asyncio.create_task(replies.reply(DAEMON_CALLER))
        tenant = asyncio.create_task(replies.reply(TENANT))
        await asyncio.sleep(0)
        gone.cancel()
        results = [decoded(r) for r in await asyncio.gather(first, *later)]
        assert replies.builds == 3  # the first, the one the ten (and the cancelled) shared, tenant
        seen = [next(x for x in r.leases if x.lease_id == mine.lease_id).held["p"]["kv"]
                for r in results]
        assert seen[1:] == [4] * 10  # 1 + 3: each later caller sees the Allocate before it
        assert [x.name for x in decoded(await tenant).leases] == ["tenant-0", "tenant-1"]
        with pytest.raises(asyncio.CancelledError):
            await gone
        workers = [s.worker for s in replies._slots.values()]
        await asyncio.gather(*workers)  # each pauses as long as its last build took, then ends
        assert replies._slots == {}  # nothing kept once nobody waits
    finally:
        daemon.close()


async def test_a_lease_closed_during_a_build_is_left_out() -> None:
    """One lease a slice: the last lease closes while the build is at its first slices; the
    reply does not list it (the counts are those of the build's start)."""
    daemon = await daemon_with({DAEMON_CALLER: 30})
    try:
        replies = StatsReplies(daemon, slice_leases=1)
        task = asyncio.create_task(replies.reply(DAEMON_CALLER))
        for _ in range(3):
            await asyncio.sleep(0)
        last = daemon.leases.of_identity(DAEMON_CALLER.identity)[-1]
        daemon.close_lease(DAEMON_CALLER, ref(last))
        got = decoded(await task)
        assert len(got.leases) == 29 and last.lease_id not in {x.lease_id for x in got.leases}
        assert got.daemon.num_leases == 30
    finally:
        daemon.close()


async def test_the_metrics_snapshot_is_read_in_slices_too() -> None:
    """``/metrics`` reads ``Daemon.snapshot``: the admin picture, its leases read in slices; the
    same as taken at once. Scraped from a thread it hops to the loop and runs there as a task;
    on the loop itself it cannot be waited for, and says so."""
    daemon = await daemon_with({DAEMON_CALLER: 7, TENANT: 3})
    try:
        whole = daemon.stats(DAEMON_CALLER)
        assert await gather_stats(daemon, DAEMON_CALLER, slice_leases=2) == whole
        assert await daemon.snapshot() == whole
        scrape = loop_snapshot(daemon.snapshot, asyncio.get_running_loop())
        assert await asyncio.to_thread(scrape) == whole
        with pytest.raises(Internal, match="another thread"):
            scrape()
    finally:
        daemon.close()


async def test_a_reply_checks_its_pool_first() -> None:
    """Unknown, malformed and out-of-scope pools are refused before any build; so is a pool
    dropped after the call queued behind a build (NOT_FOUND, for every caller waiting)."""
    daemon = await daemon_with({DAEMON_CALLER: 8})
    try:
        replies = StatsReplies(daemon, slice_leases=2)
        with pytest.raises(NotFound):
            await replies.reply(DAEMON_CALLER, "nope")
        with pytest.raises(InvalidArgument):
            await replies.reply(DAEMON_CALLER, "-x")
        with pytest.raises(PermissionDenied):
            await replies.reply(Caller("tenant", Scope(pools=("p",))), "q")
        assert replies.builds == 0
        running = asyncio.create_task(replies.reply(DAEMON_CALLER, "q"))
        await asyncio.sleep(0)
        queued = [asyncio.create_task(replies.reply(DAEMON_CALLER, "q")) for _ in range(2)]
        await asyncio.sleep(0)
        await daemon.drop(DAEMON_CALLER, "q", force=True)
        assert decoded(await running).pools[0].name == "q"  # begun before the Drop
        for task in queued:
            with pytest.raises(NotFound):
                await task
    finally:
        daemon.close()


async def test_watch_intervals_are_raised_to_the_minimum() -> None:
    """WatchStats: 0 is the default; an interval under the daemon's minimum is served at it;
    negative, NaN and over an hour are refused naming interval_seconds."""
    daemon = await daemon_with({}, watch_min_interval_s=0.2)
    try:
        for asked, served in ((0.0, DEFAULT_WATCH_INTERVAL_S), (0.01, 0.2), (0.2, 0.2),
                              (5.0, 5.0), (MAX_WATCH_INTERVAL_S, MAX_WATCH_INTERVAL_S)):
            with daemon.watching(TENANT, "", asked) as interval:
                assert interval == served
        for bad in (-1.0, float("nan"), MAX_WATCH_INTERVAL_S * 2):
            with pytest.raises(InvalidArgument) as err, daemon.watching(TENANT, "", bad):
                pass
            assert err.value.field == "interval_seconds"
            assert "--watch-min-interval" in err.value.message
        assert daemon.count_watch_streams(TENANT.identity) == 0
    finally:
        daemon.close()


async def test_watch_stream_cap_per_identity(socket_dir: Path) -> None:
    """engine-a may hold 2 WatchStats streams: the third is RESOURCE_EXHAUSTED naming what was
    asked, what it holds, the cap and its knob; engine-b is not held back; once engine-a ends a
    stream it may open another. A stream asking for 0.05 s (under the 0.5 s minimum) is
    admitted and served."""
    daemon, server = await serve(socket_dir, max_watch_streams_per_identity=2)
    try:
        async with AsyncKVPoolClient(server.addresses[1], token="secret-a") as a, \
                AsyncKVPoolClient(server.addresses[1], token="secret-b") as b:
            streams = [a.watch_stats(interval_s=0.05) for _ in range(2)]
            for s in streams:
                assert (await anext(s)).daemon.other_leases == 0
            assert daemon.count_watch_streams("engine-a") == 2
            with pytest.raises(ResourceExhausted) as err:
                await anext(a.watch_stats())
            assert re.search(r"identity 'engine-a' asks for a WatchStats stream and has 2 open, "
                             r"the cap per identity is 2 \(max_watch_streams_per_identity, "
                             r"--max-watch-streams-per-identity\)", err.value.message)
            others = [b.watch_stats() for _ in range(2)]
            for s in others:
                await anext(s)
            await streams[0].aclose()
            for _ in range(500):  # the server ends the stream when it sees the cancel
                if daemon.count_watch_streams("engine-a") == 1:
                    break
                await asyncio.sleep(0.01)
            again = a.watch_stats()
            await anext(again)
            for s in (streams[1], again, *others):
                await s.aclose()
            raw = await a.call("Stats", pb.StatsRequest())  # unary Stats has no such cap
            assert raw.daemon.num_pools == 0
    finally:
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()


async def test_unary_stats_of_many_callers_share_builds_through_the_server(
        socket_dir: Path) -> None:
    """Through the real server: twenty Stats calls at once from two admin identities (a token
    over TCP, the local identity over Unix) each get the full picture."""
    daemon, server = await serve(socket_dir)
    try:
        async with AsyncKVPoolClient(server.addresses[1], token="secret-ops") as ops, \
                AsyncKVPoolClient(server.addresses[0]) as local:
            await local.configure("a", spec=TINY_SPEC, **TINY_OPTIONS)
            leases = [await local.lease(f"engine-{i}") for i in range(5)]
            for lease in leases:
                await lease.allocate("a", "kv", 2)
            got = await asyncio.gather(*(c.stats() for c in (ops, local) for _ in range(10)))
            for stats in got:
                assert sorted(x.name for x in stats.leases) == [f"engine-{i}" for i in range(5)]
                assert all(x.held == {"a": {"kv": 2}} for x in stats.leases)
            for lease in leases:
                await lease.close()
    finally:
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()


"""Pressure (issue 12 item 2): leases report their page caches on KeepAlive; an Allocate short of
free ids asks the leases with cached ids to give some back, on their streams at once, and
waits for them; Stats shows what each lease holds cached. A real daemon on the real clock."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import numpy as np
import pytest
from grpc import aio

from kvpool import AsyncKVPoolClient, KVPoolClient
from kvpool.contract.errors import ResourceExhausted
from kvpool.contract.wire import allocate_request, free_request
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.server.daemon import Daemon
from tests.conftest import TINY_OPTIONS, TINY_SPEC
from tests.service.conftest import open_raw, proof

CAPACITY = 256  # tiny/kv
PRESSURE = CAPACITY // 16


@pytest.fixture
async def live(live: tuple[Daemon, str]) -> tuple[Daemon, str]:
    """The service conftest's live daemon with the tiny pool."""
    async with AsyncKVPoolClient(live[1]) as client:
        await client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
    return live


async def holding_20(holder: Any) -> tuple[Any, np.ndarray]:
    """A page cache of ``holder`` (high 200) settled with 20 ids in use and 180 cached."""
    cache = await holder.page_cache("tiny", low=0, high=200, batch=50)
    await cache.settle()
    in_use = await cache.alloc(20)
    await cache.settle()
    assert (cache.core.in_use, cache.core.cached) == (20, 180)
    return cache, in_use


def lease_stats(stats: object, lease_id: int) -> object:
    return next(x for x in stats.leases if x.lease_id == lease_id)  # type: ignore[attr-defined]


async def test_allocate_gets_ids_back_from_another_leases_cache(
        live: tuple[Daemon, str]) -> None:
    async with AsyncKVPoolClient(live[1]) as client, await client.lease("holder") as holder, \
                await client.lease("taker") as taker:
        cache, in_use = await holding_20(holder)
        assert await holder.report_now()
        mine = lease_stats(await client.stats("tiny"), holder.lease_id)
        assert mine.held == {"tiny": {"kv": 200}} and mine.cached == {"tiny": {"kv": 180}}
        assert mine.in_use("tiny") == 20
        assert "kv=200 (180 cached)" in mine.held_text()

        # 56 free, 100 asked: 44 short, and the holder's cache reports 180.
        got = await taker.allocate("tiny", "kv", 100)
        assert len(got) == 100 and not set(got.tolist()) & set(in_use.tolist())
        # That left the pool empty: pressure asks the holder for 16 more (the taker's
        # answer does not wait for those).
        while cache.core.gave_back < 44 + PRESSURE:
            await asyncio.sleep(0.01)
        await cache.settle()
        assert cache.core.gave_back == 44 + PRESSURE and cache.core.in_use == 20
        assert cache.core.cached == 180 - cache.core.gave_back
        assert await holder.report_now()
        stats = await client.stats("tiny")
        kv = stats.pool("tiny").spaces["kv"]
        assert kv.used + kv.free == CAPACITY and kv.used <= CAPACITY
        mine = lease_stats(stats, holder.lease_id)
        assert mine.held["tiny"]["kv"] == cache.core.in_use + cache.core.cached
        assert mine.cached.get("tiny", {}).get("kv", 0) == cache.core.cached
        assert lease_stats(stats, taker.lease_id).held == {"tiny": {"kv": 100}}
        # the ids in use were never given away: they are still the holder's to free
        await cache.close()
        assert await holder.free("tiny", "kv", in_use) == 20


async def test_allocate_that_all_cached_ids_cannot_cover_fails_without_asking(
        live: tuple[Daemon, str]) -> None:
    async with AsyncKVPoolClient(live[1]) as client, await client.lease("holder") as holder, \
                await client.lease("taker") as taker:
        cache, _ = await holding_20(holder)
        assert await holder.report_now()
        # 56 free + 180 cached < 250: refused at once, nobody is asked anything
        with pytest.raises(ResourceExhausted) as info:
            await taker.allocate("tiny", "kv", 250)
        assert "give back" not in info.value.message
        await cache.settle()
        assert cache.core.gave_back == 0 and (cache.core.in_use, cache.core.cached) == (20, 180)
        # without caches anywhere, nothing changes either
        await cache.close()
        assert await holder.report_now()
        with pytest.raises(ResourceExhausted) as info:
            await taker.allocate("tiny", "kv", 250)
        assert "give back" not in info.value.message


async def test_give_back_is_sent_at_once_and_allocate_waits_for_the_free(
        live: tuple[Daemon, str]) -> None:
    """The wire protocol with raw stubs: the GiveBack comes on the holder's stream without a
    request (seq 0); the Allocate answers once the holder frees."""
    async with aio.insecure_channel(live[1]) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        holder = await open_raw(stub, "raw")
        taker = await open_raw(stub, "t")
        resp = await stub.Allocate(allocate_request("tiny", holder, [("kv", 250)]))
        ids = np.frombuffer(resp.items[0].ids, "<i4")
        stream = stub.KeepAlive()
        await stream.write(pb.KeepAliveRequest(**proof(holder), seq=7, caches=[
            pb.CacheReport(pool="tiny", space="kv", cached=200, in_use=50)]))
        answer = await stream.read()
        assert answer.seq == 7 and list(answer.give_back) == []
        stats = await stub.Stats(pb.StatsRequest(pool="tiny"))
        (mine,) = [x for x in stats.leases if x.lease_id == holder.lease_id]
        assert [(h.pool, h.space, h.count) for h in mine.cached] == [("tiny", "kv", 200)]

        allocate = asyncio.ensure_future(
            stub.Allocate(allocate_request("tiny", taker, [("kv", 10)])))
        ask = await stream.read()  # no request was written: the daemon sent it on its own
        assert ask.seq == 0 and ask.lease_id == holder.lease_id
        # 6 free, 10 asked: 4 short
        assert [(g.pool, g.space, g.count) for g in ask.give_back] == [("tiny", "kv", 4)]
        assert not allocate.done()
        await stub.Free(free_request("tiny", holder, [("kv", ids[-5:])]))
        got = np.frombuffer((await allocate).items[0].ids, "<i4")
        assert sorted(got.tolist()) != [] and len(got) == 10
        # the pool is now full: pressure asks the holder for more, without anyone waiting
        more = await stream.read()
        assert more.seq == 0 and more.give_back[0].count == PRESSURE - 1
        kv = (await stub.Stats(pb.StatsRequest(pool="tiny"))).pools[0].spaces[0]
        assert (kv.used, kv.capacity) == (CAPACITY - 1, CAPACITY)
        await stream.done_writing()


async def test_allocate_fails_at_its_deadline_when_nobody_gives_back(
        live: tuple[Daemon, str]) -> None:
    """A holder that reports cached ids but never frees: the Allocate waits (capped by its own
    gRPC deadline) and then fails RESOURCE_EXHAUSTED, saying what was asked and what came."""
    async with aio.insecure_channel(live[1]) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        holder = await open_raw(stub, "raw")
        taker = await open_raw(stub, "t")
        await stub.Allocate(allocate_request("tiny", holder, [("kv", CAPACITY)]))
        stream = stub.KeepAlive()
        await stream.write(pb.KeepAliveRequest(**proof(holder), seq=1, caches=[
            pb.CacheReport(pool="tiny", space="kv", cached=CAPACITY)]))
        await stream.read()
        with pytest.raises(grpc.RpcError) as info:
            await stub.Allocate(allocate_request("tiny", taker, [("kv", 3)]), timeout=0.5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "give back 3 cached ids; 0 ids came free" in info.value.details()
        assert (await stream.read()).give_back[0].count == 3
        await stream.done_writing()


async def test_keep_alive_without_caches_and_bad_reports(live: tuple[Daemon, str]) -> None:
    async with aio.insecure_channel(live[1]) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        lease = await open_raw(stub, "plain")
        stream = stub.KeepAlive()
        await stream.write(pb.KeepAliveRequest(**proof(lease), seq=1, caches=[]))
        assert (await stream.read()).seq == 1
        await stream.write(pb.KeepAliveRequest(**proof(lease)))  # a client of the first form
        assert (await stream.read()).seq == 0
        stats = await stub.Stats(pb.StatsRequest())
        assert [list(x.cached) for x in stats.leases] == [[]]
        await stream.write(pb.KeepAliveRequest(**proof(lease), caches=[pb.CacheReport()]))
        with pytest.raises(grpc.RpcError) as info:
            await stream.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def sync_give_back(target: str) -> dict[str, object]:
    """The blocking client: its keep-alive thread reports the cache and routes give-backs."""
    out: dict[str, object] = {}
    with KVPoolClient(target) as client, client.lease("holder") as holder, \
            client.lease("taker") as taker:
        with holder.page_cache("tiny", low=0, high=200, batch=50) as cache:
            cache.settle(30)
            in_use = cache.alloc(20)
            assert holder.report_now()
            out["taken"] = len(taker.allocate("tiny", "kv", 100))
            while cache.core.gave_back < 44 + PRESSURE:  # the give-back, then pressure's
                time.sleep(0.01)
            cache.settle(30)
            assert holder.report_now()
            out["cache"] = (cache.core.in_use, cache.core.cached, cache.core.gave_back)
            stats = client.stats("tiny")
            mine = lease_stats(stats, holder.lease_id)
            out["held"], out["cached"] = mine.held["tiny"]["kv"], mine.cached["tiny"]["kv"]
            out["used"] = stats.pool("tiny").spaces["kv"].used
        out["freed"] = holder.free("tiny", "kv", in_use)
    return out


async def test_sync_client_gives_back(live: tuple[Daemon, str]) -> None:
    out = await asyncio.to_thread(sync_give_back, live[1])
    in_use, cached, gave_back = out["cache"]  # type: ignore[misc]
    assert out["taken"] == 100 and in_use == 20 and gave_back == 44 + PRESSURE
    assert cached == 180 - gave_back
    assert out["held"] == in_use + cached and out["cached"] == cached
    assert out["used"] == out["held"] + 100
    assert out["freed"] == 20


async def report(stub: kvpool_pb2_grpc.KVPoolStub, lease: object, cached: int,
                 pool: str = "tiny", space: str = "kv") -> aio.StreamStreamCall:
    """A KeepAlive stream of ``lease`` that has reported ``cached`` ids (and been answered)."""
    stream = stub.KeepAlive()
    await stream.write(pb.KeepAliveRequest(**proof(lease), seq=1, caches=[  # type: ignore
        pb.CacheReport(pool=pool, space=space, cached=cached)]))
    assert (await stream.read()).seq == 1
    return stream


async def test_a_report_no_holding_backs_steers_nothing(live: tuple[Daemon, str]) -> None:
    """Issue 20, finding 6: a lease reporting 2**63 cached ids while holding nothing. An
    Allocate that cannot be satisfied is refused at once: no give-back is asked of anyone (the
    liar's stream gets none, nor does an honest cache that could not cover it alone), and Stats
    shows the report capped at what the lease holds."""
    daemon = live[0]
    async with aio.insecure_channel(live[1]) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        liar, honest, taker = [await open_raw(stub, n) for n in ("liar", "honest", "taker")]
        await stub.Allocate(allocate_request("tiny", honest, [("kv", 10)]))
        await stub.Allocate(allocate_request("tiny", taker, [("kv", CAPACITY - 10)]))
        lying = await report(stub, liar, 2**63)
        honest_stream = await report(stub, honest, 10)
        for count in (1, 11):  # one the honest cache could cover, one nobody could
            with pytest.raises(grpc.RpcError) as info:
                await stub.Allocate(allocate_request("tiny", taker, [("kv", count)]),
                                    timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            if count == 11:
                assert "give back" not in info.value.details()
        lease_of = daemon.leases.find
        assert lease_of(liar.lease_id).give_back == {}  # type: ignore[union-attr]
        assert lease_of(liar.lease_id).cached("tiny", "kv") == 0  # type: ignore[union-attr]
        stats = await stub.Stats(pb.StatsRequest(pool="tiny"))
        (mine,) = [x for x in stats.leases if x.lease_id == liar.lease_id]
        assert list(mine.cached) == []
        # The honest cache was asked for the 1 it could give (the first Allocate), never for
        # the 11 it could not.
        ask = await honest_stream.read()
        assert [(g.space, g.count) for g in ask.give_back] == [("kv", 1)]
        for stream in (lying, honest_stream):
            await stream.done_writing()
        # The liar's stream got nothing but the answer to its own report.
        assert await lying.read() == aio.EOF


async def test_a_report_is_capped_at_what_the_lease_holds(live: tuple[Daemon, str]) -> None:
    """A lease holding 3 pages that reports 2**63 cached counts as 3: an Allocate 4 short is
    refused at once, one 3 short asks it for 3; a report of a pool or space that does not exist
    is not kept."""
    daemon = live[0]
    async with aio.insecure_channel(live[1]) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        holder, taker = await open_raw(stub, "holder"), await open_raw(stub, "taker")
        await stub.Allocate(allocate_request("tiny", holder, [("kv", 3)]))
        await stub.Allocate(allocate_request("tiny", taker, [("kv", CAPACITY - 3)]))
        stream = await report(stub, holder, 2**63)
        assert daemon.leases.find(holder.lease_id).cached("tiny", "kv") == 3  # type: ignore
        with pytest.raises(grpc.RpcError) as info:
            await stub.Allocate(allocate_request("tiny", taker, [("kv", 4)]), timeout=30)
        assert "give back" not in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            await stub.Allocate(allocate_request("tiny", taker, [("kv", 3)]), timeout=0.5)
        assert "give back 3 cached ids; 0 ids came free" in info.value.details()
        assert [(g.count) for g in (await stream.read()).give_back] == [3]
        await stream.write(pb.KeepAliveRequest(**proof(holder), seq=2, caches=[
            pb.CacheReport(pool="nope", space="kv", cached=5),
            pb.CacheReport(pool="tiny", space="nope", cached=5)]))
        assert (await stream.read()).seq == 2
        assert daemon.leases.find(holder.lease_id).reports == {}  # type: ignore[union-attr]
        await stream.done_writing()

"""Elastic pools in a real daemon (issue 23): a daemon on the real clock, real sparse /dev/shm
regions, real gRPC on a Unix socket. Two pools trade groups under one budget; floors that do not
fit are refused; a group asked back is released only after the leases that attached the pool
unmapped it (or lost their lease for not doing so in time)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc import aio

from kvpool.contract import codec
from kvpool.contract.wire import LeaseKey, allocate_request, configure_request, free_request
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.server.daemon import Daemon
from kvpoold.server.run import create_server, sweep_leases
from kvpoold.settings import Listener
from kvpoold.sharing.shm import ShmBackingFactory
from tests.conftest import TINY_SPEC, temp_dir
from tests.service.conftest import open_raw, proof

MiB = 1 << 20
# tiny: 4 views (K, V of 2 layers) of 64 B a token; page 16 -> 1 KiB a page a view: a group is
# 2,048 pages (32,768 tokens), 8 MiB; the fixed part (req_to_token) one 2 MiB chunk.
GROUP = 8 * MiB
FIXED = 2 * MiB
PAGES = 2048
ELASTIC = {"elastic": True, "budget_bytes": 4 * GROUP, "page_size": 16,
           "max_running_requests": 8}
BUDGET = 2 * FIXED + 3 * GROUP  # two floors of one group, one group free


@contextlib.asynccontextmanager
async def served(budget: int, *, sweep: bool = True, **kw: Any
                 ) -> AsyncIterator[tuple[Daemon, kvpool_pb2_grpc.KVPoolStub]]:
    """A daemon of ``budget`` bytes on a Unix socket, its lease sweep every 50 ms (unless
    ``sweep`` is False: the test sweeps), and a stub to it."""
    with temp_dir() as sock_dir, temp_dir("kvp-shm-", "/dev/shm") as shm:
        d = Daemon("cpu", budget, ShmBackingFactory(shm), **kw)
        sock = sock_dir / "k.sock"
        server = create_server(d, [Listener("unix", str(sock))])
        await server.start()
        sweeper = asyncio.create_task(sweep_leases(d, 0.05)) if sweep else None
        channel = aio.insecure_channel(f"unix://{sock}")
        try:
            yield d, kvpool_pb2_grpc.KVPoolStub(channel)
        finally:
            if sweeper is not None:
                sweeper.cancel()
            await channel.close()
            await server.shutdown(0)
            server.remove_sockets()
            d.close()


@pytest.fixture
async def daemon() -> AsyncIterator[tuple[Daemon, kvpool_pb2_grpc.KVPoolStub]]:
    async with served(BUDGET, reclaim_deadline_s=0.5) as out:
        yield out


async def configure(stub: kvpool_pb2_grpc.KVPoolStub, pool: str, **over: Any
                    ) -> pb.ConfigureResponse:
    return await stub.Configure(configure_request(pool, spec=TINY_SPEC, **{**ELASTIC, **over}))


async def allocate(stub: kvpool_pb2_grpc.KVPoolStub, pool: str, lease: LeaseKey,
                   count: int) -> np.ndarray:
    resp = await stub.Allocate(allocate_request(pool, lease, [("kv", count)]))
    return codec.ids_from_bytes(resp.items[0].ids).copy()


async def free(stub: kvpool_pb2_grpc.KVPoolStub, pool: str, lease: LeaseKey,
               ids: np.ndarray) -> None:
    await stub.Free(free_request(pool, lease, [("kv", ids)]))


def elastic(d: Daemon, pool: str) -> Any:
    stats = d.elastic.stats(pool)
    assert stats is not None
    return stats


def backed(d: Daemon) -> int:
    return sum(e.backing.backed_bytes() for e in d.pools.values())  # type: ignore[attr-defined]


async def until(check: Any, timeout_s: float = 60.0) -> None:
    """Wait for ``check`` (a fact); the ceiling only ends a test that would hang, so it is
    generous: a loaded 2-core machine is slow, never wrong."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not check():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


async def test_two_pools_trade_groups_under_one_budget(daemon: Any) -> None:
    d, stub = daemon
    a = await configure(stub, "a")
    await configure(stub, "b")
    plan = codec.plan_from_json(a.plan_json)
    assert plan.elastic is not None and plan.elastic.group_bytes == GROUP
    assert (plan.elastic.groups, plan.elastic.pages_per_group, plan.elastic.floor_groups) == (
        4, PAGES, 1)
    assert elastic(d, "a").granted_groups == elastic(d, "b").granted_groups == 1
    assert backed(d) == 2 * (FIXED + GROUP) <= BUDGET
    la, lb = await open_raw(stub, "a"), await open_raw(stub, "b")
    # a takes all of group 0 and more: the free group is granted to it
    ids_a = await allocate(stub, "a", la, PAGES + 10)
    assert elastic(d, "a").granted_groups == 2
    assert {int(i) // PAGES for i in ids_a} == {0, 1}
    assert backed(d) == 2 * FIXED + 3 * GROUP == d.used_bytes <= BUDGET
    # b wants more while a holds pages in both: nothing free, nothing a can give
    ids_b = await allocate(stub, "b", lb, PAGES - 1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await allocate(stub, "b", lb, 5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "granted groups" in (err.value.details() or "")
    # a frees its pages of group 1 (first fit put the last 11 there): b gets that group
    await free(stub, "a", la, ids_a[PAGES - 1:])
    more = await allocate(stub, "b", lb, 5)
    assert {int(i) // PAGES for i in more} == {1}
    sa, sb = elastic(d, "a"), elastic(d, "b")
    assert (sa.granted_groups, sb.granted_groups) == (1, 2)
    assert sa.reclaims == 1 and sb.grants == 2
    assert 0 < sa.reclaim_seconds_max < 5
    assert backed(d) == 2 * FIXED + 3 * GROUP <= BUDGET
    for e in d.pools.values():
        e.ids.audit()
    del ids_b


async def test_floors_that_do_not_fit_are_refused_naming_the_numbers(daemon: Any) -> None:
    d, stub = daemon
    await configure(stub, "a", elastic_floor_tokens=2 * PAGES * 16)  # 2 groups
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await configure(stub, "b", elastic_floor_tokens=2 * PAGES * 16)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    text = err.value.details() or ""
    assert "floor of 2 groups" in text and f"{2 * GROUP:,} B" in text
    assert f"{BUDGET:,} B" in text and "--elastic-floor-tokens" in text
    assert "b" not in d.pools and backed(d) == FIXED + 2 * GROUP


async def test_fixed_pools_beside_elastic_ones_are_unchanged(daemon: Any) -> None:
    d, stub = daemon
    await configure(stub, "a")
    fixed = await stub.Configure(configure_request(
        "f", spec=TINY_SPEC, budget_bytes=1 * MiB, page_size=16, max_running_requests=8))
    plan = codec.plan_from_json(fixed.plan_json)
    assert plan.elastic is None and d.pools["f"].sharing == "shm"
    assert d.used_bytes == FIXED + GROUP + plan.backing_bytes
    stats = await stub.Stats(pb.StatsRequest())
    by_name = {p.name: p for p in stats.pools}
    assert by_name["a"].HasField("elastic") and not by_name["f"].HasField("elastic")
    assert by_name["a"].elastic.granted_bytes == FIXED + GROUP


async def keep_alive(stub: kvpool_pb2_grpc.KVPoolStub, lease: LeaseKey,
                     requests: asyncio.Queue[pb.KeepAliveRequest | None]) -> Any:
    async def gen() -> AsyncIterator[pb.KeepAliveRequest]:
        while (r := await requests.get()) is not None:
            yield r
    return stub.KeepAlive(gen())


async def test_a_group_is_released_only_after_the_attached_lease_unmaps_it(
        daemon: Any) -> None:
    d, stub = daemon
    await configure(stub, "a")
    await configure(stub, "b")
    la, lb = await open_raw(stub, "a"), await open_raw(stub, "b")
    att = await stub.Attach(pb.AttachRequest(pool="a", **proof(la)))
    assert att.handle.sharing == "shm_sparse"
    assert codec.groups_from_bytes(att.elastic_groups) == (0,)
    queue: asyncio.Queue[pb.KeepAliveRequest | None] = asyncio.Queue()
    stream = await keep_alive(stub, la, queue)
    await queue.put(pb.KeepAliveRequest(seq=1, **proof(la)))
    first = await stream.read()
    assert first.seq == 1 and not first.unmap
    ids = await allocate(stub, "a", la, PAGES + 1)  # a: 2 groups, the budget's last one
    await free(stub, "a", la, ids)
    taker = asyncio.create_task(allocate(stub, "b", lb, PAGES))  # b needs a's group 1
    ask = await asyncio.wait_for(stream.read(), 5)
    assert ask.seq == 0 and len(ask.unmap) == 1
    unmap = ask.unmap[0]
    assert unmap.pool == "a" and codec.groups_from_bytes(unmap.groups) == (1,)
    assert 0 < unmap.deadline_seconds <= 0.5
    await asyncio.sleep(0.1)
    assert not taker.done() and elastic(d, "a").reclaiming_groups == 1
    assert backed(d) == 2 * FIXED + 3 * GROUP  # still a's memory: nobody else's yet
    await queue.put(pb.KeepAliveRequest(seq=2, unmapped=[unmap.reclaim], **proof(la)))
    got = await asyncio.wait_for(taker, 5)
    assert {int(i) // PAGES for i in got} == {0, 1}
    assert elastic(d, "a").granted_groups == 1 and elastic(d, "b").granted_groups == 2
    assert d.leases.find(la.lease_id) is not None  # it acknowledged: it keeps its lease
    await queue.put(None)
    stream.cancel()


async def test_a_lease_that_never_unmaps_loses_it_and_the_others_keep_theirs(
        daemon: Any) -> None:
    d, stub = daemon
    await configure(stub, "a")
    await configure(stub, "b")
    la, lb, other = (await open_raw(stub, "a"), await open_raw(stub, "b"),
                     await open_raw(stub, "other"))
    await stub.Attach(pb.AttachRequest(pool="a", **proof(la)))
    ids = await allocate(stub, "a", la, PAGES + 1)
    await free(stub, "a", la, ids)
    # b waits (1 s at most) while a's lease has 0.5 s to unmap; it never does: it loses its
    # lease at the deadline, the group is freed and granted to b, whose Allocate then succeeds
    got = await allocate(stub, "b", lb, PAGES)
    assert len(got) == PAGES and {int(i) // PAGES for i in got} == {0, 1}
    assert d.leases.find(la.lease_id) is None
    assert elastic(d, "a").revoked_leases == 1 and d.attachments.count_pool("a") == 0
    assert d.leases.find(lb.lease_id) is not None and d.leases.find(other.lease_id)
    assert elastic(d, "b").granted_groups == 2 and backed(d) <= BUDGET
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a's lease is gone for good
        await allocate(stub, "a", la, 1)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_attach_to_an_elastic_pool_needs_a_lease(daemon: Any) -> None:
    _, stub = daemon
    await configure(stub, "a")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Attach(pb.AttachRequest(pool="a"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "under a lease" in (err.value.details() or "")


async def test_lease_end_gives_back_what_the_pool_held_above_its_floor(daemon: Any) -> None:
    d, stub = daemon
    await configure(stub, "a")
    la = await open_raw(stub, "a")
    await allocate(stub, "a", la, PAGES + 1)
    assert elastic(d, "a").granted_groups == 2
    await stub.CloseLease(pb.CloseLeaseRequest(**proof(la)))
    await until(lambda: elastic(d, "a").granted_groups == 1)
    assert backed(d) == FIXED + GROUP


def test_shm_files_of_elastic_pools_are_0600() -> None:
    from kvpool.contract.spec import decode_spec
    from kvpoold.sizing import make_options, plan

    p = plan(decode_spec(TINY_SPEC), make_options(**ELASTIC))
    with temp_dir("kvp-shm-", "/dev/shm") as shm, ShmBackingFactory(shm) as factory:
        backing = factory.create_elastic(p, "a")
        assert os.stat(backing.path).st_mode & 0o777 == 0o600
        assert backing.backed_bytes() == FIXED


async def test_the_descriptor_socket_hands_out_nothing_unproven(daemon: Any) -> None:
    """Daemon.fd_grant, the side socket's check: a proven lease with an attachment of the pool;
    a CPU pool goes out as its one file (no parts), and the daemon records which process took
    it under which lease, until the lease ends."""
    from kvpool.contract.errors import FailedPrecondition, NotFound
    from kvpool.contract.fd_channel import FdAsk

    d, stub = daemon
    await configure(stub, "a")
    la = await open_raw(stub, "a")
    me = os.getpid()
    with pytest.raises(NotFound):
        d.fd_grant(FdAsk(pool="a", lease_id=la.lease_id, secret="00" * 16), os.getuid(), me)
    whole = FdAsk(pool="a", lease_id=la.lease_id, secret=la.secret.hex())
    with pytest.raises(FailedPrecondition, match="no attachment"):
        d.fd_grant(whole, os.getuid(), me)
    att = await stub.Attach(pb.AttachRequest(pool="a", **proof(la)))
    with pytest.raises(FailedPrecondition, match="is one file"):
        d.fd_grant(FdAsk(pool="a", lease_id=la.lease_id, secret=la.secret.hex(), groups=(0,)),
                   os.getuid(), me)
    assert d.attachments.holders("a") == {}
    grant = d.fd_grant(whole, os.getuid(), me)
    try:
        (fd,) = grant.fds
        assert os.fstat(fd).st_ino == os.stat(att.handle.path).st_ino
        assert grant.size == att.handle.size and grant.kind == "shm_sparse"
    finally:
        grant.close()
    assert d.attachments.holders("a") == {me: {la.lease_id}}
    await stub.Detach(pb.DetachRequest(attach_id=att.attach_id))
    # a detach is the client's word, not a fact: its process stays a writer of the pool
    # under the lease until the lease ends
    assert d.attachments.holders("a") == {me: {la.lease_id}}
    await stub.CloseLease(pb.CloseLeaseRequest(**proof(la)))
    assert d.attachments.holders("a") == {}


async def test_the_greedy_policy_never_takes_from_another_pool() -> None:
    """--elastic-policy greedy: a pool takes only what is free and gives back its wholly free
    groups beyond one spare on the sweep; another pool short of pages waits for that instead
    of taking groups back."""
    async with served(BUDGET + 2 * GROUP, sweep=False, elastic_policy="greedy") as (d, stub):
        await configure(stub, "a")
        await configure(stub, "b")
        la, lb = await open_raw(stub, "a"), await open_raw(stub, "b")
        ids = await allocate(stub, "a", la, 2 * PAGES + 1)  # a: 3 groups, all there is
        assert elastic(d, "a").granted_groups == 3
        await free(stub, "a", la, ids)
        with pytest.raises(grpc.aio.AioRpcError):  # b may not take a's free groups
            await allocate(stub, "b", lb, PAGES)
        assert elastic(d, "a").reclaims == 0
        d.elastic.sweep()  # a gives back what it does not use, beyond one spare group
        await until(lambda: elastic(d, "a").granted_groups == 2)
        got = await allocate(stub, "b", lb, PAGES)
        assert len(got) == PAGES and elastic(d, "b").granted_groups == 2


async def test_drop_of_an_elastic_pool_gives_its_whole_charge_back(daemon: Any) -> None:
    d, stub = daemon
    await configure(stub, "a")
    await configure(stub, "b")
    la = await open_raw(stub, "a")
    await allocate(stub, "a", la, PAGES + 1)  # a: two groups
    assert d.used_bytes == 2 * FIXED + 3 * GROUP
    files = {f.name for f in Path(d.pools["a"].backing.path).parent.iterdir()}  # type: ignore[attr-defined]
    resp = await stub.Drop(pb.DropRequest(pool="a", force=True))
    assert resp.released_bytes == FIXED + 2 * GROUP
    assert d.used_bytes == FIXED + GROUP and "a" not in d.elastic.pools
    left = {f.name for f in Path(d.pools["b"].backing.path).parent.iterdir()}  # type: ignore[attr-defined]
    assert len(files - left) == 1  # a's region file is gone
    lb = await open_raw(stub, "b")
    assert len(await allocate(stub, "b", lb, 3 * PAGES - 1)) == 3 * PAGES - 1  # b has it all


@pytest.mark.parametrize("expire", [False, True], ids=["moves", "expires"])
async def test_a_pool_above_its_share_drains_groups_in_use_for_one_that_waits(
        expire: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """No starvation of the pool that comes second: with every group of the first pool in use,
    its highest group is drained for the second (its free pages no longer handed out to it)
    and moves once its last page is freed; never past equal shares. A drain that does not
    empty in time is undone: the group is a's to use again."""
    if expire:
        monkeypatch.setattr("kvpoold.elastic.manager.BUSY_DRAIN_S", 0.3)
    async with served(2 * FIXED + 4 * GROUP, reclaim_deadline_s=0.5) as (d, stub):
        await configure(stub, "a")
        await configure(stub, "b")
        la, lb = await open_raw(stub, "a"), await open_raw(stub, "b")
        ids_a = await allocate(stub, "a", la, 3 * PAGES - 1)  # groups 0, 1, 2: all in use
        assert elastic(d, "a").granted_groups == 3
        await allocate(stub, "b", lb, PAGES - 1)  # b's floor group, full
        with pytest.raises(grpc.aio.AioRpcError) as err:  # b waits: a's group 2 drains
            await allocate(stub, "b", lb, 5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        space = d.pools["a"].ids.space("kv", "kv")
        assert space.state(2) == "draining" and elastic(d, "a").reclaiming_groups == 1
        assert [space.state(g) for g in (0, 1)] == ["open", "open"]
        # a frees half of group 2 and a page of group 0: it gets group 0's page back,
        # never group 2's, and group 2 stays a's while a page of it is in use
        in_2 = ids_a[ids_a // PAGES == 2]
        await free(stub, "a", la, np.concatenate([in_2[: PAGES // 2], ids_a[:1]]))
        again = await allocate(stub, "a", la, 1)
        assert int(again[0]) // PAGES == 0
        with pytest.raises(grpc.aio.AioRpcError):
            await allocate(stub, "a", la, 1)
        assert space.state(2) == "draining"
        if expire:
            await until(lambda: space.state(2) == "open")
            assert elastic(d, "a").reclaiming_groups == 0
            assert int((await allocate(stub, "a", la, 1))[0]) // PAGES == 2
            return
        # its last page freed, group 2 goes to b (released, then granted on b's next ask)
        await free(stub, "a", la, in_2[PAGES // 2:])
        await until(lambda: elastic(d, "a").granted_groups == 2)
        more = await allocate(stub, "b", lb, 5)
        assert {int(i) // PAGES for i in more} == {1}
        assert (elastic(d, "a").granted_groups, elastic(d, "b").granted_groups) == (2, 2)
        # equal shares now: b asks again, a's pages in use stay a's
        await allocate(stub, "b", lb, PAGES - 5)
        with pytest.raises(grpc.aio.AioRpcError):
            await allocate(stub, "b", lb, 5)
        assert elastic(d, "a").reclaiming_groups == 0
        assert [space.state(g) for g in (0, 1)] == ["open", "open"]
        assert d.used_bytes <= 2 * FIXED + 4 * GROUP
        for e in d.pools.values():
            e.ids.audit()

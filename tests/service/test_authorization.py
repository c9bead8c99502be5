"""Authorization inside the API (issue 15 items 4 and 5; docs/security.md): a lease is proven by
its secret and belongs to its opener's identity; scoped tokens reach only their pools; Stats
shows a caller that is not admin only its own leases; per-identity caps on leases and
attachments. In-process daemons on real sockets, with the real clients."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc import aio

from kvpool import AsyncKVPoolClient
from kvpool.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from kvpool.contract.wire import LeaseKey
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.access import ADMIN, NamedToken, Scope
from kvpoold.server.daemon import Daemon
from kvpoold.server.run import KVPoolServer, create_server
from kvpoold.settings import Listener
from kvpoold.sharing.base import PlainBackingFactory
from tests.conftest import TINY_OPTIONS, TINY_SPEC
from tests.service.conftest import Served, proof

TOKENS = (
    NamedToken("ops", "secret-ops", ADMIN),
    NamedToken("engine-a", "secret-a", Scope(pools=("a", "a-*"))),
    NamedToken("engine-b", "secret-b", Scope(pools=("b",))),
)


@dataclass
class Tenants:
    daemon: Daemon
    server: KVPoolServer
    unix: str
    tcp: str

    def client(self, token: str | None = None, *, tcp: bool = True) -> AsyncKVPoolClient:
        return AsyncKVPoolClient(self.tcp if tcp else self.unix, token=token)


async def serve(socket_dir: Path, **options: object) -> tuple[Daemon, KVPoolServer]:
    daemon = Daemon("cpu", 64 << 20, PlainBackingFactory(torch.device("cpu")),
                    **options)  # type: ignore[arg-type]
    server = create_server(daemon, [Listener("unix", str(socket_dir / "k.sock")),
                                    Listener("tcp", "127.0.0.1:0")], tokens=TOKENS)
    await server.start()
    return daemon, server


@pytest.fixture
async def tenants(socket_dir: Path) -> AsyncIterator[Tenants]:
    """A daemon with three tokens (ops: admin; engine-a: pools a, a-*; engine-b: pool b) and
    the pools a, a-1 and b, configured by the local (Unix, admin) identity."""
    daemon, server = await serve(socket_dir)
    t = Tenants(daemon, server, server.addresses[0], server.addresses[1])
    async with t.client(tcp=False) as local:
        for pool in ("a", "a-1", "b"):
            await local.configure(pool, spec=TINY_SPEC, **TINY_OPTIONS)
    try:
        yield t
    finally:
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()


# -- the lease secret ---------------------------------------------------------------------------

async def test_another_client_cannot_touch_a_lease_knowing_its_id(served: Served) -> None:
    """Client B learns A's lease id (it is in Stats: same identity, admin): KeepAlive, Allocate,
    Free, CloseLease and Attach under it are all NOT_FOUND, with B's secret or none; A's lease
    and pages are untouched."""
    await served.configure()
    async with AsyncKVPoolClient(served.target) as a_client, \
            AsyncKVPoolClient(served.target) as b_client, \
            await a_client.lease("a") as a, await b_client.lease("b") as b:
        pages = await a.allocate("tiny", "kv", 4)
        (seen,) = [x for x in (await b_client.stats()).leases if x.name == "a"]
        assert seen.lease_id == a.lease_id
        for forged in (LeaseKey(a.lease_id, b.secret), LeaseKey(a.lease_id, b"")):
            with pytest.raises(NotFound):
                await b_client.call("Allocate", pb.AllocateRequest(
                    pool="tiny", **proof(forged), items=[pb.AllocateItem(space="kv", count=1)]))
            with pytest.raises(NotFound):
                await b_client.call("Free", pb.FreeRequest(
                    pool="tiny", **proof(forged),
                    items=[pb.IdList(space="kv", ids=pages.tobytes())]))
            with pytest.raises(NotFound):
                await b_client.call("CloseLease", pb.CloseLeaseRequest(**proof(forged)))
            with pytest.raises(NotFound):
                await b_client.attach_raw("tiny", lease=forged)
            stream = b_client.keep_alive_stream()
            with pytest.raises(aio.AioRpcError) as info:
                await stream.write(pb.KeepAliveRequest(**proof(forged)))
                await stream.read()
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        (mine,) = [x for x in (await a_client.stats()).leases if x.lease_id == a.lease_id]
        assert mine.held == {"tiny": {"kv": 4}} and mine.attached == 0
        assert await a.free("tiny", "kv", pages) == 4


async def test_a_wrong_secret_reads_exactly_like_an_unknown_lease(served: Served) -> None:
    """The answer for a wrong, missing or foreign secret is the unknown lease's, word for word
    (but the id it repeats): it says nothing about whether the id exists."""
    lease = await served.lease()
    other = await served.lease("other")

    async def refusal(key: LeaseKey) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(aio.AioRpcError) as info:
            await served.stub.CloseLease(pb.CloseLeaseRequest(**proof(key)))
        return info.value.code(), info.value.details().replace(str(key.lease_id), "ID")

    unknown = await refusal(LeaseKey(12345, lease.secret))
    assert unknown[0] == grpc.StatusCode.NOT_FOUND
    for key in (LeaseKey(lease.lease_id, b""), LeaseKey(lease.lease_id, b"\0" * 16),
                LeaseKey(lease.lease_id, other.secret), LeaseKey(lease.lease_id, b"x" * 200)):
        assert await refusal(key) == unknown
    await served.stub.CloseLease(pb.CloseLeaseRequest(**proof(lease)))


async def test_the_secret_is_never_shown(served: Served) -> None:
    await served.configure()
    async with AsyncKVPoolClient(served.target) as client, await client.lease("x") as lease:
        assert len(lease.secret) == 16
        shown = repr(lease) + repr(LeaseKey(lease.lease_id, lease.secret))
        stats = await client.stats()
        raw = (await served.stub.Stats(pb.StatsRequest())).SerializeToString()
        assert lease.secret.hex() not in shown and repr(lease.secret) not in shown
        assert lease.secret not in raw and str(lease.lease_id) in repr(stats)
        async with await lease.page_cache("tiny", low=2, high=4, batch=2) as cache:
            assert lease.secret.hex() not in repr(cache) and repr(lease.secret) not in repr(cache)


async def test_a_bare_lease_id_is_refused_by_the_client(served: Served) -> None:
    await served.configure()
    async with AsyncKVPoolClient(served.target) as client, await client.lease("x") as lease:
        with pytest.raises(InvalidArgument, match="Lease object"):
            await client.attach_raw("tiny", lease=lease.lease_id)  # type: ignore[arg-type]
        info = await client.attach_raw("tiny", lease=lease)
        assert (await client.stats()).leases[0].attached == 1
        await client.detach(info.attach_id)


# -- identities and scopes ----------------------------------------------------------------------

async def test_a_scoped_token_reaches_only_its_pools(tenants: Tenants) -> None:
    """engine-a may use a and a-*: Configure, Attach, Allocate there; Configure, Attach, Drop,
    Stats of b (which exists) and of c (which does not) are the same PERMISSION_DENIED."""
    async with tenants.client("secret-a") as a:
        assert (await a.configure("a-2", spec=TINY_SPEC, **TINY_OPTIONS)).created
        info = await a.attach_raw("a-1")
        await a.detach(info.attach_id)
        async with await a.lease("engine-a") as lease:
            assert len(await lease.allocate("a", "kv", 2)) == 2
            with pytest.raises(PermissionDenied):
                await lease.allocate("b", "kv", 1)
        answers = set()
        for pool in ("b", "c"):
            calls = (a.configure(pool, spec=TINY_SPEC, **TINY_OPTIONS), a.attach_raw(pool),
                     a.drop(pool, force=True), a.stats(pool))
            for call in calls:
                with pytest.raises(PermissionDenied) as err:
                    await call
                assert err.value.field == "pool"
                answers.add(err.value.message.replace(f"'{pool}'", "POOL"))
        assert len(answers) == 1 and "engine-a" in answers.pop()
        with pytest.raises(NotFound) as missing:  # in scope, not there: lists only its pools
            await a.attach_raw("a-9")
        assert "pools: a, a-1, a-2" in missing.value.message and "b" not in missing.value.message
        assert [p.name for p in (await a.stats()).pools] == ["a", "a-1", "a-2"]
    async with tenants.client("secret-ops") as ops:
        assert sorted(p.name for p in (await ops.stats()).pools) == ["a", "a-1", "a-2", "b"]
        await ops.drop("a-2")


async def test_stats_shows_a_scoped_token_only_its_own_leases(tenants: Tenants) -> None:
    """engine-b sees its lease and counts engine-a's (and the local one) without their ids or
    names; the admin token and the local identity see all three; peers only for admins."""
    async with tenants.client("secret-a") as a, tenants.client("secret-b") as b, \
            tenants.client("secret-ops") as ops, tenants.client(tcp=False) as local, \
            await a.lease("tenant-a-engine") as la, await b.lease("tenant-b-engine") as lb, \
            await local.lease("local-engine") as ll:
        await la.allocate("a", "kv", 3)
        await lb.allocate("b", "kv", 2)
        seen = await b.stats()
        assert [(x.lease_id, x.name) for x in seen.leases] == [(lb.lease_id, "tenant-b-engine")]
        assert (seen.daemon.num_leases, seen.daemon.other_leases) == (3, 2)
        assert [p.name for p in seen.pools] == ["b"]
        raw = await b.call("Stats", pb.StatsRequest())
        text = str(raw)
        for hidden in (str(la.lease_id), str(ll.lease_id), "tenant-a-engine", "local-engine"):
            assert hidden not in text
        watched = b.watch_stats(interval_s=0.05)
        first = await anext(watched)
        await watched.aclose()
        assert [x.lease_id for x in first.leases] == [lb.lease_id]
        for admin in (ops, local):
            everything = await admin.stats()
            assert {x.lease_id for x in everything.leases} == {la.lease_id, lb.lease_id,
                                                               ll.lease_id}
            assert everything.daemon.other_leases == 0


async def test_a_lease_belongs_to_the_identity_that_opened_it(tenants: Tenants) -> None:
    """Even with the secret, engine-b cannot use engine-a's lease; nor the local identity."""
    async with tenants.client("secret-a") as a, tenants.client("secret-b") as b, \
            tenants.client(tcp=False) as local, await a.lease("a") as la:
        for other in (b, local):
            with pytest.raises(NotFound):
                await other.call("CloseLease", pb.CloseLeaseRequest(**proof(la)))
        assert (await a.stats()).leases[0].lease_id == la.lease_id


async def test_drop_in_use_names_only_the_callers_own_leases(tenants: Tenants) -> None:
    async with tenants.client("secret-a") as a, tenants.client("secret-ops") as ops, \
            await ops.lease("ops-engine") as lo, await a.lease("a-engine") as la:
        await lo.allocate("a", "kv", 2)
        with pytest.raises(FailedPrecondition) as err:
            await a.drop("a")
        assert str(lo.lease_id) not in err.value.message and "ops-engine" not in err.value.message
        assert "1 lease holds ids [1 not yours]" in err.value.message
        await la.allocate("a", "kv", 1)
        with pytest.raises(FailedPrecondition) as err:
            await a.drop("a")
        assert f"a-engine (lease {la.lease_id}, 1 ids), and 1 more" in err.value.message
        assert str(lo.lease_id) not in err.value.message
        with pytest.raises(FailedPrecondition) as err:
            await ops.drop("a")
        assert str(lo.lease_id) in err.value.message and str(la.lease_id) in err.value.message


async def test_an_attachment_is_detached_only_by_its_identity(tenants: Tenants) -> None:
    async with tenants.client("secret-a") as a, tenants.client("secret-ops") as ops:
        info = await a.attach_raw("a")
        with pytest.raises(NotFound) as err:
            await ops.detach(info.attach_id)
        assert err.value.field == "attach_id"
        await a.detach(info.attach_id)


async def test_tokens_on_the_unix_socket(socket_dir: Path) -> None:
    """A token on the Unix socket names its identity; an unknown one is UNAUTHENTICATED;
    with unix_auth token a Unix caller without one is too."""
    daemon = Daemon("cpu", 16 << 20, PlainBackingFactory(torch.device("cpu")))
    server = create_server(daemon, [Listener("unix", str(socket_dir / "k.sock"))],
                           tokens=TOKENS, unix_auth="token")
    await server.start()
    target = server.addresses[0]
    try:
        async with AsyncKVPoolClient(target) as anonymous, \
                AsyncKVPoolClient(target, token="wrong") as wrong, \
                AsyncKVPoolClient(target, token="secret-b") as b:
            for client in (anonymous, wrong):
                with pytest.raises(Unauthenticated):
                    await client.stats()
            assert await b.health() == "SERVING"
            with pytest.raises(PermissionDenied):
                await b.configure("a", spec=TINY_SPEC, **TINY_OPTIONS)
            await b.configure("b", spec=TINY_SPEC, **TINY_OPTIONS)
            async with await b.lease("b") as lease:
                assert (await b.stats()).leases[0].lease_id == lease.lease_id
    finally:
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()


# -- per-identity caps --------------------------------------------------------------------------

async def test_lease_and_attachment_caps_per_identity(socket_dir: Path) -> None:
    """engine-a may hold 2 leases and 1 attachment: the next is RESOURCE_EXHAUSTED naming the
    cap and its knob; engine-b is not held back by engine-a's; closing one makes room."""
    daemon, server = await serve(socket_dir, max_leases_per_identity=2,
                                 max_attachments_per_identity=1)
    try:
        async with AsyncKVPoolClient(server.addresses[1], token="secret-a") as a, \
                AsyncKVPoolClient(server.addresses[1], token="secret-b") as b:
            await a.configure("a", spec=TINY_SPEC, **TINY_OPTIONS)
            await b.configure("b", spec=TINY_SPEC, **TINY_OPTIONS)
            first, second = await a.lease("one"), await a.lease("two")
            with pytest.raises(ResourceExhausted) as err:
                await a.lease("three")
            assert re.search(r"identity 'engine-a' has 2 leases open, the cap per identity is 2 "
                             r"\(max_leases_per_identity, --max-leases-per-identity\)",
                             err.value.message)
            async with await b.lease("b1") as b1, await b.lease("b2"):
                info = await b.attach_raw("b", lease=b1)
                held = await a.attach_raw("a")
                with pytest.raises(ResourceExhausted) as err:
                    await a.attach_raw("a", lease=first)
                assert "cap per identity is 1 (max_attachments_per_identity" in err.value.message
                await a.detach(held.attach_id)
                tied = await a.attach_raw("a", lease=first)
                await b.detach(info.attach_id)
            await first.close()  # ends the attachment tied to it, and frees a lease slot
            async with await a.lease("three"):
                held = await a.attach_raw("a")
                await a.detach(held.attach_id)
            with pytest.raises(NotFound):
                await a.detach(tied.attach_id)
            await second.close()
    finally:
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()


async def test_raw_stubs_with_a_token(tenants: Tenants) -> None:
    """The raw API: OpenLease answers the secret beside the id; requests carry both."""
    async with aio.insecure_channel(tenants.tcp) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        meta = (("authorization", "Bearer secret-a"),)
        resp = await stub.OpenLease(pb.OpenLeaseRequest(name="raw", ttl_seconds=5),
                                    metadata=meta)
        assert resp.lease_id and len(resp.lease_secret) == 16
        got = await stub.Allocate(pb.AllocateRequest(
            pool="a", lease_id=resp.lease_id, lease_secret=resp.lease_secret,
            items=[pb.AllocateItem(space="kv", count=2)]), metadata=meta)
        assert len(got.items[0].ids) == 8
        with pytest.raises(aio.AioRpcError) as info:  # TCP needs the token on every call
            await stub.CloseLease(pb.CloseLeaseRequest(lease_id=resp.lease_id,
                                                       lease_secret=resp.lease_secret))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        closed = await stub.CloseLease(pb.CloseLeaseRequest(
            lease_id=resp.lease_id, lease_secret=resp.lease_secret), metadata=meta)
        assert sum(h.count for h in closed.released) == 2

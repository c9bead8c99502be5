"""A table of bad requests for every RPC: each gets its status code and field, and changes
nothing (Stats before == Stats after, but for the refused-allocation counter)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest

from kvpool.contract.codec import ids_from_bytes
from kvpool.contract.wire import LeaseKey, allocate_request, configure_request, free_request
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc
from tests.conftest import TINY_OPTIONS, TINY_SPEC
from tests.service.conftest import Served, proof

C = grpc.StatusCode


@dataclass
class Ctx:
    """Two leases: ``mine`` holds pages ``my_pages``, ``other`` holds ``their_pages``."""

    stub: kvpool_pb2_grpc.KVPoolStub
    mine: LeaseKey
    other: LeaseKey
    my_pages: np.ndarray
    their_pages: np.ndarray
    fingerprint: str


Call = Callable[[Ctx], Awaitable[Any]]
# A lease of a case: an attribute of Ctx ("mine"), a bare id (no secret), or a key made from Ctx.
LeaseArg = str | int | Callable[[Ctx], LeaseKey]


def key(c: Ctx, lease: LeaseArg) -> LeaseKey:
    if isinstance(lease, str):
        return getattr(c, lease)
    if isinstance(lease, int):
        return LeaseKey(lease, b"")
    return lease(c)


def no_secret(c: Ctx) -> LeaseKey:
    return LeaseKey(c.mine.lease_id, b"")


def wrong_secret(c: Ctx) -> LeaseKey:
    return LeaseKey(c.mine.lease_id, bytes(len(c.mine.secret)))


def others_id(c: Ctx) -> LeaseKey:
    """The other lease's id with my secret: knowing an id is not owning it."""
    return LeaseKey(c.other.lease_id, c.mine.secret)


def configure(pool: str = "new", spec: Any = TINY_SPEC, **options: Any) -> Call:
    def call(c: Ctx) -> Awaitable[Any]:
        req = configure_request(pool, spec=spec, **{**TINY_OPTIONS, **options})
        return c.stub.Configure(req)
    return call


def raw_configure(**fields: Any) -> Call:
    return lambda c: c.stub.Configure(pb.ConfigureRequest(**fields))


def open_lease(name: str = "x", ttl: float = 5.0) -> Call:
    return lambda c: c.stub.OpenLease(pb.OpenLeaseRequest(name=name, ttl_seconds=ttl))


def allocate(items: list[tuple[str, int]] | None = None, pool: str = "tiny",
             lease: LeaseArg = "mine") -> Call:
    def call(c: Ctx) -> Awaitable[Any]:
        return c.stub.Allocate(allocate_request(pool, key(c, lease), items or []))
    return call


def allocate_raw(*items: pb.AllocateItem) -> Call:
    return lambda c: c.stub.Allocate(pb.AllocateRequest(pool="tiny", **proof(c.mine),
                                                        items=items))


def free(ids: Callable[[Ctx], Any], space: str = "kv", pool: str = "tiny",
         lease: LeaseArg = "mine") -> Call:
    def call(c: Ctx) -> Awaitable[Any]:
        return c.stub.Free(free_request(pool, key(c, lease), [(space, ids(c))]))
    return call


def grant(pages: Callable[[Ctx], bytes], lease: LeaseArg = "mine") -> Call:
    def call(c: Ctx) -> Awaitable[Any]:
        return c.stub.GrantReceive(pb.GrantReceiveRequest(pool="tiny", **proof(key(c, lease)),
                                                          pages=pages(c)))
    return call


def send(peer: str = "unix:///nonexistent.sock", token: bytes = b"x" * 16,
         lease: LeaseArg = "mine") -> Call:
    return lambda c: c.stub.Send(pb.SendRequest(pool="tiny", **proof(key(c, lease)),
                                                pages=c.my_pages.tobytes(), peer=peer,
                                                token=token))


def free_bytes(data: bytes) -> Call:
    return lambda c: c.stub.Free(pb.FreeRequest(pool="tiny", **proof(c.mine), items=[
        pb.IdList(space="kv", ids=data)]))


def close(lease: LeaseArg) -> Call:
    return lambda c: c.stub.CloseLease(pb.CloseLeaseRequest(**proof(key(c, lease))))


def attach_under(lease: LeaseArg) -> Call:
    return lambda c: c.stub.Attach(pb.AttachRequest(pool="tiny", **proof(key(c, lease))))


async def keep_alive(c: Ctx, lease: LeaseArg) -> Any:
    stream = c.stub.KeepAlive()
    await stream.write(pb.KeepAliveRequest(**proof(key(c, lease))))
    return await stream.read()


async def watch(c: Ctx, pool: str, interval: float) -> Any:
    stream = c.stub.WatchStats(pb.WatchStatsRequest(pool=pool, interval_seconds=interval))
    return await stream.read()


NO_SUCH = 12345
CASES: list[tuple[str, Call, grpc.StatusCode, str | None]] = [
    # Configure
    ("configure upper-case name", configure("Tiny"), C.INVALID_ARGUMENT, "pool"),
    ("configure empty name", configure(""), C.INVALID_ARGUMENT, "pool"),
    ("configure 64-char name", configure("a" * 64), C.INVALID_ARGUMENT, "pool"),
    ("configure name with slash", configure("a/b"), C.INVALID_ARGUMENT, "pool"),
    ("configure no model", raw_configure(pool="new", budget_bytes=1 << 20), C.INVALID_ARGUMENT,
     "model"),
    ("configure spec without attention",  # a raw message: the client would refuse it first
     raw_configure(pool="new", spec=pb.ModelSpec(num_layers=2, context_length=8),
                   budget_bytes=1 << 20), C.INVALID_ARGUMENT, "model"),
    ("configure hf config not json", raw_configure(pool="new", hf_config_json="{nope",
                                                   budget_bytes=1 << 20),
     C.INVALID_ARGUMENT, "hf_config_json"),
    ("configure hf config a list", raw_configure(pool="new", hf_config_json="[1]",
                                                 budget_bytes=1 << 20),
     C.INVALID_ARGUMENT, "hf_config_json"),
    ("configure no budget", configure(budget_bytes=None), C.INVALID_ARGUMENT, "budget_bytes"),
    ("configure page_size 0", configure(page_size=0), C.INVALID_ARGUMENT, "page_size"),
    ("configure unknown dtype", configure(kv_cache_dtype="fp7"), C.INVALID_ARGUMENT,
     "kv_cache_dtype"),
    ("configure pp_rank = pp_size", configure(pp_size=2, pp_rank=2), C.INVALID_ARGUMENT,
     "pp_rank"),
    ("configure unknown speculative", configure(speculative_algorithm="magic"),
     C.INVALID_ARGUMENT, "speculative_algorithm"),
    ("configure nan ratio", configure(swa_full_tokens_ratio=math.nan), C.INVALID_ARGUMENT,
     "swa_full_tokens_ratio"),
    ("configure budget below a page", configure(budget_bytes=100), C.INVALID_ARGUMENT,
     "budget_bytes"),
    ("configure other layout, same name", configure("tiny", page_size=32), C.ALREADY_EXISTS,
     "pool"),
    ("configure over the device budget", configure(budget_bytes=64 << 20),
     C.RESOURCE_EXHAUSTED, "budget_bytes"),
    # OpenLease
    ("open lease empty name", open_lease(""), C.INVALID_ARGUMENT, "name"),
    ("open lease control chars", open_lease("a\nb"), C.INVALID_ARGUMENT, "name"),
    ("open lease ttl 0", open_lease(ttl=0.0), C.INVALID_ARGUMENT, "ttl_seconds"),
    ("open lease ttl nan", open_lease(ttl=math.nan), C.INVALID_ARGUMENT, "ttl_seconds"),
    ("open lease ttl 1e9", open_lease(ttl=1e9), C.INVALID_ARGUMENT, "ttl_seconds"),
    # KeepAlive / CloseLease
    ("keep alive lease 0", lambda c: keep_alive(c, 0), C.INVALID_ARGUMENT, "lease_id"),
    ("keep alive unknown lease", lambda c: keep_alive(c, NO_SUCH), C.NOT_FOUND, "lease_id"),
    ("keep alive without the secret", lambda c: keep_alive(c, no_secret), C.NOT_FOUND,
     "lease_id"),
    ("keep alive another's lease", lambda c: keep_alive(c, others_id), C.NOT_FOUND, "lease_id"),
    ("close lease 0", lambda c: c.stub.CloseLease(pb.CloseLeaseRequest()), C.INVALID_ARGUMENT,
     "lease_id"),
    ("close unknown lease", close(NO_SUCH), C.NOT_FOUND, "lease_id"),
    ("close without the secret", close(no_secret), C.NOT_FOUND, "lease_id"),
    ("close with a wrong secret", close(wrong_secret), C.NOT_FOUND, "lease_id"),
    ("close another's lease", close(others_id), C.NOT_FOUND, "lease_id"),
    # Allocate
    ("allocate unknown pool", allocate([("kv", 1)], pool="nope"), C.NOT_FOUND, "pool"),
    ("allocate malformed pool", allocate([("kv", 1)], pool="NOPE"), C.INVALID_ARGUMENT, "pool"),
    ("allocate unknown lease", allocate([("kv", 1)], lease=NO_SUCH), C.NOT_FOUND, "lease_id"),
    ("allocate lease 0", allocate([("kv", 1)], lease=0), C.INVALID_ARGUMENT, "lease_id"),
    ("allocate with a wrong secret", allocate([("kv", 1)], lease=wrong_secret), C.NOT_FOUND,
     "lease_id"),
    ("allocate under another's lease", allocate([("kv", 1)], lease=others_id), C.NOT_FOUND,
     "lease_id"),
    ("allocate no items", allocate([]), C.INVALID_ARGUMENT, "items"),
    ("allocate space unset", allocate_raw(pb.AllocateItem(count=1)), C.INVALID_ARGUMENT,
     "items[0].space"),
    ("allocate unknown space", allocate_raw(pb.AllocateItem(space="pages", count=1)),
     C.INVALID_ARGUMENT, "items[0].space"),
    ("allocate swa", allocate([("kv", 1), ("swa", 1)]), C.INVALID_ARGUMENT, "items[1].space"),
    ("allocate state without state space", allocate([("state", 1)]), C.INVALID_ARGUMENT,
     "items[0].space"),
    ("allocate past the whole space", allocate_raw(pb.AllocateItem(space="kv", count=1 << 31)),
     C.RESOURCE_EXHAUSTED, "items[0].count"),
    ("allocate more than free", allocate([("kv", 252)]), C.RESOURCE_EXHAUSTED,
     "items[0].count"),
    # Free
    ("free 3 bytes", free_bytes(b"\x01\x00\x00"), C.INVALID_ARGUMENT, "items[0].ids"),
    ("free id 0", free(lambda c: [0]), C.INVALID_ARGUMENT, "items[0].ids[0]"),
    ("free id out of range", free(lambda c: [9999]), C.INVALID_ARGUMENT, "items[0].ids[0]"),
    ("free negative id", free(lambda c: [-3]), C.INVALID_ARGUMENT, "items[0].ids[0]"),
    ("free repeated id", free(lambda c: [c.my_pages[0], c.my_pages[0]]), C.INVALID_ARGUMENT,
     "items[0].ids[1]"),
    ("free id not allocated", free(lambda c: [200]), C.FAILED_PRECONDITION, "items[0].ids[0]"),
    ("free id of another lease", free(lambda c: [c.my_pages[0], c.their_pages[0]]),
     C.FAILED_PRECONDITION, "items[0].ids[1]"),
    ("free swa on a non-hybrid pool", free(lambda c: c.my_pages, space="swa"),
     C.INVALID_ARGUMENT, "items[0].space"),
    ("free unknown pool", free(lambda c: c.my_pages, pool="nope"), C.NOT_FOUND, "pool"),
    ("free unknown lease", free(lambda c: c.my_pages, lease=NO_SUCH), C.NOT_FOUND, "lease_id"),
    ("free without the secret", free(lambda c: c.my_pages, lease=no_secret), C.NOT_FOUND,
     "lease_id"),
    ("free another's pages by its id",
     free(lambda c: c.their_pages, lease=lambda c: LeaseKey(c.other.lease_id, b"")),
     C.NOT_FOUND, "lease_id"),
    ("free no items", lambda c: c.stub.Free(pb.FreeRequest(pool="tiny", **proof(c.mine))),
     C.INVALID_ARGUMENT, "items"),
    # Stats / WatchStats
    ("stats unknown pool", lambda c: c.stub.Stats(pb.StatsRequest(pool="nope")), C.NOT_FOUND,
     "pool"),
    ("stats malformed pool", lambda c: c.stub.Stats(pb.StatsRequest(pool="-x")),
     C.INVALID_ARGUMENT, "pool"),
    ("watch negative interval", lambda c: watch(c, "", -1.0), C.INVALID_ARGUMENT,
     "interval_seconds"),
    ("watch huge interval", lambda c: watch(c, "", 1e9), C.INVALID_ARGUMENT, "interval_seconds"),
    ("watch unknown pool", lambda c: watch(c, "nope", 1.0), C.NOT_FOUND, "pool"),
    # Drop
    ("drop unknown pool", lambda c: c.stub.Drop(pb.DropRequest(pool="nope")), C.NOT_FOUND,
     "pool"),
    ("drop malformed pool", lambda c: c.stub.Drop(pb.DropRequest(pool="")), C.INVALID_ARGUMENT,
     "pool"),
    ("drop in use", lambda c: c.stub.Drop(pb.DropRequest(pool="tiny")), C.FAILED_PRECONDITION,
     "force"),
    # Attach / Detach
    ("attach unknown pool", lambda c: c.stub.Attach(pb.AttachRequest(pool="nope")),
     C.NOT_FOUND, "pool"),
    ("attach wrong fingerprint",
     lambda c: c.stub.Attach(pb.AttachRequest(pool="tiny", expected_fingerprint="0" * 32)),
     C.FAILED_PRECONDITION, "expected_fingerprint"),
    ("attach unknown lease", attach_under(NO_SUCH), C.NOT_FOUND, "lease_id"),
    ("attach under a lease without its secret", attach_under(no_secret), C.NOT_FOUND,
     "lease_id"),
    ("attach under another's lease", attach_under(others_id), C.NOT_FOUND, "lease_id"),
    ("detach 0", lambda c: c.stub.Detach(pb.DetachRequest()), C.INVALID_ARGUMENT, "attach_id"),
    ("detach unknown", lambda c: c.stub.Detach(pb.DetachRequest(attach_id=NO_SUCH)),
     C.NOT_FOUND, "attach_id"),
    # Transfers (this daemon has no NIXL agent: well-formed calls say what to install)
    ("grant 3 bytes", grant(lambda c: b"\x01\x00\x00"), C.INVALID_ARGUMENT, "pages"),
    ("grant no pages", grant(lambda c: b""), C.INVALID_ARGUMENT, "pages"),
    ("grant lease 0", grant(lambda c: c.my_pages.tobytes(), lease=0), C.INVALID_ARGUMENT,
     "lease_id"),
    ("grant without nixl", grant(lambda c: c.my_pages.tobytes()), C.FAILED_PRECONDITION, None),
    ("grant with a wrong secret", grant(lambda c: c.my_pages.tobytes(), lease=wrong_secret),
     C.NOT_FOUND, "lease_id"),
    ("send no peer", send(peer=""), C.INVALID_ARGUMENT, "peer"),
    ("send no token", send(token=b""), C.INVALID_ARGUMENT, "token"),
    ("send huge token", send(token=b"x" * 65), C.INVALID_ARGUMENT, "token"),
    ("send without nixl", send(), C.FAILED_PRECONDITION, None),
    ("send under another's lease", send(lease=others_id), C.NOT_FOUND, "lease_id"),
    ("wait for nothing", lambda c: c.stub.WaitTransfer(pb.WaitTransferRequest()),
     C.INVALID_ARGUMENT, "transfer_id"),
    ("wait unknown transfer",
     lambda c: c.stub.WaitTransfer(pb.WaitTransferRequest(transfer_id=NO_SUCH)), C.NOT_FOUND,
     "transfer_id"),
    ("wait unknown grant",
     lambda c: c.stub.WaitTransfer(pb.WaitTransferRequest(token=b"x" * 16)), C.NOT_FOUND,
     "token"),
    ("wait negative timeout", lambda c: c.stub.WaitTransfer(pb.WaitTransferRequest(
        token=b"x" * 16, timeout_seconds=-1)), C.INVALID_ARGUMENT, "timeout_seconds"),
    ("peerreceive no token", lambda c: c.stub.PeerReceive(pb.PeerReceiveRequest()),
     C.INVALID_ARGUMENT, "token"),
    ("peerreceive without nixl",
     lambda c: c.stub.PeerReceive(pb.PeerReceiveRequest(token=b"x" * 16, pages=1)),
     C.FAILED_PRECONDITION, None),
    ("peerdone unknown grant",
     lambda c: c.stub.PeerDone(pb.PeerDoneRequest(token=b"x" * 16)), C.NOT_FOUND, "token"),
    ("cancelgrant lease 0", lambda c: c.stub.CancelGrant(pb.CancelGrantRequest(
        token=b"x" * 16)), C.INVALID_ARGUMENT, "lease_id"),
    ("cancelgrant without nixl", lambda c: c.stub.CancelGrant(pb.CancelGrantRequest(
        **proof(c.mine), token=b"x" * 16)),
     C.FAILED_PRECONDITION, None),
    ("seal lease 0", lambda c: c.stub.Seal(pb.SealRequest(pool="tiny", layout="e")),
     C.INVALID_ARGUMENT, "lease_id"),
    ("seal another's page", lambda c: c.stub.Seal(seal_of(c, c.their_pages[:1])),
     C.FAILED_PRECONDITION, "page_ids[0]"),
    ("seal no layout", lambda c: c.stub.Seal(seal_of(c, c.my_pages[:1], layout="")),
     C.INVALID_ARGUMENT, "layout"),
    ("seal short keys", lambda c: c.stub.Seal(seal_of(c, c.my_pages[:2], keys=b"k" * 33)),
     C.INVALID_ARGUMENT, "keys"),
    ("seal tokens not a page", lambda c: c.stub.Seal(seal_of(c, c.my_pages[:1], tokens=4)),
     C.INVALID_ARGUMENT, "tokens"),
    ("seal ids not int32", lambda c: c.stub.Seal(pb.SealRequest(
        pool="tiny", **proof(c.mine), layout="e", page_ids=b"\x01" * 5)),
     C.INVALID_ARGUMENT, "page_ids"),
    ("seal unknown pool", lambda c: c.stub.Seal(seal_of(c, c.my_pages[:1], pool="nope")),
     C.NOT_FOUND, "pool"),
    ("unseal lease 0", lambda c: c.stub.Unseal(pb.UnsealRequest(pool="tiny")),
     C.INVALID_ARGUMENT, "lease_id"),
    ("unseal another's page", lambda c: c.stub.Unseal(pb.UnsealRequest(
        pool="tiny", **proof(c.mine), page_ids=c.their_pages[:1].astype("<i4").tobytes())),
     C.FAILED_PRECONDITION, "page_ids[0]"),
    ("unseal ids not int32", lambda c: c.stub.Unseal(pb.UnsealRequest(
        pool="tiny", **proof(c.mine), page_ids=b"\x01" * 5)),
     C.INVALID_ARGUMENT, "page_ids"),
    ("unseal unknown pool", lambda c: c.stub.Unseal(pb.UnsealRequest(
        pool="nope", **proof(c.mine), page_ids=c.my_pages[:1].astype("<i4").tobytes())),
     C.NOT_FOUND, "pool"),
    ("adopt lease 0", lambda c: c.stub.Adopt(pb.AdoptRequest(pool="tiny", layout="e")),
     C.INVALID_ARGUMENT, "lease_id"),
    ("adopt unknown pool", lambda c: c.stub.Adopt(pb.AdoptRequest(
        pool="nope", **proof(c.mine), layout="e")), C.NOT_FOUND, "pool"),
    ("sealed unknown pool", lambda c: c.stub.Sealed(pb.SealedRequest(pool="nope")),
     C.NOT_FOUND, "pool"),
]


def seal_of(c: Ctx, pages: np.ndarray, *, layout: str = "e", keys: bytes | None = None,
            tokens: int = 16, pool: str = "tiny") -> pb.SealRequest:
    """A Seal of ``pages`` under ``mine``, well formed unless told otherwise."""
    n = pages.shape[0]
    return pb.SealRequest(pool=pool, **proof(c.mine), layout=layout,
                          page_ids=pages.astype("<i4").tobytes(),
                          keys=b"k" * (32 * n) if keys is None else keys,
                          parents=bytes(32 * n),
                          tokens=np.zeros(tokens * n, dtype="<i4").tobytes())


def comparable(stats: pb.StatsResponse) -> pb.StatsResponse:
    """Stats without the fields that move with time or count refusals."""
    out = pb.StatsResponse()
    out.CopyFrom(stats)
    out.daemon.uptime_seconds = 0
    for pool in out.pools:
        pool.age_seconds = 0
        for space in pool.spaces:
            space.failed_allocs = 0
    for lease in out.leases:
        lease.expires_in_seconds = 0
    return out


def failed_allocs(stats: pb.StatsResponse) -> int:
    return sum(k.failed_allocs for p in stats.pools for k in p.spaces)


def test_every_rpc_has_bad_cases() -> None:
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["KVPool"].methods}
    covered = {name.split(" ")[0] for name, *_ in CASES}
    words = {"configure": "Configure", "open": "OpenLease", "keep": "KeepAlive",
             "close": "CloseLease", "allocate": "Allocate", "free": "Free", "stats": "Stats",
             "watch": "WatchStats", "drop": "Drop", "attach": "Attach", "detach": "Detach",
             "grant": "GrantReceive", "send": "Send", "wait": "WaitTransfer",
             "peerreceive": "PeerReceive", "peerdone": "PeerDone",
             "cancelgrant": "CancelGrant", "seal": "Seal", "unseal": "Unseal", "adopt": "Adopt",
             "sealed": "Sealed"}
    assert {words[w] for w in covered} == methods


@pytest.mark.parametrize(("name", "call", "code", "field"), CASES, ids=[c[0] for c in CASES])
async def test_bad_request(served: Served, name: str, call: Call, code: grpc.StatusCode,
                           field: str | None) -> None:
    fingerprint = (await served.configure()).fingerprint
    mine, other = await served.lease("mine"), await served.lease("other")
    my_pages = ids_from_bytes((await served.stub.Allocate(
        allocate_request("tiny", mine, [("kv", 3), ("req", 1)]))).items[0].ids)
    their_pages = ids_from_bytes((await served.stub.Allocate(
        allocate_request("tiny", other, [("kv", 2)]))).items[0].ids)
    ctx = Ctx(served.stub, mine, other, my_pages, their_pages, fingerprint)
    before = await served.stub.Stats(pb.StatsRequest())

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(ctx)

    assert info.value.code() == code, info.value.details()
    metadata = dict(info.value.trailing_metadata() or ())
    assert metadata.get("kvpool-field") == field, info.value.details()
    assert info.value.details()
    after = await served.stub.Stats(pb.StatsRequest())
    assert comparable(after) == comparable(before)
    refused = 1 if (code == C.RESOURCE_EXHAUSTED and name.startswith("allocate")) else 0
    assert failed_allocs(after) == failed_allocs(before) + refused

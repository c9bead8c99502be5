"""One intake for every method: undecodable bytes sent to each RPC of the KVPool service (unary
and streaming, enumerated from the service descriptor, so a new method is covered by itself)
are INVALID_ARGUMENT naming the request, never INTERNAL; every method has its own request
size bound; a Free is bounded by the largest live pool's ids before it is parsed, and a message
over the largest bound is refused by gRPC itself."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.limits import (
    FREE_OVERHEAD_BYTES,
    MAX_IDS_PER_CALL,
    MAX_LAYERS,
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    MAX_REQUEST_MESSAGE_BYTES,
    MESSAGE_SIZE_OPTIONS,
    free_request_bytes,
)
from kvpool.contract.wire import free_request
from kvpool.v1 import kvpool_pb2 as pb
from tests.service.conftest import Served, proof

METHODS = list(pb.DESCRIPTOR.services_by_name["KVPool"].methods)
# Field 1 with wire type 7 (no such type): no protobuf message parses it.
UNDECODABLE = b"\x0f\xff\xff"


async def call_raw(served: Served, method: MethodDescriptor, data: bytes) -> Any:
    """Send ``data`` as the request of ``method`` and read the reply (bytes, not parsed)."""
    path = f"/kvpool.v1.KVPool/{method.name}"
    raw: dict[str, Any] = {"request_serializer": None, "response_deserializer": None}
    channel = served.channel
    if method.client_streaming:
        call = channel.stream_stream(path, **raw)(iter([data]), timeout=10)
        return [reply async for reply in call]
    if method.server_streaming:
        call = channel.unary_stream(path, **raw)(data, timeout=10)
        return [reply async for reply in call]
    return await channel.unary_unary(path, **raw)(data, timeout=10)


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_the_bytes_are_undecodable(method: MethodDescriptor) -> None:
    with pytest.raises(DecodeError):
        getattr(pb, method.input_type.name).FromString(UNDECODABLE)


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
async def test_undecodable_request_is_invalid_argument(served: Served,
                                                       method: MethodDescriptor) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call_raw(served, method, UNDECODABLE)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert f"the {method.name} request (3 B) is not a valid protobuf message" in \
        info.value.details()
    assert dict(info.value.trailing_metadata() or ()).get("kvpool-field") == "request"


def test_every_method_has_a_request_bound() -> None:
    """Each method names its bound; Free's (4M ids) is the largest, and it is the server's
    receive limit, under the reply limit."""
    names = {m.name for m in METHODS}
    assert set(MAX_REQUEST_BYTES) == names
    assert max(MAX_REQUEST_BYTES, key=MAX_REQUEST_BYTES.__getitem__) == "Free"
    assert MAX_REQUEST_MESSAGE_BYTES == MAX_REQUEST_BYTES["Free"] < MAX_MESSAGE_BYTES
    assert MAX_REQUEST_BYTES["Free"] == 4 * MAX_IDS_PER_CALL + FREE_OVERHEAD_BYTES


def raw_free(served: Served, data: bytes) -> Any:
    """A Free of ``data`` as it is, on a channel that sends up to MAX_MESSAGE_BYTES."""
    channel = grpc.aio.insecure_channel(served.target, options=MESSAGE_SIZE_OPTIONS)
    call = channel.unary_unary("/kvpool.v1.KVPool/Free", request_serializer=None,
                               response_deserializer=None)

    async def go() -> Any:
        try:
            return await call(data, timeout=60)
        finally:
            await channel.close()

    return go()


def free_of(lease: Any, nbytes: int, pool: str = "tiny") -> bytes:
    """A well-formed Free of ids 1, 1, 1, ... whose message is ``nbytes`` long."""
    head = pb.FreeRequest(pool=pool, items=[pb.IdList(space="kv", ids=b"")],
                          **proof(lease)).ByteSize()
    ids = b"\x01\x00\x00\x00" * ((nbytes - head - 4) // 4)
    data = pb.FreeRequest(pool=pool, items=[pb.IdList(space="kv", ids=ids)],
                          **proof(lease)).SerializeToString()
    assert abs(len(data) - nbytes) < 8
    return data


async def test_a_free_larger_than_the_largest_pool_is_refused_by_its_size(
        served: Served) -> None:
    """A lease holds at most every id of a pool, so a Free longer than the largest live pool's
    ids (4 B each) plus the overhead is refused by its length, naming the bound and why; one
    within the bound goes on to the ledger (here: ids not held)."""
    await served.configure()
    lease = await served.lease()
    most = served.daemon.registry.most_ids
    bound = free_request_bytes(most)
    assert most == sum(s.capacity for s in served.daemon.pools["tiny"].plan.id_spaces)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw_free(served, free_of(lease, bound + 64))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (f"at most {bound:,} B for Free: the largest live pool has {most:,} ids"
            in info.value.details())
    assert dict(info.value.trailing_metadata() or ()).get("kvpool-field") == "request"
    with pytest.raises(grpc.aio.AioRpcError) as within:
        await raw_free(served, free_of(lease, bound - 64))
    assert within.value.code() == grpc.StatusCode.FAILED_PRECONDITION, within.value.details()


async def test_the_free_bound_follows_the_live_pools(served: Served) -> None:
    """No pool: a Free carries no ids at all; a Drop shrinks the bound to the pools left."""
    lease = await served.lease()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw_free(served, free_of(lease, FREE_OVERHEAD_BYTES + 64))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "while no pool is live: there are no ids to free" in info.value.details()
    await served.configure("small")
    small = served.daemon.registry.most_ids
    await served.configure("big", budget_bytes=4 << 20)
    big = served.daemon.registry.most_ids
    assert big > small > 0
    await served.stub.Drop(pb.DropRequest(pool="big", force=True))
    assert served.daemon.registry.most_ids == small
    with pytest.raises(grpc.aio.AioRpcError) as after:
        await raw_free(served, free_of(lease, free_request_bytes(small) + 64, pool="small"))
    assert f"the largest live pool has {small:,} ids" in after.value.details()


async def test_a_message_over_every_bound_is_refused_by_grpc_itself(served: Served) -> None:
    """Over the largest method bound, gRPC refuses the message as it arrives (it never reaches
    the event loop): RESOURCE_EXHAUSTED with gRPC's own message."""
    lease = await served.lease()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw_free(served, free_of(lease, MAX_REQUEST_MESSAGE_BYTES + 1024))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"vs. {MAX_REQUEST_MESSAGE_BYTES})" in info.value.details()
    assert "larger than max" in info.value.details()


def test_the_client_refuses_a_free_over_the_ids_bound() -> None:
    lease = type("L", (), {"lease_id": 1, "secret": b"s"})()
    ids = np.ones(MAX_IDS_PER_CALL + 1, dtype=np.int32)
    with pytest.raises(InvalidArgument, match="at most 4,194,304 per call"):
        free_request("p", lease, [("kv", ids[:-2]), ("kv", ids[:3])])
    assert len(free_request("p", lease, [("kv", ids[:-1])]).items[0].ids) == 4 * MAX_IDS_PER_CALL


def largest_layout() -> pb.PageLayout:
    """The page layout with the most buffers a plan can have: MAX_LAYERS MHA layers and as many
    draft layers, fp4 KV (K, V and a scale for each), a sliding window (its own buffers)."""
    from kvpool.contract.spec import decode_spec
    from kvpoold.sizing import make_options, plan
    from kvpoold.transfer.page_layout import page_layout

    spec = decode_spec({
        "num_layers": MAX_LAYERS, "context_length": 1 << 16,
        "attention": {"type": "mha", "num_kv_heads": 8, "head_dim": 128},
        "sliding_window": {"window": 4096, "layers": list(range(0, MAX_LAYERS, 2))}})
    options = make_options(budget_bytes=1 << 36, page_size=64, kv_cache_dtype="fp4_e2m1",
                           speculative_algorithm="eagle",
                           speculative_num_draft_layers=MAX_LAYERS)
    return page_layout(plan(spec, options))


def test_the_largest_legitimate_requests_fit_their_bounds() -> None:
    """What a transfer RPC carries at its own bounds (65,536 pages, a 512-character peer, a
    64-byte token, the largest page layout, a status message of 2,048 4-byte characters) fits
    the method's request bound."""
    from kvpoold.transfer.grants import MAX_GRANT_PAGES, MAX_TOKEN_BYTES
    from kvpoold.transfer.peers import MAX_PEER_CHARS

    pages = b"\x01\x00\x00\x00" * MAX_GRANT_PAGES
    token, secret, pool = b"t" * MAX_TOKEN_BYTES, b"s" * 64, "p" * 63
    largest = {
        "GrantReceive": pb.GrantReceiveRequest(lease_id=2**64 - 1, pool=pool, pages=pages,
                                               ttl_seconds=3600.0, lease_secret=secret),
        "Send": pb.SendRequest(lease_id=2**64 - 1, pool=pool, pages=pages,
                               peer="\u4e00" * MAX_PEER_CHARS, token=token,
                               lease_secret=secret),
        "WaitTransfer": pb.WaitTransferRequest(transfer_id=2**64 - 1, token=token,
                                               timeout_seconds=3600.0),
        "PeerReceive": pb.PeerReceiveRequest(
            token=token, layout=largest_layout(), pages=MAX_GRANT_PAGES,
            swa_mask=b"\x01" * MAX_GRANT_PAGES, known_agent="\u4e00" * 512,
            known_generations=[2**64 - 1] * 64, sender="\u4e00" * 512),
        "PeerDone": pb.PeerDoneRequest(token=token, ok=False, message="\U0001f600" * 2048),
        "CancelGrant": pb.CancelGrantRequest(lease_id=2**64 - 1, lease_secret=secret,
                                             token=token),
    }
    for method, request in largest.items():
        assert request.ByteSize() <= MAX_REQUEST_BYTES[method], method
    assert largest["PeerReceive"].layout.ByteSize() > 200_000  # what the bound is sized for

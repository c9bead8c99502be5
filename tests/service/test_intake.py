"""One intake for every method: undecodable bytes sent to each RPC of the KVPool service (unary
and streaming, enumerated from the service descriptor, so a new method is covered by itself)
are INVALID_ARGUMENT naming the request, never INTERNAL; and every method has its own request
size bound."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError

from kvpool.contract.limits import MAX_LAYERS, MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES
from kvpool.v1 import kvpool_pb2 as pb
from tests.service.conftest import Served

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
    """Each method names its bound; only Free (16M ids) may take the whole message size."""
    names = {m.name for m in METHODS}
    assert set(MAX_REQUEST_BYTES) == names
    assert {n for n, b in MAX_REQUEST_BYTES.items() if b >= MAX_MESSAGE_BYTES} == {"Free"}


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

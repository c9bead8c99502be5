"""Issue 20, finding 8: every string a request carries is bounded before the daemon logs or keeps
it. Oversized messages are refused by their method's bound before they are parsed; within the
bounds, a name the daemon keeps is refused past its length (a model's architecture), a report
of pools that do not exist is not kept, and an error quoting a long value stays short and keeps
its end (where the value was, which knob to turn)."""

from __future__ import annotations

import json
import logging

import grpc
import pytest

from kvpool.contract.limits import MAX_NAME_CHARS, MAX_REQUEST_BYTES
from kvpool.contract.wire import configure_request
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.server.status import MAX_DETAILS_CHARS, MAX_LOGGED_CHARS, bounded
from tests.conftest import TINY_OPTIONS, TINY_SPEC
from tests.service.conftest import Served, proof

BIG = "x" * (6 << 20)


def raw_configure(pool: str, **spec_fields: str) -> pb.ConfigureRequest:
    """The tiny model's Configure with spec fields set on the wire (the client's own spec check
    would refuse them before sending)."""
    req = configure_request(pool, spec=TINY_SPEC, **TINY_OPTIONS)
    for name, value in spec_fields.items():
        setattr(req.spec, name, value)
    return req


def hf_configure(pool: str, config: dict[str, object]) -> pb.ConfigureRequest:
    req = configure_request(pool, spec=TINY_SPEC, **TINY_OPTIONS)
    req.hf_config_json = json.dumps(config)
    return req


async def refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value


async def test_oversized_strings_are_refused_by_the_method_bound(served: Served) -> None:
    """A 6 MiB string in any request is refused before parsing, naming the method's bound."""
    stub = served.stub
    await served.configure()
    lease = await served.lease()
    calls = {
        "PeerReceive": stub.PeerReceive(pb.PeerReceiveRequest(token=b"t", sender=BIG)),
        "PeerDone": stub.PeerDone(pb.PeerDoneRequest(token=b"t", message=BIG)),
        "Send": stub.Send(pb.SendRequest(pool="tiny", peer=BIG, token=b"t", **proof(lease))),
        "GrantReceive": stub.GrantReceive(pb.GrantReceiveRequest(pool=BIG, **proof(lease))),
        "WaitTransfer": stub.WaitTransfer(pb.WaitTransferRequest(token=BIG.encode())),
        "OpenLease": stub.OpenLease(pb.OpenLeaseRequest(name=BIG, ttl_seconds=10)),
        "Attach": stub.Attach(pb.AttachRequest(pool="tiny", expected_fingerprint=BIG)),
        "Configure": stub.Configure(pb.ConfigureRequest(pool="big", hf_config_json=BIG)),
    }
    for method, call in calls.items():
        error = await refused(call)
        assert f"at most {MAX_REQUEST_BYTES[method]:,} B for {method}" in error.details()


async def test_a_long_architecture_is_refused_not_kept(served: Served,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A model's architecture is kept in its plan (and shown to every client that attaches):
    past MAX_NAME_CHARS it is refused, by spec and by HF config, with a short message, and the
    refusal's log line is short too."""
    error = await refused(served.stub.Configure(raw_configure(
        "a", architecture="A" * (MAX_NAME_CHARS + 1))))
    assert f"length <= {MAX_NAME_CHARS} - at `$.architecture`" in error.details()
    config = {"architectures": ["A" * 500_000], "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "hidden_size": 32, "max_position_embeddings": 256}
    with caplog.at_level(logging.WARNING, logger="kvpoold.rpc"):
        error = await refused(served.stub.Configure(hf_configure("b", config)))
    assert "$.architecture" in error.details() and len(error.details()) < 400
    del config["num_attention_heads"]  # the fallback's own message quotes the name
    error = await refused(served.stub.Configure(hf_configure("c", config)))
    assert "(500,000 chars) has no loader" in error.details()
    assert len(error.details()) < 2 * MAX_DETAILS_CHARS
    lines = [r for r in caplog.records if getattr(r, "fields", {}).get("event")
             == "configure_refused"]
    assert lines and all(len(r.fields["reason"]) < MAX_LOGGED_CHARS + 40 for r in lines)
    assert (await served.stub.Stats(pb.StatsRequest())).pools == []


async def test_a_value_quoted_whole_is_cut_in_the_middle(served: Served) -> None:
    """msgspec quotes a bad enum value whole: the status message is cut in the middle, so it
    still ends with where the value was."""
    error = await refused(served.stub.Configure(raw_configure("d", dtype="d" * 500_000)))
    details = error.details()
    assert len(details) < MAX_DETAILS_CHARS + 40 and details.endswith("- at `$.dtype`")
    assert bounded("abc", 10) == "abc"


async def test_reports_of_pools_that_do_not_exist_are_not_kept(served: Served) -> None:
    """1,024 cache reports naming pools and spaces that do not exist (long names, within the
    KeepAlive bound): none is kept on the lease."""
    await served.configure()
    lease = await served.lease()
    reports = [pb.CacheReport(pool=f"{i:03d}" + "p" * 200, space="s" * 40, cached=1)
               for i in range(1024)]
    stream = served.stub.KeepAlive()
    await stream.write(pb.KeepAliveRequest(**proof(lease), seq=1, caches=reports))
    assert (await stream.read()).seq == 1
    assert served.daemon.leases.find(lease.lease_id).reports == {}  # type: ignore[union-attr]
    await stream.done_writing()

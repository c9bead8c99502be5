"""Hybrid pools over gRPC: SWA pairs (kv brings a swa page, swa frees only that side),
mamba state slots, and Kimi delta attention's state."""

from __future__ import annotations

import json

import grpc
import msgspec
import numpy as np
import pytest

from kvpool.contract.codec import ids_from_bytes
from kvpool.contract.plan import PoolPlan
from kvpool.contract.spec import decode_spec
from kvpool.contract.wire import allocate_request, configure_request, free_request
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.hf import read_hf
from kvpoold.sizing import make_options, plan
from tests.service.conftest import Served, proof

BASE = {"num_layers": 4, "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
        "context_length": 256}
SWA_SPEC = {**BASE, "sliding_window": {"window": 32, "layers": [0, 2]}}
LINEAR_SPEC = {**BASE, "linear": {"full_attention_layers": [3], "conv_kernel": 4,
                                  "num_key_heads": 2, "num_value_heads": 2, "key_head_dim": 16,
                                  "value_head_dim": 16}}
OPTIONS = {"budget_bytes": 1 << 20, "page_size": 16, "max_running_requests": 8}


def kinds(stats: pb.StatsResponse) -> dict[str, tuple[int, int]]:
    return {k.space: (k.capacity, k.used) for k in stats.pools[0].spaces}


async def test_swa_pairs(served: Served) -> None:
    """The hybrid plan's page counts (here 141 full, 112 SWA pages) become the kv and swa
    spaces; each kv page comes with a swa page, also written into full_to_swa."""
    expected = plan(decode_spec(SWA_SPEC), make_options(**OPTIONS))
    resp = await served.stub.Configure(configure_request("swa", spec=SWA_SPEC, **OPTIONS))
    got_plan = PoolPlan.from_json(resp.plan_json)
    assert got_plan.architecture == "hybrid_swa"
    assert (got_plan.num_pages, got_plan.swa_num_pages) == (expected.num_pages,
                                                           expected.swa_num_pages)
    lease = await served.lease()
    got = await served.stub.Allocate(allocate_request("swa", lease, [("kv", 4)]))
    full, swa = ids_from_bytes(got.items[0].ids), ids_from_bytes(got.items[0].paired_ids)
    assert len(full) == len(swa) == 4 and len(set(swa.tolist())) == 4
    mapping = served.daemon.pools["swa"].buffers.views["full_to_swa"].numpy()
    assert np.array_equal(mapping[full], swa)
    stats = await served.stub.Stats(pb.StatsRequest(pool="swa"))
    n_full, n_swa = expected.num_pages, expected.swa_num_pages
    assert kinds(stats) == {"kv": (n_full, 4), "swa": (n_swa, 4),
                            "req": (8, 0)}
    # the window slid past two pages: release their swa side only
    freed = await served.stub.Free(free_request("swa", lease, [("swa", full[:2])]))
    assert freed.freed == 2
    assert mapping[full[:2]].tolist() == [0, 0]
    stats = await served.stub.Stats(pb.StatsRequest(pool="swa"))
    assert kinds(stats)["kv"] == (n_full, 4) and kinds(stats)["swa"] == (n_swa, 2)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Free(free_request("swa", lease, [("swa", full[:1])]))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # freeing kv returns both sides of the rest
    await served.stub.Free(free_request("swa", lease, [("kv", full)]))
    stats = await served.stub.Stats(pb.StatsRequest(pool="swa"))
    assert kinds(stats)["kv"][1] == kinds(stats)["swa"][1] == 0


async def test_swa_paired_by_the_engine(served: Served) -> None:
    """``swa_pairing="engine"``: kv and swa pages are allocated and freed on their own (the
    engine pairs them), the daemon never writes ``full_to_swa`` (one int64 per full token slot
    plus a trailing entry, the engine's), and Configure with the other pairing is a different
    layout."""
    opts = {**OPTIONS, "swa_pairing": "engine"}
    resp = await served.stub.Configure(configure_request("eswa", spec=SWA_SPEC, **opts))
    got_plan = PoolPlan.from_json(resp.plan_json)
    lease = await served.lease()
    got = await served.stub.Allocate(allocate_request("eswa", lease, [("kv", 4), ("swa", 3)]))
    full, swa = (ids_from_bytes(item.ids) for item in got.items)
    assert (len(full), len(swa)) == (4, 3) and not got.items[0].paired_ids
    mapping = served.daemon.pools["eswa"].buffers.views["full_to_swa"].numpy()
    assert mapping.shape == ((got_plan.num_pages + 1) * 16 + 1,) and not mapping.any()
    stats = await served.stub.Stats(pb.StatsRequest(pool="eswa"))
    assert kinds(stats)["kv"][1] == 4 and kinds(stats)["swa"][1] == 3
    assert {k.space: k.follows for k in stats.pools[0].spaces}["swa"] == ""
    await served.stub.Free(free_request("eswa", lease, [("swa", swa[:2])]))
    stats = await served.stub.Stats(pb.StatsRequest(pool="eswa"))
    assert kinds(stats)["kv"][1] == 4 and kinds(stats)["swa"][1] == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Configure(configure_request("eswa", spec=SWA_SPEC, **OPTIONS))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_state_slots(served: Served) -> None:
    """The hybrid linear plan's mamba_cache_size (62 slots here) is the state space."""
    expected = plan(decode_spec(LINEAR_SPEC), make_options(**OPTIONS))
    resp = await served.stub.Configure(configure_request("lin", spec=LINEAR_SPEC, **OPTIONS))
    assert PoolPlan.from_json(resp.plan_json).mamba_cache_size == expected.mamba_cache_size
    lease = await served.lease()
    got = await served.stub.Allocate(
        allocate_request("lin", lease, [("req", 1), ("state", 3), ("kv", 2)]))
    assert [len(item.ids) // 4 for item in got.items] == [1, 3, 2]
    stats = await served.stub.Stats(pb.StatsRequest(pool="lin"))
    assert kinds(stats)["state"] == (expected.mamba_cache_size, 3)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Allocate(
            allocate_request("lin", lease, [("state", expected.mamba_cache_size)]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    closed = await served.stub.CloseLease(pb.CloseLeaseRequest(**proof(lease)))
    assert sorted((h.space, h.count) for h in closed.released) == [
        ("kv", 2), ("req", 1), ("state", 3)]


async def test_speculative_states_over_grpc(served: Served) -> None:
    """speculative_num_draft_tokens crosses the wire: the daemon's plan matches the local plan
    and carries the spec_state buffers; without it Configure names the missing field."""
    opts = {**OPTIONS, "speculative_algorithm": "eagle", "speculative_num_draft_tokens": 3}
    expected = plan(decode_spec(LINEAR_SPEC), make_options(**opts))
    resp = await served.stub.Configure(configure_request("spec", spec=LINEAR_SPEC, **opts))
    assert resp.fingerprint == expected.fingerprint()
    spec_buffers = {b.name: tuple(b.shape) for b in PoolPlan.from_json(resp.plan_json).buffers
                    if b.kind == "spec_state"}
    rows = expected.max_running_requests + 1
    assert spec_buffers["spec_conv.0"][:2] == spec_buffers["spec_ssm.2"][:2] == (rows, 3)
    views = served.daemon.pools["spec"].buffers.views
    assert tuple(views["spec_ssm.2"].shape) == spec_buffers["spec_ssm.2"]
    del opts["speculative_num_draft_tokens"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Configure(configure_request("spec2", spec=LINEAR_SPEC, **opts))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--speculative-num-draft-tokens" in (info.value.details() or "")


# SYNTHETIC: a 4-layer Kimi Linear config (the real one, corpus/kimi-linear-48b-a3b-instruct,
# needs gigabytes): 3 Kimi delta attention layers (1-based 1..3) and one MLA layer.
TINY_KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "bfloat16",
    "num_hidden_layers": 4, "num_attention_heads": 2, "hidden_size": 64,
    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "model_max_length": 256,
    "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2,
                           "head_dim": 8, "short_conv_kernel_size": 4},
}


async def test_kimi_delta_attention_state_over_grpc(served: Served) -> None:
    """A Kimi Linear hf_config: the daemon plans MLA KV for layer 3 and a KDA state for layers
    0-2, its conv state window first as SGLang's pool holds it ((k - 1, 3 * heads * head_dim)
    per slot), and Stats shows the state space; the same spec written by hand (conv_layout
    over the wire) is the same layout."""
    spec = read_hf(TINY_KIMI_LINEAR).spec
    expected = plan(spec, make_options(**OPTIONS))
    resp = await served.stub.Configure(configure_request(
        "kda", hf_config=json.dumps(TINY_KIMI_LINEAR), **OPTIONS))
    got = PoolPlan.from_json(resp.plan_json)
    assert resp.fingerprint == expected.fingerprint()
    slots = got.mamba_cache_size + 1
    assert got.buffer("conv.0").shape == (slots, 3, 48)
    assert got.buffer("ssm.2").shape == (slots, 2, 8, 8)
    assert got.buffer("kv.3").shape[1:] == (1, 24)
    views = served.daemon.pools["kda"].buffers.views
    assert tuple(views["conv.1"].shape) == (slots, 3, 48)
    lease = await served.lease()
    await served.stub.Allocate(allocate_request("kda", lease, [("req", 1), ("state", 5)]))
    stats = await served.stub.Stats(pb.StatsRequest(pool="kda"))
    assert kinds(stats)["state"] == (got.mamba_cache_size, 5)
    by_hand = msgspec.to_builtins(spec)
    assert by_hand["linear"]["conv_layout"] == "window_first"
    resp = await served.stub.Configure(configure_request("kda2", spec=by_hand, **OPTIONS))
    assert resp.fingerprint == expected.fingerprint()

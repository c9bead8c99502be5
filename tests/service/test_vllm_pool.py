"""Configure of a vLLM-layout pool (engine vllm) over gRPC: vLLM 0.32's KV cache as one int8
region and a ``kv`` space of vLLM block ids; what such a pool refuses; SGLang pools unchanged.

TinyLlama-1.1B (22 layers, 4 KV heads of 64, bf16) on vLLM's CPU backend: a block of 128
tokens is 4 x 128 x (64 + 64) x 2 B = 128 KiB per layer, 2.75 MiB over the 22 layers; 12 MiB of
kv_cache_memory_bytes make 4 blocks (11 MiB), block 0 being vLLM's null block.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from kvpool.contract.codec import ids_from_bytes
from kvpool.contract.plan import BufferKind, PoolPlan
from kvpool.contract.spec import decode_spec
from kvpool.contract.vllm_plan import make_vllm_options
from kvpool.contract.wire import configure_request, free_request
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.sizing import make_options, plan
from kvpoold.sizing.vllm_pool import VLLM_BUFFER, pool_plan_of
from kvpoold.sizing.vllm_profile import plan_vllm
from tests.conftest import REPO, TINY_OPTIONS, TINY_SPEC
from tests.service.conftest import Served, proof

MODEL = REPO / "tests/data/models/tinyllama-1.1b-chat-v0.4.json"
KNOBS = {"kv_cache_memory_bytes": 12 << 20, "max_model_len": 256}
BLOCK_BYTES = 22 * 4 * 128 * 128 * 2  # 2.75 MiB


def vllm_request(pool: str = "tl", **fields: object) -> pb.ConfigureRequest:
    knobs = {**KNOBS, **fields.pop("vllm", {})}  # type: ignore[dict-item]
    return configure_request(pool, hf_config=MODEL, vllm=knobs, **fields)


async def test_vllm_pool_is_vllms_kv_cache_as_one_int8_region(served: Served) -> None:
    """The plan is plan_vllm's, its backing one int8 region of num_blocks x bytes_per_block
    (what vLLM's allocate_kv_cache makes), its kv space the block ids 1..num_blocks - 1."""
    resp = await served.stub.Configure(vllm_request())
    got = PoolPlan.from_json(resp.plan_json)
    vplan = plan_vllm(json.loads(MODEL.read_text()), make_vllm_options(**KNOBS))
    assert got.vllm == vplan and got.engine == "vllm"
    assert got == pool_plan_of(vplan) and got.gpu == ""
    assert resp.fingerprint == got.fingerprint()
    assert (vplan.num_blocks, vplan.bytes_per_block) == (4, BLOCK_BYTES)
    assert got.backing_bytes == vplan.size_bytes == 4 * BLOCK_BYTES
    [buf] = got.buffers
    assert (buf.name, buf.dtype, buf.shape, buf.kind, buf.nbytes) == (
        VLLM_BUFFER, "int8", (4 * BLOCK_BYTES,), BufferKind.vllm_kv, 4 * BLOCK_BYTES)
    assert [(t.size, t.offset) for t in vplan.tensors] == [(4 * BLOCK_BYTES, 0)]
    assert [(s.name, s.capacity, s.bytes_per_unit) for s in got.id_spaces] == [
        ("kv", 3, BLOCK_BYTES)]
    stats = await served.stub.Stats(pb.StatsRequest(pool="tl"))
    [pool] = stats.pools
    assert (pool.architecture, pool.page_size, pool.backing_bytes) == ("vllm", 128,
                                                                      4 * BLOCK_BYTES)
    assert [(k.space, k.capacity) for k in pool.spaces] == [("kv", 3)]
    assert stats.daemon.used_bytes == 4 * BLOCK_BYTES


async def test_kv_ids_are_vllm_block_ids_never_the_null_block(served: Served) -> None:
    await served.stub.Configure(vllm_request())
    lease = await served.lease()
    resp = await served.stub.Allocate(pb.AllocateRequest(
        pool="tl", items=[pb.AllocateItem(space="kv", count=3)], **proof(lease)))
    assert sorted(ids_from_bytes(resp.items[0].ids).tolist()) == [1, 2, 3]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Allocate(pb.AllocateRequest(
            pool="tl", items=[pb.AllocateItem(space="kv", count=1)], **proof(lease)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "num_gpu_blocks_override" in info.value.details()


async def test_same_knobs_attach_the_pool_other_knobs_are_already_exists(served: Served
                                                                         ) -> None:
    first = await served.stub.Configure(vllm_request())
    again = await served.stub.Configure(vllm_request())
    assert (again.created, again.fingerprint) == (False, first.fingerprint)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Configure(vllm_request(vllm={"num_gpu_blocks_override": 3}))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_block_override_alone_sizes_the_pool(served: Served) -> None:
    req = configure_request("tl", hf_config=MODEL,
                            vllm={"num_gpu_blocks_override": 3, "max_model_len": 256})
    got = PoolPlan.from_json((await served.stub.Configure(req)).plan_json)
    assert got.vllm is not None and got.vllm.num_blocks == 3
    assert got.id_space("kv").capacity == 2


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"elastic": True}, "elastic", "elastic pools are SGLang-layout only"),
    ({"page_size": 16}, "page_size", "SGLang-layout option"),
    ({"gpu": "h200"}, "gpu", "backend for the device"),
    ({"vllm": {"block_size": 0}}, "vllm.block_size", "block_size"),
    ({"vllm": {"max_model_len": 2048}}, "vllm.kv_cache_memory_bytes",
     "one request of max_model_len 2,048 tokens"),
    ({"vllm": {"max_model_len": 4096}}, "vllm.max_model_len", "exceeds the model's 2,048"),
])
async def test_vllm_pool_refusals_name_the_field(served: Served, fields: dict[str, object],
                                                 field: str, words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Configure(vllm_request(**fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()
    assert ("kvpool-field", field) in tuple(info.value.trailing_metadata())
    assert served.daemon.pools == {}


async def test_vllm_pool_needs_a_kv_budget_and_a_hf_config(served: Served) -> None:
    req = configure_request("tl", hf_config=MODEL, engine="vllm")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Configure(req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vllm.kv_cache_memory_bytes" in info.value.details()
    req = configure_request("tl", spec=TINY_SPEC, vllm=KNOBS)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Configure(req)
    assert "hf_config_json" in info.value.details()
    req = configure_request("tl", spec=TINY_SPEC, engine="sglang", vllm=KNOBS, **TINY_OPTIONS)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Configure(req)
    assert ("kvpool-field", "vllm") in tuple(info.value.trailing_metadata())


def test_sglang_pool_fingerprints_are_unchanged() -> None:
    """The fingerprints of SGLang-layout plans, as computed before vLLM-layout pools."""
    tiny = plan(decode_spec(TINY_SPEC), make_options(**TINY_OPTIONS, gpu="cpu"))
    assert tiny.vllm is None and tiny.engine == "sglang"
    assert tiny.fingerprint() == "1a619faca145199b56a717b1cda9538b"
    assert PoolPlan.from_json(tiny.to_json()) == tiny


def test_a_vllm_pool_ids_dtype_is_int8() -> None:
    vplan = plan_vllm(json.loads(MODEL.read_text()), make_vllm_options(**KNOBS))
    assert np.dtype(pool_plan_of(vplan).buffers[0].dtype.value) == np.int8


async def test_vllm_pool_blocks_do_not_move_between_daemons(served: Served) -> None:
    await served.stub.Configure(vllm_request())
    lease = await served.lease()
    resp = await served.stub.Allocate(pb.AllocateRequest(
        pool="tl", items=[pb.AllocateItem(space="kv", count=1)], **proof(lease)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.GrantReceive(pb.GrantReceiveRequest(
            pool="tl", pages=resp.items[0].ids, **proof(lease)))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "vLLM's layout" in info.value.details()


MAMBA = REPO / "tests/integration/synthetic_configs/mamba-130m.json"
# Mamba-130M (SYNTHETIC, attention-free): 24 layers of a 58,368 B Mamba-1 state (bf16, a CPU
# without AVX-512 BF16): 1,400,832 B a block; 8 MiB make 5 blocks (tests/unit/
# test_vllm_attention_free.py computes them)
MAMBA_KNOBS = {"kv_cache_memory_bytes": 8 << 20, "max_model_len": 2048, "cpu_avx512_bf16": "no"}
MAMBA_BLOCK = 24 * 58_368


async def test_an_attention_free_pool_holds_mamba_states_only(served: Served) -> None:
    """An attention-free model's vLLM pool: the same one int8 region and ``kv`` space of vLLM
    block ids, every block one request's Mamba state in each layer, no token slots; its
    blocks are allocated and freed as any pool's."""
    resp = await served.stub.Configure(configure_request("m", hf_config=MAMBA,
                                                         vllm=MAMBA_KNOBS))
    got = PoolPlan.from_json(resp.plan_json)
    vplan = plan_vllm(json.loads(MAMBA.read_text()), make_vllm_options(**MAMBA_KNOBS))
    assert got == pool_plan_of(vplan) and vplan.state_only
    assert [g.type.value for g in vplan.groups] == ["mamba"]
    assert (vplan.num_blocks, vplan.bytes_per_block) == (5, MAMBA_BLOCK)
    assert (got.max_total_num_tokens, got.backing_bytes) == (0, 5 * MAMBA_BLOCK)
    assert [(s.name, s.capacity) for s in got.id_spaces] == [("kv", 4)]
    lease = await served.lease()
    alloc = await served.stub.Allocate(pb.AllocateRequest(
        pool="m", items=[pb.AllocateItem(space="kv", count=4)], **proof(lease)))
    ids = ids_from_bytes(alloc.items[0].ids)
    assert sorted(ids.tolist()) == [1, 2, 3, 4]
    freed = await served.stub.Free(free_request("m", lease, [("kv", ids)]))
    assert freed.freed == 4
    stats = await served.stub.Stats(pb.StatsRequest(pool="m"))
    [pool] = stats.pools
    assert (pool.architecture, pool.max_total_num_tokens, pool.backing_bytes) == (
        "vllm", 0, 5 * MAMBA_BLOCK)
    assert [(k.space, k.capacity) for k in pool.spaces] == [("kv", 4)]

"""Configure over gRPC: create, idempotence by fingerprint, dry run, budget, model forms."""

from __future__ import annotations

import json

import grpc
import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import PoolPlan
from kvpool.contract.spec import decode_spec
from kvpool.contract.wire import configure_request
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.sizing import make_options, plan
from tests.conftest import REPO, TINY_OPTIONS, TINY_PAGES, TINY_SPEC
from tests.service.conftest import BUDGET_BYTES, Served


def tiny_plan(**options: object) -> PoolPlan:
    return plan(decode_spec(TINY_SPEC), make_options(**{**TINY_OPTIONS, **options}))


async def test_configure_builds_the_planned_pool(served: Served) -> None:
    """The reply carries the same plan as ``kvpool.contract.plan``: 256 pages (1 MiB / 4 KiB
    per 16-token page), 8 request rows; the daemon charges backing_bytes = 257 pages (the
    padding page on top) * 4 KiB = 1,052,672 B of KV + (8 + 1) rows * (256 + 4) columns * 4 B
    = 9,360 B of req_to_token = 1,062,032 B against its 16 MiB budget. A CPU daemon plans for
    the cpu profile when Configure names no --gpu."""
    expected = tiny_plan(gpu="cpu")
    assert expected.gpu == "cpu (unknown memory, no GPU)"
    resp = await served.configure()
    assert resp.created and not resp.dry_run
    assert resp.fingerprint == expected.fingerprint()
    got = PoolPlan.from_json(resp.plan_json)
    assert got == expected
    assert got.num_pages == TINY_PAGES == expected.num_pages
    assert got.backing_bytes == 1_062_032 == expected.backing_bytes
    assert got.swa_num_pages is None
    assert [b.name for b in got.buffers] == [b.name for b in expected.buffers]
    k0 = got.buffers[0]
    assert (k0.dtype, list(k0.shape), k0.page_bytes, k0.in_budget) == (
        "bfloat16", [4112, 2, 16], 16 * 2 * 16 * 2, True)
    assert resp.budget_available_bytes == BUDGET_BYTES - 1_062_032
    stats = await served.stub.Stats(pb.StatsRequest())
    assert stats.daemon.used_bytes == 1_062_032
    assert [(k.space, k.capacity) for k in stats.pools[0].spaces] == [
        ("kv", TINY_PAGES), ("req", 8)]


async def test_same_layout_returns_the_existing_pool(served: Served) -> None:
    first = await served.configure()
    again = await served.configure()
    assert (again.created, again.fingerprint) == (False, first.fingerprint)
    assert len(served.daemon.pools) == 1
    assert served.daemon.used_bytes == PoolPlan.from_json(first.plan_json).backing_bytes


async def test_other_layout_with_the_same_name_is_already_exists(served: Served) -> None:
    await served.configure()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.configure(page_size=32)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "Drop it first" in info.value.details()
    assert ("kvpool-field", "pool") in tuple(info.value.trailing_metadata())


async def test_dry_run_allocates_nothing(served: Served) -> None:
    resp = await served.configure(dry_run=True)
    assert (resp.created, resp.dry_run) == (False, True)
    assert resp.fingerprint == tiny_plan().fingerprint()
    assert resp.budget_available_bytes == BUDGET_BYTES - 1_062_032
    assert served.daemon.pools == {} and served.daemon.used_bytes == 0


async def test_pool_over_the_device_budget_is_resource_exhausted(served: Served) -> None:
    """A 32 MiB KV budget needs 32 MiB + 9,360 B of backing; the daemon has 16 MiB left."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.configure(budget_bytes=32 << 20)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    needed = tiny_plan(budget_bytes=32 << 20).backing_bytes
    assert f"needs {needed:,} B" in info.value.details()
    assert f"{BUDGET_BYTES:,} B" in info.value.details()
    # a dry run answers the same question
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.configure(budget_bytes=32 << 20, dry_run=True)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_budget_is_shared_between_pools(served: Served) -> None:
    """Fifteen 1 MiB-KV pools cost 15 * 1,062,032 B = 15,930,480 B of the 16,777,216 B budget;
    846,736 B are left, less than a 16th pool needs."""
    for i in range(15):
        await served.configure(f"p{i}")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.configure("p15")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "846,736 B" in info.value.details()
    await served.stub.Drop(pb.DropRequest(pool="p0"))
    assert (await served.configure("p15")).created


async def test_hf_config_json_is_planned_like_the_cli(served: Served) -> None:
    """Llama-3.1-8B's config.json with max_total_tokens 64, page 16, 4 requests, context
    1024: 4 pages (64 / 16), each 32 layers * 2 * 8 * 128 * 2 B * 16 = 2 MiB, plus the
    padding page: 10 MiB of KV, which fits the 16 MiB daemon budget."""
    text = (REPO / "tests/data/models/llama-3.1-8b-instruct.json").read_text()
    req = configure_request("llama", hf_config=text, max_total_tokens=64, page_size=16,
                            max_running_requests=4, context_length=1024, dry_run=True)
    resp = await served.stub.Configure(req)
    got = PoolPlan.from_json(resp.plan_json)
    assert got.architecture_source == "hf_config"
    assert got.model_architecture == "LlamaForCausalLM"
    assert got.num_pages == 4
    assert got.buffer("k.0").page_bytes == 8 * 128 * 2 * 16
    assert got.total_bytes == 5 * (2 << 20)


async def test_hf_config_json_as_hugging_face_writes_it_and_an_assumed_family(
        served: Served) -> None:
    """Configure reads hf_config_json as Python's JSON does (Infinity, NaN), refuses a class
    SGLang's registry does not know, naming the knob, and with assume_architecture plans it
    as that family, saying so."""
    config = json.loads((REPO / "tests/data/models/llama-3.1-8b-instruct.json").read_text())
    text = json.dumps({**config, "architectures": ["ZebraLMForCausalLM"],
                       "router_aux_loss_coef": float("inf"), "odd": float("nan")})
    assert "Infinity" in text and "NaN" in text
    opts = {"max_total_tokens": 64, "page_size": 16, "max_running_requests": 4,
            "context_length": 1024, "dry_run": True}
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Configure(configure_request("z", hf_config=text, **opts))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ZebraLMForCausalLM" in info.value.details()
    assert "--assume-architecture" in info.value.details()
    resp = await served.stub.Configure(configure_request(
        "z", hf_config=text, assume_architecture="mha", **opts))
    got = PoolPlan.from_json(resp.plan_json)
    assert (got.architecture, got.architecture_source) == ("mha", "assumed")
    assert any("--assume-architecture said so" in note for note in got.notes)
    for bad, where in (({"assume_architecture": "gqa"}, "accepted: mha"),
                       ({"assume_architecture": "mha", "spec": TINY_SPEC},
                        "hf_config_json model only")):
        model = {"spec": TINY_SPEC} if "spec" in bad else {"hf_config": text}
        req = configure_request("z", **model, assume_architecture=bad["assume_architecture"],
                                **opts)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.stub.Configure(req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert where in info.value.details()


async def test_concurrent_configure_of_one_name_builds_once(served: Served) -> None:
    import asyncio

    replies = await asyncio.gather(*(served.configure() for _ in range(4)))
    assert sorted(r.created for r in replies) == [False, False, False, True]
    assert len({r.fingerprint for r in replies}) == 1
    assert served.daemon.used_bytes == PoolPlan.from_json(replies[0].plan_json).backing_bytes


def test_a_spec_is_checked_before_it_is_sent() -> None:
    """A HF config passed as ``spec`` is named as such; a bad spec gets msgspec's path, not
    protobuf's field list."""
    hf = (REPO / "tests" / "data" / "models" / "llama-3.1-8b-instruct.json").read_text()
    with pytest.raises(InvalidArgument, match=r"looks like a Hugging Face config\.json.*"
                       r"--hf-config") as info:
        configure_request("p", spec=json.loads(hf), budget_bytes=1 << 20)
    assert info.value.field == "spec"
    bad = {**TINY_SPEC, "attention": {**TINY_SPEC["attention"], "num_kv_heads": 0}}
    with pytest.raises(InvalidArgument, match=r"at `\$\.attention\.num_kv_heads`"):
        configure_request("p", spec=bad, budget_bytes=1 << 20)
    assert configure_request("p", spec=TINY_SPEC, budget_bytes=1 << 20).spec.num_layers == \
        TINY_SPEC["num_layers"]

"""Shared sizing rules, options validation, spec validation and layout placement."""

from __future__ import annotations

import msgspec
import pytest

from kvpool.contract.dtypes import DType
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import BufferKind
from kvpool.contract.spec import decode_spec
from kvpoold.sizing import PoolPlan, make_options
from kvpoold.sizing.common import (
    draft_scaled_cell,
    mamba_state_ratio,
    overlap_schedule,
    pages_for_budget,
    resolve_max_running_requests,
    stage_layers,
    tp_heads,
)
from kvpoold.sizing.layout import ALIGN_BYTES, buffer, place
from kvpoold.sizing.planner import SPECULATIVE_MAX_RUNNING_REQUESTS, engine_defaults, plan
from tests.factories import GiB, deepseek_v3, deepseek_v32, llama_8b, plan_for


@pytest.mark.parametrize(
    ("layers", "pp", "sizes"),
    [(32, 1, [32]), (32, 3, [10, 11, 11]), (12, 5, [2, 2, 2, 3, 3]), (61, 4, [15, 15, 15, 16]),
     (4, 4, [1, 1, 1, 1])],
)
def test_stage_layers_cover_every_layer_once(layers, pp, sizes):
    ranges = [stage_layers(layers, pp, r) for r in range(pp)]
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(layers))


def test_tp_heads():
    assert [tp_heads(8, t) for t in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]


def test_draft_scaled_cell_is_exact():
    assert draft_scaled_cell(131_072, 1, 32) == 135_168
    assert draft_scaled_cell(100, 0, 32) == 100
    assert draft_scaled_cell(70_272, 1, 61) == 71_424


def test_pages_for_budget():
    """The padding page comes on top (SGLang): 1,000 // 100 = 10 pages, 199 // 100 = 1; below
    one page (99 < 100) nothing fits."""
    assert pages_for_budget(10 * 100, 100) == 10
    assert pages_for_budget(199, 100) == 1
    with pytest.raises(InvalidArgument, match="too small for one KV page of 100 B"):
        pages_for_budget(99, 100)


@pytest.mark.parametrize(
    ("tokens", "ctx", "user", "expected"),
    [
        (327_679, 131_072, None, 2048),  # estimate 1,279 -> clamp up to 2,048
        (10_000_000, 4096, None, 4096),  # estimate 1.25M -> clamp down to 4,096
        (3000, 4096, None, 1500),  # T // 2
        (1_000_000, 4096, 300, 300),
        (100, 4096, 300, 50),
    ],
)
def test_resolve_max_running_requests(tokens, ctx, user, expected):
    opts = make_options(budget_bytes=1, max_running_requests=user)
    assert resolve_max_running_requests(tokens, ctx, opts, []) == expected


@pytest.mark.parametrize(
    ("fields", "ratio"),
    [
        ({}, 5),  # auto = extra_buffer, overlap on: 3 + 2
        ({"mamba_radix_cache_strategy": "extra_buffer"}, 5),
        ({"disable_overlap_schedule": True}, 4),  # 3 + 1
        ({"mamba_radix_cache_strategy": "extra_buffer", "disable_overlap_schedule": True}, 4),
        ({"pp_size": 2}, 4),  # PP turns the overlap schedule off
        ({"mamba_radix_cache_strategy": "no_buffer"}, 3),
        ({"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True}, 3),
        ({"disable_radix_cache": True}, 1),
        ({"disable_radix_cache": True, "mamba_radix_cache_strategy": "no_buffer"}, 1),
    ],
)
def test_mamba_state_ratio(fields, ratio):
    """SGLang's slots per running request: 1 without the radix cache, else 3, plus the
    extra_buffer tracking slots (auto resolves to extra_buffer): 2 under the overlap schedule,
    1 without it."""
    opts = make_options(budget_bytes=1, **fields)
    assert mamba_state_ratio(opts) == ratio


def test_overlap_schedule_is_off_when_disabled_or_under_pp():
    assert overlap_schedule(make_options(budget_bytes=1))
    assert not overlap_schedule(make_options(budget_bytes=1, disable_overlap_schedule=True))
    assert not overlap_schedule(make_options(budget_bytes=1, pp_size=2, pp_rank=1))


def test_max_running_requests_capped_by_state_slots():
    """10^6 tokens at context 4,096: estimate int(10^6 / 4,096 * 512) = 125,000 -> clamp 4,096.
    state_slots 300: radix cache with auto (extra_buffer, overlap): 300 // 5 = 60; without
    the overlap schedule 300 // 4 = 75; no_buffer 300 // 3 = 100; no radix cache 300 // 1 =
    300. Four slots are not one request's five."""
    radix = make_options(budget_bytes=1)
    notes: list[str] = []
    assert resolve_max_running_requests(10**6, 4096, radix, notes, state_slots=300) == 60
    assert notes == ["max_running_requests 4096 reduced to 60 (300 state slots / 5 per request)"]
    no_overlap = make_options(budget_bytes=1, disable_overlap_schedule=True)
    assert resolve_max_running_requests(10**6, 4096, no_overlap, [], state_slots=300) == 75
    no_buffer = make_options(budget_bytes=1, mamba_radix_cache_strategy="no_buffer")
    assert resolve_max_running_requests(10**6, 4096, no_buffer, [], state_slots=300) == 100
    no_radix = make_options(budget_bytes=1, disable_radix_cache=True)
    assert resolve_max_running_requests(10**6, 4096, no_radix, [], state_slots=300) == 300
    with pytest.raises(InvalidArgument, match="and 4 state slots, not enough for one"):
        resolve_max_running_requests(10**6, 4096, radix, [], state_slots=4)


@pytest.mark.parametrize(
    ("fields", "field", "needle"),
    [
        ({"page_size": 0}, "page_size", ">= 1"),
        ({"page_size": -16}, "page_size", ">= 1"),
        ({"tp_size": 0}, "tp_size", ">= 1"),
        ({"pp_size": 0}, "pp_size", ">= 1"),
        ({"pp_size": 2, "pp_rank": 2}, "pp_rank", "must be < pp_size"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype", "fp8_e4m3"),
        ({"budget_bytes": -1}, "budget_bytes", ">= 0"),
        ({"budget_bytes": 1 << 60}, "budget_bytes", "<="),
        ({"swa_full_tokens_ratio": 0.0}, "swa_full_tokens_ratio", "> 0.0"),
        ({"speculative_algorithm": "medusa"}, "speculative_algorithm", "eagle"),
        ({"speculative_num_draft_layers": 2}, "speculative_num_draft_layers", "needs"),
    ],
)
def test_bad_options_name_the_field(fields, field, needle):
    fields = {"budget_bytes": GiB, **fields}
    with pytest.raises(InvalidArgument) as e:
        make_options(**fields)
    assert e.value.field == field
    assert needle in str(e.value)


def test_options_need_budget_or_tokens():
    with pytest.raises(InvalidArgument, match="budget_bytes, max_total_tokens"):
        make_options()


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"num_layers": 0}, "$.num_layers"),
        ({"attention": {"type": "gqa"}}, "$.attention"),
        ({"sliding_window": {"window": 128, "layers": [40]}}, "layer id 40"),
        ({"bogus": 1}, "bogus"),
        ({"dtype": "int8"}, "$.dtype"),
    ],
)
def test_bad_spec(patch, needle):
    fields = {"num_layers": 32, "attention": {"type": "mha", "num_kv_heads": 8, "head_dim": 128},
              "context_length": 4096, **patch}
    with pytest.raises(InvalidArgument) as e:
        decode_spec(fields)
    assert needle in str(e.value)


def test_place_aligns_and_puts_aux_last():
    bufs = [
        buffer("aux", DType.int32, (3, 3), BufferKind.req_to_token, in_budget=False),
        buffer("a", DType.bfloat16, (5, 3), BufferKind.kv),
        buffer("b", DType.uint8, (7,), BufferKind.kv),
    ]
    placed, end = place(bufs)
    assert [b.name for b in placed] == ["a", "b", "aux"]
    assert [b.offset_bytes for b in placed] == [0, ALIGN_BYTES, 2 * ALIGN_BYTES]
    assert end == 2 * ALIGN_BYTES + 36
    with pytest.raises(ValueError, match="twice"):
        place([bufs[1], bufs[1]])


SPECS = {
    "mha": (llama_8b, {}),
    "mha-fp4": (llama_8b, {"kv_cache_dtype": "fp4_e2m1"}),
    "mla": (deepseek_v3, {"speculative_algorithm": "eagle"}),
    "dsa": (deepseek_v32, {"page_size": 64, "kv_cache_dtype": "fp8_e4m3"}),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_plan_json_round_trip(name):
    make, opts = SPECS[name]
    p = plan_for(make(), budget_bytes=3 * GiB, **opts)
    again = PoolPlan.from_json(p.to_json())
    assert again == p
    assert again.fingerprint() == p.fingerprint()
    # dtypes are names, not torch objects
    assert isinstance(msgspec.json.decode(p.to_json())["buffers"][0]["dtype"], str)


def test_fingerprint_changes_with_layout():
    a = plan_for(llama_8b(), budget_bytes=GiB)
    b = plan_for(llama_8b(), budget_bytes=GiB, page_size=16)
    c = plan_for(llama_8b(), budget_bytes=GiB)
    assert a.fingerprint() == c.fingerprint() != b.fingerprint()


# ---- engine defaults and the context length ----------------------------------------------------


@pytest.mark.parametrize("algorithm", ["eagle", "standalone"])
def test_engine_defaults_speculative_max_running_requests_48(algorithm):
    """SGLang's server sets max_running_requests to 48 under speculative decoding when none is
    given; a given value, or no speculative decoding, is left alone."""
    spec = llama_8b()
    opts = engine_defaults(spec, make_options(budget_bytes=GiB, speculative_algorithm=algorithm))
    assert opts.max_running_requests == SPECULATIVE_MAX_RUNNING_REQUESTS == 48
    given = make_options(budget_bytes=GiB, speculative_algorithm=algorithm,
                         max_running_requests=7, swa_full_tokens_ratio=0.5, gpu="h200",
                         chunked_prefill_size=4096)
    assert engine_defaults(spec, given) is given
    plain = engine_defaults(spec, make_options(budget_bytes=GiB))
    assert plain.max_running_requests is None and plain.swa_full_tokens_ratio == 0.8
    assert engine_defaults(spec, plain) is plain


def test_engine_defaults_of_a_model_class():
    """DeepSeek-V4: SGLang's overrides set swa_full_tokens_ratio 0.1 and max_running_requests
    256 where the user gave none; given values stay."""
    v4 = llama_8b(architecture="DeepseekV4ForCausalLM")  # only the class name matters here
    opts = engine_defaults(v4, make_options(budget_bytes=GiB))
    assert (opts.swa_full_tokens_ratio, opts.max_running_requests) == (0.1, 256)
    given = make_options(budget_bytes=GiB, swa_full_tokens_ratio=0.5, max_running_requests=9,
                         gpu="cpu", chunked_prefill_size=0)
    assert engine_defaults(v4, given) is given


@pytest.mark.parametrize(("gpu", "chunk"), [("h100-80g", 8192), ("h200", 8192), ("b200", 16384),
                                            ("a100-80g", 8192), ("cpu", 4096), (None, 8192)])
def test_the_gpu_profile_sets_the_prefill_chunk(gpu, chunk):
    """SGLang's chunked_prefill_size default by device memory; no --gpu is kvpoold plan's
    default, h100-80g."""
    opts = engine_defaults(llama_8b(), make_options(budget_bytes=GiB, gpu=gpu))
    assert opts.chunked_prefill_size == chunk and opts.gpu == (gpu or "h100-80g")


def test_dsa_auto_kv_and_the_qwen3_vl_reservation_follow_the_gpu():
    """DSA under auto: bfloat16 before SM100; on a B200 fp8_e4m3 in the raw 576 B layout
    (SGLang's trtllm DSA backend) instead of the packed 656 B. Qwen3-VL: on SM90 with >= 60
    GiB SGLang's CUDA IPC feature pool (1 GiB) is reserved instead of the 100 MiB cache."""
    v32 = deepseek_v32()
    assert plan(v32, make_options(budget_bytes=8 * GiB, page_size=64)).kv_cache_dtype == "bfloat16"
    b200 = plan(v32, make_options(budget_bytes=8 * GiB, page_size=64, gpu="b200"))
    assert b200.kv_cache_dtype == "fp8_e4m3" and b200.gpu == "b200 (180 GiB, SM100)"
    hopper_fp8 = plan(v32, make_options(budget_bytes=8 * GiB, page_size=64,
                                        kv_cache_dtype="fp8_e4m3"))
    assert hopper_fp8.cell_size_bytes == 61 * (656 + 132)
    assert b200.cell_size_bytes == 61 * (576 + 132)
    vl = llama_8b(architecture="Qwen3VLForConditionalGeneration", multimodal=True)
    hopper = plan(vl, make_options(budget_bytes=8 * GiB, gpu="h100-80g"))
    ampere = plan(vl, make_options(budget_bytes=8 * GiB, gpu="a100-80g"))
    assert hopper.budget_bytes == ampere.budget_bytes == 8 * GiB
    cell = hopper.cell_size_bytes
    assert ((8 * GiB - (1 << 30)) // cell, (8 * GiB - (100 << 20)) // cell) == (
        hopper.max_total_num_tokens, ampere.max_total_num_tokens)
    assert any("CUDA IPC feature-transport pool" in n for n in hopper.notes)
    assert any("multimodal embedding cache" in n for n in ampere.notes)


def test_plan_applies_the_speculative_default():
    """Llama EAGLE, 1 GiB: cell 135,168; tokens 1,073,741,824 // 135,168 = 7,943 (7,943 *
    135,168 = 1,073,639,424); max_running_requests = min(48, 7,943 // 2) = 48, so req_to_token
    has 49 rows. At 8 MiB: 8,388,608 // 135,168 = 62 tokens -> min(48, 31) = 31."""
    p = plan_for(llama_8b(), budget_bytes=GiB, speculative_algorithm="eagle")
    assert (p.max_total_num_tokens, p.max_running_requests) == (7_943, 48)
    assert p.buffer("req_to_token").shape[0] == 49
    small = plan_for(llama_8b(), budget_bytes=8 * 2**20, speculative_algorithm="eagle")
    assert (small.max_total_num_tokens, small.max_running_requests) == (62, 31)
    # without speculative decoding the usual estimate: 1 GiB // 131,072 = 8,192 tokens ->
    # clamp(int(8,192 / 131,072 * 512) = 32, 2,048, 4,096) = 2,048, min(2,048, 4,096)
    assert plan_for(llama_8b(), budget_bytes=GiB).max_running_requests == 2048


def test_context_length_above_the_model_needs_allow_longer_context():
    """Llama's context is 131,072: 131,073 is refused (as SGLang refuses it) unless
    allow_longer_context, which then sizes req_to_token with 131,073 + 4 columns. Equal or
    shorter is always accepted."""
    with pytest.raises(InvalidArgument, match="--allow-longer-context") as e:
        plan_for(llama_8b(), budget_bytes=GiB, context_length=131_073)
    assert e.value.field == "context_length"
    assert "131,073 is above the model's 131,072" in str(e.value)
    p = plan_for(llama_8b(), budget_bytes=GiB, context_length=131_073, allow_longer_context=True)
    assert p.context_length == 131_073
    assert p.req_to_token_columns == 131_077
    assert plan_for(llama_8b(), budget_bytes=GiB, context_length=131_072).context_length == 131_072
    assert plan_for(llama_8b(), budget_bytes=GiB, context_length=4096).context_length == 4096
    # the context length only drives the request estimate: 8,192 tokens at context 131,073 ->
    # int(8,192 / 131,073 * 512) = 31 -> 2,048
    assert p.max_running_requests == 2048

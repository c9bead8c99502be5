"""Shared sizing rules, options validation, spec validation and layout placement."""

from __future__ import annotations

import msgspec
import pytest

from kvpool.dtypes import DType
from kvpool.errors import InvalidArgument
from kvpool.plan import BufferKind
from kvpool.spec import decode_spec
from kvpoold.sizing import PoolPlan, make_options
from kvpoold.sizing.common import (
    draft_scaled_cell,
    pages_for_budget,
    resolve_max_running_requests,
    stage_layers,
    tp_heads,
)
from kvpoold.sizing.layout import ALIGN_BYTES, buffer, place
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
    assert pages_for_budget(10 * 100, 100) == 9
    with pytest.raises(InvalidArgument):
        pages_for_budget(199, 100)


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


def test_max_running_requests_capped_by_state_slots():
    """state_slots 300, radix cache on: 300 // 3 = 100; off: 300 // 1 = 300."""
    radix = make_options(budget_bytes=1)
    assert resolve_max_running_requests(10**6, 4096, radix, [], state_slots=300) == 100
    no_radix = make_options(budget_bytes=1, disable_radix_cache=True)
    assert resolve_max_running_requests(10**6, 4096, no_radix, [], state_slots=300) == 300
    with pytest.raises(InvalidArgument):
        resolve_max_running_requests(10**6, 4096, radix, [], state_slots=2)


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

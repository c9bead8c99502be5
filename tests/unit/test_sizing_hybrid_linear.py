"""Hybrid linear attention (Qwen3-Next) sizing: state per slot, budget split, layout, pool views."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import BufferKind, PoolPlan
from kvpool.contract.spec import (
    DSAIndexer,
    LinearAttention,
    MHAAttention,
    MLAAttention,
    ModelDType,
    ModelSpec,
)
from kvpoold.pools import builder
from kvpoold.sizing import hybrid_linear, make_options, plan
from kvpoold.sizing.planner import make_context
from kvpoold.sizing.registry import select_architecture

GIB = 1 << 30
B40 = 40 * GIB  # 42,949,672,960 B

# Qwen3-Next-80B-A3B, tests/data/models/qwen3-next-80b-a3b-instruct.json, TP 1:
#   conv_dim = 128*32 + 2*16*128 = 8,192; conv (8192, 3) bf16 = 49,152 B
#   ssm (32, 128, 128) fp32 = 2,097,152 B; one layer's slot = 2,146,304 B
#   per_req over the 36 linear layers = 77,266,944 B
#   cell over the 12 full layers = 2 heads * (256 + 256) * 12 * 2 B = 24,576 B
SLOT_LAYER_TP1 = 2_146_304
PER_REQ_TP1 = 77_266_944
CELL_TP1 = 24_576
FULL_LAYERS = tuple(range(3, 48, 4))


def qwen3_next(**linear_overrides: object) -> ModelSpec:
    """The Qwen3-Next-80B-A3B spec, written by hand from its config.json."""
    fields: dict[str, object] = dict(
        full_attention_layers=FULL_LAYERS,
        conv_kernel=4,
        num_key_heads=16,
        num_value_heads=32,
        key_head_dim=128,
        value_head_dim=128,
        conv_dtype=ModelDType.bfloat16,
        ssm_dtype=ModelDType.float32,
    )
    fields.update(linear_overrides)
    return ModelSpec(
        num_layers=48,
        attention=MHAAttention(num_kv_heads=2, head_dim=256),
        context_length=262_144,
        dtype=ModelDType.bfloat16,
        architecture="Qwen3NextForCausalLM",
        linear=LinearAttention(**fields),  # type: ignore[arg-type]
    )


def tiny(**spec_overrides: object) -> ModelSpec:
    """4 layers, full attention at 1 and 3; small dims so a real pool builds in microseconds."""
    fields: dict[str, object] = dict(
        num_layers=4,
        attention=MHAAttention(num_kv_heads=2, head_dim=16),
        context_length=64,
        linear=LinearAttention(full_attention_layers=(1, 3), conv_kernel=4, num_key_heads=2,
                               num_value_heads=4, key_head_dim=8, value_head_dim=8),
    )
    fields.update(spec_overrides)
    return ModelSpec(**fields)  # type: ignore[arg-type]


def plan_of(spec: ModelSpec, **options: object) -> PoolPlan:
    return plan(spec, make_options(**options))


def per_req_of(p: PoolPlan) -> int:
    """One state slot over all linear layers, read back from the buffers' page bytes."""
    return sum(b.page_bytes for b in p.buffers if b.kind is BufferKind.state)


def names(p: PoolPlan) -> set[str]:
    return {b.name for b in p.buffers}


# --- selection and state shapes -------------------------------------------------------------


def test_matches_only_specs_with_linear_attention() -> None:
    assert hybrid_linear.matches(qwen3_next())
    plain = ModelSpec(num_layers=2, attention=MHAAttention(num_kv_heads=2, head_dim=8),
                      context_length=16)
    assert not hybrid_linear.matches(plain)
    assert select_architecture(qwen3_next()).name == "hybrid_linear"


def test_state_shape_tp1() -> None:
    """conv_dim = 128*32 + 2*16*128 = 8,192 -> conv (8192, 3) bf16 = 49,152 B;
    ssm (32, 128, 128) fp32 = 2,097,152 B; slot = 2,146,304 B per layer."""
    shape = hybrid_linear.state_shape(qwen3_next().linear, 1)  # type: ignore[arg-type]
    assert shape.conv == (8192, 3)
    assert shape.ssm == (32, 128, 128)
    assert (shape.conv_bytes, shape.ssm_bytes) == (49_152, 2_097_152)
    assert shape.slot_bytes == SLOT_LAYER_TP1


@pytest.mark.parametrize(
    ("tp", "conv", "ssm"),
    [
        (2, (4096, 3), (16, 128, 128)),  # 8192 / 2
        (4, (2048, 3), (8, 128, 128)),  # 8192 / 4
        # 16 key heads over 32 ranks: groups padded to 32, conv_dim = 4096 + 2*32*128 = 12,288
        (32, (384, 3), (1, 128, 128)),
    ],
)
def test_state_shape_splits_over_tp(tp: int, conv: tuple[int, int],
                                    ssm: tuple[int, int, int]) -> None:
    shape = hybrid_linear.state_shape(qwen3_next().linear, tp)  # type: ignore[arg-type]
    assert (shape.conv, shape.ssm) == (conv, ssm)


def test_state_shape_rejects_unsplittable_heads() -> None:
    with pytest.raises(InvalidArgument, match="32 value heads") as err:
        hybrid_linear.state_shape(qwen3_next().linear, 3)  # type: ignore[arg-type]
    assert err.value.field == "tp_size"
    # 12 key groups over 8 ranks can neither be split nor replicated (48 value heads split fine)
    spec = qwen3_next(num_key_heads=12, num_value_heads=48)
    with pytest.raises(InvalidArgument, match="12 key heads") as err:
        hybrid_linear.state_shape(spec.linear, 8)  # type: ignore[arg-type]
    assert err.value.field == "tp_size"


def test_mamba_budget_uses_the_exact_decimal_ratio() -> None:
    """17 * 0.7 / 1.7 is 6.999... in floats; with m = 7/10 it is exactly 17*7 // 17 = 7.
    40 GiB at 0.9: 42,949,672,960 * 9 // 19 = 20,344,581,928."""
    assert hybrid_linear.mamba_budget_bytes(17, 0.7) == 7
    assert hybrid_linear.mamba_budget_bytes(B40, 0.9) == 20_344_581_928
    assert hybrid_linear.mamba_budget_bytes(B40, 1.0) == B40 // 2


# --- the worked example and budget variants -------------------------------------------------


def test_qwen3_next_40gib_tp1() -> None:
    """The module docstring's example, page 1:
    mamba_budget = 20,344,581,928; state_slots = 20,344,581,928 // 77,266,944 - 1 = 262;
    KV = 42,949,672,960 - 263 * 77,266,944 = 22,628,466,688 B;
    tokens = 22,628,466,688 // 24,576 = 920,754 (920,754 * 24,576 = 22,628,450,304, 16,384 B
    left); max_running_requests: estimate int(920,754 / 262,144 * 512) = 1,798 -> 2,048, then
    min(2,048, 460,377, 262 // 5 = 52) = 52 (ratio 5: 3 plus extra_buffer's 2 tracking slots
    under the overlap schedule). The padding row comes on top: used = 263 * 77,266,944 +
    920,755 * 24,576 = 20,321,206,272 + 22,628,474,880 = 42,949,681,152 B = budget + 8,192."""
    p = plan_of(qwen3_next(), budget_bytes=B40)
    assert p.architecture == "hybrid_linear"
    assert p.cell_size_bytes == CELL_TP1
    assert p.mamba_cache_size == 262
    assert p.max_total_num_tokens == 920_754
    assert p.num_pages == 920_754
    assert p.max_running_requests == 52
    assert per_req_of(p) == PER_REQ_TP1
    assert p.total_bytes == 42_949_681_152 == B40 + 8_192
    assert p.full_max_total_num_tokens is None and p.swa_max_total_num_tokens is None

    kv = [b for b in p.buffers if b.kind is BufferKind.kv]
    state = [b for b in p.buffers if b.kind is BufferKind.state]
    assert len(kv) == 24 and len(state) == 72
    assert {b.name for b in kv} == {f"{x}.{lay}" for x in "kv" for lay in FULL_LAYERS}
    assert p.buffer("k.3").shape == (920_755, 2, 256)
    assert p.buffer("v.47").page_bytes == 2 * 256 * 2
    conv, ssm = p.buffer("conv.0"), p.buffer("ssm.46")
    assert (conv.shape, conv.dtype.value) == ((263, 8192, 3), "bfloat16")
    assert (ssm.shape, ssm.dtype.value) == ((263, 32, 128, 128), "float32")
    assert (conv.page_bytes, ssm.page_bytes) == (49_152, 2_097_152)
    assert "conv.3" not in names(p) and "k.0" not in names(p)
    r2s = p.buffer("req_to_state")
    assert (r2s.shape, r2s.dtype.value, r2s.kind, r2s.in_budget) == (
        (53,), "int32", BufferKind.map, False)


def test_qwen3_next_1gib_page16() -> None:
    """1 GiB = 1,073,741,824 B, page 16: mamba_budget = 1,073,741,824 * 9 // 19 = 508,614,548;
    state_slots = 508,614,548 // 77,266,944 - 1 = 5; KV = 1,073,741,824 - 6 * 77,266,944
    = 610,140,160 B; one page = 24,576 * 16 = 393,216 B; pages = 610,140,160 // 393,216 =
    1,551 (262,144 B left); tokens 24,816; max_running_requests = min(2,048, 12,408, 5 // 5)
    = 1. The padding page on top: used = 6 * 77,266,944 + 1,552 * 393,216 = 463,601,664 +
    610,271,232 = 1,073,872,896 B = budget + 131,072."""
    p = plan_of(qwen3_next(), budget_bytes=GIB, page_size=16)
    assert (p.mamba_cache_size, p.num_pages, p.max_total_num_tokens) == (5, 1_551, 24_816)
    assert p.max_running_requests == 1
    assert p.total_bytes == 1_073_872_896 == GIB + 131_072
    assert p.buffer("k.7").shape == (1_552 * 16, 2, 256)
    assert p.buffer("k.7").page_bytes == 16 * 2 * 256 * 2
    assert p.buffer("conv.1").shape == (6, 8192, 3)


@pytest.mark.parametrize(
    ("tp", "per_req", "slots", "tokens", "conv", "ssm"),
    [
        # per slot (4096*3*2 + 16*128*128*4) * 36 = 38,633,472; KV heads 2 // 2 = 1,
        # cell = 1 * 512 * 12 * 2 = 12,288; slots = 20,344,581,928 // 38,633,472 - 1 = 525;
        # KV = 40 GiB - 526 * 38,633,472 = 22,628,466,688; tokens = // 12,288 = 1,841,509
        (2, 38_633_472, 525, 1_841_509, (4096, 3), (16, 128, 128)),
        # per slot (2048*3*2 + 8*128*128*4) * 36 = 19,316,736; KV heads max(1, 2 // 4) = 1
        # (replicated), cell 12,288; slots = 1,053 - 1 = 1,052; KV = 40 GiB - 1,053 * 19,316,736
        # = 22,609,149,952; tokens = // 12,288 = 1,839,937
        (4, 19_316_736, 1_052, 1_839_937, (2048, 3), (8, 128, 128)),
    ],
)
def test_tp_splits_state_and_kv(tp: int, per_req: int, slots: int, tokens: int,
                                conv: tuple[int, ...], ssm: tuple[int, ...]) -> None:
    p = plan_of(qwen3_next(), budget_bytes=B40, tp_size=tp)
    assert per_req_of(p) == per_req
    assert p.cell_size_bytes == 12_288
    assert (p.mamba_cache_size, p.max_total_num_tokens) == (slots, tokens)
    assert p.max_running_requests == min(2048, slots // 5)  # 105 and 210
    assert p.buffer("conv.0").shape == (slots + 1, *conv)
    assert p.buffer("ssm.0").shape == (slots + 1, *ssm)
    assert p.buffer("k.3").shape == (tokens + 1, 1, 256)


@pytest.mark.parametrize("rank", [0, 1])
def test_pp2_sizes_only_the_stage_layers(rank: int) -> None:
    """Each stage has 24 layers: 6 full (3..23 or 27..47), 18 linear.
    per_req = 2,146,304 * 18 = 38,633,472; cell = 2 * 512 * 6 * 2 = 12,288: the same numbers as
    TP 2, so slots 525 and tokens 1,841,509 on both stages. PP turns SGLang's overlap schedule
    off, so extra_buffer adds one tracking slot: ratio 4, max_running_requests 525 // 4 =
    131."""
    p = plan_of(qwen3_next(), budget_bytes=B40, pp_size=2, pp_rank=rank)
    start = 24 * rank
    assert (p.layer_start, p.layer_end) == (start, start + 24)
    assert per_req_of(p) == 38_633_472
    assert p.cell_size_bytes == 12_288
    assert (p.mamba_cache_size, p.max_total_num_tokens) == (525, 1_841_509)
    assert p.max_running_requests == 131
    full = [lay for lay in FULL_LAYERS if start <= lay < start + 24]
    linear = [lay for lay in range(start, start + 24) if lay not in full]
    expected = ({f"{x}.{lay}" for x in "kv" for lay in full}
                | {f"{x}.{lay}" for x in ("conv", "ssm") for lay in linear})
    in_budget = {b.name for b in p.buffers if b.in_budget}
    assert in_budget == expected
    assert p.buffer("ssm.24" if rank else "ssm.0").shape == (526, 32, 128, 128)


def test_disable_radix_cache_with_max_running_requests_fixes_the_slots() -> None:
    """N = 100 without the radix cache: state_slots = 100, state = 101 * 77,266,944
    = 7,803,961,344 B; KV = 35,145,711,616 B; tokens = // 24,576 = 1,430,082 (16,384 B
    left); max_running_requests = min(100, 715,041, 100 // 1) = 100; the padding row on top:
    used = budget - 16,384 + 24,576 = budget + 8,192."""
    p = plan_of(qwen3_next(), budget_bytes=B40, disable_radix_cache=True,
                max_running_requests=100)
    assert (p.mamba_cache_size, p.max_total_num_tokens, p.max_running_requests) == (
        100, 1_430_082, 100)
    assert p.total_bytes == B40 + 8_192
    assert p.buffer("req_to_state").shape == (101,)


def test_disable_radix_cache_alone_keeps_the_split_with_ratio_one() -> None:
    """Same split as the default (262 slots, 920,754 tokens); one slot per request, so
    max_running_requests = min(2,048, 460,377, 262) = 262."""
    p = plan_of(qwen3_next(), budget_bytes=B40, disable_radix_cache=True)
    assert (p.mamba_cache_size, p.max_total_num_tokens, p.max_running_requests) == (
        262, 920_754, 262)


def test_radix_cache_caps_a_user_max_running_requests_at_a_fifth_of_the_slots() -> None:
    """With the radix cache N = 100 does not fix the slots: 262 slots -> min(100, 262 // 5)
    = 52."""
    p = plan_of(qwen3_next(), budget_bytes=B40, max_running_requests=100)
    assert (p.mamba_cache_size, p.max_running_requests) == (262, 52)


@pytest.mark.parametrize(
    ("options", "ratio", "mrr"),
    [
        ({}, 5, 52),  # auto = extra_buffer, overlap schedule on: 3 + 2
        ({"mamba_radix_cache_strategy": "extra_buffer"}, 5, 52),
        # without the overlap schedule one tracking slot: 3 + 1 = 4 -> 262 // 4 = 65
        ({"disable_overlap_schedule": True}, 4, 65),
        ({"mamba_radix_cache_strategy": "extra_buffer", "disable_overlap_schedule": True}, 4, 65),
        # no_buffer (page 1, no overlap schedule): SGLang's plain 3 -> 262 // 3 = 87
        ({"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True}, 3, 87),
    ],
)
def test_radix_cache_strategy_sets_the_state_ratio(options: dict[str, object], ratio: int,
                                                   mrr: int) -> None:
    """The strategy changes only max_running_requests (state_slots // ratio): the split stays
    the default one, 262 slots and 920,754 tokens."""
    p = plan_of(qwen3_next(), budget_bytes=B40, **options)
    ctx = make_context(qwen3_next(), make_options(budget_bytes=B40, **options))
    assert hybrid_linear.state_ratio(ctx) == ratio
    assert (p.mamba_cache_size, p.max_total_num_tokens, p.max_running_requests) == (
        262, 920_754, mrr)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"page_size": 16, "disable_overlap_schedule": True}, "only at page_size 1, got 16"),
        ({}, "overlap scheduler; give --disable-overlap-schedule"),  # page 1, overlap on
        ({"page_size": 16}, "only at page_size 1, got 16"),
    ],
)
def test_no_buffer_needs_page_one_and_no_overlap_schedule(options: dict[str, object],
                                                          needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle) as err:
        plan_of(qwen3_next(), budget_bytes=B40, mamba_radix_cache_strategy="no_buffer",
                **options)
    assert err.value.field == "mamba_radix_cache_strategy"


def test_no_buffer_is_accepted_without_the_radix_cache_and_under_pp() -> None:
    """Without the radix cache the strategy does not apply (ratio 1); under PP the overlap
    schedule is off anyway, so page 1 is all no_buffer needs (ratio 3: 525 // 3 = 175)."""
    p = plan_of(qwen3_next(), budget_bytes=B40, page_size=16, disable_radix_cache=True,
                mamba_radix_cache_strategy="no_buffer")
    assert p.max_running_requests == 262
    pp = plan_of(qwen3_next(), budget_bytes=B40, pp_size=2, pp_rank=0,
                 mamba_radix_cache_strategy="no_buffer")
    assert (pp.mamba_cache_size, pp.max_running_requests) == (525, 175)


@pytest.mark.parametrize(
    ("ratio", "slots", "tokens"),
    [
        # m = 1/2: 40 GiB // 3 = 14,316,557,653 -> 185 - 1 = 184 slots;
        # KV = 40 GiB - 185 * 77,266,944 = 28,655,288,320 -> // 24,576 = 1,165,986 tokens
        (0.5, 184, 1_165_986),
        # m = 1: 40 GiB // 2 = 21,474,836,480 -> 277 - 1 = 276; KV 21,546,729,472 -> 876,738
        (1.0, 276, 876_738),
        # m = 2: 40 GiB * 2 // 3 = 28,633,115,306 -> 370 - 1 = 369; KV 14,360,903,680 -> 584,346
        (2.0, 369, 584_346),
    ],
)
def test_mamba_full_memory_ratio_variants(ratio: float, slots: int, tokens: int) -> None:
    """Each KV side leaves 16,384 B (2/3 of a cell) unbought; the padding row comes on top."""
    p = plan_of(qwen3_next(), budget_bytes=B40, mamba_full_memory_ratio=ratio)
    assert (p.mamba_cache_size, p.max_total_num_tokens) == (slots, tokens)
    assert p.total_bytes == (slots + 1) * PER_REQ_TP1 + (tokens + 1) * CELL_TP1
    assert p.total_bytes == B40 + CELL_TP1 - 16_384


def test_eagle_reserves_draft_token_states_and_scales_the_cell() -> None:
    """EAGLE, 1 draft layer, D = 4 draft tokens, max_running_requests 64, radix (ratio 5).

    State (SGLang's joint solve, exact in integers): mamba_budget B = 20,344,581,928;
    slots = (B - per * (1 + D)) * 5 // (per * (5 + D))
          = (20,344,581,928 - 386,334,720) * 5 // 695,402,496 = 99,791,236,040 // 695,402,496
          = 143;
    intermediate for min(64, 143 // 5) + 1 = 29 request rows: 29 * 4 * per = 8,962,965,504 B.
    KV: 42,949,672,960 - 144 * per - 8,962,965,504 = 42,949,672,960 - 11,126,439,936 -
    8,962,965,504 = 22,860,267,520 B; cell over L = 12 full layers with the draft layer =
    24,576 * 13 // 12 = 26,624; tokens = 22,860,267,520 // 26,624 = 858,633 (22,528 B left).
    max_running_requests = min(.., 64, 143 // 5) = 28."""
    p = plan_of(qwen3_next(), budget_bytes=B40, speculative_algorithm="eagle",
                speculative_num_draft_tokens=4, max_running_requests=64)
    assert p.num_draft_layers == 1
    assert p.cell_size_bytes == 26_624
    assert (p.mamba_cache_size, p.max_total_num_tokens, p.max_running_requests) == (
        143, 858_633, 28)
    assert p.total_bytes == B40 - 22_528 + 26_624
    assert p.buffer("draft_k.0").shape == (858_634, 2, 256)
    assert p.buffer("draft_v.0").kind is BufferKind.kv
    assert p.buffer("spec_conv.0").shape == (29, 4, 8192, 3)
    assert p.buffer("spec_ssm.46").shape == (29, 4, 32, 128, 128)
    assert p.buffer("spec_ssm.46").kind is BufferKind.spec_state
    spec = [b for b in p.buffers if b.kind is BufferKind.spec_state]
    assert len(spec) == 2 * 36 and sum(b.nbytes for b in spec) == 8_962_965_504
    assert "draft_conv.0" not in names(p) and "spec_conv.3" not in names(p)


def test_eagle_without_radix_cache_reserves_one_row_per_request() -> None:
    """disable_radix_cache + max_running_requests 64: slots = 64; intermediate 65 * 4 * per =
    20,089,405,440 B; KV = 40 GiB - 65 * per - that = 42,949,672,960 - 5,022,351,360 -
    20,089,405,440 = 17,837,916,160 B -> // 26,624 = 669,993 tokens (22,528 B left)."""
    p = plan_of(qwen3_next(), budget_bytes=B40, speculative_algorithm="eagle",
                speculative_num_draft_tokens=4, max_running_requests=64,
                disable_radix_cache=True)
    assert (p.mamba_cache_size, p.max_total_num_tokens, p.max_running_requests) == (
        64, 669_993, 64)
    assert p.buffer("spec_ssm.0").shape == (65, 4, 32, 128, 128)
    assert p.total_bytes == B40 - 22_528 + 26_624


def test_speculative_linear_needs_draft_tokens() -> None:
    with pytest.raises(InvalidArgument, match="needs speculative_num_draft_tokens; give --") as err:
        plan_of(qwen3_next(), budget_bytes=B40, speculative_algorithm="eagle",
                max_running_requests=64)
    assert err.value.field == "speculative_num_draft_tokens"


def test_speculative_linear_without_max_running_requests_uses_sglangs_48() -> None:
    """SGLang sets max_running_requests to 48 under speculative decoding. Without the radix
    cache that fixes the slots at 48: intermediate 49 * 4 * per = 15,144,321,024 B; KV =
    42,949,672,960 - 49 * per - 15,144,321,024 = 42,949,672,960 - 3,786,080,256 -
    15,144,321,024 = 24,019,271,680 B -> // 26,624 = 902,166 tokens (4,096 B left).
    With the radix cache: the same 143 slots and 28 requests as with 64 (min(48, 143 // 5))."""
    p = plan_of(qwen3_next(), budget_bytes=B40, speculative_algorithm="eagle",
                speculative_num_draft_tokens=4, disable_radix_cache=True)
    assert (p.mamba_cache_size, p.max_total_num_tokens, p.max_running_requests) == (
        48, 902_166, 48)
    assert p.buffer("spec_conv.0").shape == (49, 4, 8192, 3)
    radix = plan_of(qwen3_next(), budget_bytes=B40, speculative_algorithm="eagle",
                    speculative_num_draft_tokens=4)
    assert (radix.mamba_cache_size, radix.max_total_num_tokens,
            radix.max_running_requests) == (143, 858_633, 28)


def test_draft_tokens_need_an_algorithm() -> None:
    with pytest.raises(InvalidArgument, match="speculative_num_draft_tokens needs speculative"):
        make_options(budget_bytes=B40, speculative_num_draft_tokens=4)


def test_speculative_state_budget_floor_is_named() -> None:
    """One request needs ratio + 1 slots and 2 * D intermediate states (its row and the padding
    row): per * (5 + 1 + 8) = 1,081,737,216 B of state, so a budget of at least
    1,081,737,216 * 19 / 9 = 2,283,667,456 B (exact). There the state budget is 14 * per and
    slots = (14 - 5) * per * 5 // (9 * per) = 5; one byte less gets 4 slots, too few.
    At the floor: state 6 * per + intermediate (min(8, 1) + 1) * 4 * per = 14 * per, KV
    2,283,667,456 - 1,081,737,216 = 1,201,930,240 B -> // 26,624 = 45,144 tokens."""
    opts = dict(speculative_algorithm="eagle", speculative_num_draft_tokens=4,
                max_running_requests=8)
    with pytest.raises(InvalidArgument, match="at least 2,283,667,456 B") as err:
        plan_of(qwen3_next(), budget_bytes=2_283_667_455, **opts)
    assert "4 intermediate states" in str(err.value) and err.value.field == "budget_bytes"
    p = plan_of(qwen3_next(), budget_bytes=2_283_667_456, **opts)
    assert (p.mamba_cache_size, p.max_running_requests) == (5, 1)
    assert p.max_total_num_tokens == 45_144
    assert p.total_bytes == 14 * PER_REQ_TP1 + 45_145 * 26_624


def test_build_pool_with_speculative_states() -> None:
    """tiny() with EAGLE, D = 2, max_running_requests 2, page 4, budget 65,536 B:
    per = 2,816, B = 31,043; slots = (31,043 - 2,816 * 3) * 5 // (2,816 * 7) = 112,975 //
    19,712 = 5; intermediate for min(2, 5 // 5) + 1 = 2 rows: 2 * 2 * 2,816 = 11,264 B.
    KV = 65,536 - 6 * 2,816 - 11,264 = 37,376; cell (2 full layers + 1 draft) = 256 * 3 // 2
    = 384, page 1,536 -> 37,376 // 1,536 = 24 pages (96 tokens); mrr = min(2, 5 // 5) = 1.
    Used = 16,896 + 11,264 + 25 * 1,536 = 66,560 B."""
    p = plan_of(tiny(), budget_bytes=65_536, page_size=4, speculative_algorithm="eagle",
                speculative_num_draft_tokens=2, max_running_requests=2)
    assert (p.mamba_cache_size, p.max_total_num_tokens, p.max_running_requests) == (5, 96, 1)
    assert p.total_bytes == 66_560
    pool = builder.build_pool(p, "cpu")
    views = pool.views
    assert views["spec_conv.0"].shape == (2, 2, 64, 3)
    assert views["spec_conv.0"].dtype == torch.bfloat16
    assert views["spec_ssm.2"].shape == (2, 2, 4, 8, 8)
    assert views["spec_ssm.2"].dtype == torch.float32
    base = pool.backing.data_ptr()
    for name in ("spec_conv.0", "spec_ssm.2"):
        spec = p.buffer(name)
        assert views[name].data_ptr() == base + spec.offset_bytes  # a view, not a copy


def test_mla_attention_hybrid_uses_latent_buffers() -> None:
    """An MLA hybrid (Kimi-Linear-like): 576-wide latent, not split by TP.
    cell = 576 * 12 * 2 = 13,824 B; at TP 2 the state is the TP-2 one (525 slots), so
    KV = 22,628,466,688 B -> // 13,824 = 1,636,897 tokens (2,560 B left)."""
    spec = ModelSpec(
        num_layers=48,
        attention=MLAAttention(kv_lora_rank=512, qk_rope_head_dim=64),
        context_length=262_144,
        linear=qwen3_next().linear,
    )
    p = plan_of(spec, budget_bytes=B40, tp_size=2)
    assert p.cell_size_bytes == 13_824
    assert (p.mamba_cache_size, p.max_total_num_tokens) == (525, 1_636_897)
    assert p.buffer("kv.3").shape == (1_636_898, 1, 576)
    assert "k.3" not in names(p)


def test_state_takes_its_share_and_kv_buys_whole_pages_of_the_rest() -> None:
    """Seeded sweep over budget, TP, page, ratio, radix and overlap settings: the state slots
    (plus the padding slot) are the most the mamba budget buys, the KV pages the most the rest
    buys, the padding page comes on top of those, and max_running_requests fits the slots."""
    rng = random.Random(1234)
    spec = qwen3_next()
    for _ in range(40):
        budget = rng.randrange(GIB, 80 * GIB)
        page = rng.choice([1, 16, 64])
        options = dict(
            budget_bytes=budget,
            page_size=page,
            tp_size=rng.choice([1, 2, 4, 8]),
            mamba_full_memory_ratio=rng.choice([0.3, 0.5, 0.9, 1.0, 2.0]),
            disable_radix_cache=rng.random() < 0.5,
            disable_overlap_schedule=rng.random() < 0.5,
        )
        p = plan_of(spec, **options)
        per_req = per_req_of(p)
        slots = p.mamba_cache_size
        mamba = hybrid_linear.mamba_budget_bytes(budget, options["mamba_full_memory_ratio"])
        assert (slots + 1) * per_req <= mamba < (slots + 2) * per_req, options
        page_bytes = page * p.cell_size_bytes
        kv_budget = budget - (slots + 1) * per_req
        assert p.num_pages * page_bytes <= kv_budget < (p.num_pages + 1) * page_bytes, options
        assert p.total_bytes == (slots + 1) * per_req + (p.num_pages + 1) * page_bytes
        ratio = 1 if options["disable_radix_cache"] else (
            4 if options["disable_overlap_schedule"] else 5)
        assert p.max_running_requests <= slots // ratio, options


# --- without a budget, and stages without one kind of layer -----------------------------------


def test_max_total_tokens_only_needs_max_running_requests() -> None:
    """No budget: 100,000 tokens from the cap; state = 50 * 5 = 250 slots (ratio 5); mrr =
    min(50, 50,000, 250 // 5) = 50. Without the radix cache 50 * 1 slots."""
    p = plan_of(qwen3_next(), max_total_tokens=100_000, max_running_requests=50)
    assert (p.max_total_num_tokens, p.mamba_cache_size, p.max_running_requests) == (
        100_000, 250, 50)
    assert p.buffer("ssm.0").shape == (251, 32, 128, 128)
    no_radix = plan_of(qwen3_next(), max_total_tokens=100_000, max_running_requests=50,
                       disable_radix_cache=True)
    assert no_radix.mamba_cache_size == 50
    with pytest.raises(InvalidArgument, match="--max-running-requests") as err:
        plan_of(qwen3_next(), max_total_tokens=100_000)
    assert err.value.field == "max_running_requests"


def test_max_total_tokens_caps_the_kv_side_of_a_budget() -> None:
    """The cap lowers the KV side only; the state keeps its 262 slots."""
    p = plan_of(qwen3_next(), budget_bytes=B40, max_total_tokens=100_000)
    assert (p.max_total_num_tokens, p.mamba_cache_size) == (100_000, 262)


def test_stage_without_full_attention_puts_the_budget_into_state() -> None:
    """PP 48: stage 0 holds only linear layer 0. cell 0, no KV buffers; per_req = 2,146,304;
    slots = 1,073,741,824 // 2,146,304 - 1 = 500 - 1 = 499; tokens = the context length
    262,144; PP turns the overlap schedule off (ratio 4), so max_running_requests =
    min(2,048, 131,072, 499 // 4 = 124) = 124.
    With max_total_tokens 4,096 the id space is 4,096 tokens."""
    p = plan_of(qwen3_next(), budget_bytes=GIB, pp_size=48, pp_rank=0)
    assert p.cell_size_bytes == 0
    assert (p.mamba_cache_size, p.max_total_num_tokens, p.max_running_requests) == (
        499, 262_144, 124)
    assert not [b for b in p.buffers if b.kind is BufferKind.kv]
    assert {b.name for b in p.buffers if b.in_budget} == {"conv.0", "ssm.0"}
    assert GIB - p.total_bytes < SLOT_LAYER_TP1
    assert any("no full-attention layers" in n for n in p.notes)
    capped = plan_of(qwen3_next(), budget_bytes=GIB, pp_size=48, pp_rank=0,
                     max_total_tokens=4096)
    assert capped.max_total_num_tokens == 4096
    # a model with no full-attention layer at all is the same case on every stage
    all_linear = plan_of(qwen3_next(full_attention_layers=()), budget_bytes=B40)
    assert all_linear.cell_size_bytes == 0
    assert all_linear.mamba_cache_size == B40 // (48 * SLOT_LAYER_TP1) - 1  # 415


def test_stage_without_linear_layers_puts_the_budget_into_kv() -> None:
    """PP 48: stage 3 holds only full layer 3. per_req 0, cell = 2 * 512 * 2 = 2,048;
    pages = 1,073,741,824 // 2,048 = 524,288; mrr = min(2,048, 262,144) = 2,048;
    state ids = 2,048 * 4 (ratio 4: PP, no overlap schedule) = 8,192 with no state buffers."""
    p = plan_of(qwen3_next(), budget_bytes=GIB, pp_size=48, pp_rank=3)
    assert p.cell_size_bytes == 2_048
    assert (p.max_total_num_tokens, p.max_running_requests, p.mamba_cache_size) == (
        524_288, 2_048, 8_192)
    assert {b.name for b in p.buffers if b.in_budget} == {"k.3", "v.3"}
    assert p.buffer("req_to_state").shape == (2_049,)


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "needed", "slots"),
    [
        # with the radix cache (extra_buffer, overlap) one request needs 5 slots + padding =
        # 6 * 77,266,944 = 463,601,664 B of mamba budget: budget >= 463,601,664 * 19 / 9 =
        # 978,714,624 B
        ({}, 978_714_624, 5),
        # no overlap schedule: 4 slots + padding: 5 * 77,266,944 * 19 / 9 = 815,595,520 B
        ({"disable_overlap_schedule": True}, 815_595_520, 4),
        # no_buffer: 3 slots + padding: 4 * 77,266,944 * 19 / 9 = 652,476,416 B
        ({"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True},
         652_476_416, 3),
        # without the radix cache 1 slot + padding: 2 * 77,266,944 * 19 / 9 = 326,238,208 B
        ({"disable_radix_cache": True}, 326_238_208, 1),
    ],
)
def test_budget_too_small_for_state_names_per_req_and_the_budget_needed(
        options: dict[str, object], needed: int, slots: int) -> None:
    """One byte below ``needed`` the state buys one slot too few; at ``needed`` exactly one
    request runs and the KV side gets the rest."""
    with pytest.raises(InvalidArgument) as err:
        plan_of(qwen3_next(), budget_bytes=needed - 1, **options)
    assert err.value.field == "budget_bytes"
    assert "77,266,944" in err.value.message and f"{needed:,}" in err.value.message
    p = plan_of(qwen3_next(), budget_bytes=needed, **options)
    assert (p.mamba_cache_size, p.max_running_requests) == (slots, 1)


def test_stage_without_full_attention_too_small_for_state() -> None:
    """All budget to state, radix cache under PP (no overlap schedule: ratio 4): 4 slots plus
    the padding slot, 5 * 2,146,304 = 10,731,520 B needed."""
    with pytest.raises(InvalidArgument, match="10,731,520 B") as err:
        plan_of(qwen3_next(), budget_bytes=10_731_519, pp_size=48, pp_rank=0)
    assert err.value.field == "budget_bytes"
    p = plan_of(qwen3_next(), budget_bytes=10_731_520, pp_size=48, pp_rank=0)
    assert p.mamba_cache_size == 4


def test_budget_too_small_for_kv_after_state() -> None:
    """m = 100, 1 GiB, page 4,096: 13 state slots take 1,004,470,272 B, leaving 69,271,552 B
    for KV, less than 2 pages of 24,576 * 4,096 = 100,663,296 B each."""
    with pytest.raises(InvalidArgument, match="69,271,552 B for KV") as err:
        plan_of(qwen3_next(), budget_bytes=GIB, page_size=4096, mamba_full_memory_ratio=100)
    assert err.value.field == "budget_bytes"


def test_no_radix_max_running_requests_beyond_the_budget() -> None:
    with pytest.raises(InvalidArgument, match="lower --max-running-requests") as err:
        plan_of(qwen3_next(), budget_bytes=GIB, disable_radix_cache=True,
                max_running_requests=100)
    assert err.value.field == "budget_bytes"


def test_linear_with_dsa_indexer_is_rejected() -> None:
    spec = ModelSpec(num_layers=4, attention=MLAAttention(kv_lora_rank=512, qk_rope_head_dim=64),
                     context_length=64, indexer=DSAIndexer(), linear=tiny().linear)
    with pytest.raises(InvalidArgument, match="indexer") as err:
        plan_of(spec, budget_bytes=GIB, page_size=64)
    assert err.value.field == "model"


def test_size_and_layout_agree_through_the_context() -> None:
    """The module's own entry points (as the registry calls them) give the planner's numbers."""
    ctx = make_context(qwen3_next(), make_options(budget_bytes=B40))
    assert hybrid_linear.per_request_state_bytes(ctx) == PER_REQ_TP1
    full, linear = hybrid_linear.stage_split(ctx)
    assert (full, len(linear)) == (list(FULL_LAYERS), 36)
    sizing = hybrid_linear.size(ctx)
    assert (sizing.architecture, sizing.mamba_cache_size, sizing.num_pages) == (
        "hybrid_linear", 262, 920_754)
    assert len(hybrid_linear.layout(ctx, sizing)) == 24 + 72 + 1


# --- a real pool ------------------------------------------------------------------------------


def test_build_small_pool_views() -> None:
    """tiny(): full layers 1, 3; linear 0, 2; TP 1, page 4, budget 65,536 B, context 64.
    conv_dim = 8*4 + 2*2*8 = 64: conv (64, 3) bf16 = 384 B, ssm (4, 8, 8) fp32 = 1,024 B,
    per_req = 1,408 * 2 = 2,816 B; cell = 2 * 32 * 2 * 2 = 256 B, page = 1,024 B.
    mamba_budget = 65,536 * 9 // 19 = 31,043 -> slots 31,043 // 2,816 - 1 = 10;
    KV = 65,536 - 11 * 2,816 = 34,560 -> pages 34,560 // 1,024 = 33 (132 tokens, 136 rows);
    mrr = min(2,048, 66, 10 // 5) = 2. Used = 30,976 + 34 * 1,024 = 65,792 B."""
    p = plan_of(tiny(), budget_bytes=65_536, page_size=4)
    assert (p.mamba_cache_size, p.num_pages, p.max_running_requests) == (10, 33, 2)
    assert p.total_bytes == 65_792
    pool = builder.build_pool(p, "cpu")
    views = pool.views
    assert pool.backing.numel() == p.backing_bytes
    expected = {
        "k.1": ((136, 2, 16), torch.bfloat16),
        "v.3": ((136, 2, 16), torch.bfloat16),
        "conv.0": ((11, 64, 3), torch.bfloat16),
        "ssm.2": ((11, 4, 8, 8), torch.float32),
        "req_to_state": ((3,), torch.int32),
    }
    for name, (shape, dtype) in expected.items():
        assert tuple(views[name].shape) == shape, name
        assert views[name].dtype == dtype, name
    assert set(views) == names(p)
    # every view aliases its own bytes of the backing: fill each, then read all back
    for i, name in enumerate(sorted(views)):
        views[name].fill_(i + 1)
    for i, name in enumerate(sorted(views)):
        assert bool((views[name] == i + 1).all()), name
    spec = p.buffer("ssm.2")
    views["ssm.2"][5].fill_(2.5)
    raw = pool.backing[spec.offset_bytes + 5 * spec.page_bytes:
                       spec.offset_bytes + 6 * spec.page_bytes]
    assert bool((raw.view(torch.float32) == 2.5).all())


def test_state_buffers_are_one_evenly_spaced_stack_per_kind() -> None:
    """SGLang's mamba pool keeps one ``(layers, slots, ...)`` tensor per kind; the plugin views the
    daemon's ``conv.<l>`` (then ``ssm.<l>``) buffers as one, so each kind is placed back to
    back at one stride. Qwen3-Next-80B, 40 GiB, TP 1: 263 slots of conv (8192, 3) bf16 =
    12,926,976 B and ssm (32, 128, 128) fp32 = 551,550,976 B per layer, both multiples of 256,
    so the stride is exactly one buffer: contiguous stacks."""
    p = plan_of(qwen3_next(), budget_bytes=B40)
    linear = [lay for lay in range(48) if lay not in FULL_LAYERS]
    for kind, nbytes in (("conv", 263 * 49_152), ("ssm", 263 * 2_097_152)):
        specs = [next(b for b in p.buffers if b.name == f"{kind}.{lay}") for lay in linear]
        assert {b.nbytes for b in specs} == {nbytes}
        offsets = [b.offset_bytes for b in specs]
        assert {b - a for a, b in itertools.pairwise(offsets)} == {nbytes}
    # The KV buffers come first, in layer order.
    kv = [b.name for b in p.buffers if b.kind == BufferKind.kv]
    assert kv == [f"{n}.{lay}" for lay in FULL_LAYERS for n in ("k", "v")]
    assert max(b.offset_bytes for b in p.buffers if b.kind == BufferKind.kv) < min(
        b.offset_bytes for b in p.buffers if b.kind == BufferKind.state)

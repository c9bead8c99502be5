"""DeepSeek-V4 compressed-attention sizing (kvpoold.sizing.dsv4) and its pool builder.

The spec is built by hand (there is no HF loader for DSV4): 61 layers, ratios 0, 0 then 4 / 128
alternating (layer l >= 2 is c4 when even), so L4 = 30 and L128 = 29; nope 448, rope 64,
index 128, window 128. Constants for page 256, worked out by hand:

    kv  = 448 + 2 * 64 + 448 / 64 + 1 = 584 B per entry; pages are padded to 576 B multiples
    Bs   = ceil(256 * 584 / 576) * 576 = 260 * 576 = 149,760     (SWA page, 256 entries)
    B4   = ceil( 64 * 584 / 576) * 576 =  65 * 576 =  37,440     (c4 page, 64 entries)
    B128 = ceil(  2 * 584 / 576) * 576 =   3 * 576 =   1,728     (c128 page, 2 entries)
    I4   = 64 * (128 + 4) = 8,448                                (c4 indexer page)
    c4 state row 4 * 512 * s, c4 indexer state row 4 * 128 * s, c128 state row 2 * 512 * s
    dN = 30 * (37,440 + 8,448) + 29 * 1,728 = 1,426,752 B        (one more full page)
    dS = (61 + D) * 149,760 + 30 * ring4 * (2,560 * s)         (one more SWA page: ring4
                                                                  c4 state rows each)

fp32 (s = 4), no speculative (ring4 8): dS = 9,135,360 + 30 * 8 * 10,240 = 11,592,960; SGLang's
coefficient bpt = (1,426,752 + 0.8 * 11,592,960) / 256 = 41,801.25 B per full token, cell =
int(bpt) = 41,801. Full tokens = int((budget - c128 state) / bpt), page-aligned (SGLang's DSV4
rule: the padding pages and the rings' sentinel rows come on top of the budget).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.options import make_options
from kvpool.contract.plan import BufferFill, BufferKind, PoolPlan
from kvpool.contract.spec import (
    DSV4Compression,
    MLAAttention,
    ModelSpec,
    SlidingWindow,
    decode_spec,
)
from kvpoold.pools import build_pool
from kvpoold.sizing import dsv4
from kvpoold.sizing.layout import ALIGN_BYTES
from kvpoold.sizing.planner import make_context, plan
from kvpoold.sizing.registry import select_architecture

GIB = 1 << 30
BUDGET = 40 * GIB  # 42,949,672,960 B
RATIOS_61 = (0, 0, *(4 if layer % 2 == 0 else 128 for layer in range(2, 61)))
BS, B4, B128, I4 = 149_760, 37_440, 1_728, 8_448
DN = 1_426_752


def v4_spec(state_dtype: str = "float32", ratios: tuple[int, ...] = RATIOS_61,
            **fields: object) -> ModelSpec:
    """A DeepSeek-V4-like spec; attention is schema-required but not read by DSV4 sizing."""
    base: dict[str, object] = {
        "num_layers": len(ratios),
        "attention": MLAAttention(kv_lora_rank=448, qk_rope_head_dim=64),
        "context_length": 1 << 20,
        "architecture": "DeepseekV4ForCausalLM",
        "kv_cache_quant_fp8": True,
        "num_nextn_predict_layers": 1,
        "dsv4": DSV4Compression(compress_ratios=ratios,  # type: ignore[arg-type]
                                state_dtype=state_dtype),  # type: ignore[arg-type]
    }
    base.update(fields)
    return ModelSpec(**base)  # type: ignore[arg-type]


def opts(**fields: object):
    # r = 0.8 given: the worked examples were written with it (SGLang's own default for
    # DeepseekV4ForCausalLM is 0.1; test_engine_defaults_of_a_model_class covers that)
    base: dict[str, object] = {"budget_bytes": BUDGET, "page_size": 256,
                               "max_running_requests": 256, "swa_full_tokens_ratio": 0.8}
    base.update(fields)
    return make_options(**base)


def d_swa(state_bytes: int, ring4: int, draft: int) -> int:
    """dS for the 61-layer spec at page 256 (see the module docstring)."""
    return (61 + draft) * BS + 30 * ring4 * (4 * 512 + 4 * 128) * state_bytes


def test_worked_example_fp32_40gib() -> None:
    """max_running_requests 256 -> 257 slots; fp32 c128 state rows = ceil128(257 * 128 + 128
    + 1) = ceil128(33,025) = 33,152, bytes = 29 * 33,152 * 4,096 = 3,937,927,168.
    Tokens = int((42,949,672,960 - 3,937,927,168) / 41,801.25) = int(933,267.7) -> 933,120
    aligned = N 3,645 full pages; S = int(933,120 * 0.8) // 256 = 2,916 SWA pages;
    c4_state = 2,916 * 8 = 23,328 (rows ceil4(23,337) = 23,340). Laid out:
      SWA        61 * 2,917 * 149,760                  = 26,647,845,120
      compressed 3,646 * 1,426,752                      =  5,201,937,792
      c4 states  30 * 23,340 * 10,240                   =  7,170,048,000
      c128 state                                         =  3,937,927,168
      total                                              = 42,957,758,080   8,085,120 over
    the budget: the padding pages and sentinel rows, as SGLang lays them out too.
    """
    p = plan(v4_spec(), opts())
    assert p.architecture == "dsv4"
    assert p.kv_cache_dtype == "fp8_e4m3"
    assert p.cell_size_bytes == 41_801
    assert p.num_pages == 3_645 and p.swa_num_pages == 2_916
    assert p.max_total_num_tokens == p.full_max_total_num_tokens == 933_120
    assert p.swa_max_total_num_tokens == 746_496
    assert p.c4_max_total_num_tokens == 233_280
    assert p.c128_max_total_num_tokens == 7_290
    assert p.c4_state_pool_size == 23_328
    assert p.c128_state_pool_size == 32_896
    assert p.max_running_requests == 256
    assert p.total_bytes == 42_957_758_080
    assert p.total_bytes - BUDGET == 8_085_120
    assert p.buffer("swa_kv.0").shape == (2_917, BS)
    assert p.buffer("c4_kv.2").shape == (3_646, B4)
    assert p.buffer("c4_index_k.2").shape == (3_646, I4)
    assert p.buffer("c4_state.2").shape == (23_340, 2_048)
    assert p.buffer("c4_index_state.2").shape == (23_340, 512)
    assert p.buffer("c128_kv.3").shape == (3_646, B128)
    assert p.buffer("c128_state.3").shape == (33_152, 1_024)
    assert p.buffer("c128_state.3").dtype == "float32"
    assert p.buffer("full_to_swa").shape == (3_646,)
    assert not p.buffer("full_to_swa").in_budget
    # 1M context, ~0.8M tokens: the one note says a full-context request does not fit
    assert len(p.notes) == 1
    assert p.notes[0].startswith(f"the pool holds {p.max_total_num_tokens:,} tokens, less than "
                                 "one request at the context length 1,048,576")


def test_default_max_running_requests_from_first_pass() -> None:
    """No --max-running-requests: SGLang's first pass, int(budget / 41,801.25) = 1,027,473
    tokens, no state charged; int(1,027,473 / 1,048,576 * 512) = 501 -> clamped to 2,048, and
    T1 // 2 is larger, so 2,049 slots are charged: 29 * ceil128(2,049 * 128 + 129) * 4,096 =
    29 * 262,528 * 4,096 = 31,184,125,952 B. Then int(11,765,547,008 / 41,801.25) = 281,463
    -> N = 1,099, S = int(281,344 * 0.8) // 256 = 879.
    max_running_requests = min(2,048, 281,344 // 2) = 2,048; c128_state = 2,049 * 128 = 262,272.
    """
    # a spec naming no class: SGLang's DeepseekV4ForCausalLM default of 256 requests does not
    # apply, so the first pass decides
    p = plan(v4_spec(architecture=""), opts(max_running_requests=None))
    assert p.num_pages == 1_099 and p.swa_num_pages == 879
    assert p.max_running_requests == 2_048
    assert p.c128_state_pool_size == 262_272
    assert p.buffer("c128_state.3").shape == (262_528, 1_024)
    assert p.buffer("req_to_token").shape[0] == 2_049


def test_bf16_state_halves_state_rows() -> None:
    """bf16 (s = 2): dS = 9,135,360 + 30 * 8 * 5,120 = 10,364,160, bpt = (1,426,752 +
    8,291,328) / 256 = 37,961.25, cell 37,961. c128 state 29 * 33,152 * 2,048 = 1,968,963,584.
    int((budget - 1,968,963,584) / 37,961.25) = 1,079,540 -> N = 4,216, S = 3,372.
    """
    fp32 = plan(v4_spec("float32"), opts())
    bf16 = plan(v4_spec("bfloat16"), opts())
    assert bf16.cell_size_bytes == 37_961
    assert bf16.num_pages == 4_216 and bf16.swa_num_pages == 3_372
    assert bf16.num_pages > fp32.num_pages
    for name in ("c4_state.2", "c4_index_state.2", "c128_state.3"):
        a, b = fp32.buffer(name), bf16.buffer(name)
        assert (a.dtype, b.dtype) == ("float32", "bfloat16")
        assert a.shape[1] == b.shape[1]  # same elements per row, half the bytes
        assert a.page_bytes == 2 * b.page_bytes  # one ring of rows
    assert bf16.buffer("c128_state.3").nbytes * 2 == fp32.buffer("c128_state.3").nbytes


def test_speculative_doubles_rings_and_adds_draft_swa_layer() -> None:
    """EAGLE with the spec's 1 MTP layer: rings c4 16, c128 256; the draft layer is SWA-only
    and laid out, but priced as SGLang prices its draft worker: the target's coefficient
    times (61 + 1) / 61. dS' = 61 * 149,760 + 30 * 16 * 10,240 = 14,050,560; bpt = (1,426,752 +
    11,240,448) / 256 * 62 / 61 = 50,292.418, cell 50,292. c128 rows ceil128(257 * 256 + 257) =
    66,176 -> 29 * 66,176 * 4,096 = 7,860,649,984. int((budget - 7,860,649,984) / bpt) =
    697,700 -> N = 2,725, S = 2,180.
    """
    p = plan(v4_spec(), opts(speculative_algorithm="eagle"))
    assert p.num_draft_layers == 1
    assert p.cell_size_bytes == 50_292
    assert p.num_pages == 2_725 and p.swa_num_pages == 2_180
    assert p.c4_state_pool_size == 2_180 * 16
    assert p.c128_state_pool_size == 257 * 256
    assert p.buffer("draft_swa_kv.0").shape == p.buffer("swa_kv.0").shape == (2_181, BS)
    assert p.buffer("c4_state.2").page_bytes == 16 * 2_048 * 4  # one ring
    assert p.buffer("c128_state.3").shape == (66_176, 1_024)
    assert p.buffer("c128_state.3").page_bytes == 256 * 1_024 * 4
    assert not any(b.name.startswith(("draft_c4", "draft_c128")) for b in p.buffers)


def test_pp2_each_stage_sizes_its_own_layers() -> None:
    """61 layers over 2 stages: 30 (0..29) and 31 (30..60). Stage 0: L4 = 14 (2, 4, ..., 28),
    L128 = 14; dN = 14 * 45,888 + 14 * 1,728 = 666,624; dS = 30 * 149,760 + 14 * 81,920 =
    5,639,680; cell = int((666,624 + 4,511,744) / 256) = 20,228. Stage 1: L4 = 16 (30, ...,
    60), L128 = 15; dN = 760,128; dS = 31 * 149,760 + 16 * 81,920 = 5,953,280; cell =
    int((760,128 + 4,762,624) / 256) = 21,573.
    """
    s0 = plan(v4_spec(), opts(pp_size=2, pp_rank=0))
    s1 = plan(v4_spec(), opts(pp_size=2, pp_rank=1))
    assert (s0.layer_start, s0.layer_end, s1.layer_start, s1.layer_end) == (0, 30, 30, 61)
    assert (s0.cell_size_bytes, s1.cell_size_bytes) == (20_228, 21_573)
    names0 = {b.name for b in s0.buffers}
    names1 = {b.name for b in s1.buffers}
    assert {"swa_kv.0", "swa_kv.29", "c4_kv.28", "c128_kv.29"} <= names0
    assert not any(n.endswith(".30") for n in names0)
    assert {"swa_kv.30", "c4_kv.30", "c4_kv.60", "c128_kv.59"} <= names1
    assert sum(n.startswith("c4_kv.") for n in names0) == 14
    assert sum(n.startswith("c128_kv.") for n in names0) == 14
    assert sum(n.startswith("c4_kv.") for n in names1) == 16
    assert sum(n.startswith("c128_kv.") for n in names1) == 15
    for p in (s0, s1):
        assert p.max_total_num_tokens == p.num_pages * 256


@pytest.mark.parametrize("page", [1, 64, 200, 320])
def test_a_page_size_not_a_multiple_of_128_becomes_sglangs_256(page: int) -> None:
    """SGLang's DSV4 override sets page 256; kvpool takes it, with a note, for any page size
    it could not plan (a multiple of 128 is kept)."""
    p = plan(v4_spec(), opts(page_size=page))
    assert p.page_size == 256
    assert any(n.startswith("page size 256") and f"asked {page}" in n for n in p.notes)


def test_page_size_128_is_accepted_with_a_note() -> None:
    """Page 128: Bs = ceil(128 * 584 / 576) * 576 = 74,880; c128 pages hold one entry padded
    to 1,152 B."""
    p = plan(v4_spec(), opts(page_size=128))
    assert p.buffer("swa_kv.0").shape[1] == 74_880
    assert p.buffer("c128_kv.3").shape[1] == 1_152
    assert p.buffer("c4_index_k.2").shape[1] == 32 * 132
    assert any("256" in note for note in p.notes)


def test_kv_dtype_must_be_fp8() -> None:
    spec = v4_spec(kv_cache_quant_fp8=False)
    with pytest.raises(InvalidArgument) as err:
        plan(spec, opts())
    assert err.value.field == "kv_cache_dtype"
    assert "bfloat16" in err.value.message
    assert plan(spec, opts(kv_cache_dtype="fp8_e4m3")).kv_cache_dtype == "fp8_e4m3"


def test_budget_too_small_for_the_c128_state_names_the_knob() -> None:
    """1 GiB: the first pass holds ~84 pages (~21.5k tokens) -> 2,048 requests, whose fp32
    c128 state alone is 31 GB."""
    with pytest.raises(InvalidArgument) as err:
        plan(v4_spec(), opts(budget_bytes=GIB, max_running_requests=None))
    assert err.value.field == "budget_bytes"
    assert "c128" in err.value.message and "--max-running-requests" in err.value.message
    # Fewer requests fit.
    assert plan(v4_spec(), opts(budget_bytes=GIB, max_running_requests=4)).num_pages >= 1


def test_swa_space_must_exceed_window_plus_page() -> None:
    """max_total_tokens 512 = 2 pages -> swa = int(512 * 0.8) // 256 * 256 = 256 <= 128 + 256."""
    with pytest.raises(InvalidArgument) as err:
        plan(v4_spec(), opts(budget_bytes=None, max_total_tokens=512))
    assert err.value.field == "max_total_tokens"
    for mrr in (None, 4):  # below one page, with and without a first-pass estimate
        with pytest.raises(InvalidArgument) as err:
            plan(v4_spec(), opts(budget_bytes=None, max_total_tokens=100,
                                 max_running_requests=mrr))
        assert err.value.field == "max_total_tokens"
    p = plan(v4_spec(), opts(budget_bytes=None, max_total_tokens=1024))  # swa = 768
    assert (p.num_pages, p.swa_num_pages) == (4, 3)


def test_max_total_tokens_caps_the_budget_count() -> None:
    p = plan(v4_spec(), opts(max_total_tokens=100_000))
    assert p.max_total_num_tokens == 99_840  # 390 pages
    assert p.swa_max_total_num_tokens == 312 * 256
    assert any("caps" in note for note in p.notes)


def test_sliding_window_must_agree_with_the_dsv4_window() -> None:
    mismatched = v4_spec(sliding_window=SlidingWindow(window=64, layers=(0,)))
    with pytest.raises(InvalidArgument) as err:
        plan(mismatched, opts())
    assert err.value.field == "model"
    agreeing = v4_spec(sliding_window=SlidingWindow(window=128, layers=(0,)))
    assert plan(agreeing, opts()).num_pages == 3_645


def test_registry_selects_dsv4_and_a_json_spec_plans() -> None:
    """The spec as docs/dsv4-layout.md tells users to write it."""
    doc = {
        "num_layers": 4,
        "attention": {"type": "mla", "kv_lora_rank": 448, "qk_rope_head_dim": 64},
        "context_length": 65536,
        "kv_cache_quant_fp8": True,
        "dsv4": {"compress_ratios": [0, 4, 128, 4], "window_size": 128,
                 "state_dtype": "bfloat16"},
    }
    spec = decode_spec(doc)
    assert select_architecture(spec).name == "dsv4"
    plain_mla = ModelSpec(num_layers=1, context_length=4096,
                          attention=MLAAttention(kv_lora_rank=512, qk_rope_head_dim=64))
    assert dsv4.matches(spec) and not dsv4.matches(plain_mla)
    assert plan(spec, opts(budget_bytes=GIB, max_running_requests=8)).architecture == "dsv4"


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    budget=st.integers(min_value=8 * GIB, max_value=80 * GIB),
    state=st.sampled_from([("float32", 4), ("bfloat16", 2)]),
    speculative=st.booleans(),
    ratio=st.sampled_from([0.5, 0.7, 0.8, 1.0]),
    mrr=st.integers(min_value=1, max_value=300),
)
def test_budget_invariants(budget: int, state: tuple[str, int], speculative: bool, ratio: float,
                           mrr: int) -> None:
    """SGLang's DSV4 rule: full tokens = int((budget - c128 state) / bpt), page-aligned, with
    bpt = (dN + r * dS) / 256 as a float; S = int(full * r) // 256 SWA pages; what the budget
    does not pay (the padding pages and the rings' sentinel rows) stays under one SWA page of
    every layer, one full page and a ring of c4 state rows."""
    dtype, s = state
    try:
        p = plan(v4_spec(dtype), opts(budget_bytes=budget, max_running_requests=mrr,
                                      swa_full_tokens_ratio=ratio,
                                      speculative_algorithm="eagle" if speculative else "none"))
    except InvalidArgument as exc:
        # The c128 state of many requests can leave too little for one page or window: a clear
        # refusal is the right answer there, not a pool.
        assert exc.field == "budget_bytes"
        assert "window" in str(exc) or "too small" in str(exc)
        assume(False)
    ring4, ring128 = (16, 256) if speculative else (8, 128)
    draft = 1 if speculative else 0
    bpt = (DN + ratio * d_swa(s, ring4, 0)) / 256 * (62 / 61 if speculative else 1)
    assert p.cell_size_bytes == int(bpt)
    c128 = 29 * math.ceil(((mrr + 1) * ring128 + ring128 + 1) / 128) * 128 * 1_024 * s
    full = int((budget - c128) / bpt) // 256 * 256
    assert p.max_total_num_tokens == full and p.num_pages == full // 256
    assert p.swa_num_pages == int(full * ratio) // 256
    assert p.total_bytes == sum(b.nbytes for b in p.buffers if b.in_budget)
    unpaid = (61 + draft) * BS + DN + 30 * (ring4 + 4) * 2_560 * s
    assert p.total_bytes - budget < unpaid
    assert p.max_running_requests <= mrr
    assert p.c128_state_pool_size == (mrr + 1) * ring128


def test_buffers_are_aligned_and_do_not_overlap() -> None:
    p = plan(v4_spec(), opts(speculative_algorithm="eagle"))
    spans = sorted((b.offset_bytes, b.offset_bytes + b.nbytes, b.name) for b in p.buffers)
    for (_, end, name), (start, _, nxt) in itertools.pairwise(spans):
        assert end <= start, f"{name} overlaps {nxt}"
    assert all(b.offset_bytes % ALIGN_BYTES == 0 for b in p.buffers)
    assert spans[-1][1] == p.backing_bytes
    assert p.backing_bytes - p.total_bytes - p.aux_bytes < ALIGN_BYTES * len(p.buffers)
    expected = 61 + 1 + 30 * 4 + 29 * 2 + 2  # swa, draft, c4 x4, c128 x2, map, req_to_token
    assert len(p.buffers) == expected


def test_plan_json_round_trip() -> None:
    p = plan(v4_spec("bfloat16"), opts(pp_size=2, pp_rank=1, speculative_algorithm="eagle"))
    back = PoolPlan.from_json(p.to_json())
    assert back == p
    assert back.fingerprint() == p.fingerprint()
    assert back.buffer("c4_state.30").kind == BufferKind.state


def tiny_plan() -> PoolPlan:
    """4 layers (0, 4, 128, 4), page 128, bf16 state, max_total_tokens 512, 2 requests:
    N = 4, S = floor(3.2) = 3 (384 > 128 + 128). Bs = 74,880; B4 = ceil(32 * 584 / 576) * 576
    = 19,008; I4 = 32 * 132 = 4,224; B128 = 1,152. c4_state = 3 * 128 // 128 * 8 = 24, rows
    ceil4(33) = 36; c128 rows ceil128(3 * 128 + 129) = 640. Bytes: SWA 4 * 4 * 74,880 =
    1,198,080; c4 2 * 5 * 23,232 = 232,320; c128 KV 5 * 1,152 = 5,760; c4 states 2 * 36 *
    (4,096 + 1,024) = 368,640; c128 state 640 * 2,048 = 1,310,720; total 3,115,520.
    """
    spec = v4_spec("bfloat16", ratios=(0, 4, 128, 4))
    return plan(spec, opts(budget_bytes=None, max_total_tokens=512, page_size=128,
                           max_running_requests=2))


def test_tiny_plan_numbers() -> None:
    p = tiny_plan()
    assert (p.num_pages, p.swa_num_pages, p.total_bytes) == (4, 3, 3_115_520)
    assert (p.c4_state_pool_size, p.c128_state_pool_size) == (24, 384)
    assert p.budget_bytes is None


def test_build_small_pool_on_cpu() -> None:
    p = tiny_plan()
    pool = build_pool(p, "cpu")
    backing, views = pool.backing, pool.views
    assert set(views) == {b.name for b in p.buffers}
    expect = {
        "swa_kv.0": ((4, 74_880), torch.uint8),
        "swa_kv.3": ((4, 74_880), torch.uint8),
        "c4_kv.1": ((5, 19_008), torch.uint8),
        "c4_index_k.3": ((5, 4_224), torch.uint8),
        "c4_state.1": ((36, 2_048), torch.bfloat16),
        "c4_index_state.3": ((36, 512), torch.bfloat16),
        "c128_kv.2": ((5, 1_152), torch.uint8),
        "c128_state.2": ((640, 1_024), torch.bfloat16),
        "full_to_swa": ((5,), torch.int64),
        "req_to_token": ((3, (1 << 20) + 4), torch.int32),
    }
    for name, (shape, dtype) in expect.items():
        assert tuple(views[name].shape) == shape, name
        assert views[name].dtype == dtype, name
    base = backing.data_ptr()
    for b in p.buffers:
        assert views[b.name].data_ptr() == base + b.offset_bytes  # views, not copies
    filled = {b.name for b in p.buffers if b.fill == BufferFill.kv_score}
    assert filled == {b.name for b in p.buffers if b.kind == BufferKind.state}
    for name in ("c4_state.1", "c4_index_state.3", "c128_state.2"):
        assert name in filled
        state = views[name]
        half = state.shape[-1] // 2
        assert torch.all(state[:, :half] == 0)
        assert torch.all(torch.isneginf(state[:, half:]))
    assert not torch.any(views["swa_kv.0"]) and not torch.any(views["c4_kv.1"])
    # Writes land in the shared backing.
    views["c4_kv.1"][1, 0] = 7
    assert backing[p.buffer("c4_kv.1").offset_bytes + 19_008] == 7


def test_geometry_formulas_match_the_layout() -> None:
    """The closed-form byte count equals the laid-out buffers for a few page counts."""
    spec = v4_spec()
    options = opts(speculative_algorithm="eagle")
    ctx = make_context(spec, options)
    geo = dsv4.geometry(ctx)
    p = plan(spec, options)
    slots = p.c128_state_pool_size // geo.ring128
    assert geo.pool_bytes(p.num_pages, slots) == p.total_bytes
    assert geo.full_page_bytes == DN
    assert geo.swa_page_cost() == d_swa(4, 16, 1)
    assert dsv4.kv_bytes_per_token(448, 64) == 584
    assert dsv4.index_bytes_per_token(128) == 132
    assert dsv4.packed_page_bytes(256, 448, 64) == BS

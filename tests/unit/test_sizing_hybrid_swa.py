"""Hybrid sliding-window sizing (kvpoold.sizing.hybrid_swa), checked on gpt-oss-20b by hand.

gpt-oss-20b (tests/data/models/gpt-oss-20b.json): 24 layers, the even ids 0, 2, ..., 22 slide
(HF window 128; SGLang's gpt-oss model reports the exclusive window 127), 8 KV heads,
head_dim 64, bf16. Per layer and token F = S = 8 * (64 + 64) * 2 = 2,048 B; with 12 full and
12 SWA layers Fb = Sb = 24,576 B, and at r = 0.8 SGLang's float cell is cell_f = 24,576 +
0.8 * 24,576 = 44,236.8 (reported as int: 44,236 B). The rule, SGLang's:

    full = int(budget // cell_f) // page * page        swa = int(full * r) // page * page

and with fp = full // page and sp = swa // page the buffers (padding pages on top) cost
page * ((fp + 1) * Fb + (sp + 1) * Sb) bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.options import make_options
from kvpool.contract.plan import BufferKind, PoolPlan
from kvpool.contract.spec import (
    DSV4Compression,
    MHAAttention,
    MLAAttention,
    ModelSpec,
    SlidingWindow,
)
from kvpoold.pools import build_pool
from kvpoold.sizing import hybrid_swa
from kvpoold.sizing.planner import make_context, plan
from kvpoold.sizing.registry import select_architecture

GPT_OSS = Path(__file__).resolve().parents[1] / "data" / "models" / "gpt-oss-20b.json"
GIB = 1 << 30
FB = SB = 24_576  # gpt-oss-20b, TP 1, bf16: 12 layers * 2,048 B


def gpt_oss(**sliding: object) -> ModelSpec:
    """gpt-oss-20b built by hand from its config.json (the HF loader is not used here), with
    the window SGLang's gpt-oss model reports: sliding_window - 1 = 127 (HF counts the current
    token)."""
    cfg = json.loads(GPT_OSS.read_text())
    layers = tuple(i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention")
    window: dict[str, object] = {"window": cfg["sliding_window"] - 1, "layers": layers,
                                 **sliding}
    return ModelSpec(
        num_layers=cfg["num_hidden_layers"],
        attention=MHAAttention(num_kv_heads=cfg["num_key_value_heads"],
                               head_dim=cfg["head_dim"]),
        context_length=cfg["max_position_embeddings"],
        architecture=cfg["architectures"][0],
        sliding_window=SlidingWindow(**window),  # type: ignore[arg-type]
    )


def all_swa_spec() -> ModelSpec:
    """gpt-oss geometry with every one of the 24 layers sliding."""
    return gpt_oss(layers=tuple(range(24)))


def mk(spec: ModelSpec | None = None, **options: object) -> PoolPlan:
    return plan(spec or gpt_oss(), make_options(**options))


def swa_layer_ids(p: PoolPlan) -> list[int]:
    return [int(b.name.split(".")[1]) for b in p.buffers
            if b.kind is BufferKind.swa_kv and b.name.startswith("k.")]


def full_layer_ids(p: PoolPlan) -> list[int]:
    return [int(b.name.split(".")[1]) for b in p.buffers
            if b.kind is BufferKind.kv and b.name.startswith("k.")]


def test_spec_loaded_as_expected() -> None:
    spec = gpt_oss()
    assert spec.sliding_window is not None
    assert spec.sliding_window.layers == tuple(range(0, 24, 2))
    assert spec.sliding_window.window == 127


def test_matches_only_mha_sliding_specs() -> None:
    attn = MHAAttention(num_kv_heads=8, head_dim=64)
    plain = ModelSpec(num_layers=4, attention=attn, context_length=4096)
    empty = ModelSpec(num_layers=4, attention=attn, context_length=4096,
                      sliding_window=SlidingWindow(window=128, layers=()))
    mla = ModelSpec(num_layers=4, attention=MLAAttention(kv_lora_rank=512, qk_rope_head_dim=64),
                    context_length=4096, sliding_window=SlidingWindow(window=128, layers=(0,)))
    dsv4 = ModelSpec(num_layers=4, attention=attn, context_length=4096,
                     sliding_window=SlidingWindow(window=128, layers=(0,)),
                     dsv4=DSV4Compression(compress_ratios=(0, 4, 128, 0)))
    assert hybrid_swa.matches(gpt_oss())
    assert hybrid_swa.matches(all_swa_spec())
    for spec in (plain, empty, mla, dsv4):
        assert not hybrid_swa.matches(spec)
    assert select_architecture(gpt_oss()).name == "hybrid_swa"
    assert hybrid_swa.REPORTS == ("hybrid_swa", "all_swa")


def test_gpt_oss_40gib_page16() -> None:
    """The module docstring's example. 42,949,672,960 / 44,236.8 = 970,903.7 -> 970,903 ->
    // 16 * 16: full = 970,896 (fp = 60,681); swa = int(776,716.8) = 776,716 -> 776,704
    (sp = 48,544). bytes = 16 * 24,576 * (60,682 + 48,545) = 393,216 * 109,227 =
    42,949,804,032 = budget + 131,072 (the padding pages come on top).
    mrr = clamp(int(970,896 / 131,072 * 512) = int(3,792.56) = 3,792, 2,048, 4,096) = 3,792."""
    p = mk(budget_bytes=40 * GIB, page_size=16)
    assert p.architecture == "hybrid_swa"
    assert p.cell_size_bytes == 44_236
    assert p.num_pages == 60_681
    assert p.full_max_total_num_tokens == p.max_total_num_tokens == 970_896
    assert p.swa_max_total_num_tokens == 776_704
    assert p.swa_num_pages == 48_544
    assert p.max_running_requests == 3_792
    assert p.total_bytes == 42_949_804_032
    assert p.buffer("k.1").shape == (60_682 * 16, 8, 64)  # full layer
    assert p.buffer("k.0").shape == (48_545 * 16, 8, 64)  # SWA layer
    assert p.buffer("full_to_swa").shape == (60_682,)


def test_gpt_oss_10gib_page1() -> None:
    """10,737,418,240 / 44,236.8 = 242,725.9 -> full = 242,725 tokens; swa = int(242,725 *
    0.8) = int(194,180.0) = 194,180 (the float product rounds to exactly 194,180.0).
    bytes = 24,576 * (242,726 + 194,181) = 24,576 * 436,907 = 10,737,426,432 = budget + 8,192.
    mrr: int(242,725 / 131,072 * 512) = 948 -> clamped up to 2,048."""
    p = mk(budget_bytes=10 * GIB, page_size=1)
    assert (p.num_pages, p.swa_num_pages) == (242_725, 194_180)
    assert p.full_max_total_num_tokens == 242_725
    assert p.swa_max_total_num_tokens == 194_180
    assert p.total_bytes == 10_737_426_432
    assert p.max_running_requests == 2_048
    assert p.buffer("v.3").shape == (242_726, 8, 64)
    assert p.buffer("v.2").shape == (194_181, 8, 64)
    assert p.buffer("full_to_swa").shape == (242_726,)


def test_small_budget_padding_pages_on_top() -> None:
    """page 1, budget 10,000,000: 10,000,000 / 44,236.8 = 226.06 -> full = 226, swa = int(180.8)
    = 180; bytes = 24,576 * (227 + 181) = 24,576 * 408 = 10,027,008 = budget + 27,008. The
    excess is under one page of every layer: full * cell_f <= budget and swa <= full * r, so
    bytes <= budget + page * (Fb + Sb)."""
    p = mk(budget_bytes=10_000_000, page_size=1)
    assert (p.num_pages, p.swa_num_pages) == (226, 180)
    assert p.total_bytes == 10_027_008
    assert 0 < p.total_bytes - 10_000_000 < FB + SB
    assert p.max_running_requests == 113  # half of 226 tokens


@pytest.mark.parametrize(("tp", "heads"), [(2, 4), (8, 1), (16, 1)])
def test_tp_splits_heads(tp: int, heads: int) -> None:
    """Per-rank heads max(1, 8 // tp): F = S = heads * 128 * 2. Bytes scale with heads (by
    powers of two, so the floats scale exactly), and a budget of 10 GiB * heads / 8 gives the
    same counts as TP 1 with 10 GiB (242,725 full, 194,180 SWA); TP 16 replicates the one
    head. cell = int(12 * F * 1.8)."""
    per_layer = heads * 128 * 2
    p = mk(budget_bytes=10 * GIB * heads // 8, page_size=1, tp_size=tp)
    assert p.cell_size_bytes == int(12 * per_layer * 1.8)
    assert (p.num_pages, p.swa_num_pages) == (242_725, 194_180)
    assert p.buffer("k.1").shape == (242_726, heads, 64)
    assert p.buffer("k.0").shape == (194_181, heads, 64)
    assert p.total_bytes == 10_737_426_432 * heads // 8


def test_tp2_cell_is_half() -> None:
    """TP 2: 4 heads, F = S = 1,024 B; Fb = Sb = 12,288; cell = int(22,118.4) = 22,118."""
    assert mk(budget_bytes=GIB, tp_size=2).cell_size_bytes == 22_118


def test_pp2_stages_split_layers_half_open() -> None:
    """PP 2: stage 0 = layers 0..11 (sliding 0, 2, ..., 10: nf = ns = 6), stage 1 = 12..23
    (sliding 12, ..., 22). Fb = Sb = 6 * 2,048 = 12,288, half of PP 1, so 5 GiB per stage gives
    the PP 1 / 10 GiB counts. Layer 12 belongs to stage 1 only (no inclusive end)."""
    s0 = mk(budget_bytes=5 * GIB, page_size=1, pp_size=2, pp_rank=0)
    s1 = mk(budget_bytes=5 * GIB, page_size=1, pp_size=2, pp_rank=1)
    assert (s0.layer_start, s0.layer_end, s1.layer_start, s1.layer_end) == (0, 12, 12, 24)
    assert swa_layer_ids(s0) == [0, 2, 4, 6, 8, 10]
    assert full_layer_ids(s0) == [1, 3, 5, 7, 9, 11]
    assert swa_layer_ids(s1) == [12, 14, 16, 18, 20, 22]
    assert full_layer_ids(s1) == [13, 15, 17, 19, 21, 23]
    for s in (s0, s1):
        assert s.cell_size_bytes == int(12_288 * 1.8)
        assert (s.num_pages, s.swa_num_pages) == (242_725, 194_180)


def test_pp5_uneven_stages() -> None:
    """24 layers over 5 stages: 4, 5, 5, 5, 5 -> stage 1 = 4..8 (sliding 4, 6, 8: ns 3, nf 2),
    stage 2 = 9..13 (sliding 10, 12: ns 2, nf 3)."""
    s1 = mk(max_total_tokens=1000, pp_size=5, pp_rank=1)
    s2 = mk(max_total_tokens=1000, pp_size=5, pp_rank=2)
    assert (swa_layer_ids(s1), full_layer_ids(s1)) == ([4, 6, 8], [5, 7])
    assert (swa_layer_ids(s2), full_layer_ids(s2)) == ([10, 12], [9, 11, 13])
    assert s1.cell_size_bytes == int(2 * 2048 + 0.8 * 3 * 2048)  # 9,011
    assert s2.cell_size_bytes == int(3 * 2048 + 0.8 * 2 * 2048)  # 9,420


def test_pp_stage_without_full_layers_is_all_swa() -> None:
    """Sliding = layers 0..11, PP 2: stage 0 has no full layer -> all_swa, one token space
    (cell 12 * 2,048 = 24,576; page 1, 1 GiB: 1,073,741,824 // 24,576 = 43,690 tokens);
    stage 1 is hybrid with ns = 0: cell_f = 24,576 + 0.8 * 0, SWA count still derived
    (int(0.8 * full)) but costs nothing, so full = 43,690 and swa = int(34,952.0) = 34,952."""
    spec = gpt_oss(layers=tuple(range(12)))
    s0 = mk(spec, budget_bytes=GIB, pp_size=2, pp_rank=0)
    s1 = mk(spec, budget_bytes=GIB, pp_size=2, pp_rank=1)
    assert s0.architecture == "all_swa"
    assert (s0.num_pages, s0.swa_num_pages, s0.full_max_total_num_tokens) == (43_690, 43_690,
                                                                             None)
    assert s1.architecture == "hybrid_swa"
    assert (s1.num_pages, s1.swa_num_pages) == (43_690, 34_952)
    assert swa_layer_ids(s1) == []
    assert s1.total_bytes == 43_691 * 24_576


def test_eagle_one_draft_layer_counts_as_full() -> None:
    """EAGLE, 1 draft layer: Fb = 13 * 2,048 = 26,624, Sb = 24,576; cell_f = 26,624 +
    19,660.8 = 46,284.8 (reported 46,284). page 16, 40 GiB: 42,949,672,960 / 46,284.8 =
    927,943.4 -> full = 927,943 // 16 * 16 = 927,936 (57,996 pages); swa = int(742,348.8) =
    742,348 -> 742,336 (46,396 pages). bytes = 16 * (57,997 * 26,624 + 46,397 * 24,576) =
    16 * (1,544,112,128 + 1,140,252,672) = 42,949,836,800.
    mrr: no user value under speculative decoding -> SGLang's 48."""
    p = mk(budget_bytes=40 * GIB, page_size=16, speculative_algorithm="eagle")
    assert p.num_draft_layers == 1
    assert p.cell_size_bytes == 46_284
    assert (p.num_pages, p.swa_num_pages) == (57_996, 46_396)
    assert p.full_max_total_num_tokens == 927_936
    assert p.swa_max_total_num_tokens == 742_336
    assert p.total_bytes == 42_949_836_800
    assert p.max_running_requests == 48
    for name in ("draft_k.0", "draft_v.0"):
        assert p.buffer(name).shape == (57_997 * 16, 8, 64)
        assert p.buffer(name).kind is BufferKind.kv
    with pytest.raises(KeyError):
        p.buffer("draft_k.1")


def test_all_swa() -> None:
    """Every layer slides: cell = 24 * 2,048 = 49,152 (= 3 * 2^14). page 1, 1 GiB:
    1,073,741,824 // 49,152 = 65,536 // 3 = 21,845 tokens; no mapping buffer, full = None,
    mrr = min(2,048, 10,922) = 2,048; buffers hold 21,846 rows."""
    p = mk(all_swa_spec(), budget_bytes=GIB)
    assert p.architecture == "all_swa"
    assert p.cell_size_bytes == 49_152
    assert p.max_total_num_tokens == p.swa_max_total_num_tokens == 21_845
    assert p.num_pages == p.swa_num_pages == 21_845
    assert p.full_max_total_num_tokens is None
    assert p.max_running_requests == 2_048
    assert p.total_bytes == 21_846 * 49_152
    assert all(b.kind is BufferKind.swa_kv for b in p.buffers if b.in_budget)
    assert [b.name for b in p.buffers if not b.in_budget] == ["req_to_token"]


def test_all_swa_with_eagle() -> None:
    """cell = 49,152 + 1 draft full layer 2,048 = 51,200; 1,073,741,824 // 51,200 = 20,971
    (20,971 * 51,200 = 1,073,715,200, 26,624 B left); the draft layer shares the one token
    space. mrr: SGLang's speculative default 48."""
    p = mk(all_swa_spec(), budget_bytes=GIB, speculative_algorithm="eagle")
    assert p.cell_size_bytes == 51_200
    assert p.num_pages == p.swa_num_pages == 20_971
    assert p.buffer("draft_k.0").shape == (20_972, 8, 64)
    assert p.buffer("k.0").shape == (20_972, 8, 64)
    assert p.total_bytes == 20_972 * 51_200
    assert p.max_running_requests == 48


def test_ratio_one() -> None:
    """r = 1: cell = 49,152 and swa = full = 10,737,418,240 // 49,152 = 327,680 // 1.5 =
    218,453; bytes = (218,453 + 1) * 49,152."""
    p = mk(budget_bytes=10 * GIB, swa_full_tokens_ratio=1.0)
    assert p.cell_size_bytes == 49_152
    assert p.num_pages == p.swa_num_pages == 218_453
    assert p.total_bytes == 218_454 * 49_152


def test_ratio_half_page16() -> None:
    """r = 0.5, page 16, 1 GiB: cell_f = 24,576 + 12,288 = 36,864.0; 1,073,741,824 / 36,864 =
    29,127.1 -> 29,127 // 16 * 16 = 29,120 full (1,820 pages); swa = int(14,560.0) = 14,560
    (910 pages). bytes = 16 * 24,576 * (1,821 + 911) = 393,216 * 2,732 = 1,074,266,112."""
    p = mk(budget_bytes=GIB, page_size=16, swa_full_tokens_ratio=0.5)
    assert p.cell_size_bytes == 36_864
    assert (p.num_pages, p.swa_num_pages) == (1_820, 910)
    assert (p.full_max_total_num_tokens, p.swa_max_total_num_tokens) == (29_120, 14_560)
    assert p.total_bytes == 1_074_266_112


def test_max_total_tokens_caps_full_then_swa_is_rederived() -> None:
    """40 GiB page 16 holds 970,896 full tokens; cap 100,005 -> align_down = 100,000 full
    (6,250 pages), swa = int(80,000.0) = 80,000 (5,000 pages)."""
    p = mk(budget_bytes=40 * GIB, page_size=16, max_total_tokens=100_005)
    assert (p.num_pages, p.swa_num_pages) == (6_250, 5_000)
    assert p.max_total_num_tokens == 100_000
    assert p.total_bytes == 16 * 24_576 * (6_251 + 5_001)
    assert any("caps" in n for n in p.notes)


def test_max_total_tokens_without_budget() -> None:
    """No budget: full = 50,000 and swa = 40,000; bytes = 24,576 * (50,001 + 40,001)."""
    p = mk(max_total_tokens=50_000)
    assert (p.num_pages, p.swa_num_pages) == (50_000, 40_000)
    assert p.budget_bytes is None
    assert p.total_bytes == 2_211_889_152


@pytest.mark.parametrize(
    ("options", "field"),
    [
        # full 160 > 127 + 1 but swa int(128.0) = 128 <= 128: the ratio is the knob.
        ({"max_total_tokens": 160}, "swa_full_tokens_ratio"),
        # full 128 is itself too small; the cap set it.
        ({"max_total_tokens": 128}, "max_total_tokens"),
        # r = 1, 128 * 49,152 B: full = 128 = swa <= 128.
        ({"budget_bytes": 128 * 49_152, "swa_full_tokens_ratio": 1.0}, "budget_bytes"),
    ],
)
def test_window_too_large_for_swa_pool(options: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        mk(**options)
    assert err.value.field == field
    assert "window 127 plus one page" in err.value.message


def test_window_just_fits() -> None:
    """r = 1, 129 * 49,152 B: full = swa = 129 > 127 + 1."""
    p = mk(budget_bytes=129 * 49_152, swa_full_tokens_ratio=1.0)
    assert (p.num_pages, p.swa_num_pages) == (129, 129)


def test_window_check_all_swa() -> None:
    """All-SWA, 128 * 49,152 B: 128 tokens <= 127 + 1."""
    with pytest.raises(InvalidArgument, match="holds 128 tokens") as err:
        mk(all_swa_spec(), budget_bytes=128 * 49_152)
    assert err.value.field == "budget_bytes"


@pytest.mark.parametrize(
    ("budget", "page", "needle"),
    [
        # 44,236 // 44,236.8 = 0 tokens: not one page of 1 token (44,236.8 B)
        (44_236, 1, "a page of 1 tokens 44,237 B"),
        # 707,788 / 44,236.8 = 15.99 -> 15 tokens < one page of 16 (16 * 44,236.8 = 707,788.8)
        (707_788, 16, "a page of 16 tokens 707,789 B"),
    ],
)
def test_budget_below_one_page(budget: int, page: int, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle) as err:
        mk(budget_bytes=budget, page_size=page)
    assert err.value.field == "budget_bytes"
    assert "costs 44,236.8 B" in err.value.message


def check_float_rule(p: PoolPlan, budget: int, page: int, ratio: float, fb: int,
                     sb: int) -> None:
    """SGLang's invariants: full is the most whole pages the float cell buys, swa is derived
    from it, the padding pages come on top, and so the buffers exceed the budget by less than
    one page of every layer (full * cell_f <= budget, swa <= full * r)."""
    cell_f = fb + ratio * sb
    full, swa = p.full_max_total_num_tokens, p.swa_max_total_num_tokens
    assert full is not None and swa is not None
    assert full % page == 0 and full * cell_f <= budget < (full + page) * cell_f
    assert swa == int(full * ratio) // page * page
    assert (p.num_pages, p.swa_num_pages) == (full // page, swa // page)
    assert p.total_bytes == page * ((full // page + 1) * fb + (swa // page + 1) * sb)
    assert p.total_bytes - budget < page * (fb + sb)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    budget=st.integers(min_value=GIB // 4, max_value=1 << 40),
    page=st.sampled_from([1, 16, 64, 128]),
    ratio=st.floats(min_value=0.2, max_value=1.0),
)
def test_float_rule_invariants(budget: int, page: int, ratio: float) -> None:
    p = mk(budget_bytes=budget, page_size=page, swa_full_tokens_ratio=ratio)
    check_float_rule(p, budget, page, ratio, FB, SB)


@pytest.mark.parametrize("budget", [3 * GIB + 12_345, 7 * GIB, 123_456_789])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_plan_float_rule(budget: int, page: int) -> None:
    check_float_rule(mk(budget_bytes=budget, page_size=page), budget, page, 0.8, FB, SB)


def test_buffers_do_not_overlap() -> None:
    p = mk(budget_bytes=2 * GIB, page_size=16, speculative_algorithm="eagle")
    placed = sorted(p.buffers, key=lambda b: b.offset_bytes)
    end = 0
    for b in placed:
        assert b.offset_bytes >= end
        assert b.nbytes == math.prod(b.shape) * b.dtype.itemsize
        end = b.offset_bytes + b.nbytes
    assert end == p.backing_bytes
    assert len({b.name for b in p.buffers}) == len(p.buffers)
    in_budget = [b for b in p.buffers if b.in_budget]
    assert len(in_budget) == 2 * 25  # 24 layers + 1 draft, K and V
    assert max(b.offset_bytes for b in in_budget) < min(
        b.offset_bytes for b in p.buffers if not b.in_budget)
    mapping = p.buffer("full_to_swa")
    assert (mapping.kind, mapping.dtype, mapping.in_budget) == (BufferKind.map, "int64", False)
    assert mapping.shape == (p.num_pages + 1,)
    assert mapping.page_bytes == 8
    assert p.aux_bytes == mapping.nbytes + p.buffer("req_to_token").nbytes
    assert p.buffer("k.0").page_bytes == 16 * 8 * 64 * 2


def test_fp8_shapes() -> None:
    """fp8_e4m3: uint8, F = S = 8 * 128 = 1,024 B; cell = int(12,288 * 1.8) = 22,118."""
    p = mk(budget_bytes=GIB, kv_cache_dtype="fp8_e4m3")
    assert p.kv_cache_dtype == "fp8_e4m3"
    assert p.cell_size_bytes == 22_118
    for name, rows in (("k.1", p.num_pages + 1), ("v.0", p.swa_num_pages + 1)):
        assert p.buffer(name).dtype == "uint8"
        assert p.buffer(name).shape == (rows, 8, 64)


def test_fp4_shapes() -> None:
    """fp4_e2m1: F = S = 8 * 128 / 2 + 2 * 8 * 64 / 16 = 512 + 64 = 576 B; Fb = Sb = 6,912;
    cell_f = 6,912 + 5,529.6 = 12,441.6 (reported 12,441); K/V (rows, 8, 32) plus scales
    (rows, 32), all uint8. 1 GiB / 12,441.6 = 86,302.6 -> 86,302 // 16 = 5,393 pages (86,288
    tokens); swa = int(69,030.4) = 69,030 // 16 = 4,314 pages (69,024 tokens);
    bytes = 16 * 6,912 * (5,394 + 4,315) = 110,592 * 9,709 = 1,073,737,728."""
    p = mk(budget_bytes=GIB, page_size=16, kv_cache_dtype="fp4_e2m1")
    assert p.cell_size_bytes == 12_441
    assert (p.num_pages, p.swa_num_pages) == (5_393, 4_314)
    full_rows = (p.num_pages + 1) * 16
    swa_rows = (p.swa_num_pages + 1) * 16  # type: ignore[operator]
    for layer, rows, kind in ((1, full_rows, BufferKind.kv), (0, swa_rows, BufferKind.swa_kv)):
        assert p.buffer(f"k.{layer}").shape == (rows, 8, 32)
        assert p.buffer(f"v.{layer}").shape == (rows, 8, 32)
        assert p.buffer(f"k_scale.{layer}").shape == (rows, 32)
        assert p.buffer(f"v_scale.{layer}").kind is kind
    assert p.total_bytes == 1_073_737_728
    check_float_rule(p, GIB, 16, 0.8, 6_912, 6_912)


def test_swa_geometry_overrides() -> None:
    """SWA layers with 2 KV heads of dim 128: S = 2 * 256 * 2 = 1,024 B, F stays 2,048 B;
    cell = int(24,576 + 0.8 * 12,288) = 34,406. TP 4: SWA heads max(1, 2 // 4) = 1, full 2."""
    spec = gpt_oss(num_kv_heads=2, head_dim=128)
    p = mk(spec, budget_bytes=GIB)
    assert p.cell_size_bytes == 34_406
    assert p.buffer("k.0").shape == (p.swa_num_pages + 1, 2, 128)  # type: ignore[operator]
    assert p.buffer("v.0").shape == (p.swa_num_pages + 1, 2, 128)  # type: ignore[operator]
    assert p.buffer("k.1").shape == (p.num_pages + 1, 8, 64)
    p4 = mk(spec, budget_bytes=GIB, tp_size=4)
    assert p4.buffer("k.0").shape[1:] == (1, 128)
    assert p4.buffer("k.1").shape[1:] == (2, 64)
    split = hybrid_swa.split_stage(make_context(spec, make_options(budget_bytes=GIB)))
    assert (split.swa.heads, split.swa.head_dim, split.swa.v_head_dim) == (2, 128, 128)


def test_build_small_pool() -> None:
    """max_total_tokens 256, page 1: full 256, swa int(204.8) = 204. Views: full layers
    (257, 8, 64) bf16, SWA layers (205, 8, 64) bf16, full_to_swa (257,) int64, all over one
    zeroed backing."""
    p = mk(max_total_tokens=256)
    pool = build_pool(p)
    assert pool.backing.numel() == p.backing_bytes
    assert pool.views["k.1"].shape == (257, 8, 64)
    assert pool.views["k.1"].dtype == torch.bfloat16
    assert pool.views["v.22"].shape == (205, 8, 64)
    mapping = pool.views["full_to_swa"]
    assert (mapping.shape, mapping.dtype) == ((257,), torch.int64)
    assert not mapping.any()
    base = pool.backing.data_ptr()
    for b in p.buffers:
        assert pool.views[b.name].data_ptr() == base + b.offset_bytes
    pool.views["v.22"][204].fill_(1.0)
    assert pool.views["v.22"].sum().item() == 8 * 64


# ---- SGLang's SWA request cap (no radix cache, fixed max_running_requests) ----------------------

REQUEST_CAP = 34_768  # gpt-oss, page 16, 64 requests, chunk 8,192, overlap schedule on


def test_request_cap_tokens() -> None:
    """Per request: window 127 + 128 tokens between evictions + a page 16 + one decode step's
    allocation (a page, 16) = 287; 287 * 64 = 18,368, plus two prefill chunks in flight under
    the overlap schedule (2 * 8,192 = 16,384) and a page: 34,768 (= 16 * 2,173, aligned)."""
    opts = make_options(budget_bytes=8 * GIB, page_size=16, disable_radix_cache=True,
                        max_running_requests=64)
    ctx = make_context(gpt_oss(), opts)
    assert hybrid_swa.request_cap_applies(ctx)
    assert hybrid_swa.swa_request_cap(ctx) == REQUEST_CAP == 287 * 64 + 2 * 8192 + 16


def test_request_cap_8gib_page16() -> None:
    """swa = 34,768 (2,173 pages) at Sb = 24,576: 854,458,368 B; the full space gets the rest at
    Fb = 24,576: (8,589,934,592 - 854,458,368) // 24,576 = 7,735,476,224 // 24,576 = 314,757
    (314,757 * 24,576 = 7,735,468,032, 8,192 B left) -> // 16 * 16 = 314,752 (19,672 pages).
    bytes = 16 * 24,576 * (19,673 + 2,174) = 393,216 * 21,847 = 8,590,589,952.
    mrr = min(64, 314,752 // 2) = 64. The cell reported is Fb (the SWA side is fixed)."""
    p = mk(budget_bytes=8 * GIB, page_size=16, disable_radix_cache=True,
           max_running_requests=64)
    assert p.architecture == "hybrid_swa"
    assert p.full_max_total_num_tokens == p.max_total_num_tokens == 314_752
    assert p.swa_max_total_num_tokens == REQUEST_CAP
    assert (p.num_pages, p.swa_num_pages) == (19_672, 2_173)
    assert p.max_running_requests == 64
    assert p.cell_size_bytes == FB
    assert p.total_bytes == 8_590_589_952
    assert p.buffer("k.0").shape == (2_174 * 16, 8, 64)  # SWA layer
    assert p.buffer("k.1").shape == (19_673 * 16, 8, 64)  # full layer
    assert any("request cap" in n for n in p.notes)


def test_request_cap_40gib_matches_sglang() -> None:
    """(42,949,672,960 - 854,458,368) // 24,576 = 42,095,214,592 // 24,576 = 1,712,858 ->
    // 16 * 16 = 1,712,848 full tokens, SGLang's own figure; swa 34,768."""
    p = mk(budget_bytes=40 * GIB, page_size=16, disable_radix_cache=True,
           max_running_requests=64)
    assert (p.full_max_total_num_tokens, p.swa_max_total_num_tokens) == (1_712_848, REQUEST_CAP)


def test_request_cap_without_overlap_schedule() -> None:
    """One prefill chunk in flight: 287 * 64 + 8,192 + 16 = 26,576 (= 16 * 1,661) SWA tokens;
    full = (8,589,934,592 - 26,576 * 24,576) // 24,576 = 7,936,802,816 // 24,576 = 322,949 ->
    // 16 * 16 = 322,944."""
    p = mk(budget_bytes=8 * GIB, page_size=16, disable_radix_cache=True,
           max_running_requests=64, disable_overlap_schedule=True)
    assert (p.full_max_total_num_tokens, p.swa_max_total_num_tokens) == (322_944, 26_576)


@pytest.mark.parametrize(
    "options",
    [
        {"max_running_requests": 64},  # radix cache on
        {"disable_radix_cache": True},  # no fixed request count
        {"disable_radix_cache": True, "max_running_requests": 64, "chunked_prefill_size": 0},
    ],
)
def test_request_cap_needs_no_radix_cache_a_request_count_and_chunking(
        options: dict[str, object]) -> None:
    """Otherwise swa_full_tokens_ratio sizes the SWA space: the 8 GiB float rule,
    8,589,934,592 / 44,236.8 = 194,180.7 -> 194,180 // 16 * 16 = 194,176 full tokens,
    swa = int(155,340.8) = 155,340 -> 155,328."""
    opts = make_options(budget_bytes=8 * GIB, page_size=16, **options)
    assert not hybrid_swa.request_cap_applies(make_context(gpt_oss(), opts))
    p = plan(gpt_oss(), opts)
    assert (p.full_max_total_num_tokens, p.swa_max_total_num_tokens) == (194_176, 155_328)


def test_request_cap_leaving_no_full_page() -> None:
    """34,768 SWA tokens cost 854,458,368 B; a budget of that plus 15 full tokens' bytes
    (15 * 24,576 = 368,640) leaves 15 // 16 * 16 = 0 full tokens."""
    with pytest.raises(InvalidArgument, match="no full page") as err:
        mk(budget_bytes=854_458_368 + 368_640, page_size=16, disable_radix_cache=True,
           max_running_requests=64)
    assert err.value.field == "budget_bytes"
    assert "34,768 tokens = 854,458,368 B" in err.value.message
    # 16 full tokens' bytes (393,216) more buy exactly one full page
    p = mk(budget_bytes=854_458_368 + 16 * 24_576, page_size=16, disable_radix_cache=True,
           max_running_requests=64)
    assert (p.full_max_total_num_tokens, p.swa_max_total_num_tokens) == (16, REQUEST_CAP)


def test_request_cap_is_page_aligned_up() -> None:
    """8 requests: 287 * 8 + 2 * 8,192 + 16 = 2,296 + 16,400 = 18,696 = 16 * 1,168.5 -> the SWA
    space takes whole pages: 1,169 pages = 18,704 tokens."""
    p = mk(budget_bytes=8 * GIB, page_size=16, disable_radix_cache=True, max_running_requests=8)
    assert (p.swa_max_total_num_tokens, p.swa_num_pages) == (18_704, 1_169)

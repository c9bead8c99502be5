"""Hybrid sliding-window sizing (kvpoold.sizing.hybrid_swa), checked on gpt-oss-20b by hand.

gpt-oss-20b (tests/data/models/gpt-oss-20b.json): 24 layers, the even ids 0, 2, ..., 22 slide
(window 128), 8 KV heads, head_dim 64, bf16. Per layer and token F = S = 8 * (64 + 64) * 2 =
2,048 B; with 12 full and 12 SWA layers Fb = Sb = 24,576 B, and at r = 0.8 the cell is
int(24,576 + 0.8 * 24,576) = int(44,236.8) = 44,236 B. A pool of fp full pages and
sp = int(fp * page * r) // page SWA pages costs page * ((fp + 1) * Fb + (sp + 1) * Sb) bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import InvalidArgument
from kvpool.options import make_options
from kvpool.plan import BufferKind, PoolPlan
from kvpool.spec import (
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
    """gpt-oss-20b built by hand from its config.json (the HF loader is not used here)."""
    cfg = json.loads(GPT_OSS.read_text())
    layers = tuple(i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention")
    window: dict[str, object] = {"window": cfg["sliding_window"], "layers": layers, **sliding}
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
    assert spec.sliding_window.window == 128


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
    """The module docstring's example. Estimate (2,684,354,560 - 49,152) / 44,236.8 = 60,680.37
    -> fp = 60,680; full = 970,880; swa = int(776,704.0) // 16 * 16 = 776,704 (48,544 pages).
    bytes = 16 * 24,576 * (60,681 + 48,545) = 42,949,410,816 (leftover 262,144); fp + 1 needs
    16 * 24,576 * (60,682 + 48,545) = 42,949,804,032 > budget.
    mrr = clamp(int(970,880 / 131,072 * 512) = 3,792, 2,048, 4,096) = 3,792."""
    p = mk(budget_bytes=40 * GIB, page_size=16)
    assert p.architecture == "hybrid_swa"
    assert p.cell_size_bytes == 44_236
    assert p.num_pages == 60_680
    assert p.full_max_total_num_tokens == p.max_total_num_tokens == 970_880
    assert p.swa_max_total_num_tokens == 776_704
    assert p.swa_num_pages == 48_544
    assert p.max_running_requests == 3_792
    assert p.total_bytes == 42_949_410_816
    assert hybrid_swa.pool_bytes(60_681, 16, FB, SB, 0.8) == 42_949_804_032
    assert p.buffer("k.1").shape == (60_681 * 16, 8, 64)  # full layer
    assert p.buffer("k.0").shape == (48_545 * 16, 8, 64)  # SWA layer
    assert p.buffer("full_to_swa").shape == (60_681,)


def test_gpt_oss_10gib_page1() -> None:
    """(10,737,418,240 - 49,152) / 44,236.8 = 242,724.81 -> fp = 242,724 = full tokens;
    swa = int(194,179.2) = 194,179. bytes = 24,576 * (242,725 + 194,180) = 10,737,377,280
    (leftover 40,960 < 44,236); fp + 1 (swa int(194,180.0) = 194,180) needs
    24,576 * (242,726 + 194,181) = 10,737,426,432 > budget.
    mrr: int(242,724 / 131,072 * 512) = 948 -> clamped up to 2,048."""
    p = mk(budget_bytes=10 * GIB, page_size=1)
    assert (p.num_pages, p.swa_num_pages) == (242_724, 194_179)
    assert p.full_max_total_num_tokens == 242_724
    assert p.swa_max_total_num_tokens == 194_179
    assert p.total_bytes == 10_737_377_280
    assert p.max_running_requests == 2_048
    assert p.buffer("v.3").shape == (242_725, 8, 64)
    assert p.buffer("v.2").shape == (194_180, 8, 64)
    assert p.buffer("full_to_swa").shape == (242_725,)


def test_leftover_can_exceed_one_cell_page_but_not_one_page_of_every_layer() -> None:
    """page 1, budget 10,000,000: fp = 224, swa = int(179.2) = 179; bytes = 24,576 * (225 + 180)
    = 9,953,280, leftover 46,720 >= cell 44,236 but < Fb + Sb = 49,152. fp = 225 would bring a
    new SWA page too (int(180.0) = 180): 24,576 * (226 + 181) = 10,002,432 > budget. So the
    tight bound on the leftover is one page of every layer, not one page of the float cell."""
    p = mk(budget_bytes=10_000_000, page_size=1)
    assert (p.num_pages, p.swa_num_pages) == (224, 179)
    assert p.total_bytes == 9_953_280
    assert p.cell_size_bytes <= 10_000_000 - p.total_bytes < FB + SB
    assert hybrid_swa.pool_bytes(225, 1, FB, SB, 0.8) == 10_002_432
    assert p.max_running_requests == 112  # half of 224 tokens


@pytest.mark.parametrize(("tp", "heads"), [(2, 4), (8, 1), (16, 1)])
def test_tp_splits_heads(tp: int, heads: int) -> None:
    """Per-rank heads max(1, 8 // tp): F = S = heads * 128 * 2. Bytes scale with heads, so a
    budget of 10 GiB * heads / 8 gives the same counts as TP 1 with 10 GiB (242,724 full,
    194,179 SWA); TP 16 replicates the one head. cell = int(12 * F * 1.8)."""
    per_layer = heads * 128 * 2
    p = mk(budget_bytes=10 * GIB * heads // 8, page_size=1, tp_size=tp)
    assert p.cell_size_bytes == int(12 * per_layer * 1.8)
    assert (p.num_pages, p.swa_num_pages) == (242_724, 194_179)
    assert p.buffer("k.1").shape == (242_725, heads, 64)
    assert p.buffer("k.0").shape == (194_180, heads, 64)
    assert p.total_bytes == 10_737_377_280 * heads // 8


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
        assert (s.num_pages, s.swa_num_pages) == (242_724, 194_179)


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
    (cell 12 * 2,048 = 24,576; page 1, 1 GiB: 1,073,741,824 // 24,576 - 1 = 43,689 tokens);
    stage 1 is hybrid with ns = 0: SWA count still derived (int(0.8 * full)) but costs nothing,
    so fp = 1,073,741,824 // 24,576 - 1 = 43,689 and swa = int(34,951.2) = 34,951."""
    spec = gpt_oss(layers=tuple(range(12)))
    s0 = mk(spec, budget_bytes=GIB, pp_size=2, pp_rank=0)
    s1 = mk(spec, budget_bytes=GIB, pp_size=2, pp_rank=1)
    assert s0.architecture == "all_swa"
    assert (s0.num_pages, s0.swa_num_pages, s0.full_max_total_num_tokens) == (43_689, 43_689,
                                                                             None)
    assert s1.architecture == "hybrid_swa"
    assert (s1.num_pages, s1.swa_num_pages) == (43_689, 34_951)
    assert swa_layer_ids(s1) == []
    assert s1.total_bytes == 43_690 * 24_576


def test_eagle_one_draft_layer_counts_as_full() -> None:
    """EAGLE, 1 draft layer: Fb = 13 * 2,048 = 26,624, Sb = 24,576; cell = int(26,624 +
    19,660.8) = 46,284. page 16, 40 GiB: (2,684,354,560 - 51,200) / 46,284.8 = 57,995.35 ->
    fp = 57,995, full = 927,920, swa = int(742,336.0) // 16 * 16 = 742,336 (46,396 pages).
    bytes = 16 * (57,996 * 26,624 + 46,397 * 24,576) = 42,949,410,816; fp + 1 needs
    16 * (57,997 * 26,624 + 46,397 * 24,576) = 42,949,836,800 > budget.
    mrr = int(927,920 / 131,072 * 512) = 3,624."""
    p = mk(budget_bytes=40 * GIB, page_size=16, speculative_algorithm="eagle")
    assert p.num_draft_layers == 1
    assert p.cell_size_bytes == 46_284
    assert (p.num_pages, p.swa_num_pages) == (57_995, 46_396)
    assert p.full_max_total_num_tokens == 927_920
    assert p.swa_max_total_num_tokens == 742_336
    assert p.total_bytes == 42_949_410_816
    assert p.max_running_requests == 3_624
    for name in ("draft_k.0", "draft_v.0"):
        assert p.buffer(name).shape == (57_996 * 16, 8, 64)
        assert p.buffer(name).kind is BufferKind.kv
    with pytest.raises(KeyError):
        p.buffer("draft_k.1")


def test_all_swa() -> None:
    """Every layer slides: cell = 24 * 2,048 = 49,152. page 1, 1 GiB:
    1,073,741,824 // 49,152 - 1 = 21,845 - 1 = 21,844 tokens; no mapping buffer, full = None,
    mrr = min(2,048, 10,922) = 2,048."""
    p = mk(all_swa_spec(), budget_bytes=GIB)
    assert p.architecture == "all_swa"
    assert p.cell_size_bytes == 49_152
    assert p.max_total_num_tokens == p.swa_max_total_num_tokens == 21_844
    assert p.num_pages == p.swa_num_pages == 21_844
    assert p.full_max_total_num_tokens is None
    assert p.max_running_requests == 2_048
    assert p.total_bytes == 21_845 * 49_152
    assert all(b.kind is BufferKind.swa_kv for b in p.buffers if b.in_budget)
    assert [b.name for b in p.buffers if not b.in_budget] == ["req_to_token"]


def test_all_swa_with_eagle() -> None:
    """cell = 49,152 + 1 draft full layer 2,048 = 51,200; 1,073,741,824 // 51,200 - 1 = 20,970;
    the draft layer shares the one token space."""
    p = mk(all_swa_spec(), budget_bytes=GIB, speculative_algorithm="eagle")
    assert p.cell_size_bytes == 51_200
    assert p.num_pages == p.swa_num_pages == 20_970
    assert p.buffer("draft_k.0").shape == (20_971, 8, 64)
    assert p.buffer("k.0").shape == (20_971, 8, 64)
    assert p.total_bytes == 20_971 * 51_200


def test_ratio_one() -> None:
    """r = 1: cell = 49,152 and swa = full; bytes = (fp + 1) * 49,152 <= 10 GiB ->
    fp = 10,737,418,240 // 49,152 - 1 = 218,453 - 1 = 218,452."""
    p = mk(budget_bytes=10 * GIB, swa_full_tokens_ratio=1.0)
    assert p.cell_size_bytes == 49_152
    assert p.num_pages == p.swa_num_pages == 218_452
    assert p.total_bytes == 218_453 * 49_152


def test_ratio_half_page16() -> None:
    """r = 0.5, page 16, 1 GiB: cell = 36,864; sp = (8 * fp) // 16 = fp // 2 and
    bytes = 393,216 * (fp + 1 + fp // 2 + 1) <= 1 GiB needs fp + fp // 2 <= 2,728
    (1 GiB / 393,216 = 2,730.67) -> fp = 1,819 (1,819 + 909); 1,820 + 910 = 2,730 is too many.
    full = 29,104, swa = 14,552 // 16 * 16 = 14,544; bytes = 393,216 * 2,730 = 1,073,479,680."""
    p = mk(budget_bytes=GIB, page_size=16, swa_full_tokens_ratio=0.5)
    assert p.cell_size_bytes == 36_864
    assert (p.num_pages, p.swa_num_pages) == (1_819, 909)
    assert (p.full_max_total_num_tokens, p.swa_max_total_num_tokens) == (29_104, 14_544)
    assert p.total_bytes == 1_073_479_680


def test_max_total_tokens_caps_full_then_swa_is_rederived() -> None:
    """40 GiB page 16 holds 970,880 full tokens; cap 100,005 -> align_down = 100,000 full
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
        # full 160 > 129 but swa int(128.0) = 128 <= 128 + 1: the ratio is the knob.
        ({"max_total_tokens": 160}, "swa_full_tokens_ratio"),
        # full 129 is itself too small; the cap set it.
        ({"max_total_tokens": 129}, "max_total_tokens"),
        # r = 1, 130 * 49,152 B: fp = 129 = swa <= 129.
        ({"budget_bytes": 130 * 49_152, "swa_full_tokens_ratio": 1.0}, "budget_bytes"),
    ],
)
def test_window_too_large_for_swa_pool(options: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        mk(**options)
    assert err.value.field == field
    assert "window 128 plus one page" in err.value.message


def test_window_check_all_swa() -> None:
    """All-SWA, 130 * 49,152 B: 129 tokens <= 128 + 1."""
    with pytest.raises(InvalidArgument, match="holds 129 tokens") as err:
        mk(all_swa_spec(), budget_bytes=130 * 49_152)
    assert err.value.field == "budget_bytes"


def test_budget_below_one_page() -> None:
    """One full page plus both padding pages: 24,576 * (2 + 1) = 73,728 B (sp = int(0.8) = 0)."""
    with pytest.raises(InvalidArgument, match="73,728 B") as err:
        mk(budget_bytes=50_000)
    assert err.value.field == "budget_bytes"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    budget=st.integers(min_value=0, max_value=1 << 44),
    page=st.sampled_from([1, 16, 64, 128]),
    fb=st.integers(min_value=1, max_value=1 << 20),
    sb=st.integers(min_value=0, max_value=1 << 20),
    ratio=st.floats(min_value=0.01, max_value=1.0),
)
def test_full_pages_is_the_largest_that_fits(budget: int, page: int, fb: int, sb: int,
                                             ratio: float) -> None:
    fp = hybrid_swa.full_pages_for_budget(budget, page, fb, sb, ratio)
    assert hybrid_swa.pool_bytes(fp + 1, page, fb, sb, ratio) > budget
    if fp:
        used = hybrid_swa.pool_bytes(fp, page, fb, sb, ratio)
        assert used <= budget
        assert budget - used < page * (fb + sb)


@pytest.mark.parametrize("budget", [3 * GIB + 12_345, 7 * GIB, 123_456_789])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_plan_total_within_budget(budget: int, page: int) -> None:
    p = mk(budget_bytes=budget, page_size=page)
    assert p.total_bytes == hybrid_swa.pool_bytes(p.num_pages, page, FB, SB, 0.8)
    assert p.total_bytes <= budget
    assert budget - p.total_bytes < page * (FB + SB)


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
    """fp4_e2m1: F = S = 8 * 128 / 2 + 2 * 8 * 64 / 16 = 512 + 64 = 576 B;
    cell = int(6,912 * 1.8) = 12,441; K/V (rows, 8, 32) plus scales (rows, 32), all uint8."""
    p = mk(budget_bytes=GIB, page_size=16, kv_cache_dtype="fp4_e2m1")
    assert p.cell_size_bytes == 12_441
    full_rows = (p.num_pages + 1) * 16
    swa_rows = (p.swa_num_pages + 1) * 16  # type: ignore[operator]
    for layer, rows, kind in ((1, full_rows, BufferKind.kv), (0, swa_rows, BufferKind.swa_kv)):
        assert p.buffer(f"k.{layer}").shape == (rows, 8, 32)
        assert p.buffer(f"v.{layer}").shape == (rows, 8, 32)
        assert p.buffer(f"k_scale.{layer}").shape == (rows, 32)
        assert p.buffer(f"v_scale.{layer}").kind is kind
    assert p.total_bytes == hybrid_swa.pool_bytes(p.num_pages, 16, 6_912, 6_912, 0.8)


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

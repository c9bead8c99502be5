"""MLA sizing on its own: DeepSeek-V3 geometry, numbers worked out by hand."""

from __future__ import annotations

import pytest

from tests.factories import GiB, deepseek_v3, plan_for

BUDGET = 40 * GiB  # 42,949,672,960 B


def test_deepseek_v3_bf16_page1():
    """kv_dim = 512 + 64 = 576; cell = 576 * 61 * 2 = 70,272 B/token;
    42,949,672,960 // 70,272 = 611,191 tokens (611,191 * 70,272 = 42,949,613,952, 59,008 B
    left); the padding row comes on top: 611,192 rows."""
    p = plan_for(deepseek_v3(), budget_bytes=BUDGET)
    assert p.architecture == "mla"
    assert p.cell_size_bytes == 70_272
    assert p.max_total_num_tokens == 611_191
    kv = p.buffer("kv.60")
    assert kv.shape == (611_192, 1, 576)
    assert p.total_bytes == 611_192 * 70_272
    assert kv.dtype == "bfloat16"
    assert not any(b.name.startswith("k.") for b in p.buffers)


def test_latent_is_not_split_by_tp():
    one = plan_for(deepseek_v3(), budget_bytes=BUDGET)
    eight = plan_for(deepseek_v3(), budget_bytes=BUDGET, tp_size=8)
    assert one.cell_size_bytes == eight.cell_size_bytes
    assert one.max_total_num_tokens == eight.max_total_num_tokens


def test_page64():
    """One page = 64 * 70,272 = 4,497,408 B; 42,949,672,960 // 4,497,408 = 9,549 pages
    (9,549 * 4,497,408 = 42,945,748,992, 3,923,968 B left) = 611,136 tokens;
    rows (9,549 + 1) * 64 = 611,200."""
    p = plan_for(deepseek_v3(), budget_bytes=BUDGET, page_size=64)
    assert p.num_pages == 9_549
    assert p.max_total_num_tokens == 9_549 * 64 == 611_136
    assert p.buffer("kv.0").shape == (611_200, 1, 576)


def test_fp8():
    """cell = 576 * 61 * 1 = 35,136; tokens = 42,949,672,960 // 35,136 = 1,222,383 (twice
    611,191, plus one: 2 * 59,008 = 118,016 >= 35,136 left over); uint8."""
    p = plan_for(deepseek_v3(), budget_bytes=BUDGET, kv_cache_dtype="fp8_e4m3")
    assert p.cell_size_bytes == 35_136
    assert p.max_total_num_tokens == 1_222_383
    assert p.buffer("kv.0").dtype == "uint8"


def test_mtp_draft_layer_defaults_from_the_model():
    """num_nextn_predict_layers = 1: cell = 70,272 * 62 // 61 = 71,424 (= 1,152 * 62).
    tokens = 42,949,672,960 // 71,424 = 601,333 (601,333 * 71,424 = 42,949,608,192, 64,768 B
    left); max_running_requests: SGLang's speculative default 48."""
    p = plan_for(deepseek_v3(), budget_bytes=BUDGET, speculative_algorithm="eagle")
    assert p.num_draft_layers == 1
    assert p.cell_size_bytes == 71_424
    assert p.max_total_num_tokens == 601_333
    assert p.max_running_requests == 48
    assert p.buffer("draft_kv.0").shape == p.buffer("kv.0").shape


@pytest.mark.parametrize(("rank", "layers"), [(0, 30), (1, 31)])
def test_pp2(rank, layers):
    """61 layers over 2 stages: 30 and 31."""
    p = plan_for(deepseek_v3(), budget_bytes=BUDGET, pp_size=2, pp_rank=rank)
    assert p.layer_end - p.layer_start == layers
    assert p.cell_size_bytes == 1152 * layers

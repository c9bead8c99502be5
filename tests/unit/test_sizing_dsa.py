"""DSA (MLA + lightning indexer) sizing on its own: DeepSeek-V3.2 geometry."""

from __future__ import annotations

import pytest

from kvpool.errors import InvalidArgument
from tests.factories import GiB, deepseek_v32, plan_for

BUDGET = 40 * GiB


def test_bf16_page64():
    """cell = (576 * 2 + 132) * 61 = 1,284 * 61 = 78,324 B; one page = 5,012,736 B;
    42,949,672,960 // 5,012,736 = 8,568 -> 8,567 pages = 548,288 tokens.
    index_k.<l>: (8,568 pages incl. padding, 64 * 132 = 8,448) uint8, page-major."""
    p = plan_for(deepseek_v32(), budget_bytes=BUDGET, page_size=64)
    assert p.architecture == "dsa"
    assert p.cell_size_bytes == 78_324
    assert p.num_pages == 8_567
    assert p.max_total_num_tokens == 548_288
    idx = p.buffer("index_k.0")
    assert idx.shape == (8_568, 8_448)
    assert idx.dtype == "uint8"
    assert idx.page_bytes == 8_448
    assert p.buffer("kv.0").shape == (8_568 * 64, 1, 576)


def test_fp8_main_latent_is_656_bytes():
    """fp8_e4m3: 512 nope + 512/128*4 scale + 64*2 rope = 656 B; cell = (656 + 132) * 61 =
    48,068; pages = 42,949,672,960 // (48,068 * 64) - 1 = 13,960."""
    p = plan_for(deepseek_v32(), budget_bytes=BUDGET, page_size=64, kv_cache_dtype="fp8_e4m3")
    assert p.cell_size_bytes == 48_068
    assert p.num_pages == 13_960
    assert p.buffer("kv.5").shape == (13_961 * 64, 1, 656)
    assert p.buffer("kv.5").dtype == "uint8"


@pytest.mark.parametrize("page", [1, 16, 128])
def test_page_size_must_be_64(page):
    with pytest.raises(InvalidArgument) as e:
        plan_for(deepseek_v32(), budget_bytes=BUDGET, page_size=page)
    assert e.value.field == "page_size"
    assert "64" in str(e.value)


def test_fp4_rejected():
    with pytest.raises(InvalidArgument) as e:
        plan_for(deepseek_v32(), budget_bytes=BUDGET, page_size=64, kv_cache_dtype="fp4_e2m1")
    assert e.value.field == "kv_cache_dtype"


def test_draft_layer_has_its_indexer():
    """cell = 78,324 * 62 // 61 = 79,608 (= 1,284 * 62)."""
    p = plan_for(deepseek_v32(), budget_bytes=BUDGET, page_size=64,
                 speculative_algorithm="eagle")
    assert p.cell_size_bytes == 79_608
    assert p.buffer("draft_index_k.0").shape == p.buffer("index_k.0").shape
    assert p.total_bytes <= BUDGET

"""DSA (MLA + lightning indexer) sizing on its own: DeepSeek-V3.2 geometry."""

from __future__ import annotations

import pytest

from kvpool.contract.errors import InvalidArgument
from tests.factories import GiB, deepseek_v32, plan_for

BUDGET = 40 * GiB


def test_bf16_page64():
    """cell = (576 * 2 + 132) * 61 = 1,284 * 61 = 78,324 B; one page = 5,012,736 B;
    42,949,672,960 // 5,012,736 = 8,568 pages (8,568 * 5,012,736 = 42,949,122,048, 550,912 B
    left) = 548,352 tokens; the padding page on top: 8,569 pages of buffers.
    index_k.<l>: (8,569 pages incl. padding, 64 * 132 = 8,448) uint8, page-major."""
    p = plan_for(deepseek_v32(), budget_bytes=BUDGET, page_size=64)
    assert p.architecture == "dsa"
    assert p.cell_size_bytes == 78_324
    assert p.num_pages == 8_568
    assert p.max_total_num_tokens == 548_352
    idx = p.buffer("index_k.0")
    assert idx.shape == (8_569, 8_448)
    assert idx.dtype == "uint8"
    assert idx.page_bytes == 8_448
    assert p.buffer("kv.0").shape == (8_569 * 64, 1, 576)
    assert p.total_bytes == 8_569 * 5_012_736


def test_fp8_main_latent_is_656_bytes():
    """fp8_e4m3: 512 nope + 512/128*4 scale + 64*2 rope = 656 B; cell = (656 + 132) * 61 =
    48,068; one page 48,068 * 64 = 3,076,352 B; pages = 42,949,672,960 // 3,076,352 = 13,961
    (13,961 * 3,076,352 = 42,948,950,272, 722,688 B left)."""
    p = plan_for(deepseek_v32(), budget_bytes=BUDGET, page_size=64, kv_cache_dtype="fp8_e4m3")
    assert p.cell_size_bytes == 48_068
    assert p.num_pages == 13_961
    assert p.buffer("kv.5").shape == (13_962 * 64, 1, 656)
    assert p.buffer("kv.5").dtype == "uint8"


@pytest.mark.parametrize("page", [1, 16, 128])
def test_page_size_is_forced_to_64(page):
    """SGLang's DSA override sets page size 64 whatever --page-size says; so does the plan,
    with a note, and the numbers are page 64's."""
    p = plan_for(deepseek_v32(), budget_bytes=BUDGET, page_size=page)
    assert p.page_size == 64
    assert p.num_pages == 8_568
    assert any(n.startswith("page size 64") and f"asked {page}" in n for n in p.notes)


def test_fp4_rejected():
    with pytest.raises(InvalidArgument) as e:
        plan_for(deepseek_v32(), budget_bytes=BUDGET, page_size=64, kv_cache_dtype="fp4_e2m1")
    assert e.value.field == "kv_cache_dtype"


def test_draft_layer_has_its_indexer():
    """cell = 78,324 * 62 // 61 = 79,608 (= 1,284 * 62); one page 5,094,912 B;
    pages = 42,949,672,960 // 5,094,912 = 8,429 (8,429 * 5,094,912 = 42,945,013,248,
    4,659,712 B left). The 62 layers' buffers (draft included) hold 8,430 pages:
    total = 8,430 * 5,094,912 = 42,950,108,160 B, over the budget by less than a page."""
    p = plan_for(deepseek_v32(), budget_bytes=BUDGET, page_size=64,
                 speculative_algorithm="eagle")
    assert p.cell_size_bytes == 79_608
    assert p.num_pages == 8_429
    assert p.buffer("draft_index_k.0").shape == p.buffer("index_k.0").shape == (8_430, 8_448)
    assert p.total_bytes == 42_950_108_160

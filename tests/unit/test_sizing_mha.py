"""MHA sizing on its own: Llama-3.1-8B geometry, numbers worked out by hand."""

from __future__ import annotations

import pytest

from kvpool.contract.errors import InvalidArgument
from tests.factories import GiB, llama_8b, plan_for

BUDGET = 40 * GiB  # 42,949,672,960 B


def test_llama_page1_bf16():
    """cell = 8 heads * (128 + 128) * 32 layers * 2 B = 131,072 B/token.
    tokens = 42,949,672,960 // 131,072 = 327,680 (the padding page comes on top).
    max_running_requests: int(327,680 / 131,072 * 512) = 1,280 -> clamp 2,048; min(2,048,
    163,840) = 2,048. Buffers: 32 k + 32 v of (327,681, 8, 128) bf16 = 327,681 * 2,048 =
    671,090,688 B each; total = 327,681 * 131,072 = 42,949,804,032 B = budget + one cell."""
    p = plan_for(llama_8b(), budget_bytes=BUDGET)
    assert p.architecture == "mha"
    assert p.cell_size_bytes == 131_072
    assert p.max_total_num_tokens == 327_680
    assert p.num_pages == 327_680
    assert p.max_running_requests == 2048
    assert p.total_bytes == 327_681 * 131_072 == 42_949_804_032 == BUDGET + 131_072
    k0 = p.buffer("k.0")
    assert k0.shape == (327_681, 8, 128)
    assert k0.dtype == "bfloat16"
    assert k0.nbytes == 671_090_688
    assert k0.page_bytes == 8 * 128 * 2
    assert [b.name for b in p.buffers if b.in_budget][:4] == ["k.0", "v.0", "k.1", "v.1"]
    assert len([b for b in p.buffers if b.in_budget]) == 64


def test_llama_page16_puts_the_padding_page_on_top():
    """tokens = 42,949,672,960 // 131,072 // 16 * 16 = 327,680; pages = 20,480.
    Rows per buffer = (20,480 + 1) * 16 = 327,696; total = 327,696 * 131,072 =
    42,951,770,112 B = budget + one page (2,097,152 B)."""
    p = plan_for(llama_8b(), budget_bytes=BUDGET, page_size=16)
    assert p.max_total_num_tokens == 327_680
    assert p.num_pages == 20_480
    assert p.buffer("v.31").shape == (327_696, 8, 128)
    assert p.buffer("v.31").page_bytes == 16 * 8 * 128 * 2
    assert p.total_bytes == 42_951_770_112 == BUDGET + 2_097_152


def test_req_to_token_is_aux():
    """req_to_token: (2,048 + 1) rows x (131,072 + 4) int32 columns = 1,074,298,896 B,
    outside the budget."""
    p = plan_for(llama_8b(), budget_bytes=BUDGET)
    r = p.buffer("req_to_token")
    assert r.shape == (2049, 131_076)
    assert not r.in_budget
    assert p.aux_bytes == r.nbytes == 1_074_298_896
    assert p.backing_bytes >= p.total_bytes + p.aux_bytes


@pytest.mark.parametrize(
    ("tp", "cell", "tokens"),
    [
        (2, 65_536, 655_360),  # 4 heads
        (4, 32_768, 1_310_720),  # 2 heads
        (8, 16_384, 2_621_440),  # 1 head
        (16, 16_384, 2_621_440),  # max(1, 8 // 16) = 1 head: replicated
    ],
)
def test_tp_head_split(tp, cell, tokens):
    """cell = max(1, 8 // tp) * 256 * 32 * 2; tokens = 40 GiB // cell (40 * 2^30 / 2^16 =
    655,360 at 4 heads, and twice that per halving)."""
    p = plan_for(llama_8b(), budget_bytes=BUDGET, tp_size=tp)
    assert p.cell_size_bytes == cell
    assert p.max_total_num_tokens == tokens
    assert p.buffer("k.0").shape[1] == max(1, 8 // tp)


@pytest.mark.parametrize(
    ("pp", "rank", "start", "end"),
    [(2, 0, 0, 16), (2, 1, 16, 32), (3, 0, 0, 10), (3, 1, 10, 21), (3, 2, 21, 32),
     (5, 0, 0, 6), (5, 3, 18, 25), (5, 4, 25, 32)],
)
def test_pp_stage_layers(pp, rank, start, end):
    """Even split, the remainder one each to the last stages: 32 over 3 = 10, 11, 11;
    32 over 5 = 6, 6, 6, 7, 7. Buffers keep global layer ids; cell uses the stage's layers."""
    p = plan_for(llama_8b(), budget_bytes=BUDGET, pp_size=pp, pp_rank=rank)
    assert (p.layer_start, p.layer_end) == (start, end)
    assert p.cell_size_bytes == 4096 * (end - start)
    names = {b.name for b in p.buffers}
    assert f"k.{start}" in names and f"v.{end - 1}" in names
    assert f"k.{end}" not in names


def test_eagle_draft_scaling():
    """cell = int(131,072 * (1 + 1/32)) = 135,168 = 33 * 4,096; tokens = 42,949,672,960 //
    135,168 = (10,485,760 // 33 with 40 GiB / 4,096 = 10,485,760) = 317,750 (rem 10 * 4,096).
    The draft layer's KV is built too: draft_k.0 / draft_v.0, so the 33 layers' buffers hold
    317,751 rows of 4,096 B: total = 317,751 * 135,168. max_running_requests: no user value,
    so SGLang's speculative default 48 (min(48, 317,750 // 2))."""
    p = plan_for(llama_8b(), budget_bytes=BUDGET, speculative_algorithm="eagle")
    assert p.num_draft_layers == 1
    assert p.cell_size_bytes == 135_168
    assert p.max_total_num_tokens == 317_750
    assert p.max_running_requests == 48
    assert p.buffer("draft_k.0").shape == p.buffer("k.0").shape == (317_751, 8, 128)
    assert p.total_bytes == 317_751 * 135_168
    assert 317_750 * 135_168 <= BUDGET < 317_751 * 135_168


def test_standalone_with_three_draft_layers():
    """cell = 131,072 * 35 // 32 = 143,360."""
    p = plan_for(llama_8b(), budget_bytes=BUDGET, speculative_algorithm="standalone",
                 speculative_num_draft_layers=3)
    assert p.cell_size_bytes == 143_360
    assert p.req_to_token_columns == 131_072 + 4 + 3 + 1


@pytest.mark.parametrize(
    ("dtype", "cell", "store"),
    [("fp8_e4m3", 65_536, "uint8"), ("fp8_e5m2", 65_536, "uint8"),
     ("float16", 131_072, "float16"), ("float32", 262_144, "float32")],
)
def test_kv_dtypes(dtype, cell, store):
    p = plan_for(llama_8b(), budget_bytes=BUDGET, kv_cache_dtype=dtype)
    assert p.cell_size_bytes == cell
    assert p.kv_cache_dtype == dtype
    assert p.buffer("k.0").dtype == store


def test_auto_follows_model_dtype_and_fp8_checkpoints():
    assert plan_for(llama_8b(dtype="float16"), budget_bytes=BUDGET).kv_cache_dtype == "float16"
    p = plan_for(llama_8b(kv_cache_quant_fp8=True), budget_bytes=BUDGET)
    assert p.kv_cache_dtype == "fp8_e4m3"
    assert p.cell_size_bytes == 65_536


def test_max_total_tokens_cap_realigns():
    """Cap 1,000 with page 16 -> 62 pages = 992 tokens; max_running_requests = 992 // 2."""
    p = plan_for(llama_8b(), budget_bytes=BUDGET, page_size=16, max_total_tokens=1000)
    assert p.max_total_num_tokens == 992
    assert p.num_pages == 62
    assert p.max_running_requests == 496
    assert any("caps" in n for n in p.notes)


def test_max_total_tokens_without_budget():
    p = plan_for(llama_8b(), max_total_tokens=4100, page_size=16)
    assert p.max_total_num_tokens == 4096
    assert p.total_bytes == (256 + 1) * 16 * 131_072
    assert p.budget_bytes is None


def test_user_max_running_requests_capped_at_half():
    p = plan_for(llama_8b(), budget_bytes=64 * 1024 * 1024, max_running_requests=100_000)
    # 67,108,864 // 131,072 = 512 tokens; 512 // 2 = 256
    assert p.max_total_num_tokens == 512
    assert p.max_running_requests == 256
    assert any("reduced" in n for n in p.notes)


def test_context_length_override_drives_the_estimate():
    """T = 327,680, context 4,096: int(327,680 / 4,096 * 512) = 40,960 -> clamp 4,096."""
    p = plan_for(llama_8b(), budget_bytes=BUDGET, context_length=4096)
    assert p.context_length == 4096
    assert p.max_running_requests == 4096
    assert p.buffer("req_to_token").shape == (4097, 4100)


def test_budget_too_small_names_the_page_bytes():
    """page 16: one page = 16 * 131,072 = 2,097,152 B; a budget one byte short buys no page.
    A budget of exactly one page buys it, and the padding page on top makes the buffers
    2 * 2,097,152 = 4,194,304 B."""
    with pytest.raises(InvalidArgument) as e:
        plan_for(llama_8b(), budget_bytes=2_097_151, page_size=16)
    assert e.value.field == "budget_bytes"
    assert "2,097,151" in str(e.value) and "one KV page of 2,097,152 B" in str(e.value)
    p = plan_for(llama_8b(), budget_bytes=2_097_152, page_size=16)
    assert p.num_pages == 1
    assert p.total_bytes == 4_194_304


def test_pp_more_stages_than_layers():
    with pytest.raises(InvalidArgument) as e:
        plan_for(llama_8b(), budget_bytes=BUDGET, pp_size=33, pp_rank=0)
    assert e.value.field == "pp_size"


@pytest.mark.parametrize("budget", [10**8, 3 * 10**9, 40 * GiB + 12_345])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_budget_invariant(budget, page):
    """SGLang's rule: the pages are the most the budget buys (num_pages * page * cell <=
    budget < (num_pages + 1) * page * cell) and the padding page comes on top: the buffers
    hold (num_pages + 1) * page rows."""
    p = plan_for(llama_8b(), budget_bytes=budget, page_size=page)
    page_bytes = p.cell_size_bytes * page
    assert p.num_pages * page_bytes <= budget < (p.num_pages + 1) * page_bytes
    assert p.total_bytes == (p.num_pages + 1) * page_bytes
    assert p.max_total_num_tokens == p.num_pages * page


def test_pp_stages_agree_on_the_smallest_token_count():
    """32 layers over 3 stages: 10, 11, 11. Stage 0 alone would hold 40 GiB // (4,096 * 10)
    = 1,048,576 tokens; stages 1 and 2 hold 40 GiB // (4,096 * 11) = 10,485,760 // 11 =
    953,250. Every stage uses 953,250 (SGLang MIN-reduces the count over the PP group), so
    stage 0 allocates (953,250 + 1) * 40,960 = 39,045,160,960 B, under its budget."""
    counts = [plan_for(llama_8b(), budget_bytes=BUDGET, pp_size=3, pp_rank=r).max_total_num_tokens
              for r in range(3)]
    assert counts == [953_250] * 3
    p0 = plan_for(llama_8b(), budget_bytes=BUDGET, pp_size=3, pp_rank=0)
    assert any("smallest" in n for n in p0.notes)
    assert p0.total_bytes == 39_045_160_960

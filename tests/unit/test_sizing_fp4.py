"""FP4 cells with scales, for MHA and MLA, on their own."""

from __future__ import annotations

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpoold.sizing import fp4
from tests.factories import GiB, deepseek_v3, llama_8b, plan_for

BUDGET = 40 * GiB


def test_mha_layer_bytes():
    """8 heads, hd = vd = 128: data 8 * 256 / 2 = 1,024; scales 8*128/16 * 2 = 128 -> 1,152."""
    assert fp4.mha_layer_bytes(8, 128, 128) == 1152


def test_mla_layer_bytes():
    """kv_dim 576: 288 data + 36 scale bytes = 324 per layer."""
    assert fp4.mla_layer_bytes(576) == 324


def test_llama_fp4_plan():
    """cell = 1,152 * 32 = 36,864; tokens = 42,949,672,960 // 36,864 = 1,165,084
    (1,165,084 * 36,864 = 42,949,656,576, 16,384 B left); rows = tokens + 1 padding row.
    Buffers k/v (rows, 8, 64) uint8 and k_scale/v_scale (rows, 64) uint8."""
    p = plan_for(llama_8b(), budget_bytes=BUDGET, kv_cache_dtype="fp4_e2m1")
    assert p.cell_size_bytes == 36_864
    assert p.max_total_num_tokens == 1_165_084
    rows = 1_165_085
    assert p.buffer("k.3").shape == (rows, 8, 64)
    assert p.buffer("v.3").shape == (rows, 8, 64)
    assert p.buffer("k_scale.3").shape == (rows, 64)
    assert p.buffer("v_scale.3").shape == (rows, 64)
    assert {b.dtype for b in p.buffers if b.in_budget} == {"uint8"}
    assert p.total_bytes == rows * 36_864


def test_dsv3_fp4_plan():
    """cell = 324 * 61 = 19,764; tokens = 42,949,672,960 // 19,764 = 2,173,126
    (2,173,126 * 19,764 = 42,949,662,264, 10,696 B left); rows 2,173,127."""
    p = plan_for(deepseek_v3(), budget_bytes=BUDGET, kv_cache_dtype="fp4_e2m1")
    assert p.cell_size_bytes == 19_764
    assert p.max_total_num_tokens == 2_173_126
    assert p.buffer("kv.0").shape == (2_173_127, 1, 288)
    assert p.buffer("kv_scale.0").shape == (2_173_127, 36)
    assert p.total_bytes == 2_173_127 * 19_764


def test_head_dim_not_divisible_by_16():
    spec = llama_8b(attention={"type": "mha", "num_kv_heads": 8, "head_dim": 72})
    with pytest.raises(InvalidArgument) as e:
        plan_for(spec, budget_bytes=BUDGET, kv_cache_dtype="fp4_e2m1")
    assert e.value.field == "kv_cache_dtype"
    assert "72" in str(e.value)

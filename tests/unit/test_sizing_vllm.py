"""The vLLM profile (``kvpoold.sizing.vllm_*``): numbers computed by hand, vLLM's grouping
rules on real configs, its typed refusals, and properties over random full-attention models.

Worked numbers (bf16 = 2 B, CPU block 128 unless said):

* Llama-3.1-8B: a page is 8 heads * 128 tokens * (128 + 128) * 2 = 524,288 B; 32 layers make
  16 MiB a block; 1 GiB holds 64 blocks. One tensor of 1 GiB, layer stride 64 pages = 32 MiB,
  block stride 512 KiB. A 4,096-token request takes 32 blocks: max concurrency 64 / 32 = 2.0.
  The capacity check leaves out the null block: 1 GiB - 16 MiB = 63 blocks = 8,064 tokens.
* Gemma-2-2B (4 KV heads, head 256, 13 sliding + 13 full layers): 4 * 128 * 512 * 2 =
  524,288 B per page, two groups of 13; at block 48 the full page is 48 * 4,096 = 196,608 B
  and the sliding layers run 32-token kernel blocks (131,072 B), which do not divide it: vLLM
  pads them to 196,608 B.
* Gemma-3-1B (22 sliding + 4 full): group size 4, the sliding bucket cut into 6 groups taking
  every 6th sliding layer (0, 7, 14, 21 first), the full layers 5, 11, 17, 23 in the last.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.vllm_plan import (
    VllmLayout,
    VllmSpecType,
    decode_vllm_plan,
    make_vllm_options,
    vllm_plan_to_json,
)
from kvpoold.sizing.vllm_host import cpuinfo_has_avx512_bf16
from kvpoold.sizing.vllm_profile import plan_vllm
from kvpoold.sizing.vllm_specs import stage_bounds

MODELS = Path(__file__).resolve().parents[2] / "tests" / "data" / "models"
GiB = 1 << 30
MiB = 1 << 20


def _config(name: str) -> dict[str, Any]:
    return json.loads((MODELS / f"{name}.json").read_text())


def _plan(name: str, **options: Any):
    return plan_vllm(_config(name), make_vllm_options(**options))


def _index(name: str) -> int:
    return int(name.split(".")[2])


def test_llama_one_gib_by_hand() -> None:
    p = _plan("llama-3.1-8b-instruct", kv_cache_memory_bytes=GiB, max_model_len=4096)
    assert (p.block_size, p.cache_dtype, p.layout) == (128, "bfloat16", VllmLayout.LBHNC)
    assert {s.page_size_bytes for s in p.layers} == {524_288}
    assert (p.bytes_per_block, p.num_blocks, p.size_bytes) == (16 * MiB, 64, GiB)
    assert len(p.groups) == 1 and len(p.groups[0].layer_names) == 32
    (t,) = p.tensors
    assert (t.size, t.layer_stride, t.block_stride, t.offset) == (GiB, 32 * MiB, 512 << 10, 0)
    assert p.max_concurrency == 2.0


def test_llama_refusal_names_the_length_that_fits() -> None:
    with pytest.raises(InvalidArgument) as info:
        _plan("llama-3.1-8b-instruct", kv_cache_memory_bytes=GiB)  # its own 131,072 tokens
    assert info.value.field == "kv_cache_memory_bytes"
    assert "131,072" in info.value.message and "at most 8,064 tokens fit" in info.value.message
    assert "--kv-cache-memory-bytes" in info.value.message


def test_memory_exactly_one_request_plus_the_null_block() -> None:
    # 2,048 tokens = 16 blocks of 16 MiB, and the null block
    p = _plan("llama-3.1-8b-instruct", kv_cache_memory_bytes=17 * 16 * MiB,
              max_model_len=2048)
    assert p.num_blocks == 17
    with pytest.raises(InvalidArgument, match="at most 1,920 tokens"):
        _plan("llama-3.1-8b-instruct", kv_cache_memory_bytes=17 * 16 * MiB - 1,
              max_model_len=2048)


def test_gemma2_two_groups_and_one_without_the_hybrid_manager() -> None:
    p = _plan("gemma-2-2b", kv_cache_memory_bytes=4 * GiB, max_model_len=2048)
    assert [(g.type, len(g.layer_names), g.sliding_window) for g in p.groups] == [
        (VllmSpecType.sliding_window, 13, 4096), (VllmSpecType.full_attention, 13, None)]
    assert p.bytes_per_block == 13 * 524_288
    assert all(t.offset == 0 and t.size == p.size_bytes for t in p.tensors)
    off = _plan("gemma-2-2b", kv_cache_memory_bytes=4 * GiB, max_model_len=2048,
                disable_hybrid_kv_cache_manager=True)
    (g,) = off.groups
    assert (g.type, len(g.layer_names), g.sliding_window) == (
        VllmSpecType.full_attention, 26, 4096)
    assert off.bytes_per_block == 26 * 524_288


def test_gemma2_block48_pads_the_sliding_pages() -> None:
    p = _plan("gemma-2-2b", kv_cache_memory_bytes=4 * GiB, max_model_len=2048, block_size=48)
    sliding = [s for s in p.layers if s.type is VllmSpecType.sliding_window]
    assert {(s.block_size, s.page_size_padded) for s in sliding} == {(32, None)}
    assert {g.page_size_bytes for g in p.groups} == {196_608}
    assert {t.block_stride for t in p.tensors} == {196_608}


def test_gemma3_groups_take_every_nth_layer() -> None:
    p = _plan("gemma-3-1b-it", kv_cache_memory_bytes=GiB, max_model_len=4096)
    sizes = [len(g.layer_names) for g in p.groups]
    assert sizes == [4, 4, 4, 4, 3, 3, 4]
    assert [_index(n) for n in p.groups[0].layer_names] == [0, 7, 14, 21]
    assert [_index(n) for n in p.groups[-1].layer_names] == [5, 11, 17, 23]
    assert p.groups[-1].type is VllmSpecType.full_attention
    assert p.num_blocks == GiB // (4 * 131_072)


def test_mla_on_cpu_runs_16_token_blocks() -> None:
    p = _plan("deepseek-v3", kv_cache_memory_bytes=4 * GiB, max_model_len=2048, block_size=64)
    assert (p.block_size, p.layout) == (16, VllmLayout.LBNHC)
    # one latent of 512 + 64 per token: 16 * 576 * 2 B per layer
    assert {s.page_size_bytes for s in p.layers} == {18_432}
    assert p.num_blocks == 4 * GiB // (61 * 18_432)
    assert any("block_size 16" in n for n in p.notes)


def test_tensor_parallel_splits_and_replicates_kv_heads() -> None:
    p = _plan("tinyllama-1.1b-chat-v0.4", kv_cache_memory_bytes=GiB, max_model_len=2048,
              tp_size=8)
    assert {s.num_kv_heads for s in p.layers} == {1}  # 4 heads over 8 ranks: one each
    p = _plan("llama-3.1-8b-instruct", kv_cache_memory_bytes=GiB, max_model_len=2048,
              tp_size=2)
    assert {s.num_kv_heads for s in p.layers} == {4} and p.num_blocks == 128
    with pytest.raises(InvalidArgument) as info:
        _plan("llama-3.1-8b-instruct", kv_cache_memory_bytes=GiB, tp_size=3)
    assert info.value.field == "tp_size"


def test_pipeline_stages_take_the_smallest_block_count() -> None:
    plans = [_plan("llama-3.1-8b-instruct", kv_cache_memory_bytes=GiB, max_model_len=2048,
                   pp_size=3, pp_rank=r) for r in range(3)]
    assert [len(p.layers) for p in plans] == [11, 11, 10]
    assert {p.num_blocks for p in plans} == {GiB // (11 * 524_288)}
    assert plans[2].bytes_per_block == 10 * 524_288
    assert any("another pipeline stage" in n for n in plans[2].notes)


@pytest.mark.parametrize(("layers", "stages", "sizes"), [
    (12, 5, [2, 2, 3, 3, 2]), (32, 3, [11, 11, 10]), (61, 2, [31, 30]), (22, 4, [5, 6, 6, 5])])
def test_stage_bounds_by_hand(layers: int, stages: int, sizes: list[int]) -> None:
    got = [stage_bounds(layers, r, stages) for r in range(stages)]
    assert [b - a for a, b in got] == sizes


@given(st.integers(1, 300), st.integers(1, 64))
def test_stage_bounds_cover_the_layers_once(layers: int, stages: int) -> None:
    if stages > layers:
        with pytest.raises(InvalidArgument):
            stage_bounds(layers, 0, stages)
        return
    got = [stage_bounds(layers, r, stages) for r in range(stages)]
    assert got[0][0] == 0 and got[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
    assert max(b - a for a, b in got) - min(b - a for a, b in got) <= 1


def test_override_fixes_the_block_count() -> None:
    p = _plan("llama-3.1-8b-instruct", kv_cache_memory_bytes=GiB, max_model_len=2048,
              num_gpu_blocks_override=100)
    assert p.num_blocks == 100 and p.size_bytes == 100 * 16 * MiB


def test_qwen3_next_block_holds_a_state() -> None:
    """A gated-delta-net state on a CPU without AVX-512 BF16: conv (16*128*2 + 32*128) * 3 +
    SSM 32*128*128, bf16 = 1,097,728 B; an attention token 2 * 512 * 2 = 2,048 B; the block
    grows to 128 * ceil(1,097,728 / 262,144) = 640 tokens, a page of 1,310,720 B the states
    are padded to. 36 state layers in 3 groups of 12 and 12 full layers: 12 pages a block,
    4 GiB holds 273 blocks; a 2,048-token request takes 2 blocks per state group (prefix
    caching keeps the previous state) and 4 in the full group."""
    p = _plan("qwen3-next-80b-a3b-instruct", kv_cache_memory_bytes=4 * GiB,
              max_model_len=2048, cpu_avx512_bf16="no")
    assert p.block_size == 640
    states = [s for s in p.layers if s.type is VllmSpecType.mamba]
    assert len(states) == 36 and {s.page_size_padded for s in states} == {1_310_720}
    assert states[0].name == "model.layers.0.linear_attn"
    assert [(g.type, len(g.layer_names)) for g in p.groups] == [
        (VllmSpecType.mamba, 12)] * 3 + [(VllmSpecType.full_attention, 12)]
    assert p.num_blocks == 4 * GiB // (12 * 1_310_720) == 273
    assert p.max_concurrency == 273 / (3 * 2 + 4)
    one = _plan("qwen3-next-80b-a3b-instruct", kv_cache_memory_bytes=4 * GiB,
                max_model_len=2048, no_enable_prefix_caching=True, cpu_avx512_bf16="no")
    assert one.max_concurrency == 273 / (3 * 1 + 4)
    with pytest.raises(InvalidArgument) as info:
        _plan("qwen3-next-80b-a3b-instruct", kv_cache_memory_bytes=4 * GiB,
              max_model_len=2048, disable_hybrid_kv_cache_manager=True)
    assert info.value.field == "disable_hybrid_kv_cache_manager"


def test_qwen3_next_ssm_state_is_float32_on_a_cpu_with_avx512_bf16() -> None:
    """vLLM's CPU platform stores an ``auto`` SSM state in float32 on a CPU with AVX-512
    BF16: conv 24,576 * 2 + SSM 524,288 * 4 = 2,146,304 B, the block grows to
    128 * ceil(2,146,304 / 262,144) = 1,152 tokens, a page of 2,359,296 B, 4 GiB holds
    4 GiB // (12 * 2,359,296) = 151 blocks. A named --mamba-ssm-cache-dtype is kept on
    either CPU."""
    p = _plan("qwen3-next-80b-a3b-instruct", kv_cache_memory_bytes=4 * GiB,
              max_model_len=2048, cpu_avx512_bf16="yes")
    assert p.block_size == 1152
    states = [s for s in p.layers if s.type is VllmSpecType.mamba]
    assert {s.page_size_padded for s in states} == {2_359_296}
    assert p.num_blocks == 4 * GiB // (12 * 2_359_296) == 151
    assert any("SSM states are float32" in n for n in p.notes)
    kept = _plan("qwen3-next-80b-a3b-instruct", kv_cache_memory_bytes=4 * GiB,
                 max_model_len=2048, cpu_avx512_bf16="yes", mamba_ssm_cache_dtype="bfloat16")
    assert (kept.block_size, kept.num_blocks) == (640, 273)
    asked = _plan("qwen3-next-80b-a3b-instruct", kv_cache_memory_bytes=4 * GiB,
                  max_model_len=2048, cpu_avx512_bf16="no", mamba_ssm_cache_dtype="float32")
    assert (asked.block_size, asked.num_blocks) == (1152, 151)
    # a model without linear attention does not change with the CPU
    for isa in ("yes", "no"):
        llama = _plan("llama-3.1-8b-instruct", kv_cache_memory_bytes=GiB, max_model_len=2048,
                      cpu_avx512_bf16=isa)
        assert (llama.block_size, llama.num_blocks, llama.notes) == (
            128, 64, ("layers full decided by architectures (as vLLM 0.32 reads them)",))


def test_cpuinfo_flag() -> None:
    with_flag = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n"
    without = "processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni\nbugs\t\t: avx512_bf16x\n"
    assert cpuinfo_has_avx512_bf16(with_flag)
    assert not cpuinfo_has_avx512_bf16(without)
    assert not cpuinfo_has_avx512_bf16("")


def test_sparse_attention_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match="DeepSeek sparse attention") as info:
        _plan("deepseek-v3.2-exp", kv_cache_memory_bytes=GiB)
    assert info.value.field == "model_config"


def test_bad_options_are_refused_with_their_field() -> None:
    for fields, field in (({"kv_cache_memory_bytes": GiB, "block_size": 0}, "block_size"),
                          ({"kv_cache_memory_bytes": GiB, "pp_size": 2, "pp_rank": 2},
                           "pp_rank"),
                          ({"kv_cache_memory_bytes": -1}, "kv_cache_memory_bytes")):
        with pytest.raises(InvalidArgument) as info:
            make_vllm_options(**fields)
        assert info.value.field == field
    with pytest.raises(InvalidArgument) as info:
        make_vllm_options(kv_cache_memory_bytes=GiB, kv_cache_dtype="fp4_e2m1")
    assert info.value.field == "kv_cache_dtype"


def test_plan_round_trips_json() -> None:
    p = _plan("gpt-oss-20b", kv_cache_memory_bytes=GiB, max_model_len=4096)
    assert decode_vllm_plan(vllm_plan_to_json(p)) == p


def _llama_like(layers: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": layers, "num_attention_heads": kv_heads * 4,
            "num_key_value_heads": kv_heads, "hidden_size": kv_heads * 4 * head_dim,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 80), kv_heads=st.sampled_from([1, 2, 4, 8]),
       head_dim=st.sampled_from([32, 64, 128, 256]), block=st.sampled_from([32, 64, 128]),
       memory=st.integers(1 << 20, 64 << 30), dtype=st.sampled_from(["auto", "fp8"]))
def test_full_attention_blocks_and_tensors(layers: int, kv_heads: int, head_dim: int,
                                           block: int, memory: int, dtype: str) -> None:
    """One group, ``num_blocks = memory // (layers * page)``, one tensor whose layers sit
    ``num_blocks`` pages apart and fill the region exactly; or a refusal when one request of
    256 tokens does not fit beside the null block."""
    page = kv_heads * block * 2 * head_dim * (1 if dtype == "fp8" else 2)
    options = make_vllm_options(kv_cache_memory_bytes=memory, block_size=block,
                                max_model_len=256, kv_cache_dtype=dtype)
    need = layers * page * (-(-256 // block) + 1)
    if memory < need:
        with pytest.raises(InvalidArgument) as info:
            plan_vllm(_llama_like(layers, kv_heads, head_dim), options)
        assert info.value.field == "kv_cache_memory_bytes"
        return
    p = plan_vllm(_llama_like(layers, kv_heads, head_dim), options)
    assert p.num_blocks == memory // (layers * page)
    (t,) = p.tensors
    assert t.layer_stride == page * p.num_blocks and t.block_stride == page
    assert t.offset + len(t.layers) * t.layer_stride == t.size == p.size_bytes <= memory

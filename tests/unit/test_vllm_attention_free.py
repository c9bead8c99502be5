"""The vLLM profile's attention-free Mamba models (issue 42): Mamba-1 (``MambaForCausalLM``,
``FalconMambaForCausalLM``), Mamba-2 (``Mamba2ForCausalLM``) and a Granite-4.0-H whose layers
are all Mamba, on the SYNTHETIC configs of ``tests/integration/synthetic_configs`` (see that
folder's README), with numbers computed by hand from vLLM 0.32's formulas (real vLLM agrees in
``tests/integration/test_vllm_parity.py``, cases ``synthetic/...``, at TP 1; the TP numbers
here are by hand only: the harness cannot split a state over ranks).

vLLM's rules for such a model: no attention backend, so no block alignment and the layout
of its default preference, ``LBNHC``; ``block_size`` stays the CPU platform's 128 (or
``--block-size``) and sizes nothing; the state spec's block is vLLM's ``mamba_block_size``:
with prefix caching the block size the model's config hook saw (``--block-size``, else
CacheConfig's default 16), without it ``max_model_len``. One group of every layer, a page of
one state; a request holds 2 blocks with prefix caching (Mamba-2: 3, its prefill checkpoint),
else 1.

Worked numbers (bf16 = 2 B, fp16 = 2 B, fp32 = 4 B; a CPU without AVX-512 BF16, so the SSM
state is in the model dtype, unless said; 4 GiB, 2,048 tokens):

* Mamba-130M (synthetic, Mamba-1): 24 layers, intermediate 1,536, state 16, kernel 4, a
  float32 checkpoint run in bf16. Conv 1,536 * 3 = 4,608 (9,216 B) + SSM 1,536 * 16 = 24,576
  (49,152 B) = 58,368 B; 24 * 58,368 = 1,400,832 B a block, 3,066 blocks, 3,066 / 2 = 1,533
  requests (no prefix caching: 3,066). fp32 SSM (a CPU with AVX-512 BF16): 107,520 B, 1,664
  blocks. TP 2: conv 768 * 3 (4,608 B) + SSM 768 * 16 (24,576 B) = 29,184 B.
* Mamba2-2.7B (synthetic, Mamba-2): 64 layers, hidden 2,560, expand 2: 5,120 = 80 heads of 64,
  1 group, state 128, kernel 4, float16. Conv (5,120 + 2 * 128) * 3 = 16,128 (32,256 B) + SSM
  80 * 64 * 128 = 655,360 (1,310,720 B) = 1,342,976 B; 64 of them 85,950,464 B a block, 49
  blocks, 49 / 3 requests. TP 16: the one group is replicated to 16, conv (5,120 + 2 * 16 *
  128) / 16 * 3 = 1,728 (3,456 B) + SSM 5 * 64 * 128 = 40,960 (81,920 B) = 85,376 B.
* Falcon-Mamba-7B (synthetic, Mamba-1): 64 layers, ``intermediate_size`` 8,192 as the file
  states (beside ``expand`` 16, which transformers then ignores), state 16, bf16. Conv 8,192 *
  3 = 24,576 (49,152 B) + SSM 8,192 * 16 = 131,072 (262,144 B) = 311,296 B; 64 of them
  19,922,944 B a block, 215 blocks, 107.5 requests.
* Granite-4.0-H-Tiny without ``layer_types`` (synthetic): 40 Mamba-2 layers of 48 heads of 64,
  1 group, state 128: conv (3,072 + 256) * 3 = 9,984 (19,968 B) + SSM 393,216 (786,432 B) =
  806,400 B; 40 of them 32,256,000 B a block, 133 blocks, 133 / 3 requests.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.vllm_plan import VllmLayout, VllmSpecType
from kvpoold.sizing.vllm_model import LayerKind, read_vllm_model
from kvpoold.sizing.vllm_pool import pool_plan_of
from tests.unit.synthetic_plans import GiB
from tests.unit.synthetic_plans import synthetic_config as _config
from tests.unit.synthetic_plans import synthetic_plan as _plan

MAMBA1, MAMBA2 = "mamba-130m", "mamba2-2.7b"
FALCON_MAMBA, NO_ATTENTION = "falcon-mamba-7b", "granite-4.0-h-tiny-no-attention"


@pytest.mark.parametrize(("name", "layers", "state", "blocks", "per_request", "prefix"), [
    (MAMBA1, 24, 58_368, 3_066, 2, "backbone"),
    (MAMBA2, 64, 1_342_976, 49, 3, "backbone"),
    (FALCON_MAMBA, 64, 311_296, 215, 2, "backbone"),
    (NO_ATTENTION, 40, 806_400, 133, 3, "model"),
])
def test_attention_free_plan(name: str, layers: int, state: int, blocks: int,
                             per_request: int, prefix: str) -> None:
    """One Mamba group of every layer, a page of one state, vLLM's LBNHC layout, the CPU's
    block size 128 beside states kept per 16 tokens."""
    model = read_vllm_model(_config(name))
    assert model.is_attention_free and model.has_state
    assert all(layer.kind is LayerKind.mamba for layer in model.layers)
    p = _plan(name)
    assert (p.block_size, p.layout, p.num_blocks) == (128, VllmLayout.LBNHC, blocks)
    assert p.bytes_per_block == layers * state and p.size_bytes == blocks * layers * state
    assert {(s.type, s.block_size, s.page_size_bytes) for s in p.layers} == {
        (VllmSpecType.mamba, 16, state)}
    [group] = p.groups
    assert (group.type, group.block_size, group.page_size_bytes, group.uniform_type) == (
        VllmSpecType.mamba, 16, state, False)
    assert group.layer_names == tuple(f"{prefix}.layers.{i}.mixer" for i in range(layers))
    [tensor] = p.tensors
    assert (tensor.size, tensor.layer_stride, tensor.block_stride, tensor.offset) == (
        blocks * layers * state, blocks * state, state, 0)
    assert p.max_concurrency == pytest.approx(blocks / per_request)
    assert any("no attention layer: vLLM plans the model attention-free" in n
               for n in p.notes)


def test_state_block_follows_block_size_and_prefix_caching() -> None:
    """With prefix caching states are kept per --block-size tokens (the plan's block size
    too); without it one state covers the request: per max_model_len, one block each."""
    p = _plan(MAMBA1, block_size=64)
    assert p.block_size == 64 and {s.block_size for s in p.layers} == {64}
    assert p.num_blocks == 3_066
    p = _plan(MAMBA1, no_enable_prefix_caching=True, max_model_len=1000)
    assert p.block_size == 128 and {s.block_size for s in p.layers} == {1000}
    assert p.max_concurrency == 3_066


def test_ssm_dtype_on_a_cpu_with_avx512_bf16() -> None:
    """``auto`` is float32 there; a named half dtype stays (transformers lists every layer of
    these classes as linear_attention)."""
    assert _plan(MAMBA1, cpu_avx512_bf16="yes").layers[0].page_size_bytes == 107_520
    assert _plan(MAMBA1, cpu_avx512_bf16="yes", mamba_ssm_cache_dtype="bfloat16"
                 ).layers[0].page_size_bytes == 58_368
    assert _plan(MAMBA2, cpu_avx512_bf16="yes").layers[0].page_size_bytes == 2_653_696
    assert _plan(FALCON_MAMBA, cpu_avx512_bf16="yes").layers[0].page_size_bytes == 573_440
    assert _plan(NO_ATTENTION, cpu_avx512_bf16="yes").layers[0].page_size_bytes == 1_592_832


def test_tensor_parallel_split_by_hand() -> None:
    assert _plan(MAMBA1, tp_size=2).layers[0].page_size_bytes == 29_184
    # Mamba-2's one group is replicated to follow the head shards
    assert _plan(MAMBA2, tp_size=16).layers[0].page_size_bytes == 85_376
    with pytest.raises(InvalidArgument, match=r"Mamba-1 conv channels \(1536\) do not split "
                                              "over tp_size 5") as info:
        _plan(MAMBA1, tp_size=5)
    assert info.value.field == "tp_size"
    # the all-Mamba Granite still has 12 attention heads, which vLLM's TP check divides
    with pytest.raises(InvalidArgument, match="12 attention heads do not split"):
        _plan(NO_ATTENTION, tp_size=8)


def test_pipeline_stages() -> None:
    """Mamba-1 splits 24 layers over 2 stages of 12; Mamba2ForCausalLM has no pipeline
    parallelism in vLLM (no SupportsPP), so the profile refuses it as vLLM does."""
    p = _plan(MAMBA1, pp_size=2, pp_rank=1)
    assert [s.name for s in p.layers] == [f"backbone.layers.{i}.mixer" for i in range(12, 24)]
    assert p.num_blocks == 4 * GiB // (12 * 58_368)
    with pytest.raises(InvalidArgument, match="runs Mamba2ForCausalLM in one pipeline stage "
                                              "only") as info:
        _plan(MAMBA2, pp_size=2)
    assert info.value.field == "pp_size"


def test_capacity_is_the_state_blocks_whatever_the_length() -> None:
    """A request holds 2 blocks (Mamba-1, prefix caching) beside the null block: 3 blocks of
    memory plan, one byte less is refused, naming the states and the one knob that helps."""
    page = 24 * 58_368
    assert _plan(MAMBA1, kv_cache_memory_bytes=3 * page).num_blocks == 3
    with pytest.raises(InvalidArgument, match=r"one request's Mamba states need 2,801,664 B "
                                              r"\(2 blocks of 1,400,832 B") as info:
        _plan(MAMBA1, kv_cache_memory_bytes=3 * page - 1)
    assert info.value.field == "kv_cache_memory_bytes"
    assert "lower --max-model-len" not in str(info.value)


def test_a_config_without_a_length_takes_any_max_model_len() -> None:
    """No length key: vLLM's default 2,048, and a longer max_model_len is taken as asked."""
    assert _plan(MAMBA1, max_model_len=None).max_model_len == 2048
    assert _plan(MAMBA1, max_model_len=8192).max_model_len == 8192


def test_mamba1_intermediate_size_is_the_files_else_expand_times_hidden() -> None:
    model = read_vllm_model(_config(FALCON_MAMBA))
    assert model.mamba is not None and model.mamba.intermediate_size == 8_192
    model = read_vllm_model(_config(FALCON_MAMBA, intermediate_size=...))
    assert model.mamba is not None and model.mamba.intermediate_size == 16 * 4_096
    assert model.decided_by == ("architectures", "model_type")


@pytest.mark.parametrize(("name", "change", "words"), [
    (MAMBA2, {"num_heads": 64}, r"num_heads x head_dim \(64 x 64\) is not the Mamba "
                                r"intermediate size 5,120"),
    (MAMBA2, {"n_groups": None}, "n_groups must be a positive integer"),
    (MAMBA1, {"state_size": 0}, "state_size must be a positive integer"),
    (MAMBA1, {"intermediate_size": ..., "expand": ...}, "expand must be a positive integer"),
])
def test_bad_configs_are_refused_by_field(name: str, change: dict[str, Any],
                                          words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        read_vllm_model(_config(name, **change))


def test_granite_all_mamba_ignores_a_head_dim_nothing_reads() -> None:
    """A hybrid aligns its block with ``head_dim`` while its attention uses hidden / heads
    (refused); with no attention layer there is no alignment and nothing reads it."""
    plan = _plan(_config(NO_ATTENTION, head_dim=64))
    assert plan.num_blocks == 133


def test_pool_of_an_attention_free_plan_holds_states_only() -> None:
    """The daemon's pool: one int8 region, vLLM's block ids as the ``kv`` space (the Mamba
    group takes its blocks from vLLM's block pool like any group), no token slots."""
    vplan = _plan(MAMBA1, kv_cache_memory_bytes=8 << 20)
    assert vplan.state_only and vplan.num_blocks == 5
    pool = pool_plan_of(vplan)
    assert (pool.max_total_num_tokens, pool.cell_size_bytes, pool.page_size) == (0, 0, 128)
    assert [(s.name, s.capacity, s.bytes_per_unit) for s in pool.id_spaces] == [
        ("kv", 4, 24 * 58_368)]
    assert pool.backing_bytes == 5 * 24 * 58_368
    assert "no KV pages and no token slots" in pool.notes[-1]
    hybrid = _plan("granite-4.0-h-tiny")
    assert not hybrid.state_only and pool_plan_of(hybrid).max_total_num_tokens > 0

"""The vLLM profile's Zamba2 (Zyphra's Mamba-2 hybrid with shared transformer blocks, issue 42),
on the SYNTHETIC configs of ``tests/integration/synthetic_configs`` (no real Hub file is
reachable; see that folder's README), with numbers computed by hand from vLLM 0.32's formulas
(real vLLM agrees in ``tests/integration/test_vllm_parity.py``, cases ``synthetic/zamba2-...``).

vLLM's ``Zamba2ForCausalLM``: every layer is a Mamba-2 mixer, named ``{h + i}.mixer`` (``h`` the
hybrid layers; no ``model.`` prefix); each ``hybrid`` layer also runs one of ``num_mem_blocks``
shared transformer blocks, cycled, and every use gets its own attention module
``model.attn.{j}``, registered before the mixers, block ``b``'s uses numbered from
``b * (h + blocks - 1) // blocks``. The attention keeps ``num_attention_heads`` KV heads of
``attention_head_dim`` = 2 * hidden / heads.

Worked numbers (bf16 = 2 B, fp32 = 4 B, CPU block 128; a CPU without AVX-512 BF16 unless said):

* Zamba2-2.7B (synthetic): 54 layers, 9 hybrid (6, 12, ..., 42, 47, 51), 2 blocks. Attention:
  32 KV heads of 160, 20,480 B a token, a 128-token page 2,621,440 B. Mixer: 5,120 channels in
  80 heads of 64, 1 group, state 64, kernel 4: conv (5,120 + 2 * 64) * 3 = 15,744 (31,488 B) +
  SSM 80 * 64 * 64 = 327,680 (655,360 B) = 686,848 B; block 128 * ceil(686,848 / 2,621,440) =
  128. 9 attention and 54 Mamba layers: group size 9, one attention group and 6 Mamba groups,
  9 * 2,621,440 = 23,592,960 B a block, 4 GiB: 182 blocks; a 2,048-token request: 16 attention
  + 6 * 3 Mamba blocks (running, previous, prefill checkpoint) = 34, 182 / 34 requests.
  Names: block 0's uses (layers 6, 18, 30, 42, 51) are ``model.attn.0``-``4``, block 1's
  (12, 24, 36, 47) ``model.attn.5``-``8``; layer 0's mixer is ``9.mixer``.
* Zamba2-1.2B (synthetic): 38 layers, 6 hybrid, 1 block; attention 32 heads of 128 (16,384 B a
  token, 2 MiB a 128-token page); mixer 4,096 channels in 64 heads of 64, state 128: conv
  (4,096 + 256) * 3 * 2 = 26,112 B + SSM 64 * 64 * 128 * 2 = 1,048,576 B = 1,074,688 B, block
  128; group size 6, 1 + 7 groups, 12 MiB a block: 341 blocks, a request 16 + 7 * 3 = 37
  blocks. With float32 SSM (auto on a CPU with AVX-512 BF16): 26,112 + 2,097,152 = 2,123,264 B
  > 2 MiB, block 256, 24 MiB a block: 170 blocks, a request 8 + 21 = 29.
* Zamba2-7B (synthetic): 81 layers, 13 hybrid, 2 groups of Mamba-2 (conv (7,168 + 2 * 2 * 64)
  * 3); attention 32 heads of 224 (28,672 B a token, 3,670,016 B a page); group size 13, 1 + 7
  groups: 90 blocks of 47,710,208 B in 4 GiB.
* TP 2 (2.7B): 16 KV heads (1,310,720 B a page); the single group is replicated: conv
  (5,120 + 2 * 2 * 64) / 2 * 3 = 8,064 (16,128 B) + SSM 40 * 64 * 64 * 2 = 327,680 B.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.vllm_plan import VllmSpecType
from kvpoold.sizing.vllm_model import LayerKind, read_vllm_model
from tests.unit.synthetic_plans import synthetic_config as _config
from tests.unit.synthetic_plans import synthetic_plan as _plan

SMALL, MID, LARGE = "zamba2-1.2b", "zamba2-2.7b", "zamba2-7b"


def test_shared_attention_is_one_module_per_use_registered_first() -> None:
    model = read_vllm_model(_config(MID))
    attention = [(layer.index, layer.name_index) for layer in model.layers
                 if layer.kind is LayerKind.full]
    assert attention == [(6, 0), (18, 1), (30, 2), (42, 3), (51, 4),
                         (12, 5), (24, 6), (36, 7), (47, 8)]
    assert [layer.kind for layer in model.layers[9:]] == [LayerKind.mamba] * 54
    assert model.num_decoder_layers == 54 and model.head_size == 160
    assert model.num_kv_heads == 32 and not model.pipeline_parallel
    assert model.decided_by == ("architectures", "layers_block_type")
    mixer = model.mamba
    assert mixer is not None and (mixer.intermediate_size, mixer.num_heads, mixer.head_dim,
                                  mixer.n_groups, mixer.state_size) == (5_120, 80, 64, 1, 64)


def test_zamba2_2_7b_plan() -> None:
    plan = _plan(_config(MID))
    assert (plan.block_size, plan.num_blocks, plan.bytes_per_block) == (128, 182, 23_592_960)
    assert plan.max_concurrency == pytest.approx(182 / 34)
    attention, *mamba = plan.groups
    assert attention.type is VllmSpecType.full_attention and len(mamba) == 6
    assert attention.layer_names == tuple(f"model.attn.{j}" for j in range(9))
    assert mamba[0].layer_names == tuple(f"{9 + i}.mixer" for i in range(0, 54, 6))
    assert {g.page_size_bytes for g in plan.groups} == {2_621_440}
    assert any("conv 31,488 B (bfloat16) + SSM 655,360 B (bfloat16) = 686,848 B, padded to "
               "2,621,440 B; 54 state layers" in n for n in plan.notes)


@pytest.mark.parametrize(("isa", "ssm", "block", "blocks", "per_request"), [
    ("no", "auto", 128, 341, 37),
    ("yes", "auto", 256, 170, 29),  # the CPU platform's float32 reset
    ("yes", "bfloat16", 128, 341, 37),  # kept: transformers calls the mamba layers
    ("no", "float32", 256, 170, 29),  # linear_attention
])
def test_zamba2_1_2b_ssm_dtype(isa: str, ssm: str, block: int, blocks: int,
                               per_request: int) -> None:
    plan = _plan(_config(SMALL), cpu_avx512_bf16=isa, mamba_ssm_cache_dtype=ssm)
    assert (plan.block_size, plan.num_blocks) == (block, blocks)
    assert plan.max_concurrency == pytest.approx(blocks / per_request)
    assert len(plan.groups) == 8 and plan.groups[1].layer_names[0] == "6.mixer"


def test_zamba2_7b_two_mamba_groups() -> None:
    plan = _plan(_config(LARGE), cpu_avx512_bf16="yes")
    assert (plan.block_size, plan.num_blocks, plan.bytes_per_block) == (128, 90, 47_710_208)
    assert any("conv 44,544 B (bfloat16) + SSM 1,835,008 B (float32)" in n for n in plan.notes)
    assert plan.groups[0].layer_names[-1] == "model.attn.12"
    assert plan.groups[1].layer_names[0] == "13.mixer"


def test_three_blocks_skip_a_name_as_vllm_numbers_them() -> None:
    """7 hybrid layers over 3 blocks: block 1 starts at 9 // 3 = 3 (2 uses), block 2 at
    18 // 3 = 6, so no module is called ``model.attn.5``; the class defaults give 8 Mamba
    heads of 4,096 / 8 = 512, state 64."""
    model = read_vllm_model(_config("zamba2-three-blocks"))
    assert [layer.name_index for layer in model.layers[:7]] == [0, 1, 2, 3, 4, 6, 7]
    assert [layer.index for layer in model.layers[:7]] == [4, 19, 34, 9, 24, 14, 29]
    assert model.mamba is not None and (model.mamba.num_heads, model.mamba.head_dim,
                                        model.mamba.state_size) == (8, 512, 64)
    assert _plan(_config("zamba2-three-blocks")).groups[1].layer_names[0] == "7.mixer"


def test_tensor_parallel_splits_heads_and_replicates_the_single_group() -> None:
    plan = _plan(_config(MID), tp_size=2, mamba_ssm_cache_dtype="bfloat16")
    assert plan.layers[0].num_kv_heads == 16 and plan.layers[0].page_size_bytes == 1_310_720
    assert any("conv 16,128 B (bfloat16) + SSM 327,680 B (bfloat16)" in n for n in plan.notes)
    with pytest.raises(InvalidArgument, match="2 Mamba-2 groups do not split over tp_size 4"):
        _plan(_config(LARGE), tp_size=4)


def test_no_pipeline_parallelism() -> None:
    with pytest.raises(InvalidArgument, match="does not implement SupportsPP") as info:
        _plan(_config(MID), pp_size=2)
    assert info.value.field == "pp_size"


def test_config_class_defaults_and_names() -> None:
    """No layers_block_type: transformers' default 54-layer pattern (the 2.7B one); the
    field under its attribute_map name ``layer_types``, with the new ``linear_attention``
    names; ``use_long_context`` sets max_position_embeddings to 16,384."""
    base = _plan(_config(MID))
    bare = _config(MID, layers_block_type=..., hybrid_layer_ids=..., attention_head_dim=...,
                   attention_hidden_size=..., mamba_headdim=...)
    assert _plan(bare).groups == base.groups
    types = ["linear_attention" if t == "mamba" else t
             for t in _config(MID)["layers_block_type"]]
    renamed = _config(MID, layers_block_type=..., layer_types=types)
    assert read_vllm_model(renamed).decided_by == ("architectures", "layer_types")
    assert _plan(renamed).groups == base.groups
    assert read_vllm_model(_config(MID, use_long_context=True)).derived_max_model_len == 16_384


@pytest.mark.parametrize(("change", "words"), [
    ({"hybrid_layer_ids": [6, 12]}, r"hybrid_layer_ids \[6, 12\] are not the hybrid layers"),
    ({"layers_block_type": ["mamba"] * 54, "hybrid_layer_ids": ...}, "lists no hybrid layer"),
    ({"layers_block_type": ["mamba"] * 53 + ["attention"]}, "'attention' at layer 53"),
    ({"layers_block_type": ["mamba", "hybrid"]}, r"num_hidden_layers \(54\)"),
    ({"attention_head_dim": 128}, r"\(128 x 32\) is not attention_hidden_size \(5120\)"),
    ({"num_key_value_heads": 8}, "num_key_value_heads 8 is not num_attention_heads"),
    ({"mamba_headdim": 32}, r"\(80 x 32\) is not the Mamba intermediate size"),
    ({"mamba_ngroups": None}, "mamba_ngroups must be a positive integer"),
])
def test_bad_zamba2_configs_are_refused_by_field(change: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        read_vllm_model(_config(MID, **change))


def test_every_layer_hybrid_lists_no_linear_attention() -> None:
    """Every layer ``hybrid``: transformers' layer_types lists no ``linear_attention``, so on a
    CPU with AVX-512 BF16 vLLM's platform stores even a named bfloat16 SSM state as float32
    (checked against vLLM 0.32 by hand). 8 heads of 512, state 256: conv (4,096 + 512) * 3 * 2
    = 27,648 B + SSM 8 * 512 * 256 * 2 = 2,097,152 B, block 256 (2 MiB a 128-token page); in
    float32 4,221,952 B, block 384."""
    config = _config("zamba2-three-blocks", layers_block_type=["hybrid"] * 38,
                     num_mem_blocks=4, mamba_d_state=256)
    assert _plan(config, cpu_avx512_bf16="no").block_size == 256
    assert _plan(config, cpu_avx512_bf16="yes", mamba_ssm_cache_dtype="bfloat16").block_size \
        == 384

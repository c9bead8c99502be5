"""The vLLM profile's Falcon-H1 and Granite-4.0-H (Mamba-2 hybrids, issue 42), on the SYNTHETIC
configs of ``tests/integration/synthetic_configs`` (no real Hub file is reachable; see that
folder's README), with numbers computed by hand from vLLM 0.32's formulas (real vLLM agrees in
``tests/integration/test_vllm_parity.py``, cases ``synthetic/...``).

Worked numbers (bf16 = 2 B, fp32 = 4 B, CPU block 128, a CPU without AVX-512 BF16 unless said):

* Falcon-H1-0.5B (synthetic): 36 layers, each an attention (2 KV heads of 64: 512 B a token)
  and a Mamba-2 mixer (``mamba_d_ssm`` 1,536 = 24 heads x 64, 1 group, state 128, kernel 4):
  conv (1,536 + 2 * 128) * 3 = 5,376 (10,752 B) + SSM 24 * 64 * 128 = 196,608 (393,216 B) =
  403,968 B; block 128 * ceil(403,968 / 65,536) = 896, page 458,752 B. 36 attention and 36
  Mamba layers: two groups of 36, 36 * 458,752 = 16,515,072 B a block, 4 GiB: 260 blocks; a
  2,048-token request takes 3 attention blocks and 3 Mamba blocks (running, previous, prefill
  checkpoint): 260 / 6 requests. With a float32 SSM state (a named half dtype on a CPU with
  AVX-512 BF16: Falcon-H1's ``layer_types`` is its ``layers_block_type``, no
  ``linear_attention``): 10,752 + 786,432 = 797,184 B, block 128 * 13 = 1,664.
* ``mamba_d_ssm: null``: ``mamba_expand * hidden_size`` = 2,048; 32 heads, ``mamba_d_head``
  auto = 64: conv (2,048 + 256) * 3 * 2 = 13,824 B + SSM 32 * 64 * 128 * 2 = 524,288 B =
  538,112 B, block 128 * 9 = 1,152.
* Granite-4.0-H-Tiny (synthetic): 40 layers, attention at 5, 15, 25, 35 (4 KV heads of 1,536 /
  12 = 128: 2,048 B a token), Mamba-2 elsewhere (48 heads of 64, 1 group, state 128): conv
  (3,072 + 256) * 3 * 2 = 19,968 B + SSM 48 * 64 * 128 * 2 = 786,432 B = 806,400 B; block
  128 * ceil(806,400 / 262,144) = 512, page 1 MiB. 36 Mamba and 4 attention layers: group size
  4, nine Mamba groups and one attention group, 4 MiB a block, 1,024 blocks; a 2,048-token
  request: 4 attention + 9 * 3 Mamba blocks, 1,024 / 31 requests.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.vllm_plan import VllmSpecType
from kvpoold.sizing.vllm_model import LayerKind, read_vllm_model
from tests.unit.synthetic_plans import synthetic_config as _config
from tests.unit.synthetic_plans import synthetic_plan as _plan

FALCON = "falcon-h1-0.5b"
GRANITE = "granite-4.0-h-tiny"


def test_falcon_h1_has_an_attention_and_a_mixer_in_every_layer() -> None:
    model = read_vllm_model(_config(FALCON))
    assert [layer.kind for layer in model.layers[:4]] == [
        LayerKind.full, LayerKind.mamba, LayerKind.full, LayerKind.mamba]
    assert model.num_decoder_layers == 36 and len(model.layers) == 72
    assert model.decided_by == ("architectures", "model_type")
    plan = _plan(_config(FALCON))
    assert (plan.block_size, plan.num_blocks) == (896, 260)
    assert plan.max_concurrency == pytest.approx(260 / 6)
    full, mamba = plan.groups
    assert full.type is VllmSpecType.full_attention and mamba.type is VllmSpecType.mamba
    assert full.layer_names[:2] == ("model.layers.0.attn", "model.layers.1.attn")
    assert mamba.layer_names[:2] == ("model.36.mixer", "model.37.mixer")
    assert (full.page_size_bytes, mamba.page_size_bytes) == (458_752, 458_752)
    assert any("conv 10,752 B (bfloat16) + SSM 393,216 B (bfloat16) = 403,968 B" in n
               for n in plan.notes)


def test_falcon_h1_pipeline_stage_holds_its_layers_mixers() -> None:
    plan = _plan(_config(FALCON), pp_size=2, pp_rank=1)
    names = [layer.name for layer in plan.layers]
    assert names[:2] == ["model.layers.18.attn", "model.54.mixer"]
    assert names[-1] == "model.71.mixer" and len(names) == 36


@pytest.mark.parametrize(("name", "isa", "ssm", "block"), [
    (FALCON, "yes", "bfloat16", 1_664),  # reset to float32: no linear_attention layer type
    (FALCON, "no", "bfloat16", 896),
    (FALCON, "yes", "auto", 1_664),
    (GRANITE, "yes", "bfloat16", 512),  # kept: transformers calls its mamba linear_attention
    (GRANITE, "yes", "auto", 896),  # 19,968 + 1,572,864 B: 128 * 7
])
def test_ssm_dtype_on_a_cpu_with_and_without_avx512_bf16(name: str, isa: str, ssm: str,
                                                          block: int) -> None:
    plan = _plan(_config(name), cpu_avx512_bf16=isa, mamba_ssm_cache_dtype=ssm)
    assert plan.block_size == block


def test_falcon_h1_null_d_ssm_is_expand_times_hidden_and_auto_head() -> None:
    config = _config(FALCON, mamba_d_ssm=None, mamba_d_head="auto", mamba_n_heads=32)
    model = read_vllm_model(config)
    assert model.mamba is not None and model.mamba.head_dim == 64
    assert model.mamba.intermediate_size == 2_048
    assert _plan(config).block_size == 1_152


def test_falcon_h1_without_d_ssm_takes_the_config_class_default() -> None:
    """No mamba_d_ssm: transformers' (and SGLang's) FalconH1Config default, 1,024, as vLLM
    reads it; with the synthetic config's 24 heads of 64 that is refused by the head check,
    so with 16 heads of ``auto`` (1,024 / 16 = 64) it plans."""
    with pytest.raises(InvalidArgument, match=r"is not the Mamba intermediate size 1,024"):
        read_vllm_model(_config(FALCON, mamba_d_ssm=...))
    model = read_vllm_model(_config(FALCON, mamba_d_ssm=..., mamba_n_heads=16,
                                    mamba_d_head="auto"))
    assert model.mamba is not None and model.mamba.intermediate_size == 1_024
    assert model.mamba.head_dim == 64


@pytest.mark.parametrize(("change", "words"), [
    ({"mamba_d_head": 32}, r"24 x 32\) is not the Mamba intermediate size 1,536"),
    ({"mamba_n_groups": None}, "mamba_n_groups must be a positive integer"),
])
def test_bad_falcon_h1_configs_are_refused_by_field(change: dict[str, Any],
                                                    words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        read_vllm_model(_config(FALCON, **change))


def test_granite_layers_by_layer_types() -> None:
    model = read_vllm_model(_config(GRANITE))
    full = [layer.index for layer in model.layers if layer.kind is LayerKind.full]
    assert full == [5, 15, 25, 35] and model.head_size == 128
    assert model.decided_by == ("architectures", "layer_types")
    plan = _plan(_config(GRANITE))
    assert (plan.block_size, plan.num_blocks, len(plan.groups)) == (512, 1_024, 10)
    assert plan.max_concurrency == pytest.approx(1_024 / 31)
    assert plan.groups[0].layer_names[0] == "model.layers.0.mixer"
    assert plan.groups[-1].layer_names == tuple(
        f"model.layers.{i}.self_attn.attn" for i in full)


def test_granite_all_attention_is_not_hybrid() -> None:
    """Granite-4.0-Micro: every layer attention, so vLLM's ModelConfig.is_hybrid is false: no
    state, no block alignment."""
    model = read_vllm_model(_config("granite-4.0-micro"))
    assert model.mamba is None and not model.has_state
    plan = _plan(_config("granite-4.0-micro"))
    assert plan.block_size == 128 and len(plan.groups) == 1


@pytest.mark.parametrize(("change", "words"), [
    ({"layer_types": ["mamba"] * 39 + ["sliding_attention"]}, "'sliding_attention' at layer 39"),
    ({"layer_types": ["mamba", "attention"]}, r"num_hidden_layers \(40\)"),
    ({"head_dim": 64}, "head_dim 64 is not hidden_size / num_attention_heads"),
])
def test_bad_granite_configs_are_refused_by_field(change: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        read_vllm_model(_config(GRANITE, **change))


def test_other_mamba_hybrids_are_still_refused_by_name() -> None:
    bamba = {"architectures": ["BambaForCausalLM"], "model_type": "bamba",
             "num_hidden_layers": 2, "hidden_size": 1536, "num_attention_heads": 12,
             "num_key_value_heads": 4, "mamba_d_state": 128}
    with pytest.raises(InvalidArgument, match="mamba_d_state") as info:
        read_vllm_model(bamba)
    assert "model_type nemotron_h, jamba, falcon_h1, granitemoehybrid" in str(info.value)

"""The loaders the architecture table chooses: DSA variants, Mamba2 and gated-delta-net hybrids,
per-layer-type geometry, quantization-implied KV dtype, transformers-5 rope parameters, config
key aliases and lenient JSON. Configs are small dicts shaped like the real checkpoints'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.limits import MAX_CONFIG_CHARS
from kvpool.contract.spec import MHAAttention, MLAAttention, ModelDType
from kvpoold.hf import kv_quant_fp8, load_model_config, parse_config_json, spec_from_hf
from kvpoold.sizing import make_options, plan

GiB = 1 << 30


def mla_config(arch: str, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": [arch], "num_hidden_layers": 4, "num_attention_heads": 16,
        "hidden_size": 2048, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }
    cfg.update(over)
    return cfg


# ---- DSA variants ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["GlmMoeDsaForCausalLM", "MistralLarge3ForCausalLM",
                                  "LongcatFlashForCausalLM", "DeepseekV3ForCausalLM"])
def test_a_dsa_class_with_index_topk_gets_the_indexer(arch: str):
    spec, source = spec_from_hf(mla_config(arch, index_topk=2048, index_head_dim=128))
    assert source == "hf_config"
    assert spec.indexer is not None and spec.indexer.index_head_dim == 128
    assert spec.attention == MLAAttention(kv_lora_rank=512, qk_rope_head_dim=64)


def test_the_same_class_without_index_topk_is_plain_mla():
    spec, _ = spec_from_hf(mla_config("DeepseekV3ForCausalLM"))
    assert spec.indexer is None and isinstance(spec.attention, MLAAttention)


def test_an_mla_class_outside_the_dsa_list_ignores_index_topk():
    spec, _ = spec_from_hf(mla_config("KimiK25ForConditionalGeneration", index_topk=2048))
    assert spec.indexer is None


def test_pixtral_is_mla_only_with_kv_lora_rank():
    """SGLang's MLA branch takes Pixtral only when its text config has kv_lora_rank."""
    mha = {"architectures": ["PixtralForConditionalGeneration"], "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
           "max_position_embeddings": 4096}
    assert isinstance(spec_from_hf(mha)[0].attention, MHAAttention)
    spec, _ = spec_from_hf(mla_config("PixtralForConditionalGeneration", index_topk=64))
    assert spec.indexer is not None


def test_dsa_cell_is_latent_plus_132_byte_indexer_and_656_under_fp8():
    """576 latent bf16 = 1,152 B + 132 B indexer per layer; fp8: 656 + 132."""
    spec, _ = spec_from_hf(mla_config("GlmMoeDsaForCausalLM", index_topk=2048))
    bf16 = plan(spec, make_options(budget_bytes=GiB, page_size=64))
    assert (bf16.architecture, bf16.cell_size_bytes) == ("dsa", (1152 + 132) * 4)
    fp8 = plan(spec, make_options(budget_bytes=GiB, page_size=64, kv_cache_dtype="fp8_e4m3"))
    assert fp8.cell_size_bytes == (656 + 132) * 4


def test_dsa_auto_kv_is_bfloat16_whatever_the_quantization_says():
    """SGLang's DSA override turns `auto` into bfloat16 before Blackwell, even for a ModelOpt
    checkpoint whose kv_cache_scheme is fp8 (GLM-5.1 NVFP4); fp8 when asked."""
    quant = {"quant_method": "modelopt", "quant_algo": "NVFP4",
             "kv_cache_scheme": {"type": "float", "num_bits": 8}}
    spec, _ = spec_from_hf(mla_config("GlmMoeDsaForCausalLM", index_topk=2048,
                                      quantization_config=quant))
    assert spec.kv_cache_quant_fp8
    p = plan(spec, make_options(budget_bytes=GiB, page_size=64))
    assert p.kv_cache_dtype == "bfloat16"
    assert any(n.startswith("kv cache dtype bfloat16") for n in p.notes)
    asked = plan(spec, make_options(budget_bytes=GiB, page_size=64, kv_cache_dtype="fp8_e4m3"))
    assert asked.kv_cache_dtype == "fp8_e4m3"


def test_dsa_forces_page_size_64_as_sglang_does():
    spec, _ = spec_from_hf(mla_config("DeepseekV32ForCausalLM", index_topk=2048))
    p = plan(spec, make_options(budget_bytes=GiB))
    assert p.page_size == 64
    assert any("page size 64" in n for n in p.notes)


# ---- DeepSeek-V4 ----------------------------------------------------------------------------


def test_deepseek_v4_reads_compress_ratios_and_its_window():
    """DeepSeek-V4-Flash's shape, cut to 4 layers: the HF list's trailing MTP ratio is dropped;
    nope = head_dim 512 - rope 64 = 448; fp8 KV (SGLang's DSV4 default)."""
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 4,
           "head_dim": 512, "qk_rope_head_dim": 64, "index_head_dim": 128,
           "sliding_window": 128, "compress_ratios": [0, 4, 128, 4, 0],
           "num_attention_heads": 64, "num_key_value_heads": 1, "hidden_size": 4096,
           "max_position_embeddings": 65536, "num_nextn_predict_layers": 1,
           "torch_dtype": "bfloat16"}
    spec, _ = spec_from_hf(cfg)
    assert spec.dsv4 is not None and spec.dsv4.compress_ratios == (0, 4, 128, 4)
    assert (spec.dsv4.window_size, spec.dsv4.nope_head_dim, spec.dsv4.rope_head_dim) == (
        128, 448, 64)
    assert spec.kv_cache_quant_fp8
    p = plan(spec, make_options(budget_bytes=4 * GiB, page_size=256))
    assert (p.architecture, p.kv_cache_dtype) == ("dsv4", "fp8_e4m3")


# ---- gated delta net through text_config (Qwen3.5) ---------------------------------------------


def qwen35(**text_over: Any) -> dict[str, Any]:
    text = {
        "model_type": "qwen3_5_text", "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048,
        "max_position_embeddings": 262144,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                        "full_attention"] * 2,
        "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    }
    text.update(text_over)
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "torch_dtype": "bfloat16", "text_config": text, "vision_config": {"depth": 2}}


def test_qwen35_layer_types_in_text_config_give_a_state_pool():
    spec, source = spec_from_hf(qwen35())
    assert source == "hf_config"
    assert spec.linear is not None
    assert spec.linear.full_attention_layers == (3, 7)
    assert spec.linear.state_layer_ids(spec.num_layers) == (0, 1, 2, 4, 5, 6)
    p = plan(spec, make_options(budget_bytes=4 * GiB))
    assert p.architecture == "hybrid_linear" and p.mamba_cache_size


# ---- Mamba2 hybrids ----------------------------------------------------------------------------


def nemotron_h(**over: Any) -> dict[str, Any]:
    """Nemotron-H-8B's shape, 12 layers: M Mamba2, * attention, - MLP."""
    cfg: dict[str, Any] = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-M*-M-M*-M", "num_hidden_layers": 52,
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
        "ssm_state_size": 128, "conv_kernel": 4, "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }
    cfg.update(over)
    return cfg


def test_nemotron_h_pattern_gives_attention_and_mamba_layers():
    spec, _ = spec_from_hf(nemotron_h())
    assert spec.num_layers == 11  # the pattern's length, not num_hidden_layers
    assert spec.linear is not None
    assert spec.linear.full_attention_layers == (3, 8)
    assert spec.linear.state_layers == (0, 2, 5, 7, 10)
    assert (spec.linear.num_key_heads, spec.linear.key_head_dim) == (8, 128)
    assert (spec.linear.num_value_heads, spec.linear.value_head_dim) == (128, 64)


def test_nemotron_h_state_buffers_only_in_mamba_layers():
    """Per slot and Mamba layer: conv (8192 + 2*8*128 = 10,240, 3) bf16 = 61,440 B, ssm
    (128, 64, 128) fp32 = 4,194,304 B; the MLP layers hold nothing."""
    spec, _ = spec_from_hf(nemotron_h())
    p = plan(spec, make_options(budget_bytes=8 * GiB))
    conv = [b for b in p.buffers if b.name.startswith("conv.")]
    assert [b.name for b in conv] == ["conv.0", "conv.2", "conv.5", "conv.7", "conv.10"]
    assert tuple(conv[0].shape[1:]) == (10_240, 3)
    ssm = next(b for b in p.buffers if b.name == "ssm.0")
    assert tuple(ssm.shape[1:]) == (128, 64, 128)
    assert {b.name for b in p.buffers if b.name.startswith("k.")} == {"k.3", "k.8"}


def test_nemotron_h_layers_block_type_wins_over_the_pattern():
    cfg = nemotron_h(layers_block_type=["mamba", "attention", "moe", "mamba"])
    spec, _ = spec_from_hf(cfg)
    assert spec.num_layers == 4 and spec.linear is not None
    assert spec.linear.full_attention_layers == (1,)
    assert spec.linear.state_layers == (0, 3)


def test_nemotron_h_bad_pattern_letter_is_named():
    with pytest.raises(InvalidArgument, match="hybrid_override_pattern has 'X'"):
        spec_from_hf(nemotron_h(hybrid_override_pattern="M*X"))


def test_granite_hybrid_reads_layer_types_and_its_mamba_keys():
    cfg = {"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 4,
           "layer_types": ["mamba", "mamba", "mamba", "attention"], "hidden_size": 1536,
           "num_attention_heads": 12, "num_key_value_heads": 4, "mamba_n_heads": 48,
           "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4,
           "mamba_expand": 2, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
    spec, _ = spec_from_hf(cfg)
    assert spec.linear is not None
    assert spec.linear.full_attention_layers == (3,)
    assert spec.linear.state_layers == (0, 1, 2)


@pytest.mark.parametrize(("types", "attention", "state"), [
    # transformers >= 5.15's names, which SGLang's GraniteMoeHybridConfig reads as its own
    (["linear_attention", "full_attention", "linear_attention", "linear_attention"], (1,),
     (0, 2, 3, 4, 5, 6)),
    # absent: SGLang's default, attention where (i + 1) % 6 == 0
    (None, (5,), (0, 1, 2, 3, 4, 6)),
])
def test_granite_hybrid_layer_types_as_sglang_names_them(
        types: list[str] | None, attention: tuple[int, ...], state: tuple[int, ...]) -> None:
    cfg = {"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 7,
           "hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 4,
           "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
           "mamba_d_conv": 4, "mamba_expand": 2, "torch_dtype": "bfloat16"}
    if types is not None:
        cfg["layer_types"] = types + ["linear_attention"] * 3
    spec, _ = spec_from_hf(cfg)
    assert spec.linear is not None
    assert spec.linear.full_attention_layers == attention
    assert spec.linear.state_layers == state


def test_falcon_h1_has_attention_and_mamba_in_every_layer():
    cfg = {"architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": 3,
           "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 64, "mamba_n_heads": 32, "mamba_d_head": 64, "mamba_n_groups": 1,
           "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_d_ssm": 2048,
           "max_position_embeddings": 16384, "torch_dtype": "bfloat16"}
    spec, _ = spec_from_hf(cfg)
    assert spec.linear is not None
    assert spec.linear.full_attention_layers == spec.linear.state_layers == (0, 1, 2)
    p = plan(spec, make_options(budget_bytes=4 * GiB))
    names = {b.name for b in p.buffers}
    assert {"k.0", "conv.0", "ssm.0"} <= names


def test_falcon_h1_without_d_ssm_reads_the_config_class_default():
    """No mamba_d_ssm: FalconH1Config's 1,024 (SGLang's class and transformers' alike), not
    expand x hidden (that is what a null one means)."""
    base = {"architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": 3,
            "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 64, "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4,
            "mamba_expand": 2, "max_position_embeddings": 16384, "torch_dtype": "bfloat16"}
    spec, _ = spec_from_hf({**base, "mamba_n_heads": 16, "mamba_d_head": 64})
    assert spec.linear is not None and spec.linear.num_value_heads == 16
    with pytest.raises(InvalidArgument, match="1,024 is not heads x head dim"):
        spec_from_hf({**base, "mamba_n_heads": 32, "mamba_d_head": 64})
    spec, _ = spec_from_hf({**base, "mamba_n_heads": 32, "mamba_d_head": 64,
                            "mamba_d_ssm": None})  # null: 2 x 1,024
    assert spec.linear is not None and spec.linear.num_value_heads == 32


def test_a_mamba2_hybrid_without_its_state_keys_is_refused():
    cfg = nemotron_h()
    del cfg["mamba_num_heads"]
    with pytest.raises(InvalidArgument, match="needs its state geometry"):
        spec_from_hf(cfg)


# ---- per-layer-type geometry -------------------------------------------------------------------


def gemma4(**text_over: Any) -> dict[str, Any]:
    text = {"model_type": "gemma4_text", "num_hidden_layers": 6, "hidden_size": 2816,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
            "num_global_key_value_heads": 2, "global_head_dim": 512, "sliding_window": 1024,
            "max_position_embeddings": 262144,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    text.update(text_over)
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "torch_dtype": "bfloat16", "text_config": text}


def test_gemma4_full_layers_take_the_global_geometry():
    spec, _ = spec_from_hf(gemma4())
    assert spec.attention == MHAAttention(num_kv_heads=2, head_dim=512)
    sw = spec.sliding_window
    assert sw is not None and sw.layers == (0, 1, 2, 3, 4) and sw.window == 1023
    assert (sw.num_kv_heads, sw.head_dim) == (8, 256)


def test_gemma4_without_global_keys_has_one_geometry():
    text = {k: v for k, v in gemma4()["text_config"].items()
            if k not in ("num_global_key_value_heads", "global_head_dim")}
    spec, _ = spec_from_hf({**gemma4(), "text_config": text})
    assert spec.attention == MHAAttention(num_kv_heads=8, head_dim=256)
    assert spec.sliding_window is not None and spec.sliding_window.num_kv_heads is None


def test_swa_keys_give_the_swa_layers_their_geometry_and_v_head_dim_is_read():
    """MiMo-V2-Flash: full 4 KV heads of 192 (V 128), SWA 8 KV heads of 192 (V 128)."""
    cfg = {"architectures": ["MiMoV2FlashForCausalLM"], "num_hidden_layers": 4,
           "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 4,
           "head_dim": 192, "v_head_dim": 128, "swa_num_key_value_heads": 8,
           "swa_head_dim": 192, "swa_v_head_dim": 128, "sliding_window": 128,
           "hybrid_layer_pattern": [0, 1, 1, 1], "max_position_embeddings": 262144,
           "torch_dtype": "bfloat16"}
    spec, _ = spec_from_hf(cfg)
    assert spec.attention == MHAAttention(num_kv_heads=4, head_dim=192, v_head_dim=128)
    sw = spec.sliding_window
    assert sw is not None and (sw.num_kv_heads, sw.head_dim, sw.v_head_dim) == (8, 192, 128)


# ---- KV dtype implied by quantization ----------------------------------------------------------


@pytest.mark.parametrize(("quant", "fp8"), [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4",
      "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False}}, True),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, True),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, False),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": "FP8"}, True),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": "FP8"}, False),
    ({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}, True),
    ({"quant_method": "compressed-tensors",
      "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor",
                          "symmetric": True, "dynamic": False}}, True),
    ({"quant_method": "compressed-tensors",
      "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor",
                          "dynamic": True}}, False),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": None}, False),
    ({"quant_method": "fp8", "kv_cache_quant_algo": "fp8"}, True),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, False),
    (None, False),
])
def test_quantization_implies_fp8_kv(quant: Any, fp8: bool):
    assert kv_quant_fp8(quant) is fp8


def test_quantized_kv_flows_into_the_plan():
    cfg = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 512,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
           "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": {
               "type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}}}
    spec, _ = spec_from_hf(cfg)
    assert plan(spec, make_options(budget_bytes=GiB)).kv_cache_dtype == "fp8_e4m3"


# ---- rope parameters, key aliases, special KV head rules ---------------------------------------


def test_transformers5_rope_parameters_scale_the_context():
    cfg = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 512,
           "num_attention_heads": 8, "max_position_embeddings": 32768,
           "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}
    assert spec_from_hf(cfg)[0].context_length == 131072


def test_gpt_bigcode_keys_are_read_through_their_aliases():
    cfg = {"architectures": ["GPTBigCodeForCausalLM"], "n_layer": 24, "n_head": 16,
           "n_embd": 2048, "n_positions": 2048, "multi_query": True}
    spec, _ = spec_from_hf(cfg)
    assert (spec.num_layers, spec.context_length) == (24, 2048)
    assert spec.attention == MHAAttention(num_kv_heads=1, head_dim=128)


def test_a_llama_text_config_takes_llamaconfig_defaults():
    """LLaVA-1.5's text_config states only max_position_embeddings and the vocabulary."""
    cfg = {"architectures": ["LlavaForConditionalGeneration"],
           "text_config": {"model_type": "llama", "max_position_embeddings": 4096,
                           "torch_dtype": "float16"}}
    spec, _ = spec_from_hf(cfg)
    assert (spec.num_layers, spec.context_length, spec.dtype) == (32, 4096, ModelDType.float16)
    assert spec.attention == MHAAttention(num_kv_heads=32, head_dim=128)


def test_nemotron_nas_kv_heads_come_from_block_configs():
    block = {"attention": {"n_heads_in_group": 8, "no_op": False}}
    cfg = {"architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas",
           "num_hidden_layers": 3, "hidden_size": 8192, "num_attention_heads": 64,
           "max_position_embeddings": 131072,
           "block_configs": [block, {"attention": {"no_op": True}}, block]}
    assert spec_from_hf(cfg)[0].attention == MHAAttention(num_kv_heads=8, head_dim=128)
    cfg["block_configs"][1] = {"attention": {"n_heads_in_group": 4, "no_op": False}}
    with pytest.raises(InvalidArgument, match="variable GQA"):
        spec_from_hf(cfg)


def test_step3_num_attention_groups_are_kv_heads():
    cfg = {"architectures": ["Step3VLForConditionalGeneration"], "num_hidden_layers": 2,
           "hidden_size": 7168, "num_attention_heads": 64, "num_attention_groups": 1,
           "head_dim": 256, "max_position_embeddings": 65536}
    assert spec_from_hf(cfg)[0].attention == MHAAttention(num_kv_heads=1, head_dim=256)


# ---- lenient, bounded JSON ---------------------------------------------------------------------


def test_infinity_and_nan_are_accepted(tmp_path: Path):
    text = json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                       "hidden_size": 512, "num_attention_heads": 8,
                       "max_position_embeddings": 4096, "torch_dtype": "bfloat16"})
    text = text[:-1] + ', "router_aux_loss_coef": Infinity, "x": -Infinity, "y": NaN}'
    path = tmp_path / "config.json"
    path.write_text(text)
    spec, _ = load_model_config(path)
    assert spec.num_layers == 2


@pytest.mark.parametrize(("raw", "needle"), [
    (b'{"a": Infinit}', "not valid JSON: Expecting value at line 1 column 7"),
    (b"[1, 2]", "holds a JSON list, expected an object"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nests too deep"),
    (b" " * (MAX_CONFIG_CHARS + 1), "at most"),
])
def test_garbage_is_refused_with_a_clear_message(raw: bytes, needle: str):
    with pytest.raises(InvalidArgument, match="config") as err:
        parse_config_json(raw, "model config x.json")
    assert needle in str(err.value)
    assert err.value.field == "model_config"


# ---- multimodal reservation --------------------------------------------------------------------


def llava(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["LlavaForConditionalGeneration"], "torch_dtype": "float16",
        "text_config": {"model_type": "llama", "num_hidden_layers": 2,
                        "max_position_embeddings": 4096}}
    cfg.update(over)
    return cfg


def test_a_multimodal_model_reserves_sglangs_100_mib_vlm_cache():
    """SGLang takes SGLANG_VLM_CACHE_SIZE_MB (100 MiB) off the KV budget of a multimodal
    model: LLaVA with 2 layers of 32 x 128 fp16 = 32 KiB per token."""
    spec, _ = spec_from_hf(llava())
    assert spec.multimodal
    p = plan(spec, make_options(budget_bytes=GiB))
    assert p.max_total_num_tokens == (GiB - (100 << 20)) // (2 * 2 * 32 * 128 * 2)
    assert p.budget_bytes == GiB
    assert any("multimodal embedding cache" in n for n in p.notes)


@pytest.mark.parametrize(("cfg", "multimodal"), [
    ({"language_model_only": True}, False),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, False),  # SGLang turns it off
    ({"architectures": ["Qwen3VLForConditionalGeneration"]}, True),
])
def test_multimodal_follows_sglangs_rule(cfg: dict[str, Any], multimodal: bool):
    spec, _ = spec_from_hf(llava(**cfg))
    assert spec.multimodal is multimodal


def test_a_text_model_reserves_nothing():
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 512,
           "num_attention_heads": 8, "max_position_embeddings": 4096}
    spec, _ = spec_from_hf(cfg)
    assert not spec.multimodal
    assert not any("multimodal" in n for n in plan(spec, make_options(budget_bytes=GiB)).notes)

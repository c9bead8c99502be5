"""Hugging Face config.json -> ModelSpec: the shared model configs, each loading rule, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.spec import MHAAttention, MLAAttention, ModelDType
from kvpoold.hf import (
    FAMILY_LOADERS,
    HYBRID_SWA,
    load_model,
    load_model_config,
    spec_from_hf,
)
from kvpoold.sizing import architectures

MODELS = Path(__file__).resolve().parents[1] / "data" / "models"


def llama(**over: Any) -> dict[str, Any]:
    """A small Llama-shaped config: 4 layers, 8 heads of 64 (hidden 512), 2 KV heads."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    cfg.update(over)
    return cfg


def with_arch(arch: str, **over: Any) -> dict[str, Any]:
    return llama(architectures=[arch], **over)


def sliding_layers(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    spec, _ = spec_from_hf(cfg)
    return None if spec.sliding_window is None else spec.sliding_window.layers


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


# ---- the shared model configs -------------------------------------------------------------------


def test_llama_31_8b():
    """32 layers; no head_dim, so 4096 hidden / 32 heads = 128; 8 KV heads; context 131,072;
    torch_dtype bfloat16; no sliding window, no MTP, no FP8 KV."""
    spec, source = load_model_config(MODELS / "llama-3.1-8b-instruct.json")
    assert source == "hf_config"
    assert spec.architecture == "LlamaForCausalLM"
    assert spec.num_layers == 32
    assert spec.attention == MHAAttention(num_kv_heads=8, head_dim=128)
    assert spec.context_length == 131_072
    assert spec.dtype is ModelDType.bfloat16
    assert spec.sliding_window is None and spec.linear is None and spec.indexer is None
    assert spec.num_nextn_predict_layers == 0
    assert not spec.kv_cache_quant_fp8


def test_qwen3_8b():
    """36 layers, explicit head_dim 128 (here equal to 4096 / 32), 8 KV heads, context 40,960;
    use_sliding_window false and sliding_window null: no sliding window despite
    max_window_layers 36."""
    spec, source = load_model_config(MODELS / "qwen3-8b.json")
    assert source == "hf_config"
    assert spec.num_layers == 36
    assert spec.attention == MHAAttention(num_kv_heads=8, head_dim=128)
    assert spec.context_length == 40_960
    assert spec.sliding_window is None


def test_deepseek_v3():
    """MLA: kv_lora_rank 512 + qk_rope_head_dim 64; 61 layers; 1 NextN layer carried; context
    163,840; quant_method fp8 weights but no kv_cache_quant_algo, so the KV stays bf16."""
    spec, source = load_model_config(MODELS / "deepseek-v3.json")
    assert source == "hf_config"
    assert spec.attention == MLAAttention(kv_lora_rank=512, qk_rope_head_dim=64)
    assert spec.num_layers == 61
    assert spec.num_nextn_predict_layers == 1
    assert spec.context_length == 163_840
    assert spec.indexer is None
    assert not spec.kv_cache_quant_fp8
    assert spec.dtype is ModelDType.bfloat16


def test_deepseek_v32():
    """DeepSeek-V3 geometry plus the DSA indexer with index_head_dim 128."""
    spec, _ = load_model_config(MODELS / "deepseek-v3.2-exp.json")
    assert spec.architecture == "DeepseekV32ForCausalLM"
    assert spec.attention == MLAAttention(kv_lora_rank=512, qk_rope_head_dim=64)
    assert spec.indexer is not None and spec.indexer.index_head_dim == 128
    assert spec.num_nextn_predict_layers == 1


def test_gpt_oss_20b():
    """head_dim 64 given explicitly wins over 2880 / 64 = 45; 8 KV heads; 24 layers whose
    layer_types alternate sliding/full starting with sliding: layers 0, 2, ..., 22 slide, window
    128; no torch_dtype in the file, so bfloat16."""
    spec, _ = load_model_config(MODELS / "gpt-oss-20b.json")
    assert spec.attention == MHAAttention(num_kv_heads=8, head_dim=64)
    assert spec.num_layers == 24
    assert spec.sliding_window is not None
    assert spec.sliding_window.window == 127  # SGLang: HF window - 1
    assert spec.sliding_window.layers == tuple(range(0, 24, 2))
    assert spec.dtype is ModelDType.bfloat16
    assert spec.context_length == 131_072


def test_qwen3_next():
    """48 layers, full_attention_interval 4: full where (i + 1) % 4 == 0 -> 3, 7, ..., 47 (12
    layers), the other 36 linear. Full layers: 2 KV heads of 256. Linear: conv kernel 4, 16 key
    heads and 32 value heads of 128."""
    spec, _ = load_model_config(MODELS / "qwen3-next-80b-a3b-instruct.json")
    assert spec.attention == MHAAttention(num_kv_heads=2, head_dim=256)
    assert spec.context_length == 262_144
    assert spec.linear is not None
    assert spec.linear.full_attention_layers == tuple(range(3, 48, 4))
    assert len(spec.linear.full_attention_layers) == 12
    assert (spec.linear.conv_kernel, spec.linear.num_key_heads, spec.linear.num_value_heads,
            spec.linear.key_head_dim, spec.linear.value_head_dim) == (4, 16, 32, 128, 128)
    assert spec.linear.ssm_dtype is ModelDType.float32
    assert spec.sliding_window is None


# ---- rules, each on a small synthetic config ----------------------------------------------------


def test_explicit_head_dim_wins():
    """hidden 512 / 8 heads would be 64; head_dim 96 is used instead."""
    spec, _ = spec_from_hf(llama(head_dim=96))
    assert spec.attention == MHAAttention(num_kv_heads=2, head_dim=96)


def test_head_dim_from_hidden_size():
    spec, _ = spec_from_hf(llama())
    assert spec.attention == MHAAttention(num_kv_heads=2, head_dim=64)


def test_hidden_size_not_divisible_without_head_dim_is_rejected():
    with pytest.raises(InvalidArgument, match="head_dim"):
        spec_from_hf(llama(hidden_size=500))


@pytest.mark.parametrize("kv", [None, "absent"])
def test_kv_heads_default_to_attention_heads(kv: str | None):
    cfg = llama()
    if kv is None:
        cfg["num_key_value_heads"] = None
    else:
        del cfg["num_key_value_heads"]
    spec, _ = spec_from_hf(cfg)
    assert spec.attention == MHAAttention(num_kv_heads=8, head_dim=64)


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                                  "LlamaForCausalLM"])
def test_models_off_the_hybrid_swa_allowlist_get_a_full_attention_pool(arch: str):
    """SGLang applies their window in attention only: a window, layer_types and
    use_sliding_window do not make a sliding-window pool."""
    types = ["sliding_attention", "full_attention"] * 2
    cfg = with_arch(arch, sliding_window=4096, use_sliding_window=True, layer_types=types,
                    sliding_window_pattern=2, max_window_layers=1)
    assert sliding_layers(cfg) is None


def test_gpt_oss_layer_types_decide_which_layers_slide():
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    cfg = with_arch("GptOssForCausalLM", sliding_window=512, layer_types=types)
    assert sliding_layers(cfg) == (1, 2)
    spec, _ = spec_from_hf(cfg)
    assert spec.sliding_window is not None and spec.sliding_window.window == 511


def test_an_allowlisted_model_whose_layers_all_slide_gets_an_swa_only_pool():
    cfg = with_arch("GptOssForCausalLM", sliding_window=128, layer_types=["sliding_attention"] * 4)
    assert sliding_layers(cfg) == (0, 1, 2, 3)
    from kvpoold.sizing import make_options, plan

    p = plan(spec_from_hf(cfg)[0], make_options(budget_bytes=64 << 20, page_size=16))
    assert p.architecture == "all_swa" and p.full_max_total_num_tokens is None


def test_layer_types_must_cover_the_layers_and_name_known_kinds():
    with pytest.raises(InvalidArgument, match="layer_types"):
        spec_from_hf(with_arch("GptOssForCausalLM", sliding_window=8,
                               layer_types=["full_attention"]))
    with pytest.raises(InvalidArgument, match=r"chunked_attention.*accepted"):
        spec_from_hf(with_arch("GptOssForCausalLM", sliding_window=8,
                               layer_types=["chunked_attention"] * 4))
    with pytest.raises(InvalidArgument, match="layer_types is missing"):
        spec_from_hf(with_arch("GptOssForCausalLM", sliding_window=8))


def test_llama4_slides_on_three_of_every_four_layers_over_its_attention_chunk():
    cfg = {"architectures": ["Llama4ForConditionalGeneration"], "torch_dtype": "bfloat16",
           "text_config": {"num_hidden_layers": 8, "num_attention_heads": 40,
                           "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120,
                           "max_position_embeddings": 10485760, "attention_chunk_size": 8192,
                           "model_type": "llama4_text"}}
    spec, _ = spec_from_hf(cfg)
    assert spec.sliding_window is not None
    assert spec.sliding_window.layers == (0, 1, 2, 4, 5, 6)
    assert spec.sliding_window.window == 8192


def test_is_hybrid_swa_opt_in_reads_hybrid_layer_pattern():
    cfg = with_arch("MyHybridForCausalLM", is_hybrid_swa=True, sliding_window=64,
                    hybrid_layer_pattern=[1, 0, 1, 1])
    spec, source = spec_from_hf(cfg, assume="mha")
    assert source == "assumed"
    assert spec.sliding_window is not None and spec.sliding_window.layers == (0, 2, 3)


def test_gemma3_conditional_generation_reads_text_config():
    """gemma-3-4b-it style: the text_config lists only what differs from Gemma3TextConfig
    (34 layers, hidden 2560, window 1024); heads 8, KV heads 4, head_dim 256 and context
    131,072 are the class defaults; torch_dtype is at the top level. No SWA pool (Gemma-3 is
    not on SGLang's allowlist)."""
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "torch_dtype": "bfloat16",
        "text_config": {"hidden_size": 2560, "num_hidden_layers": 34, "sliding_window": 1024,
                        "model_type": "gemma3_text"},
        "vision_config": {"hidden_size": 1152},
    }
    spec, source = spec_from_hf(cfg)
    assert source == "hf_config"
    assert spec.num_layers == 34
    assert spec.attention == MHAAttention(num_kv_heads=4, head_dim=256)
    assert spec.context_length == 131_072
    assert spec.sliding_window is None
    assert spec.dtype is ModelDType.bfloat16


@pytest.mark.parametrize("key", ["text_config", "llm_config", "language_config"])
def test_a_nested_text_config_is_read_and_inherits_the_parents_dtype(key: str):
    text = {k: v for k, v in llama().items() if k not in ("architectures", "torch_dtype")}
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "torch_dtype": "bfloat16",
           key: {**text, "num_hidden_layers": 6}}
    spec, source = spec_from_hf(cfg)
    assert (source, spec.num_layers, spec.dtype) == ("hf_config", 6, ModelDType.bfloat16)


def test_thinker_config_wins_and_its_text_config_is_the_model():
    text = {k: v for k, v in llama().items() if k not in ("architectures", "torch_dtype")}
    cfg = {"architectures": ["Qwen3OmniMoeForConditionalGeneration"],
           "text_config": {**text, "num_hidden_layers": 2},
           "thinker_config": {"torch_dtype": "float16",
                              "text_config": {**text, "num_hidden_layers": 5}}}
    spec, _ = spec_from_hf(cfg)
    assert (spec.num_layers, spec.dtype) == (5, ModelDType.float16)


def test_a_wrapper_is_classified_by_its_own_class_and_read_through_its_text_config():
    """LLaVA: SGLang's registry has the wrapper (an MHA row); its KV geometry is the
    text_config's."""
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "torch_dtype": "float16",
           "text_config": llama()}
    spec, source = spec_from_hf(cfg)
    assert source == "hf_config" and spec.architecture == "LlavaForConditionalGeneration"
    assert spec.attention == MHAAttention(num_kv_heads=2, head_dim=64)


def test_an_unknown_wrapper_around_a_known_text_class_uses_the_text_class():
    cfg = {"architectures": ["FooVLForConditionalGeneration"], "text_config": llama()}
    spec, source = spec_from_hf(cfg)
    assert source == "hf_config" and spec.architecture == "LlamaForCausalLM"


def test_multi_query_means_one_kv_head():
    assert spec_from_hf(llama(multi_query=True))[0].attention == MHAAttention(1, 64)
    # Falcon's new decoder architecture ignores multi_query and reads its KV head count
    cfg = llama(model_type="falcon", multi_query=True,
                new_decoder_architecture=True, num_kv_heads=4)
    del cfg["num_key_value_heads"]
    assert spec_from_hf(cfg)[0].attention == MHAAttention(4, 64)
    # SGLang's exception is Falcon's alone: another model type stays multi-query
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    assert spec_from_hf(cfg)[0].attention == MHAAttention(1, 64)
    # FalconConfig's default is multi_query: true, so a Falcon config that omits it has one
    # KV head (transformers' class default, which both engines read)
    cfg = llama(model_type="falcon")
    del cfg["num_key_value_heads"]
    assert spec_from_hf(cfg)[0].attention == MHAAttention(1, 64)


def test_qwen3_next_layer_types_override_interval():
    cfg = json.loads((MODELS / "qwen3-next-80b-a3b-instruct.json").read_text())
    cfg["num_hidden_layers"] = 4
    cfg["layer_types"] = ["linear_attention", "full_attention", "linear_attention",
                          "full_attention"]
    spec, _ = spec_from_hf(cfg)
    assert spec.linear is not None and spec.linear.full_attention_layers == (1, 3)


def test_qwen3_next_mamba_ssm_dtype_carried():
    cfg = json.loads((MODELS / "qwen3-next-80b-a3b-instruct.json").read_text())
    cfg["mamba_ssm_dtype"] = "bfloat16"
    spec, _ = spec_from_hf(cfg)
    assert spec.linear is not None and spec.linear.ssm_dtype is ModelDType.bfloat16


@pytest.mark.parametrize(("over", "expected"), [
    ({"torch_dtype": "float16"}, ModelDType.float16),
    ({"torch_dtype": "bfloat16", "dtype": "float16"}, ModelDType.float16),  # dtype wins
    ({"torch_dtype": None, "dtype": "bfloat16"}, ModelDType.bfloat16),
    ({"torch_dtype": "float32"}, ModelDType.float16),  # served as float16
    ({"torch_dtype": "auto"}, ModelDType.float16),  # not a dtype name: float32 -> float16
    ({"torch_dtype": None}, ModelDType.float16),
    ({"torch_dtype": "int8"}, ModelDType.float16),
    ({"torch_dtype": "float32", "model_type": "gemma2"}, ModelDType.bfloat16),
    ({"torch_dtype": None, "model_type": "gemma3_text"}, ModelDType.bfloat16),
    ({"torch_dtype": "float16", "model_type": "gemma"}, ModelDType.float16),
])
def test_dtype_is_what_sglang_serves_with_dtype_auto(over: dict[str, Any],
                                                     expected: ModelDType):
    assert spec_from_hf(llama(**over))[0].dtype is expected


def test_gpt_oss_mxfp4_runs_in_bfloat16():
    cfg = json.loads((MODELS / "gpt-oss-20b.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    assert spec_from_hf(cfg)[0].dtype is ModelDType.bfloat16
    cfg["quantization_config"] = {"quant_method": "fp8"}
    assert spec_from_hf(cfg)[0].dtype is ModelDType.float16


@pytest.mark.parametrize(("over", "expected"), [
    ({}, 4096),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, 16384),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 1024}}, 4096),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 4096),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.5}}, 10240),
    ({"seq_length": 8192}, 8192),
    ({"max_sequence_length": 1000, "seq_length": 8192}, 1000),
    ({"max_position_embeddings": None}, 2048),
])
def test_context_length_as_sglang_derives_it(over: dict[str, Any], expected: int):
    assert spec_from_hf(llama(**over))[0].context_length == expected


def test_context_length_and_nextn_carried():
    spec, _ = spec_from_hf(llama(max_position_embeddings=777, num_nextn_predict_layers=2))
    assert spec.context_length == 777
    assert spec.num_nextn_predict_layers == 2


def test_kv_cache_quant_fp8():
    """ModelOpt checkpoints: quantization_config.kv_cache_quant_algo == "FP8" -> fp8 KV."""
    quant = {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}
    assert spec_from_hf(llama(quantization_config=quant))[0].kv_cache_quant_fp8
    assert not spec_from_hf(llama(quantization_config={"quant_method": "fp8"}))[0] \
        .kv_cache_quant_fp8


def test_dsa_index_head_dim_other_than_128_is_rejected():
    cfg = json.loads((MODELS / "deepseek-v3.2-exp.json").read_text())
    cfg["index_head_dim"] = 64
    with pytest.raises(InvalidArgument, match="index_head_dim"):
        spec_from_hf(cfg)


def test_deepseek_v2_is_mla():
    """DeepSeek-V2-Lite: 27 layers, kv_lora_rank 512, rope 64, q_lora_rank null."""
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "num_hidden_layers": 27,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "q_lora_rank": None,
           "max_position_embeddings": 163840, "num_attention_heads": 16}
    spec, _ = spec_from_hf(cfg)
    assert spec.attention == MLAAttention(kv_lora_rank=512, qk_rope_head_dim=64)


def test_every_family_sglang_builds_has_a_loader_or_a_reason():
    """Each family of the architecture table is read by a loader or refused with a reason."""
    families = set(architectures.counts())
    assert families <= set(FAMILY_LOADERS) | set(architectures.UNSUPPORTED)
    assert "GptOssForCausalLM" in HYBRID_SWA
    swa = {n for n, r in architectures.ROWS.items() if r[0] == "hybrid_swa"}
    assert set(HYBRID_SWA) <= swa


# ---- unknown architectures ---------------------------------------------------------------------


def test_unknown_architecture_is_refused_with_the_nearest_known_names():
    with pytest.raises(InvalidArgument) as err:
        spec_from_hf(with_arch("LlamaForCausalLMX"))
    msg = str(err.value)
    assert err.value.field == "model_config"
    assert "'LlamaForCausalLMX' is not in SGLang 0.5.23's model registry" in msg
    assert "nearest known: LlamaForCausalLM" in msg
    assert "--assume-architecture FAMILY (mha, mla, dsa, hybrid_swa" in msg


def test_assumed_mha_reads_the_standard_fields():
    spec, source = spec_from_hf(with_arch("FooForCausalLM"), assume="mha")
    assert source == "assumed"
    assert spec.architecture == "FooForCausalLM"
    assert spec.attention == MHAAttention(num_kv_heads=2, head_dim=64)
    assert spec.num_layers == 4


def test_assumed_with_head_dim_instead_of_hidden_size():
    cfg = with_arch("FooForCausalLM", head_dim=32)
    del cfg["hidden_size"]
    assert spec_from_hf(cfg, assume="mha")[0].attention == MHAAttention(num_kv_heads=2,
                                                                        head_dim=32)


def test_assumption_does_not_override_a_known_class():
    spec, source = spec_from_hf(llama(), assume="mla")
    assert source == "hf_config" and spec.attention == MHAAttention(num_kv_heads=2, head_dim=64)


def test_assumed_family_must_be_one_kvpool_reads():
    with pytest.raises(InvalidArgument, match="accepted: mha, mla, dsa") as err:
        spec_from_hf(with_arch("FooForCausalLM"), assume="dsv4")
    assert err.value.field == "assume_architecture"


def test_first_known_class_of_several_is_used():
    spec, source = spec_from_hf(llama(architectures=["FooModel", "LlamaForCausalLM"]))
    assert source == "hf_config" and spec.architecture == "LlamaForCausalLM"


def test_assumed_without_fields_names_the_missing_one():
    with pytest.raises(InvalidArgument, match="missing num_attention_heads") as err:
        spec_from_hf({"architectures": ["FooForCausalLM"], "num_hidden_layers": 2},
                     assume="mha")
    assert err.value.field == "model_config"


def test_a_known_family_kvpool_does_not_plan_is_refused_with_the_reason():
    # Kimi Linear's class without SGLang's Kimi Linear config class (model_type) behind it
    with pytest.raises(InvalidArgument, match="KimiLinearForCausalLM has model_type None: SGLang "
                                              "sizes Kimi delta attention only from its "
                                              "KimiLinearConfig"):
        spec_from_hf(with_arch("KimiLinearForCausalLM"))
    with pytest.raises(InvalidArgument, match="SGLang sizes MambaForCausalLM as mamba: a pure"):
        spec_from_hf(with_arch("MambaForCausalLM"))


def test_errors_blame_the_given_field():
    """The daemon passes its RPC field name; the CLI keeps the default ``model_config``."""
    with pytest.raises(InvalidArgument) as err:
        spec_from_hf({"architectures": ["X"]}, where="hf_config_json", field="hf_config_json")
    assert err.value.field == "hf_config_json"
    assert str(err.value).startswith("hf_config_json: ")
    with pytest.raises(InvalidArgument) as err:
        spec_from_hf(llama(num_hidden_layers=0), field="hf_config_json")
    assert err.value.field == "hf_config_json"


def test_no_architectures_and_no_fields():
    with pytest.raises(InvalidArgument, match="the config lists no architectures"):
        spec_from_hf({})


# ---- errors -------------------------------------------------------------------------------------


def test_known_architecture_missing_field_is_named():
    cfg = llama()
    del cfg["num_hidden_layers"]
    with pytest.raises(InvalidArgument, match="missing num_hidden_layers"):
        spec_from_hf(cfg)
    cfg = json.loads((MODELS / "deepseek-v3.json").read_text())
    del cfg["kv_lora_rank"]
    # DeepseekV3Config's default (512) fills it, as transformers does for both engines
    assert spec_from_hf(cfg)[0].attention.kv_lora_rank == 512  # type: ignore[union-attr]
    del cfg["model_type"]  # a class transformers does not know has no defaults
    with pytest.raises(InvalidArgument, match="missing kv_lora_rank"):
        spec_from_hf(cfg)


@pytest.mark.parametrize("bad", ["32", True, 3.5])
def test_mistyped_field_is_named(bad: object):
    with pytest.raises(InvalidArgument, match="num_hidden_layers must be an integer"):
        spec_from_hf(llama(num_hidden_layers=bad))


def test_out_of_range_value_comes_back_with_its_path():
    with pytest.raises(InvalidArgument, match=r"num_layers"):
        spec_from_hf(llama(num_hidden_layers=0))


def test_missing_file_names_the_path(tmp_path: Path):
    path = tmp_path / "nope.json"
    with pytest.raises(InvalidArgument, match=r"nope\.json"):
        load_model(path)
    with pytest.raises(InvalidArgument, match=r"nope\.json"):
        load_model_config(path)


def test_non_json_names_the_path(tmp_path: Path):
    path = write(tmp_path, "config.json", "{not json")
    with pytest.raises(InvalidArgument, match=re.escape(f"{path} is not valid JSON")):
        load_model(path)


def test_non_object_json_is_rejected(tmp_path: Path):
    path = write(tmp_path, "config.json", "[1, 2]")
    with pytest.raises(InvalidArgument, match="JSON list, expected an object"):
        load_model_config(path)


def test_error_messages_name_the_file(tmp_path: Path):
    path = write(tmp_path, "config.json", json.dumps({"architectures": ["X"]}))
    with pytest.raises(InvalidArgument, match=re.escape(str(path))):
        load_model(path)


def test_model_directory_means_its_config_json(tmp_path: Path):
    write(tmp_path, "config.json", json.dumps(llama()))
    spec, source = load_model(tmp_path)
    assert source == "hf_config" and spec.num_layers == 4


# ---- spec files ---------------------------------------------------------------------------------


def test_json_spec_file(tmp_path: Path):
    spec_json = {"num_layers": 2, "context_length": 1024,
                 "attention": {"type": "mha", "num_kv_heads": 1, "head_dim": 64}}
    spec, source = load_model(write(tmp_path, "spec.json", json.dumps(spec_json)))
    assert source == "spec"
    assert spec.attention == MHAAttention(num_kv_heads=1, head_dim=64)


def test_toml_spec_file(tmp_path: Path):
    text = ('num_layers = 3\ncontext_length = 2048\n\n[attention]\ntype = "mla"\n'
            "kv_lora_rank = 512\nqk_rope_head_dim = 64\n")
    spec, source = load_model(write(tmp_path, "spec.toml", text))
    assert source == "spec"
    assert spec.attention == MLAAttention(kv_lora_rank=512, qk_rope_head_dim=64)


def test_bad_spec_file_is_invalid_argument(tmp_path: Path):
    bad = {"num_layers": 0, "context_length": 1,
           "attention": {"type": "mha", "num_kv_heads": 1, "head_dim": 64}}
    with pytest.raises(InvalidArgument, match=r"\$\.num_layers"):
        load_model(write(tmp_path, "spec.json", json.dumps(bad)))
    with pytest.raises(InvalidArgument, match=r"spec\.toml"):
        load_model(write(tmp_path, "spec.toml", "num_layers = ["))
    with pytest.raises(InvalidArgument, match=r"missing\.toml"):
        load_model(tmp_path / "missing.toml")

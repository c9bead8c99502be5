"""The one config reader both profiles share (``kvpoold.hf_view``), and each place where the
SGLang reader (``kvpoold.hf``) and the vLLM reader (``kvpoold.sizing.vllm_model``) read the same
config differently because the engines do.

Worked example (santacoder, ``corpus/gpt_bigcode-santacoder.json``): ``n_layer`` 24,
``n_head`` 16, ``n_embd`` 2048, ``multi_query`` true -> 24 layers, 1 KV head of 2048 / 16 =
128 in both readers (GPTBigCodeConfig's attribute_map and its derived ``num_key_value_heads``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.spec import MHAAttention, MLAAttention
from kvpoold import hf_view
from kvpoold.hf import spec_from_hf
from kvpoold.sizing.vllm_model import LayerKind, read_vllm_model
from tests.conftest import REPO

MODELS = REPO / "tests" / "data" / "models"


def _load(name: str) -> dict[str, Any]:
    return json.loads((MODELS / name).read_text())


def _small_llama(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                           "num_hidden_layers": 4, "num_attention_heads": 8,
                           "num_key_value_heads": 2, "hidden_size": 512,
                           "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    cfg.update(over)
    return cfg


# ---- the shared view ----------------------------------------------------------------------------


def test_legacy_names_are_read_through_the_class_attribute_map() -> None:
    cfg = _load("corpus/gpt_bigcode-santacoder.json")
    view = hf_view.class_view(cfg)
    assert (view["num_hidden_layers"], view["num_attention_heads"], view["hidden_size"],
            view["max_position_embeddings"]) == (24, 16, 2048, 2048)
    assert view["num_key_value_heads"] == 1
    # both readers: 24 layers of one KV head of 128
    assert spec_from_hf(cfg)[0].attention == MHAAttention(1, 128)
    model = read_vllm_model(cfg)
    assert (len(model.layers), model.num_kv_heads, model.head_size) == (24, 1, 128)


def test_the_alias_map_is_transformers_own() -> None:
    """The generated rows hold GPT-2's and MPT's attribute_map; a class without one (Falcon,
    whose 5.19 class dropped ``n_head``) keeps its default and ignores the legacy key."""
    assert hf_view.CLASSES["gpt2"]["aliases"] == {
        "hidden_size": "n_embd", "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}
    assert hf_view.CLASSES["mpt"]["aliases"]["num_hidden_layers"] == "n_layers"
    falcon = hf_view.class_view({"model_type": "falcon", "n_head": 32, "n_layer": 24})
    assert (falcon["num_attention_heads"], falcon["num_hidden_layers"]) == (71, 32)
    # a type transformers lacks (remote code) reads the common legacy names
    remote = hf_view.class_view({"model_type": "chatglm", "num_layers": 28, "n_inner": 9})
    assert (remote["num_hidden_layers"], remote["intermediate_size"]) == (28, 9)


def test_class_defaults_fill_omitted_keys_and_explicit_null_stays() -> None:
    view = hf_view.class_view({"model_type": "mistral"})
    assert view["sliding_window"] == 4096  # MistralConfig's default
    view = hf_view.class_view({"model_type": "mistral", "sliding_window": None})
    assert view["sliding_window"] is None


@pytest.mark.parametrize("model_type", sorted(
    mt for mt, row in hf_view.CLASSES.items() if "sliding_switch" in row))
def test_use_sliding_window_false_drops_the_window_of_every_class_with_the_switch(
        model_type: str) -> None:
    off = hf_view.class_view({"model_type": model_type, "sliding_window": 4096,
                              "use_sliding_window": False})
    assert not off["sliding_window"]
    on = hf_view.class_view({"model_type": model_type, "sliding_window": 4096,
                             "use_sliding_window": True})
    assert on["sliding_window"] == 4096


def test_the_switch_covers_nested_text_configs() -> None:
    """A Qwen2.5-VL wrapper: the text config names no model_type; transformers builds it as
    ``qwen2_5_vl_text``, whose switch drops the window, in both readers."""
    text = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
            "hidden_size": 512, "max_position_embeddings": 4096, "sliding_window": 1024,
            "use_sliding_window": False}
    cfg = {"architectures": ["Qwen2_5_VLForConditionalGeneration"],
           "model_type": "qwen2_5_vl", "torch_dtype": "bfloat16", "text_config": text}
    model = read_vllm_model(cfg)
    assert {layer.kind for layer in model.layers} == {LayerKind.full}
    assert spec_from_hf(cfg)[0].sliding_window is None
    # the same text config under a class without the switch keeps its window in vLLM
    mistral = {**_small_llama(model_type="mistral", architectures=["MistralForCausalLM"]),
               "sliding_window": 1024, "use_sliding_window": False}
    assert {layer.kind for layer in read_vllm_model(mistral).layers} == {LayerKind.sliding}


# ---- where the engines differ, and so the readers -----------------------------------------------


def test_differ_multi_query_on_a_model_type_other_than_falcon() -> None:
    """SGLang reads ``multi_query`` on any text config; vLLM only through Falcon's convertor
    (and the KV-head keys a class derives from it, as GPT-BigCode's)."""
    cfg = _small_llama(multi_query=True)
    assert spec_from_hf(cfg)[0].attention == MHAAttention(1, 64)
    assert read_vllm_model(cfg).num_kv_heads == 2


def test_agree_falcon_multi_query_and_new_decoder_architecture() -> None:
    cfg = _small_llama(model_type="falcon", multi_query=True)
    del cfg["num_key_value_heads"]
    assert spec_from_hf(cfg)[0].attention.num_kv_heads == 1  # type: ignore[union-attr]
    assert read_vllm_model(cfg).num_kv_heads == 1
    cfg.update(new_decoder_architecture=True, num_kv_heads=4)
    assert spec_from_hf(cfg)[0].attention.num_kv_heads == 4  # type: ignore[union-attr]
    assert read_vllm_model(cfg).num_kv_heads == 4


def test_agree_num_kv_heads_is_read() -> None:
    """Both engines try ``n_head_kv``, ``num_kv_heads``, ``num_key_value_heads`` in order."""
    cfg = _small_llama(num_kv_heads=4)
    assert spec_from_hf(cfg)[0].attention.num_kv_heads == 4  # type: ignore[union-attr]
    assert read_vllm_model(cfg).num_kv_heads == 4


def test_differ_which_sub_config_is_the_text_model() -> None:
    """SGLang reads ``llm_config`` / ``language_config`` / ``thinker_config``; vLLM asks
    transformers' ``get_text_config`` (``decoder``, ``generator``, ``text_config``)."""
    wrapper = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
               "torch_dtype": "bfloat16", "llm_config": _small_llama()}
    assert spec_from_hf(wrapper)[0].num_layers == 4
    assert len(read_vllm_model(wrapper).layers) == 2
    assert hf_view.text_config(wrapper, "sglang")[0] == "llm_config"
    assert hf_view.text_config(wrapper, "vllm")[0] is None


def test_differ_head_size_per_head() -> None:
    """vLLM reads PLaMo's ``hidden_size_per_head`` before hidden / heads; SGLang's generic
    rule does not."""
    cfg = _small_llama(hidden_size_per_head=128)
    assert read_vllm_model(cfg).head_size == 128
    assert spec_from_hf(cfg)[0].attention.head_dim == 64  # type: ignore[union-attr]


def test_differ_context_length_keys() -> None:
    """SGLang takes the first present of its keys (``seq_length`` before
    ``max_position_embeddings``); vLLM the smallest of its keys."""
    cfg = _small_llama(seq_length=8192)
    assert spec_from_hf(cfg)[0].context_length == 8192
    assert read_vllm_model(cfg).derived_max_model_len == 4096


def test_differ_sliding_window_without_an_allowlisted_class() -> None:
    """Mistral's model-level window: vLLM slides every layer; SGLang keeps a full pool (its
    hybrid-SWA allowlist decides, not the config)."""
    cfg = _load("mistral-7b-v0.1.json")
    assert spec_from_hf(cfg)[0].sliding_window is None
    assert {layer.kind for layer in read_vllm_model(cfg).layers} == {LayerKind.sliding}


# ---- family from content ------------------------------------------------------------------------


def test_kda_layers_in_a_wrappers_text_config_are_refused_naming_the_field() -> None:
    """SGLang's ``uses_kda_attention`` reads ``linear_attn_config.kda_layers`` in the text
    config too: Kimi-K2.5's wrapper row says MLA, the content says hybrid_kda. Neither reader
    plans every layer as MLA any more; both name the field."""
    cfg = _load("corpus/kimi-k2.5.json")
    assert isinstance(spec_from_hf(cfg)[0].attention, MLAAttention)  # as published: MLA
    cfg["text_config"]["linear_attn_config"] = {"kda_layers": [1, 2, 3], "full_attn_layers": [4]}
    with pytest.raises(InvalidArgument, match=r"text_config\.linear_attn_config\.kda_layers"
                                              r".*hybrid_kda"):
        spec_from_hf(cfg)
    with pytest.raises(InvalidArgument, match=r"text_config\.linear_attn_config\.kda_layers"):
        read_vllm_model(cfg)


def test_state_layers_the_class_row_does_not_keep_are_refused_naming_the_field() -> None:
    cfg = _small_llama(layers_block_type=["attention", "mamba", "attention", "mamba"])
    with pytest.raises(InvalidArgument, match="layers_block_type declares mamba layers"):
        spec_from_hf(cfg)
    with pytest.raises(InvalidArgument, match=r"layers_block_type \(mamba layers\)"):
        read_vllm_model(cfg)
    # MiniMax-M2.5 lists attn_type_list of full-attention layers only: no state, planned
    m2 = _load("corpus/minimax-m2.5-nvfp4.json")
    assert hf_view.state_layer_marker(m2) is None
    assert hf_view.state_layer_marker({"attn_type_list": [0, 1]}) == ("attn_type_list",
                                                                      "lightning")

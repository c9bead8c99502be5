"""A HF ``config.json`` read the way vLLM 0.32 reads it for its KV cache: per layer, full
attention, sliding window, MLA, a gated-delta-net or Mamba state, or nothing (an MLP / MoE
block), with vLLM's head sizes, default ``max_model_len`` and dtype.

This is not :mod:`kvpoold.hf` (SGLang's reading): vLLM takes ``sliding_window`` as is (gpt-oss:
128, where SGLang keeps 127), slides Gemma-2/3's layers from their ``layer_types`` pattern, and
treats a model-level ``sliding_window`` without ``layer_types`` (Mistral-7B, Phi-3) as every
layer sliding. Pure: a mapping in, a frozen :class:`VllmModel` out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.limits import MAX_LAYERS
from kvpoold import hf_view
from kvpoold.sizing.vllm_layers import (
    DTYPE_NAMES,
    FIELD,
    VLLM_VERSION,
    GatedDeltaNet,
    LayerAttention,
    LayerKind,
    MambaMixer,
)
from kvpoold.sizing.vllm_layers import positive_int as _int
from kvpoold.sizing.vllm_mamba import MAMBA_HYBRIDS, MAMBA_MODELS

__all__ = ["FIELD", "VLLM_VERSION", "GatedDeltaNet", "LayerAttention", "LayerKind",
           "MambaMixer", "VllmModel", "read_vllm_model"]

SLIDING = "sliding_attention"
# vLLM's keys for the model's length, the smallest present wins (``model_max_length`` last).
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")
DEFAULT_MAX_LEN = 2048
# RoPE types whose max_position_embeddings is already the scaled length.
SCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn",
                     "deepseek_llama_scaling")
# what the refusals of other state layers name
_STATES = ("Qwen3-Next's gated delta nets, Kimi Linear's Kimi delta attention, the Mamba "
           f"hybrids of model_type {', '.join(MAMBA_HYBRIDS)} and the attention-free Mamba "
           f"models of model_type {', '.join(MAMBA_MODELS)}")
# the layer kinds an attention backend serves
ATTENTION_KINDS = (LayerKind.full, LayerKind.sliding, LayerKind.mla)

@dataclass(frozen=True)
class VllmModel:
    """What vLLM's KV-cache sizing reads about a model."""

    architecture: str
    model_type: str
    num_attention_heads: int
    num_kv_heads: int  # total, before the TP split
    head_size: int  # MLA: kv_lora_rank + qk_rope_head_dim
    layers: tuple[LayerAttention, ...]
    dtype: str  # the checkpoint's dtype name (bfloat16, float16, float32)
    derived_max_model_len: int
    max_len_key: str | None
    model_max_length: int | None
    kv_cache_fp8: bool  # the checkpoint quantizes its KV cache to fp8
    gdn: GatedDeltaNet | None = None  # the linear layers' state, when there are any
    # the config fields that decided the layer kinds (paths in the file, as vLLM reads them)
    decided_by: tuple[str, ...] = ()
    mamba: MambaMixer | None = None  # the mamba layers' state, when there are any
    # vLLM's module names of a layer's attention and of its state, ``{i}`` its index
    attention_module: str = "model.layers.{i}.self_attn.attn"
    state_module: str = "model.layers.{i}.linear_attn"
    # added to a layer's index in its state module's name (Falcon-H1: num_hidden_layers)
    state_index_offset: int = 0
    pipeline_parallel: bool = True  # vLLM's model class runs pipeline stages (SupportsPP)

    @property
    def num_decoder_layers(self) -> int:
        """The decoder layers vLLM splits over pipeline stages (Falcon-H1 lists two modules,
        an attention and a mixer, under one index)."""
        return len({layer.index for layer in self.layers})

    @property
    def is_mla(self) -> bool:
        return any(layer.kind is LayerKind.mla for layer in self.layers)

    @property
    def is_hybrid_linear(self) -> bool:
        return self.gdn is not None

    @property
    def has_state(self) -> bool:
        """Some layer keeps a per-request state (a gated delta net, a Kimi delta attention
        layer or a Mamba mixer)."""
        return self.gdn is not None or self.mamba is not None

    @property
    def is_attention_free(self) -> bool:
        """State layers and no attention layer (Mamba-1/2, Falcon-Mamba, a Granite-4.0-H whose
        layers are all Mamba): vLLM has no attention backend to align the block to, and its
        blocks hold states only."""
        return self.has_state and not any(layer.kind in ATTENTION_KINDS
                                          for layer in self.layers)

    @property
    def is_kda(self) -> bool:
        """Kimi Linear: Kimi delta attention layers beside MLA ones."""
        return self.gdn is not None and self.gdn.kda


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text config as transformers loads it (:func:`kvpoold.hf_view.class_view`), the
    sub-config transformers' ``get_text_config`` finds (``decoder``, ``generator``,
    ``text_config``) inheriting the wrapper's dtype and quantization when it states none."""
    key, sub, parent = hf_view.text_config(config, "vllm")
    if key is None:
        return hf_view.class_view(config)
    inherited = {k: parent[k] for k in ("torch_dtype", "dtype", "quantization_config")
                 if k in parent and sub.get(k) is None}
    view = hf_view.class_view(sub, hf_view.sub_model_type(parent, key))
    return {**inherited, **{k: v for k, v in view.items() if v is not None}}


def _kv_heads(text: Mapping[str, Any], model_type: str, heads: int, where: str) -> int:
    """vLLM's ``get_total_num_kv_heads``: Falcon's multi-query rule, DBRX's ``attn_config``,
    then the first KV-head key set (:data:`kvpoold.hf_view.KV_HEAD_KEYS`), else the heads."""
    if hf_view.multi_query_kv_heads(text, "vllm", model_type) == 1:
        return 1
    attn = text.get("attn_config")
    if model_type == "dbrx" and isinstance(attn, Mapping):
        return _int(attn, "kv_n_heads", where) if attn.get("kv_n_heads") is not None \
            else heads
    found = hf_view.first_kv_heads(text)
    if found is None:
        return heads
    return _int(text, found[0], where)


def _layer_types(text: Mapping[str, Any], model_type: str, n: int) -> list[str] | None:
    """The per-layer attention types transformers gives the config (its own ``layer_types``,
    or the pattern its config class derives), or None when it has none."""
    explicit = text.get("layer_types")
    if isinstance(explicit, list) and len(explicit) >= n:
        return [str(t) for t in explicit[:n]]
    if model_type == "gemma2":
        return [SLIDING if (i + 1) % 2 else "full_attention" for i in range(n)]
    if model_type in ("gemma3", "gemma3_text"):
        pattern = text.get("sliding_window_pattern") or 6
        return [SLIDING if (i + 1) % pattern else "full_attention" for i in range(n)]
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        use = bool(text.get("use_sliding_window", False))
        first = text.get("max_window_layers") or n
        return [SLIDING if use and i >= first else "full_attention" for i in range(n)]
    if model_type == "gpt_oss":
        return [SLIDING if i % 2 == 0 else "full_attention" for i in range(n)]
    return None


def _max_len(text: Mapping[str, Any]) -> tuple[int, str | None]:
    derived: float = math.inf
    key = None
    for k in MAX_LEN_KEYS:
        value = text.get(k)
        if isinstance(value, int | float) and not isinstance(value, bool):
            if value < derived:
                key = k
            derived = min(derived, value)
    if text.get("model_max_length"):
        derived, key = text["model_max_length"], "model_max_length"
    if derived == math.inf:
        return DEFAULT_MAX_LEN, None
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if isinstance(rope, Mapping) and "gemma3" not in str(text.get("model_type", "")):
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type == "longrope":
            return int(text.get("original_max_position_embeddings", derived)), key
        if rope_type not in SCALED_ROPE_TYPES and rope.get("factor") is not None:
            derived *= rope["factor"]
    return int(derived), key


def _decided_by(config: Mapping[str, Any], text: Mapping[str, Any], model_type: str,
                kinds: tuple[str, ...], fp8: bool) -> tuple[str, ...]:
    """The fields vLLM reads to decide the layers' kinds, as paths in the file: the class
    name, then (by kind) ``kv_lora_rank`` for MLA; ``sliding_window`` with the switch
    (``use_sliding_window``) of a class that has one and the layer list or pattern that places
    it; ``layer_types`` / ``full_attention_interval`` for gated-delta-net layers; then the
    quantization field that makes the KV cache fp8."""
    key = hf_view.text_config(config, "vllm")[0]
    prefix = f"{key}." if key else ""
    out = ["architectures"]
    if "mla" in kinds:
        out.append("kv_lora_rank")
    if "linear" in kinds:
        out += ["model_type", "layer_types" if text.get("layer_types") else
                "full_attention_interval"]
    elif text.get("sliding_window"):
        out.append("sliding_window")
        row = hf_view.class_row(model_type)
        if row is not None and "sliding_switch" in row:
            out.append("use_sliding_window")
        if isinstance(text.get("layer_types"), list):
            out.append("layer_types")
        elif model_type in ("gemma3", "gemma3_text") and text.get("sliding_window_pattern"):
            out.append("sliding_window_pattern")
        elif model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and text.get(
                "max_window_layers") is not None:
            out.append("max_window_layers")
        elif model_type in ("gemma2", "gemma3", "gemma3_text", "gpt_oss"):
            out.append("model_type")  # the class's own sliding pattern
    elif "sliding_window" in text and hf_view.class_row(model_type) is not None and \
            "sliding_switch" in (hf_view.class_row(model_type) or {}):
        out.append("use_sliding_window")  # the switch dropped the window
    fields = [out[0], *(f"{prefix}{f}" for f in out[1:])]
    return (*fields, *_fp8_field(text, fp8))


def _fp8_field(text: Mapping[str, Any], fp8: bool) -> tuple[str, ...]:
    """The quantization field that makes the KV cache fp8, when it is."""
    if not fp8:
        return ()
    quant = text.get("quantization_config")
    scheme = isinstance(quant, Mapping) and quant.get("kv_cache_scheme") is not None
    return ("quantization_config." + ("kv_cache_scheme" if scheme else "kv_cache_quant_algo"),)


def _kv_cache_fp8(text: Mapping[str, Any]) -> bool:
    """Whether ``--kv-cache-dtype auto`` means fp8: vLLM reads a KV-cache scheme only from a
    ModelOpt config (``quant_method: modelopt*``) or from compressed-tensors' quantization
    (``kv_cache_scheme`` there); a config without a ``quant_method`` quantizes nothing."""
    quant = text.get("quantization_config")
    if not isinstance(quant, Mapping):
        return False
    method = str(quant.get("quant_method") or "")
    if method.startswith("modelopt"):
        inner = quant.get("quantization") if isinstance(quant.get("quantization"),
                                                       Mapping) else quant
        algo = (inner.get("kv_cache_scheme") or quant.get("kv_cache_scheme")
                or inner.get("kv_cache_quant_algo") or quant.get("kv_cache_quant_algo"))
        if isinstance(algo, Mapping):
            return (algo.get("dynamic") is False and algo.get("num_bits") == 8
                    and algo.get("type") == "float")
        return isinstance(algo, str) and algo.lower().startswith("fp8")
    return method == "compressed-tensors" and isinstance(quant.get("kv_cache_scheme"),
                                                          Mapping)


def _kimi_linear(config: Mapping[str, Any], text: Mapping[str, Any], architecture: str,
                 model_type: str, where: str) -> VllmModel:
    """Kimi Linear (and Kimi-K3 through its text config) as vLLM's Kimi classes build it:
    ``model.layers.{i}.self_attn`` is a Kimi delta attention layer (a ``MambaSpec``) where
    ``i + 1`` is in ``linear_attn_config.kda_layers``, else an MLA layer of
    ``kv_lora_rank + qk_rope_head_dim`` (``is_deepseek_mla`` lists ``kimi_linear``); a wrapper
    nests them under ``language_model.``."""
    n = _int(text, "num_hidden_layers", where)
    try:
        kda = hf_view.kimi_delta_attention(text, n, MAX_LAYERS)
    except ValueError as exc:
        raise InvalidArgument(f"{where}: {architecture or model_type}: {exc}",
                              field=FIELD) from None
    state = set(kda.state_layers)
    layers = tuple(LayerAttention(i, LayerKind.linear if i in state else LayerKind.mla)
                   for i in range(n))
    head_size = _int(text, "kv_lora_rank", where) + _int(text, "qk_rope_head_dim", where)
    dtype = DTYPE_NAMES.get(str(text.get("dtype") or text.get("torch_dtype") or ""), "float32")
    max_len, key_len = _max_len(text)
    fp8 = _kv_cache_fp8(text)
    sub = hf_view.text_config(config, "vllm")[0]
    prefix = f"{sub}." if sub else ""
    # the file's model_type picks the config class (a wrapper's makes its text config one)
    decided = ("architectures", "model_type", f"{prefix}{hf_view.KDA_LAYERS}",
               f"{prefix}kv_lora_rank", *_fp8_field(text, fp8))
    module = ("language_model." if sub else "") + "model.layers.{i}.self_attn"
    gdn = GatedDeltaNet(kda.num_heads, kda.num_heads, kda.head_dim, kda.head_dim,
                        kda.conv_kernel, kda=True)
    return VllmModel(architecture, model_type, _int(text, "num_attention_heads", where), 1,
                     head_size, layers, dtype, max_len, key_len, text.get("model_max_length"),
                     fp8, gdn, decided, attention_module=module, state_module=module)


def _attention_free(config: Mapping[str, Any], text: Mapping[str, Any], architecture: str,
                    model_type: str, where: str) -> VllmModel:
    """An attention-free Mamba model (:data:`~kvpoold.sizing.vllm_mamba.MAMBA_MODELS`): a
    mixer in every layer, no attention heads (vLLM's ``get_total_num_attention_heads`` is 0,
    which any TP divides), the length keys and dtype read as for any model (none of the
    published configs states a length: vLLM's default 2,048)."""
    n = _int(text, "num_hidden_layers", where)
    state = MAMBA_MODELS[model_type](text, n, where)
    dtype = DTYPE_NAMES.get(str(text.get("dtype") or text.get("torch_dtype") or ""), "float32")
    max_len, key_len = _max_len(text)
    fp8 = _kv_cache_fp8(text)
    layers = tuple(LayerAttention(i, kind) for i, kind in enumerate(state.kinds))
    sub = hf_view.text_config(config, "vllm")[0]
    fields = ("architectures", *(f"{sub}.{f}" if sub else f for f in state.fields))
    return VllmModel(architecture, model_type, 0, 0, 0, layers, dtype, max_len, key_len,
                     text.get("model_max_length"), fp8, None, fields + _fp8_field(text, fp8),
                     mamba=state.mixer, attention_module=state.attention_module,
                     state_module=state.state_module,
                     pipeline_parallel=state.pipeline_parallel)


def read_vllm_model(config: Mapping[str, Any], *, where: str = "config.json") -> VllmModel:
    """Read a HF config as vLLM does for its KV cache.

    Raises:
        InvalidArgument: a missing or bad key, or an architecture the vLLM profile does not
            size yet (mamba / linear attention, DeepSeek sparse attention, DeepSeek-V4),
            naming it.
    """
    text = _text_config(config)
    names = config.get("architectures") or []
    architecture = str(names[0]) if isinstance(names, list) and names else ""
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    if config.get("model_type") in hf_view.KIMI_LINEAR_TYPES:
        return _kimi_linear(config, text, architecture, model_type, where)
    if model_type in MAMBA_MODELS:
        return _attention_free(config, text, architecture, model_type, where)
    linear = model_type == "qwen3_next"
    hybrid = MAMBA_HYBRIDS.get(model_type)
    for key, what in (("linear_conv_kernel_dim", "linear attention"),
                      ("mamba_d_state", "mamba"), ("ssm_state_size", "mamba"),
                      ("index_topk", "DeepSeek sparse attention (indexer)"),
                      ("compress_ratios", "DeepSeek-V4 compressed attention")):
        if text.get(key) is not None and not (linear and key == "linear_conv_kernel_dim") \
                and not (hybrid is not None and what == "mamba"):
            raise InvalidArgument(
                f"{where}: {architecture or model_type} has {what} ({key}); the vLLM "
                f"profile sizes full, sliding-window and MLA attention, {_STATES}",
                field=FIELD)
    marker = hf_view.kda_marker(config)
    state = hf_view.state_layer_marker(text)
    if marker is None and state is not None and not (linear and state[1] == "linear_attention") \
            and not (hybrid is not None and state[1] in ("mamba", "linear_attention")):
        marker = f"{state[0]} ({state[1]} layers)"
    if marker is not None:
        raise InvalidArgument(
            f"{where}: {architecture or model_type} declares per-request state layers in "
            f"{marker}; the vLLM profile sizes full, sliding-window and MLA attention, "
            f"{_STATES}", field=FIELD)
    n = _int(text, "num_hidden_layers", where)
    heads = _int(text, "num_attention_heads", where)
    kv_heads = _kv_heads(text, str(config.get("model_type") or model_type), heads, where)
    dtype = DTYPE_NAMES.get(str(text.get("dtype") or text.get("torch_dtype") or ""), "float32")
    max_len, key_len = _max_len(text)
    fp8 = _kv_cache_fp8(text)
    mml = text.get("model_max_length")
    if text.get("kv_lora_rank"):
        head_size = _int(text, "kv_lora_rank", where) + _int(text, "qk_rope_head_dim", where)
        layers = tuple(LayerAttention(i, LayerKind.mla) for i in range(n))
        return VllmModel(architecture, model_type, heads, 1, head_size, layers, dtype,
                         max_len, key_len, mml, fp8,
                         decided_by=_decided_by(config, text, model_type, ("mla",), fp8))
    # head_dim when positive, else PLaMo's hidden_size_per_head, else hidden / heads
    head_size = (text.get("head_dim") or text.get("hidden_size_per_head")
                 or _int(text, "hidden_size", where) // heads)
    window = text.get("sliding_window") or None  # 0 means none, as in vLLM
    types = _layer_types(text, model_type, n)
    if types is not None and any(t == SLIDING for t in types) and window is None:
        types = None
    gdn = None
    if linear:
        gdn = GatedDeltaNet(_int(text, "linear_num_key_heads", where),
                            _int(text, "linear_num_value_heads", where),
                            _int(text, "linear_key_head_dim", where),
                            _int(text, "linear_value_head_dim", where),
                            _int(text, "linear_conv_kernel_dim", where))
        interval = _int(text, "full_attention_interval", where)
        types = text.get("layer_types") or [
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
        window = None
    if hybrid is not None:
        layers_of = hybrid(text, n, where)
        out = [LayerAttention(i, LayerKind.full, name_index=j)
               for i, j in layers_of.shared_attention]
        for i, kind in enumerate(layers_of.kinds):
            if layers_of.parallel_attention:
                out.append(LayerAttention(i, LayerKind.full))
            out.append(LayerAttention(i, kind))
        if layers_of.head_size is not None:
            head_size = layers_of.head_size
        sub = hf_view.text_config(config, "vllm")[0]
        fields = ("architectures", *(f"{sub}.{f}" if sub else f for f in layers_of.fields))
        return VllmModel(architecture, model_type, heads, int(kv_heads), int(head_size),
                         tuple(out), dtype, max_len, key_len, mml, fp8, None,
                         fields + _fp8_field(text, fp8),
                         mamba=layers_of.mixer,
                         attention_module=layers_of.attention_module,
                         state_module=layers_of.state_module,
                         state_index_offset=layers_of.state_index_offset,
                         pipeline_parallel=layers_of.pipeline_parallel)
    out = []
    for i in range(n):
        if linear and types[i] == "linear_attention":
            out.append(LayerAttention(i, LayerKind.linear))
            continue
        sliding = window is not None and (types is None or types[i] == SLIDING)
        out.append(LayerAttention(i, LayerKind.sliding if sliding else LayerKind.full,
                                  window if sliding else None))
    kinds = tuple(dict.fromkeys(layer.kind.value for layer in out))
    return VllmModel(architecture, model_type, heads, int(kv_heads), int(head_size),
                     tuple(out), dtype, max_len, key_len, mml, fp8, gdn,
                     _decided_by(config, text, model_type, kinds, fp8))

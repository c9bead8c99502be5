"""A ``config.json`` as transformers 5.19 loads it, for the keys kvpool reads; shared by the
SGLang reader (:mod:`kvpoold.hf`) and the vLLM one (:mod:`kvpoold.sizing.vllm_model`).

Both engines read a model's config through transformers' config class, never the raw JSON, so
both readers start from :func:`class_view`, built from generated data
(``config_classes.json`` beside this module, by ``tests/sglang/gen_config_classes.py``):

- **Legacy key names**: the class's ``attribute_map`` (GPT-2's ``n_layer``/``n_head``/
  ``n_embd``/``n_positions``, MPT's ``n_layers``/``d_model``, ...) read under the canonical
  names. A model type transformers does not know (remote code) gets :data:`REMOTE_ALIASES`.
- **Class defaults** for keys the file omits (Falcon and GPT-BigCode: ``multi_query`` true;
  Gemma-3's text config: 8 heads, 4 KV heads, ``head_dim`` 256); an explicit ``null`` stays.
- **The sliding switch**: ``use_sliding_window`` false (or unset) drops ``sliding_window`` in
  every class that has the switch (Qwen2/2.5-VL/3/-MoE, their text configs), as transformers
  does; the classes without it keep the window.
- **Derived keys** of three classes' ``__post_init__`` (:data:`DERIVED`).

Then what differs per engine: the sub-config each treats as the text model
(:data:`SGLANG_TEXT_KEYS` vs :data:`VLLM_TEXT_KEYS`) and the multi-query rule
(:func:`multi_query_kv_heads`). Worked example: santacoder's ``{"model_type": "gpt_bigcode",
"n_layer": 24, "n_head": 16, "n_embd": 2048, "multi_query": true}`` reads as
``num_hidden_layers`` 24, ``num_attention_heads`` 16, ``hidden_size`` 2048 and
``num_key_value_heads`` 1 in both engines.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DATA = Path(__file__).with_name("config_classes.json")
_TABLE: dict[str, Any] = json.loads(DATA.read_text(encoding="utf-8"))
TRANSFORMERS_VERSION: str = _TABLE["transformers_version"]
CLASSES: dict[str, dict[str, Any]] = _TABLE["classes"]

Engine = Literal["sglang", "vllm"]

# The legacy names of a class transformers does not ship (remote code: ChatGLM's num_layers,
# T5-style d_model): read as the canonical key when that one is absent.
REMOTE_ALIASES: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("n_head", "n_heads"),
    "hidden_size": ("n_embd", "d_model"),
    "max_position_embeddings": ("n_positions",),
    "intermediate_size": ("n_inner",),
}
# SGLang's priority among the sub-configs of a multimodal config (``get_hf_text_config``);
# vLLM asks transformers' ``get_text_config``, which looks for these.
SGLANG_TEXT_KEYS = ("thinker_config", "llm_config", "language_config", "text_config")
VLLM_TEXT_KEYS = ("decoder", "generator", "text_config")
# Falcon's model types (both engines' Falcon rule keys on these).
FALCON_TYPES = frozenset({"falcon", "RefinedWeb", "RefinedWebModel"})
# The KV head count's key names, in the order both engines try them.
KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
                "num_attention_groups")


def _gpt_bigcode(view: dict[str, Any]) -> None:
    # GPTBigCodeConfig.__post_init__: one KV head for multi-query, else one per head
    view["num_key_value_heads"] = 1 if view.get("multi_query") else view.get(
        "num_attention_heads")


def _falcon(view: dict[str, Any]) -> None:
    # FalconConfig.__post_init__: num_kv_heads defaults to the head count
    if view.get("num_kv_heads") is None:
        view["num_kv_heads"] = view.get("num_attention_heads")


def _zamba2(view: dict[str, Any]) -> None:
    # Zamba2Config.__post_init__: use_long_context sets max_position_embeddings to 16,384
    if view.get("use_long_context"):
        view["max_position_embeddings"] = 16384


# model_type -> the keys its config class's __post_init__ derives that kvpool reads.
DERIVED: dict[str, Callable[[dict[str, Any]], None]] = {
    "gpt_bigcode": _gpt_bigcode,
    "falcon": _falcon,
    "zamba2": _zamba2,
}


def class_row(model_type: object) -> dict[str, Any] | None:
    """The generated facts of a config class, or None for a type transformers lacks."""
    return CLASSES.get(model_type) if isinstance(model_type, str) else None


def class_view(config: Mapping[str, Any], model_type: object = None) -> dict[str, Any]:
    """``config`` as transformers' class for ``model_type`` (default: the config's own) loads
    it: class defaults, legacy names under the canonical ones, the sliding switch, derived keys.

    Args:
        config: one (text) config mapping as parsed from JSON.
        model_type: the class to read it as, when the mapping does not say (a sub-config).

    Returns:
        A new dict; the input is not changed.
    """
    model_type = config.get("model_type") or model_type
    row = class_row(model_type)
    if row is None:
        view = dict(config)
        for key, aliases in REMOTE_ALIASES.items():
            if view.get(key) is None:
                alias = next((a for a in aliases if view.get(a) is not None), None)
                if alias is not None:
                    view[key] = view[alias]
        return view
    view = {**row.get("defaults", {}), **config}
    for key, legacy in row.get("aliases", {}).items():
        if legacy in config:
            view[key] = config[legacy]
        elif key not in config and legacy in view:
            view[key] = view[legacy]
    if "sliding_switch" in row and not view.get("use_sliding_window"):
        view["sliding_window"] = row["sliding_switch"]
    derive = DERIVED.get(str(model_type))
    if derive is not None:
        derive(view)
    return view


def text_config(config: Mapping[str, Any], engine: Engine,
                ) -> tuple[str | None, Mapping[str, Any], Mapping[str, Any]]:
    """The sub-config an engine reads as the text model.

    Returns:
        ``(key, sub, parent)``: the key it sits under (None: the config itself), the mapping,
        and the mapping holding it (Qwen2.5-Omni's thinker nests one more ``text_config``,
        which SGLang reads).
    """
    keys = SGLANG_TEXT_KEYS if engine == "sglang" else VLLM_TEXT_KEYS
    for key in keys:
        sub = config.get(key)
        if not isinstance(sub, Mapping):
            continue
        if engine == "sglang" and key == "thinker_config" and isinstance(
                sub.get("text_config"), Mapping):
            return "thinker_config.text_config", sub["text_config"], sub
        return key, sub, config
    return None, config, config


def sub_model_type(parent: Mapping[str, Any], key: str | None) -> str | None:
    """The class transformers builds a sub-config as when it names no ``model_type``."""
    if key is None:
        return None
    row = class_row(parent.get("model_type"))
    subs = row.get("sub_configs", {}) if row else {}
    found = subs.get(key.rsplit(".", 1)[-1])
    return found if isinstance(found, str) else None


def multi_query_kv_heads(view: Mapping[str, Any], engine: Engine,
                         model_type: object) -> int | None:
    """1 where the engine reads the config as multi-query attention, else None.

    SGLang (``ModelConfig.get_total_num_kv_heads``): ``multi_query`` on the text config of any
    model type, except a Falcon with ``new_decoder_architecture``. vLLM
    (``FalconModelArchConfigConvertor``): only Falcon's model types, the same exception; other
    classes say it through their KV-head keys (GPT-BigCode's derived ``num_key_value_heads``).
    """
    falcon = model_type in FALCON_TYPES
    if not view.get("multi_query"):
        return None
    if falcon and view.get("new_decoder_architecture"):
        return None
    if engine == "vllm" and not falcon:
        return None
    return 1


def first_kv_heads(view: Mapping[str, Any]) -> tuple[str, object] | None:
    """The first of :data:`KV_HEAD_KEYS` the view sets, with its value."""
    for key in KV_HEAD_KEYS:
        if view.get(key) is not None:
            return key, view[key]
    return None


# The config files' model types whose text config both engines build as a Kimi Linear config
# (SGLang 0.5.23's and vLLM 0.32's ``KimiLinearConfig``): the model itself, or a Kimi-K3 wrapper
# (its ``KimiK3Config`` makes ``text_config`` one, whatever model type that names; Kimi-K2.5's
# wrapper makes a DeepSeek-V3 config). SGLang sizes a Kimi delta attention state pool for
# exactly these (``hybrid_arch.kimi_linear_config``); vLLM's Kimi classes build their layers
# from the same config.
KIMI_LINEAR_TYPES = ("kimi_linear", "kimi_k3")
KDA_LAYERS = "linear_attn_config.kda_layers"


@dataclass(frozen=True)
class KimiDeltaAttention:
    """A Kimi Linear text config's linear layers, as both engines read ``linear_attn_config``:
    layer ``i`` (0-based) is a Kimi delta attention layer when ``i + 1`` is in ``kda_layers``
    (``full_attn_layers`` must be set but is not read: every other layer is full attention,
    MLA); ``num_heads`` H of ``head_dim`` D (keys as values: neither engine passes
    ``num_k_heads``), a causal conv of ``short_conv_kernel_size`` k over q, k and v."""

    state_layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """The conv state's channels before the TP split (q, k and v: ``3 * H * D``)."""
        return 3 * self.num_heads * self.head_dim


def _layer_numbers(linear: Mapping[str, Any], key: str, max_layers: int) -> list[int]:
    value = linear.get(key)
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                          for v in value):
        raise ValueError(f"linear_attn_config.{key} must list 1-based layer numbers (the "
                         f"engines' KimiLinearConfig asserts it is set), got {value!r}"[:300])
    if len(value) > max_layers:
        raise ValueError(f"linear_attn_config.{key} lists {len(value):,} layers, at most "
                         f"{max_layers:,} are supported")
    return value


def kimi_delta_attention(view: Mapping[str, Any], num_layers: int,
                         max_layers: int) -> KimiDeltaAttention:
    """The Kimi delta attention layers of a Kimi Linear text config (:data:`KIMI_LINEAR_TYPES`).

    Raises:
        ValueError: what the engines cannot build a state from (no ``linear_attn_config``, a
            list missing, no KDA layer among the model's, a missing or bad size), the message
            naming the field.
    """
    linear = view.get("linear_attn_config")
    if not isinstance(linear, Mapping):
        raise ValueError(f"linear_attn_config is {linear!r}: a Kimi Linear config's state is "
                         "read from that mapping (kda_layers, full_attn_layers, num_heads, "
                         "head_dim, short_conv_kernel_size)"[:300])
    kda = set(_layer_numbers(linear, "kda_layers", max_layers))
    _layer_numbers(linear, "full_attn_layers", max_layers)
    state = tuple(i for i in range(num_layers) if i + 1 in kda)
    if not state:
        raise ValueError(f"{KDA_LAYERS} names none of the model's {num_layers} layers "
                         "(1-based): a Kimi Linear config gets a state pool, which cannot be "
                         "sized without a Kimi delta attention layer")
    sizes = []
    for key, least in (("num_heads", 1), ("head_dim", 1), ("short_conv_kernel_size", 2)):
        value = linear.get(key)
        if value is None:
            raise ValueError(f"linear_attn_config is missing {key}")
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"linear_attn_config.{key} must be an integer >= {least}, got "
                             f"{value!r}"[:200])
        sizes.append(value)
    return KimiDeltaAttention(state, *sizes)


__all__ = ["CLASSES", "DATA", "DERIVED", "FALCON_TYPES", "KDA_LAYERS", "KIMI_LINEAR_TYPES",
           "KV_HEAD_KEYS", "REMOTE_ALIASES", "SGLANG_TEXT_KEYS", "TRANSFORMERS_VERSION",
           "VLLM_TEXT_KEYS", "KimiDeltaAttention", "class_row", "class_view", "first_kv_heads",
           "kimi_delta_attention", "multi_query_kv_heads", "sub_model_type", "text_config"]


def kda_marker(config: Mapping[str, Any]) -> str | None:
    """The field that makes SGLang size a model as Kimi delta attention, whatever its class
    (``uses_kda_attention``: the config and its transformers text config, a
    ``linear_attn_config`` with ``kda_layers``, or ``linear_attention`` in ``layer_types``
    beside ``linear_num_heads`` and ``linear_head_dim``), or None."""
    key, sub, _ = text_config(config, "vllm")  # transformers' get_text_config
    for prefix, c in (("", config), (f"{key}." if key else "", sub)):
        linear = c.get("linear_attn_config")
        if isinstance(linear, Mapping) and linear.get("kda_layers"):
            return f"{prefix}linear_attn_config.kda_layers"
        types = c.get("layer_types")
        if (isinstance(types, list) and "linear_attention" in types
                and c.get("linear_num_heads") is not None
                and c.get("linear_head_dim") is not None):
            return f"{prefix}layer_types"
    return None


def state_layer_marker(view: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(field, kind)`` when the text config declares layers that keep a per-request state
    instead of (only) KV: Mamba (``layers_block_type`` / ``layer_types`` entries ``mamba``,
    an ``M`` in ``hybrid_override_pattern``), linear attention (``layer_types`` entries
    ``linear_attention``), lightning attention (a 0 in ``attn_type_list``); else None."""
    for key in ("layers_block_type", "layer_types"):
        value = view.get(key)
        if isinstance(value, list):
            if "mamba" in value:
                return key, "mamba"
            if "linear_attention" in value:
                return key, "linear_attention"
    pattern = view.get("hybrid_override_pattern")
    if isinstance(pattern, str) and "M" in pattern:
        return "hybrid_override_pattern", "mamba"
    kinds = view.get("attn_type_list")
    if isinstance(kinds, list) and 0 in kinds:
        return "attn_type_list", "lightning"
    return None

"""Hugging Face ``config.json`` -> :class:`ModelSpec`, read the way SGLang 0.5.23 reads it.

The HF class name (``LlamaForCausalLM``) is looked up in SGLang's architecture table
(:mod:`kvpoold.sizing.architectures`, one row per class of SGLang's model registry); its family
picks the loader (:data:`FAMILY_LOADERS`). The config is read as transformers loads it
(:mod:`kvpoold.hf_view`: class defaults, legacy key names, the sliding switch). A class
SGLang does not know is refused, naming the nearest known ones, unless ``--assume-architecture
FAMILY`` says how to read it (source ``"assumed"``). The rules, each SGLang's
(``configs/model_config.py``, ``utils/hf_transformers/common.py``, ``configs/hybrid_arch.py``):

- **JSON** as Python reads it (``Infinity``/``NaN`` accepted), at most ``MAX_CONFIG_CHARS``.

- **Text config.** A multimodal config is read through its first sub-config present among
  ``thinker_config``, ``llm_config``, ``language_config``, ``text_config``; a sub-config without a
  dtype inherits the parent's.
- **KV geometry.** ``head_dim`` given explicitly wins over ``hidden_size // num_attention_heads``;
  ``multi_query`` (any model type; not a Falcon with ``new_decoder_architecture``) means one
  KV head; otherwise the first of ``n_head_kv``,
  ``num_kv_heads``, ``num_key_value_heads``, ``multi_query_group_num`` that is not null, else
  ``num_attention_heads``.
- **dtype** (``--dtype auto``): the config's ``dtype``, else ``torch_dtype``; none means
  float32, and float32 is served as float16, or bfloat16 when ``model_type`` starts with
  ``gemma``; gpt-oss with an ``mxfp4`` ``quantization_config`` runs in bfloat16.
- **KV dtype implied by quantization** (``--kv-cache-dtype auto``): fp8_e4m3 when the
  quantization method reports ``kv_cache_quant_algo == "FP8"`` (:func:`kv_quant_fp8`: ModelOpt's
  float 8-bit ``kv_cache_scheme`` or ``kv_cache_quant_algo``, compressed-tensors' static
  per-tensor fp8 ``kv_cache_scheme``, fp8's ``kv_cache_quant_algo``).
- **Context length**: the first present of ``max_sequence_length``, ``seq_length``,
  ``max_seq_len``, ``model_max_length``, ``max_position_embeddings`` (else 2048), times the
  ``rope_scaling`` ``factor`` unless that has ``original_max_position_embeddings`` or
  ``rope_type: llama3``.
- **Sliding window pools** only for SGLang's hybrid-SWA allowlist (:data:`HYBRID_SWA`: gpt-oss,
  Llama-4, Gemma-4, MiMo-V2, Step-3.5, ...) or a config saying ``is_hybrid_swa: true``. Gemma-2,
  Gemma-3, Mistral, Qwen2/3, Phi-3 and the like get a plain full-attention pool even with
  ``sliding_window`` or ``layer_types`` (the window is applied in attention only). An
  allowlisted model whose layers all slide gets an SWA-only pool.
- **Per-layer-type geometry** of hybrid SWA: Gemma-4's full layers take
  ``num_global_key_value_heads`` / ``global_head_dim``; others' SWA layers ``swa_*`` keys.
- **Gated delta net** (Qwen3-Next, Qwen3.5 through its ``text_config``): full attention on
  ``(i + 1) % full_attention_interval == 0`` (or the ``"full_attention"`` entries of
  ``layer_types``), linear attention elsewhere.
- **Mamba2 hybrids** (Nemotron-H ``hybrid_override_pattern`` / ``layers_block_type``, Granite-4
  ``layer_types``, Falcon-H1): attention KV in the attention layers, Mamba2 state in the Mamba
  layers, nothing in MLP/MoE layers.
- **Kimi delta attention** (Kimi Linear, a Kimi-K3 wrapper's text config): MLA KV in the layers
  not in ``linear_attn_config.kda_layers`` (1-based), a KDA conv + recurrent state in those.
- **DSA**: an MLA class of SGLang's DSA list whose config sets ``index_topk``.
- **Family from content**: the row's conditions (``kv_lora_rank``, ``use_mla``,
  ``index_topk``; Granite-4's ``layer_types`` with a ``mamba`` entry; Inkling's
  ``mamba2_cache_params``), the hybrid-SWA rules' fields and Kimi delta attention (the file's
  ``model_type`` ``kimi_linear`` or ``kimi_k3`` makes SGLang's ``KimiLinearConfig`` and its
  state pool whatever the class row says; ``linear_attn_config.kda_layers`` in any other
  config, at either nesting, is refused). :func:`read_hf` returns the
  fields that decided, as paths in the file (``text_config.layer_types``); the plan's first
  note names them (tests/integration/test_family_fields.py checks them against SGLang's source).
- **DeepSeek-V4**: ``compress_ratios`` per layer, ``sliding_window``, fp8 KV
  (docs/dsv4-layout.md).

Worked example, Llama-3.1-8B: 32 layers, 32 heads, 8 KV heads, hidden 4096 -> head_dim 128,
context 131,072 (rope_type llama3: no scaling), bfloat16:
``ModelSpec(num_layers=32, attention=MHAAttention(8, 128), context_length=131072, ...)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvpool.contract.errors import InvalidArgument, echo
from kvpool.contract.limits import MAX_CONFIG_CHARS, MAX_LAYERS
from kvpool.contract.plan import ArchitectureSource
from kvpool.contract.spec import ModelDType, ModelSpec, decode_spec, load_spec_file
from kvpoold import hf_view
from kvpoold.sizing import architectures

FIELD = "model_config"
SLIDING = "sliding_attention"
FULL = "full_attention"
LINEAR = "linear_attention"

# The dtype names SGLang recognizes in a config; any other value, or none, means float32.
_DTYPES: dict[str, ModelDType] = {
    "bfloat16": ModelDType.bfloat16,
    "float16": ModelDType.float16,
    "half": ModelDType.float16,
    "float32": ModelDType.float32,
    "float": ModelDType.float32,
}
# SGLang's priority among the sub-configs of a multimodal config.
TEXT_CONFIG_KEYS = hf_view.SGLANG_TEXT_KEYS
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")
DEFAULT_CONTEXT_LENGTH = 2048
# Key names of the KV head count, in the order SGLang tries them (vLLM's order too).
KV_HEAD_KEYS = hf_view.KV_HEAD_KEYS

Config = Mapping[str, Any]
SpecFields = dict[str, Any]


class _Reader:
    """Typed access to one config mapping; every complaint names the file and the key."""

    def __init__(self, config: Config, where: str, field: str = FIELD) -> None:
        self.config = config
        self.where = where
        self.field = field

    def fail(self, message: str) -> InvalidArgument:
        return InvalidArgument(f"{self.where}: {message}", field=self.field)

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None

    def get_int(self, key: str) -> int:
        value = self.config.get(key)
        if value is None:
            raise self.fail(f"missing {key}")
        return self._check_int(key, value)

    def opt_int(self, key: str, default: int | None = None) -> int | None:
        value = self.config.get(key)
        return default if value is None else self._check_int(key, value)

    def _check_int(self, key: str, value: object) -> int:
        # bool is an int subclass; `true` is never a layer count
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{key} must be an integer, got {echo(value)}")
        if key == "num_hidden_layers" and value > MAX_LAYERS:  # before any O(layers) work
            raise self.fail(f"{key} is {value:,}, at most {MAX_LAYERS:,} layers are supported")
        return value


def _kv_heads(r: _Reader, heads: int) -> int:
    """KV heads: one for multi-query attention, else the first key SGLang reads that is set."""
    if hf_view.multi_query_kv_heads(r.config, "sglang", r.config.get("model_type")) == 1:
        return 1
    if r.config.get("model_type") == "nemotron-nas":
        return _nemotron_nas_kv_heads(r, heads)
    attn = r.config.get("attn_config")
    if r.config.get("model_type") in ("dbrx", "mpt") and isinstance(attn, Mapping):
        value = attn.get("kv_n_heads")  # DBRX / MPT keep it in attn_config
        if value is not None:
            return _Reader(attn, r.where, r.field)._check_int("attn_config.kv_n_heads", value)
        return heads
    for key in KV_HEAD_KEYS:
        value = r.opt_int(key)
        if value is not None:
            return value
    return heads


def _nemotron_nas_kv_heads(r: _Reader, heads: int) -> int:
    """Nemotron-NAS (DeciLM): ``heads // n_heads_in_group`` of its attention blocks, which must
    agree (SGLang refuses variable GQA)."""
    blocks = r.config.get("block_configs")
    if not isinstance(blocks, list):
        raise r.fail("block_configs must list the blocks of a nemotron-nas model")
    found: set[int] = set()
    for block in blocks:
        attn = block.get("attention") if isinstance(block, Mapping) else None
        if not isinstance(attn, Mapping) or attn.get("no_op"):
            continue
        group = _Reader(attn, r.where, r.field).get_int("n_heads_in_group")
        if group < 1:
            raise r.fail(f"n_heads_in_group must be >= 1, got {group}")
        found.add(heads // group)
    if len(found) != 1:
        raise r.fail("block_configs give " + ("no attention block" if not found else
                     f"KV head counts {sorted(found)}: variable GQA, which SGLang refuses"))
    return found.pop()


def _mha_attention(r: _Reader) -> dict[str, Any]:
    """KV geometry of an MHA/GQA model: explicit head_dim wins over hidden / heads."""
    heads = r.get_int("num_attention_heads")
    if heads < 1:
        raise r.fail(f"num_attention_heads must be >= 1, got {heads}")
    kv_heads = _kv_heads(r, heads)
    head_dim = r.opt_int("head_dim")
    if head_dim is None:
        hidden = r.get_int("hidden_size")
        if hidden % heads:
            raise r.fail(
                f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
                "give head_dim explicitly"
            )
        head_dim = hidden // heads
    attention: dict[str, Any] = {"type": "mha", "num_kv_heads": kv_heads, "head_dim": head_dim}
    v_head_dim = r.opt_int("v_head_dim")  # SGLang: unset or 0 means head_dim
    if v_head_dim and v_head_dim != head_dim:
        attention["v_head_dim"] = v_head_dim
    return attention


def _model_dtype(r: _Reader, architecture: str) -> ModelDType:
    """The dtype SGLang serves the model in with ``--dtype auto``."""
    raw = r.config.get("dtype") or r.config.get("torch_dtype")
    name = raw.removeprefix("torch.") if isinstance(raw, str) else ""
    declared = _DTYPES.get(name, ModelDType.float32)
    quant = r.config.get("quantization_config")
    if (architecture == "GptOssForCausalLM" and isinstance(quant, Mapping)
            and quant.get("quant_method") == "mxfp4"):
        return ModelDType.bfloat16  # SGLang's gpt-oss override: mxfp4 kernels run in bf16
    if declared is not ModelDType.float32:
        return declared
    model_type = r.config.get("model_type")
    if isinstance(model_type, str) and model_type.startswith("gemma"):
        return ModelDType.bfloat16
    return ModelDType.float16


# Families whose transformers (v5) config nests rope parameters per layer type
# ({"full_attention": {...}, "sliding_attention": {...}}): SGLang reads ``factor`` at the top of
# that mapping, finds none, and does not scale their context length.
PER_LAYER_TYPE_ROPE = frozenset({
    "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text",
    "gemma4_unified", "embedding_gemma2", "diffusion_gemma", "t5gemma2", "laguna", "mellum",
    "mimo_v2_flash", "olmo3", "modernbert", "modernbert_decoder", "neomme",
})


def _context_length(r: _Reader) -> int:
    """The model's context length as SGLang derives it (rope scaling included)."""
    rope = r.config.get("rope_scaling") or r.config.get("rope_parameters")
    factor: float = 1
    if r.config.get("model_type") in PER_LAYER_TYPE_ROPE:
        rope = None
    if isinstance(rope, Mapping):
        raw = rope.get("factor", 1)
        factor = raw if isinstance(raw, int | float) and not isinstance(raw, bool) else 1
        if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
            factor = 1
    for key in CONTEXT_LENGTH_KEYS:
        if r.config.get(key) is not None:
            return int(factor * r.get_int(key))
    return DEFAULT_CONTEXT_LENGTH


def _fp8_scheme(scheme: object, *, compressed_tensors: bool = False) -> bool:
    """An 8-bit float ``kv_cache_scheme``; compressed-tensors loads only static symmetric
    per-tensor scales, so SGLang takes its fp8 pool only for those."""
    if not isinstance(scheme, Mapping):
        return False
    fp8 = scheme.get("type") == "float" and scheme.get("num_bits") == 8
    if not compressed_tensors:
        return fp8
    return (fp8 and scheme.get("strategy") == "tensor" and scheme.get("symmetric", True) is True
            and not scheme.get("dynamic", False))


def kv_quant_fp8(quant: object) -> bool:
    """Whether the checkpoint's ``quantization_config`` makes ``--kv-cache-dtype auto`` fp8
    (:func:`kv_quant_field` names the field that says so)."""
    return kv_quant_field(quant) is not None


def kv_quant_field(quant: object) -> str | None:
    """The ``quantization_config`` field that makes ``--kv-cache-dtype auto`` fp8, or None.

    SGLang takes fp8 KV under ``auto`` when the model's quantization method reports
    ``kv_cache_quant_algo == "FP8"``: compressed-tensors from a static per-tensor fp8
    ``kv_cache_scheme``; ModelOpt's flat format (``quant_algo`` at the top) from a float 8-bit
    ``kv_cache_scheme``, else its ``kv_cache_quant_algo``; ModelOpt's nested format from
    ``quantization.kv_cache_quant_algo``; fp8 and the others from ``kv_cache_quant_algo``.
    """
    if not isinstance(quant, Mapping):
        return None
    scheme_field = "quantization_config.kv_cache_scheme"
    method = str(quant.get("quant_method") or "").lower()
    scheme = quant.get("kv_cache_scheme")
    if method == "compressed-tensors":
        return scheme_field if _fp8_scheme(scheme, compressed_tensors=True) else None
    algo = quant.get("kv_cache_quant_algo")
    algo_field = "quantization_config.kv_cache_quant_algo"
    if method.startswith("modelopt") or (method == "" and ("quant_algo" in quant
                                                           or "quantization" in quant)):
        quant_algo = quant.get("quant_algo")
        if quant_algo is not None:
            if isinstance(scheme, Mapping):
                return scheme_field if _fp8_scheme(scheme) else None
            if isinstance(scheme, str) and "FP4" in str(quant_algo).upper():
                # ModelOpt's FP4 config names the scheme too ("FP8", "FLOAT8")
                return scheme_field if scheme.strip().upper() in ("FP8", "FLOAT8") else None
        elif isinstance(quant.get("quantization"), Mapping):
            algo = quant["quantization"].get("kv_cache_quant_algo")
            algo_field = "quantization_config.quantization.kv_cache_quant_algo"
    return algo_field if isinstance(algo, str) and algo.upper() == "FP8" else None


def _kv_cache_quant_fp8(r: _Reader) -> bool:
    return kv_quant_fp8(r.config.get("quantization_config"))


def _common(r: _Reader, architecture: str) -> SpecFields:
    """Fields every loader fills the same way."""
    return {
        "num_layers": r.get_int("num_hidden_layers"),
        "context_length": _context_length(r),
        "dtype": _model_dtype(r, architecture),
        "architecture": architecture,
        "num_nextn_predict_layers": r.opt_int("num_nextn_predict_layers", 0),
        "kv_cache_quant_fp8": _kv_cache_quant_fp8(r),
    }


# ---- sliding window ---------------------------------------------------------------------------

# (reader, num_layers) -> global ids of the sliding layers (None: the model gets no SWA pool)
SlidingRule = Callable[[_Reader, int], "list[int] | None"]


def _layer_types(r: _Reader, n: int, accepted: tuple[str, ...]) -> list[str] | None:
    raw = r.config.get("layer_types")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) < n:
        raise r.fail(f"layer_types must be a list of (at least) num_hidden_layers = {n} entries")
    raw = raw[:n]  # Step-3.5 lists its MTP layers after the model's
    bad = [t for t in raw if t not in accepted]
    if bad:
        raise r.fail(f"layer_types has {echo(bad[0])} (accepted: {', '.join(accepted)})")
    return raw


def _by_layer_types(r: _Reader, n: int) -> list[int] | None:
    types = _layer_types(r, n, (SLIDING, FULL))
    if types is None:
        raise r.fail("layer_types is missing: this architecture's sliding layers are listed "
                     "there")
    return [i for i, t in enumerate(types) if t == SLIDING]


def _if_any_sliding(r: _Reader, n: int) -> list[int] | None:
    """Beam: an SWA pool only when some layer slides."""
    layers = _by_layer_types(r, n)
    return layers or None


def _if_window(r: _Reader, n: int) -> list[int] | None:
    """Laguna: an SWA pool only with a non-zero sliding_window."""
    return _by_layer_types(r, n) if r.config.get("sliding_window") else None


def _llama4(r: _Reader, n: int) -> list[int]:
    """Llama-4: every fourth layer is global attention, the others chunked (sliding)."""
    return [i for i in range(n) if (i + 1) % 4 != 0]


def _by_pattern(r: _Reader, n: int) -> list[int]:
    """MiMo-V2 and configs opting in with ``is_hybrid_swa``: ``hybrid_layer_pattern`` 1 = SWA."""
    pattern = r.config.get("hybrid_layer_pattern")
    if not isinstance(pattern, list) or len(pattern) < n:
        raise r.fail(f"hybrid_layer_pattern must list (at least) num_hidden_layers = {n} "
                     "entries, 1 for a sliding layer and 0 for full attention")
    return [i for i in range(n) if pattern[i] == 1]


def _every_layer(r: _Reader, n: int) -> list[int]:
    return list(range(n))


# SGLang 0.5.23's hybrid sliding-window allowlist (``is_hybrid_swa_model``) and how each class
# names its sliding layers (``get_hybrid_layer_ids``). DeepSeek-V4 is planned from a spec file.
HYBRID_SWA: dict[str, SlidingRule] = {
    "GptOssForCausalLM": _by_layer_types,
    "GraniteSWAForCausalLM": _by_layer_types,
    "GraniteMoeSWAForCausalLM": _by_layer_types,
    "IQuestQ1ForCausalLM": _by_layer_types,
    "BeamForCausalLM": _if_any_sliding,
    "Llama4ForConditionalGeneration": _llama4,
    "MiMoV2ForCausalLM": _by_pattern,
    "MiMoV2FlashForCausalLM": _by_pattern,
    "Step3p5ForCausalLM": _by_layer_types,
    "Step3p7ForConditionalGeneration": _by_layer_types,
    "Gemma4ForCausalLM": _by_layer_types,
    "Gemma4ForConditionalGeneration": _by_layer_types,
    "Gemma4UnifiedForConditionalGeneration": _by_layer_types,
    "EmbeddingGemma2Model": _by_layer_types,
    "DiffusionGemmaForBlockDiffusion": _by_layer_types,
    "LagunaForCausalLM": _if_window,
    "MellumForCausalLM": _by_layer_types,
    "MuseGlimmerForCausalLM": _by_layer_types,
    "MuseGlimmerForConditionalGeneration": _by_layer_types,
    "UnlimitedOCRForCausalLM": _every_layer,
}
# Llama-4 slides over its attention chunk; the others name their window directly.
WINDOW_KEYS = ("sliding_window_size", "sliding_window", "window_size", "attention_chunk_size")
# Classes whose SGLang model reports the HF window minus one (HF counts the current token).
EXCLUSIVE_WINDOW = frozenset({
    "GptOssForCausalLM", "BeamForCausalLM", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForConditionalGeneration", "DiffusionGemmaForBlockDiffusion",
    "MellumForCausalLM", "MuseGlimmerForCausalLM", "MuseGlimmerForConditionalGeneration",
})
EMBEDDING_GEMMA2_WINDOW = 512  # EmbeddingGemma2Model's fixed window in SGLang


# Gemma-4's family states its shapes sliding-window first: ``head_dim`` / ``num_key_value_heads``
# are the SWA layers', ``global_head_dim`` / ``num_global_key_value_heads`` the full layers'.
GEMMA4_MODEL_TYPES = frozenset({
    "gemma4", "gemma4_text", "gemma4_assistant", "gemma4_unified", "gemma4_unified_assistant",
    "diffusion_gemma", "embedding_gemma2",
})


def _sliding(r: _Reader, n: int, architecture: str, *, assumed: bool = False,
             ) -> dict[str, Any] | None:
    """The spec's ``sliding_window`` entry: only for the allowlist or ``is_hybrid_swa: true``
    (or ``--assume-architecture hybrid_swa``: ``layer_types``, else ``hybrid_layer_pattern``)."""
    rule = HYBRID_SWA.get(architecture)
    if rule is None and (assumed or r.config.get("is_hybrid_swa") is True):
        rule = _by_layer_types if assumed and r.has("layer_types") else _by_pattern
    if rule is None:
        return None
    layers = rule(r, n)
    if not layers:
        return None
    if architecture == "EmbeddingGemma2Model":
        return {"window": EMBEDDING_GEMMA2_WINDOW, "layers": layers}
    if architecture in EXCLUSIVE_WINDOW:
        return {"window": r.get_int("sliding_window") - 1, "layers": layers}
    window = next((r.get_int(k) for k in WINDOW_KEYS if r.config.get(k) is not None), None)
    if window is None:
        raise r.fail(f"{architecture or 'this model'} has sliding layers but no window "
                     f"({', '.join(WINDOW_KEYS)})")
    return {"window": window, "layers": layers}


def _per_layer_type_geometry(r: _Reader, attention: dict[str, Any]) -> dict[str, Any]:
    """Full-attention and SWA KV geometry when the layer types differ (SGLang's rules).

    Gemma-4 family: the full layers take ``num_global_key_value_heads`` / ``global_head_dim``
    (each defaulting to the base value), the SWA layers the base ``num_key_value_heads`` /
    ``head_dim``. Others: ``swa_num_key_value_heads`` / ``swa_head_dim`` / ``swa_v_head_dim``
    when the config states them (Step-3.5: ``attention_other_setting.num_attention_groups``).
    Updates ``attention`` (the full layers) in place; returns the SWA layers' overrides.
    """
    base_heads, base_dim = attention["num_kv_heads"], attention["head_dim"]
    model_type = r.config.get("model_type")
    swa: dict[str, Any] = {}
    if model_type in GEMMA4_MODEL_TYPES and (r.has("num_global_key_value_heads")
                                             or r.has("global_head_dim")):
        attention["num_kv_heads"] = r.opt_int("num_global_key_value_heads", base_heads)
        attention["head_dim"] = r.opt_int("global_head_dim", base_dim)
        attention.pop("v_head_dim", None)
        swa = {"num_kv_heads": base_heads, "head_dim": base_dim}
    else:
        other = r.config.get("attention_other_setting")
        heads = r.opt_int("swa_num_key_value_heads")
        if heads is None and isinstance(other, Mapping) and other.get("num_attention_groups"):
            heads = _Reader(other, r.where, r.field).get_int("num_attention_groups")
        dim = r.opt_int("swa_head_dim")
        v_dim = r.opt_int("swa_v_head_dim")
        if heads is not None:
            swa["num_kv_heads"] = heads
        if dim is not None:
            swa["head_dim"] = dim
        if v_dim is not None and v_dim != (dim or base_dim):
            swa["v_head_dim"] = v_dim
    full = (attention["num_kv_heads"], attention["head_dim"])
    if (swa.get("num_kv_heads", full[0]), swa.get("head_dim", full[1])) == full \
            and "v_head_dim" not in swa:
        return {}
    return swa


# ---- loaders -----------------------------------------------------------------------------------


def _mha(r: _Reader, architecture: str, *, assumed: bool = False) -> SpecFields:
    """An MHA/GQA model, with an SWA pool when SGLang gives it one (:func:`_sliding`)."""
    fields = _common(r, architecture)
    fields["attention"] = _mha_attention(r)
    window = _sliding(r, fields["num_layers"], architecture, assumed=assumed)
    if window is not None:
        window.update(_per_layer_type_geometry(r, fields["attention"]))
        fields["sliding_window"] = window
    return fields


def _hybrid_swa(r: _Reader, architecture: str) -> SpecFields:
    """``--assume-architecture hybrid_swa``: sliding layers from ``layer_types`` (or
    ``hybrid_layer_pattern``), the window from the config."""
    fields = _mha(r, architecture, assumed=True)
    if "sliding_window" not in fields:
        raise r.fail("assumed hybrid_swa, but the config names no sliding layer (layer_types "
                     "with sliding_attention entries, or hybrid_layer_pattern with 1s)")
    return fields


def _mla(r: _Reader, architecture: str) -> SpecFields:
    fields = _common(r, architecture)
    fields["attention"] = {
        "type": "mla",
        "kv_lora_rank": r.get_int("kv_lora_rank"),
        "qk_rope_head_dim": r.get_int("qk_rope_head_dim"),
    }
    return fields


def _dsa(r: _Reader, architecture: str) -> SpecFields:
    """DeepSeek sparse attention: MLA plus the lightning indexer (SGLang's ``is_deepseek_dsa``:
    an MLA class of its DSA list whose config sets ``index_topk``)."""
    fields = _mla(r, architecture)
    indexer: dict[str, Any] = {}
    if r.has("index_head_dim"):
        indexer["index_head_dim"] = r.get_int("index_head_dim")
    fields["indexer"] = indexer
    return fields


def _hybrid_linear(r: _Reader, architecture: str) -> SpecFields:
    """Gated delta net hybrids (Qwen3-Next, Qwen3.5 in its text_config, Jet-Nemotron ...)."""
    fields = _common(r, architecture)
    n = fields["num_layers"]
    fields["attention"] = _mha_attention(r)
    types = _layer_types(r, n, (FULL, LINEAR))
    if types is not None:
        full = [i for i, t in enumerate(types) if t == FULL]
    else:
        interval = r.get_int("full_attention_interval")
        if interval < 1:
            raise r.fail(f"full_attention_interval must be >= 1, got {interval}")
        full = [i for i in range(n) if (i + 1) % interval == 0]
    linear: dict[str, Any] = {
        "full_attention_layers": full,
        "conv_kernel": r.get_int("linear_conv_kernel_dim"),
        "num_key_heads": r.get_int("linear_num_key_heads"),
        "num_value_heads": r.get_int("linear_num_value_heads"),
        "key_head_dim": r.get_int("linear_key_head_dim"),
        "value_head_dim": r.get_int("linear_value_head_dim"),
    }
    # the checkpoint may pin the SSM state dtype; conv state stays bf16 (SGLang's default)
    ssm = r.config.get("mamba_ssm_dtype")
    if ssm is not None:
        linear["ssm_dtype"] = ssm
    fields["linear"] = linear
    return fields


def _dsv4(r: _Reader, architecture: str) -> SpecFields:
    """DeepSeek-V4 compressed attention (docs/dsv4-layout.md, "Where each field comes from"):
    ``compress_ratios`` (its trailing MTP entry dropped), ``sliding_window`` as the window,
    ``head_dim - qk_rope_head_dim`` / ``qk_rope_head_dim`` as nope / rope, ``index_head_dim``;
    fp8 KV, SGLang's DSV4 default."""
    fields = _common(r, architecture)
    n = fields["num_layers"]
    ratios = r.config.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < n:
        raise r.fail(f"compress_ratios must list (at least) num_hidden_layers = {n} entries "
                     "of 0, 4 or 128")
    rope = r.get_int("qk_rope_head_dim")
    nope = r.get_int("head_dim") - rope
    fields["attention"] = {"type": "mla", "kv_lora_rank": nope, "qk_rope_head_dim": rope}
    fields["kv_cache_quant_fp8"] = True
    fields["dsv4"] = {
        "compress_ratios": ratios[:n],
        "window_size": r.opt_int("sliding_window", 128),
        "nope_head_dim": nope,
        "rope_head_dim": rope,
        "index_head_dim": r.opt_int("index_head_dim", 128),
    }
    return fields


# Nemotron-H's hybrid_override_pattern letters: M Mamba2, * attention, - MLP, E MoE.
NEMOTRON_H_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# The Mamba2 keys of each config style: (heads, head dim, groups, state size, conv kernel).
MAMBA2_KEYS = (
    ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel"),
    ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
)


# SGLang's GraniteMoeHybridConfig's names of transformers' layer types
GRANITE_LAYER_TYPES = {"linear_attention": "mamba", "full_attention": "attention",
                       "mamba": "mamba", "attention": "attention"}


def _mamba_layers(r: _Reader, granite: bool = False) -> tuple[int, list[int], list[int]]:
    """(num_layers, attention layers, Mamba2 layers) of a Mamba2 hybrid.

    Nemotron-H: ``layers_block_type`` (mamba / attention / mlp / moe), else the legacy
    ``hybrid_override_pattern``; its length is the layer count. Granite-4 hybrids:
    ``layer_types`` (mamba / attention, or transformers' linear_attention / full_attention;
    absent: every sixth layer attention, SGLang's default). Falcon-H1 (no layer list):
    attention and Mamba2 in every layer.
    """
    blocks = r.config.get("layers_block_type")
    pattern = r.config.get("hybrid_override_pattern")
    if blocks is None and isinstance(pattern, str):
        bad = sorted(set(pattern) - set(NEMOTRON_H_PATTERN))
        if bad:
            raise r.fail(f"hybrid_override_pattern has {echo(bad[0])} (accepted: M mamba, "
                         "* attention, - mlp, E moe)")
        blocks = [NEMOTRON_H_PATTERN[c] for c in pattern]
    if blocks is None and r.has("layer_types"):
        types = r.config.get("layer_types")
        blocks = [GRANITE_LAYER_TYPES.get(t, t) for t in types] if granite and isinstance(
            types, list) else types
    if blocks is None and granite:
        # SGLang's GraniteMoeHybridConfig without layer_types: layer i attention when
        # (i + 1) % 6 == 0, else mamba
        n = r.get_int("num_hidden_layers")
        blocks = ["attention" if (i + 1) % 6 == 0 else "mamba" for i in range(n)]
    if blocks is None:
        n = r.get_int("num_hidden_layers")
        return n, list(range(n)), list(range(n))
    accepted = ("mamba", "attention", "mlp", "moe")
    if not isinstance(blocks, list) or not blocks or len(blocks) > MAX_LAYERS:
        raise r.fail(f"the layer list must have 1 to {MAX_LAYERS:,} entries of "
                     f"{', '.join(accepted)}")
    bad_types = [b for b in blocks if b not in accepted]
    if bad_types:
        raise r.fail(f"the layer list has {echo(bad_types[0])} (accepted: {', '.join(accepted)})")
    return (len(blocks), [i for i, b in enumerate(blocks) if b == "attention"],
            [i for i, b in enumerate(blocks) if b == "mamba"])


def _hybrid_mamba(r: _Reader, architecture: str) -> SpecFields:
    """Mamba2 hybrids (Nemotron-H, Granite-4 hybrid, Falcon-H1): attention KV plus a Mamba2
    conv/SSM state per request slot in each Mamba layer, sized by the hybrid_linear module
    (``n_groups`` as its key heads, ``ssm_state_size`` as the key head dim)."""
    keys = next((k for k in MAMBA2_KEYS if r.has(k[0])), None)
    if keys is None:
        raise r.fail("a Mamba2 hybrid needs its state geometry: "
                     + " or ".join(f"({', '.join(k)})" for k in MAMBA2_KEYS))
    heads, head_dim, groups, state, kernel = (r.get_int(k) for k in keys)
    n, attention, mamba = _mamba_layers(r, architecture == "GraniteMoeHybridForCausalLM")
    # Nemotron-H's layer count is its layer list's length (num_hidden_layers is ignored)
    r = _Reader({**r.config, "num_hidden_layers": n}, r.where, r.field)
    fields = _common(r, architecture)
    hidden = r.opt_int("hidden_size")
    expand = r.config.get("mamba_expand")
    # Falcon-H1's config class gives mamba_d_ssm 1,024 when the file leaves it out (null:
    # expand x hidden), as SGLang reads it
    d_ssm = r.config.get("mamba_d_ssm", 1024 if architecture == "FalconH1ForCausalLM" else None)
    intermediate = (r.opt_int("mamba_d_ssm") if "mamba_d_ssm" in r.config else d_ssm) or (
        hidden * expand if hidden is not None and isinstance(expand, int) else None)
    if intermediate is not None and intermediate != heads * head_dim:
        raise r.fail(f"Mamba2 intermediate size {intermediate:,} is not heads x head dim "
                     f"({heads} x {head_dim}); kvpool's state shape assumes it is")
    fields["attention"] = _mha_attention(r)
    linear: dict[str, Any] = {
        "full_attention_layers": attention,
        "state_layers": mamba,
        "conv_kernel": kernel,
        "num_key_heads": groups,
        "num_value_heads": heads,
        "key_head_dim": state,
        "value_head_dim": head_dim,
    }
    ssm = r.config.get("mamba_ssm_dtype")
    if ssm is not None and architecture != "GraniteMoeHybridForCausalLM":
        linear["ssm_dtype"] = ssm  # Granite's SGLang config does not pass its config dtype
    fields["linear"] = linear
    return fields


KIMI_LINEAR_TYPES = hf_view.KIMI_LINEAR_TYPES
KDA_LAYERS = hf_view.KDA_LAYERS


def _hybrid_kda(r: _Reader, architecture: str) -> SpecFields:
    """Kimi delta attention hybrids (Kimi Linear; Kimi-K3 through its text config): MLA KV in
    the full-attention layers, a KDA conv + recurrent state per request slot in the others.

    SGLang's ``KimiLinearConfig``: layer ``i`` is KDA when ``i + 1`` is in
    ``linear_attn_config.kda_layers`` (``full_attn_layers`` must be set but is not read: every
    other layer is full attention); ``KimiLinearStateShape`` with ``num_heads`` H, ``head_dim``
    D, ``short_conv_kernel_size`` k: conv ``(k - 1, 3 * H * D / tp)`` (q, k and v), recurrent
    ``(H / tp, D, D)``, in SGLang's default state dtypes (bf16 conv, fp32 recurrent: the config's
    ``mamba_ssm_dtype`` is not read for KDA). That is the Mamba2 shape with ``n_groups = H``,
    ``state_size = head_dim``, conv axes swapped (``conv_layout = "window_first"``).
    """
    fields = _mla(r, architecture)
    n = fields["num_layers"]
    try:
        kda = hf_view.kimi_delta_attention(r.config, n, MAX_LAYERS)
    except ValueError as exc:
        raise r.fail(f"{architecture}: {exc} (SGLang cannot size its state pool either); give "
                     "a spec file (docs/sizing.md)") from None
    state = set(kda.state_layers)
    fields["linear"] = {
        "full_attention_layers": [i for i in range(n) if i not in state],
        "conv_kernel": kda.conv_kernel,
        "num_key_heads": kda.num_heads,
        "num_value_heads": kda.num_heads,
        "key_head_dim": kda.head_dim,
        "value_head_dim": kda.head_dim,
        "conv_layout": "window_first",
    }
    return fields


# The loader of each family of the architecture table (kvpoold.sizing.architectures).
FAMILY_LOADERS: dict[str, Callable[[_Reader, str], SpecFields]] = {
    "mha": _mha,
    "mla": _mla,
    "dsa": _dsa,
    "hybrid_swa": _mha,
    "hybrid_gdn": _hybrid_linear,
    "hybrid_mamba": _hybrid_mamba,
    "hybrid_kda": _hybrid_kda,
    "dsv4": _dsv4,
}
# `--assume-architecture FAMILY`: as the table's, but hybrid_swa reads its layers generically.
ASSUMED_LOADERS: dict[str, Callable[[_Reader, str], SpecFields]] = {
    **{k: v for k, v in FAMILY_LOADERS.items() if k in architectures.ASSUMABLE},
    "hybrid_swa": _hybrid_swa,
}


def _architecture_names(config: Config) -> list[str]:
    names = config.get("architectures")
    if isinstance(names, str):
        return [names]
    if isinstance(names, list):
        return [n for n in names if isinstance(n, str)]
    return []


def _text_view(config: Config, defaults: Mapping[str, Any]) -> Config:
    """The mapping a loader reads: the text config as transformers loads it
    (:func:`kvpoold.hf_view.class_view`: class defaults, legacy key names, the sliding
    switch), over the loader's own defaults.

    A multimodal config's text settings are its first sub-config among
    :data:`TEXT_CONFIG_KEYS` (Qwen2.5-Omni's thinker nests one more ``text_config``); a
    sub-config that states no dtype inherits the parent's, and quantization stated once at the
    top applies to it.
    """
    key, sub, parent = hf_view.text_config(config, "sglang")
    if key is None:
        return {**defaults, **hf_view.class_view(config)}
    view = hf_view.class_view(sub, hf_view.sub_model_type(parent, key))
    # a sub-config's own class knows its model_type (gemma3 -> gemma3_text); the parent's
    # has the same family prefix, which is what the dtype rule reads
    inherited = {k: parent[k] for k in ("dtype", "torch_dtype", "quantization_config",
                                        "model_type")
                 if k in parent and sub.get(k) is None}
    return {**defaults, **view, **inherited}


def _to_spec(fields: SpecFields, r: _Reader) -> ModelSpec:
    try:
        return msgspec.convert(fields, ModelSpec)
    except msgspec.ValidationError as exc:
        raise r.fail(f"config gives an invalid model spec: {exc}") from exc


def _family_of(row: architectures.Row, r: _Reader,
               model_type: object = None) -> tuple[str, tuple[str, ...]]:
    """The family SGLang builds for this row and config (the row's ``when`` conditions), with
    the text-config keys SGLang tested to decide it (present or not). ``model_type``: the
    config file's own (a wrapper's), which picks SGLang's config class."""
    if model_type in KIMI_LINEAR_TYPES and row.kv == "mla":
        # SGLang's KimiLinearConfig (the model's, or a Kimi-K3 wrapper's text config): a state
        # pool whatever the class row says (Kimi-K3's row reads only its wrapper class)
        return "hybrid_kda", ("model_type", KDA_LAYERS)
    if row.family == "hybrid_kda":
        raise r.fail(f"{row.name} has model_type {echo(model_type)}: SGLang "
                     "sizes Kimi delta attention only from its KimiLinearConfig (model_type "
                     f"{' or '.join(KIMI_LINEAR_TYPES)}), and kvpool does not guess how it "
                     "plans another; give a spec file (docs/sizing.md)")
    if row.family == "mla":
        needs = row.mla_only_with
        if needs == "kv_lora_rank" and not r.has("kv_lora_rank"):
            return "mha", ("kv_lora_rank",)
        if needs == "use_mla" and r.config.get("use_mla", True) is False:
            return "mha", ("use_mla",)
        decided = (needs,) if needs else ()
        if row.dsa_with_index_topk:
            return ("dsa" if r.has("index_topk") else "mla"), (*decided, "index_topk")
        return "mla", decided
    if row.family == "hybrid_mamba" and "layer_types" in row.when:
        # Granite-4: a Mamba2 hybrid only when some layer_types entry is mamba (SGLang's
        # GraniteMoeHybridConfig reads transformers' linear_attention as mamba, and without
        # layer_types makes every sixth layer attention, the rest mamba)
        types = r.config.get("layer_types")
        has = types is None or (isinstance(types, list) and any(
            GRANITE_LAYER_TYPES.get(t) == "mamba" for t in types))
        return ("hybrid_mamba" if has else "mha"), ("layer_types",)
    if row.family == "hybrid_mamba" and "mamba2_cache_params" in row.when:
        # Inkling: Mamba2 only with mamba2_cache_params; else its hybrid-SWA class rule
        if r.config.get("mamba2_cache_params") is None:
            return "hybrid_swa", ("mamba2_cache_params",)
        return "hybrid_mamba", ("mamba2_cache_params",)
    return row.family, ()


# The text-config keys each hybrid-SWA layer rule reads (the sliding pool exists only when the
# rule finds sliding layers).
_SLIDING_RULE_FIELDS: dict[SlidingRule, tuple[str, ...]] = {
    _by_layer_types: ("layer_types",),
    _if_any_sliding: ("layer_types",),
    _if_window: ("sliding_window", "layer_types"),
    _by_pattern: ("hybrid_layer_pattern",),
    _llama4: (),
    _every_layer: (),
}


def _loader_fields(family: str, architecture: str, r: _Reader) -> tuple[str, ...]:
    """The text-config keys the family's loader reads to split the layers into KV, sliding and
    state layers (what makes a hybrid hybrid)."""
    if family in ("mha", "hybrid_swa"):
        rule = HYBRID_SWA.get(architecture)
        if rule is not None:
            return _SLIDING_RULE_FIELDS[rule]
        if r.config.get("is_hybrid_swa") is True:
            return ("is_hybrid_swa", "hybrid_layer_pattern")
        return ()
    if family == "hybrid_gdn":
        return ("layer_types",) if r.has("layer_types") else ("full_attention_interval",)
    if family == "hybrid_mamba":
        for key in ("layers_block_type", "hybrid_override_pattern", "layer_types"):
            if r.has(key):
                return (key,)
        return ()
    return ()


def decided_by(names: list[str], known: str, text_key: str | None,
               fields: tuple[str, ...], kv_field: str | None) -> tuple[str, ...]:
    """The config fields that decided a plan's family, as paths in the file
    (``text_config.layer_types``): the class name's field, then the text-config keys tested,
    then the field that quantizes the KV cache, if any."""
    prefix = f"{text_key}." if text_key else ""
    name_field = "architectures" if known in names else f"{prefix}architectures"
    out = [name_field, *(f"{prefix}{k}" for k in dict.fromkeys(fields))]
    if kv_field is not None:
        out.append(kv_field)
    return tuple(out)


# The families whose pools hold each kind of per-request state a config can declare.
STATE_FAMILIES = {
    "mamba": ("hybrid_mamba", "mamba"),
    # transformers >= 5.15 renames mamba layers linear_attention (Granite-4's, read as mamba)
    "linear_attention": ("hybrid_gdn", "hybrid_kda", "hybrid_mamba"),
    "lightning": ("hybrid_lightning",),
}


def _check_content(config: Config, r: _Reader, known: str, family: str) -> None:
    """Refuse a config that declares Kimi delta attention layers outside a Kimi Linear config
    (where SGLang sizes no state pool for them) or state layers the row's family does not
    keep; never plan those layers as KV.

    Raises:
        InvalidArgument: naming the field.
    """
    kda = hf_view.kda_marker(config)
    if kda is not None and family != "hybrid_kda":
        raise r.fail(f"{kda} declares Kimi delta attention layers, but SGLang sizes "
                     "hybrid_kda state pools only for a Kimi Linear config (model_type "
                     f"{' or '.join(KIMI_LINEAR_TYPES)}) and sizes {known} as {family}: "
                     "the content contradicts the class, and kvpool does not guess how SGLang "
                     "plans those layers; give a spec file (docs/sizing.md)")
    marker = hf_view.state_layer_marker(r.config)
    if marker is not None and family not in STATE_FAMILIES[marker[1]]:
        raise r.fail(f"{marker[0]} declares {marker[1]} layers, which keep a per-request "
                     f"state, but {known} is sized as {family} by SGLang's class row; kvpool "
                     "does not guess how SGLang plans them: give a spec file (docs/sizing.md)")


def _unknown(names: list[str], config: Config, where: str, field: str) -> InvalidArgument:
    model_type = config.get("model_type")
    if names:
        near = architectures.nearest(names[0])
        what = (f"architecture {echo(names[0])} is not in SGLang "
                f"{architectures.SGLANG_VERSION}'s model registry (nearest known: "
                f"{', '.join(near)})")
    else:
        what = ("the config lists no architectures"
                + (f" (model_type {echo(model_type)})" if isinstance(model_type, str) else ""))
    return InvalidArgument(
        f"{where}: {what}; SGLang would run it through its generic Transformers backend, whose "
        "KV layout kvpool does not guess. "
        f"Give --assume-architecture FAMILY ({', '.join(architectures.ASSUMABLE)}) to read it "
        "as one of those, or a hand-written spec file (docs/sizing.md)", field=field)


@dataclass(frozen=True)
class HfModel:
    """A HF config as read for SGLang: the spec, how its family was found, and the config
    fields that decided the family (``("architectures", "text_config.layer_types")``; an
    assumed family: none)."""

    spec: ModelSpec
    source: ArchitectureSource
    decided_by: tuple[str, ...] = ()


def spec_from_hf(config: Config, *, where: str = "config.json", field: str = FIELD,
                 assume: str | None = None) -> tuple[ModelSpec, ArchitectureSource]:
    """:func:`read_hf`'s spec and source (callers that do not print the deciding fields).

    Raises:
        InvalidArgument: as :func:`read_hf`.
    """
    model = read_hf(config, where=where, field=field, assume=assume)
    return model.spec, model.source


def read_hf(config: Config, *, where: str = "config.json", field: str = FIELD,
            assume: str | None = None) -> HfModel:
    """Build the spec of a model from its parsed HF ``config.json``.

    The class (the first of ``architectures``, or of the text sub-config's, that SGLang's
    registry knows) picks the family from the architecture table
    (:mod:`kvpoold.sizing.architectures`), the family its loader.

    Args:
        config: the parsed JSON object.
        where: how to name the config in errors (the file path).
        field: the input field errors blame (``model_config``; the daemon: its RPC field).
        assume: a family (``--assume-architecture``) to read an unknown class as; a known class
            is still read by its own row.

    Returns:
        source ``"hf_config"`` for a class of the table (with the fields that decided the
        family), ``"assumed"`` for an unknown class read as ``assume``.

    Raises:
        InvalidArgument: an unknown class without ``assume`` (naming the nearest known ones), a
            family kvpool does not plan from a HF config, or a missing or mistyped field.
    """
    if assume is not None and assume not in ASSUMED_LOADERS:
        raise InvalidArgument(f"--assume-architecture {echo(assume)} is not a family kvpool "
                              f"reads (accepted: {', '.join(architectures.ASSUMABLE)})",
                              field="assume_architecture")
    names = _architecture_names(config)
    inner = _architecture_names(_text_view(config, {}))
    known = next((n for n in [*names, *inner] if architectures.row(n) is not None), None)
    if known is None:
        if assume is None:
            raise _unknown(names or inner, config, where, field)
        r = _Reader(_text_view(config, {}), where, field)
        name = (names or inner or [""])[0]
        fields = ASSUMED_LOADERS[assume](r, name)
        fields["multimodal"] = _multimodal(config, name, None)
        return HfModel(_to_spec(fields, r), "assumed")
    row = architectures.row(known)
    assert row is not None
    r = _Reader(_text_view(config, {}), where, field)
    family, tested = _family_of(row, r, config.get("model_type"))
    _check_content(config, r, known, family)
    load = FAMILY_LOADERS.get(family)
    if load is None:
        why = architectures.UNSUPPORTED.get(family, "kvpool has no loader for it")
        raise r.fail(f"SGLang sizes {known} as {family}: {why}")
    if family == "hybrid_swa" and known not in HYBRID_SWA:
        raise r.fail(f"SGLang sizes {known} as hybrid_swa, with a layer rule kvpool does not "
                     "read yet; give a spec file (docs/sizing.md)")
    if family == "hybrid_mamba" and "mamba2_cache_params" in tested:
        raise r.fail(f"SGLang sizes {known} as hybrid_mamba (mamba2_cache_params is set), from "
                     "a nested state geometry kvpool does not read yet; give a spec file "
                     "(docs/sizing.md)")
    if family == "hybrid_gdn" and row.kv == "mla":
        raise r.fail(f"SGLang sizes {known} as a gated-delta-net hybrid with MLA layers, which "
                     "kvpool does not plan yet; give a spec file (docs/sizing.md)")
    fields = load(r, known)
    fields["multimodal"] = _multimodal(config, names[0] if names else known, row)
    text_key, sub, _ = hf_view.text_config(config, "sglang")
    kv_field = kv_quant_field(r.config.get("quantization_config"))
    if kv_field is not None and text_key and sub.get("quantization_config") is not None:
        kv_field = f"{text_key}.{kv_field}"
    decided = decided_by(names, known, text_key, (*tested, *_loader_fields(family, known, r)),
                         kv_field)
    if family == "hybrid_kda" and text_key:
        # the wrapper's own model_type (kimi_k3) made its text config a KimiLinearConfig
        decided = tuple("model_type" if d == f"{text_key}.model_type" else d for d in decided)
    return HfModel(_to_spec(fields, r), "hf_config", decided)


def _multimodal(config: Config, first: str, row: architectures.Row | None) -> bool:
    """SGLang's ``ModelConfig.is_multimodal`` with ``--enable-multimodal`` unset: not one of the
    classes it turns multimodal off for, not ``language_model_only``, and either a multimodal
    architecture or a config whose text model is a sub-config. MiMo-V2 counts only with both
    ``vision_config`` and ``audio_config``."""
    first_row = architectures.row(first)
    if (first_row is not None and first_row.mm == "disabled") or config.get(
            "language_model_only") is True:
        return False
    if first == "MiMoV2ForCausalLM" and not ("vision_config" in config
                                              and "audio_config" in config):
        return False
    if first.startswith("Llava") and first.endswith("ForCausalLM"):
        return row is not None and row.mm == "listed"  # SGLang reads these flat
    return (first_row is not None and first_row.mm == "listed") or any(
        isinstance(config.get(k), Mapping) for k in TEXT_CONFIG_KEYS)


def parse_config_json(raw: bytes | str, where: str, field: str = FIELD) -> dict[str, Any]:
    """Parse a config.json as Hugging Face writes it, bounded.

    Python's JSON reading: ``Infinity``, ``-Infinity`` and ``NaN`` are accepted (transformers
    writes them, e.g. ``"router_aux_loss_coef": Infinity``); at most
    :data:`~kvpool.contract.limits.MAX_CONFIG_CHARS` characters, nesting bounded by Python's
    recursion limit, an object at the top.

    Raises:
        InvalidArgument: too large, not UTF-8, not JSON, too deep, or not an object.
    """
    if len(raw) > MAX_CONFIG_CHARS:
        raise InvalidArgument(f"{where} has {len(raw):,} characters, at most "
                              f"{MAX_CONFIG_CHARS:,}: that is not a config.json", field=field)
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        data = json.loads(text)
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{where} is not UTF-8 text: {exc.reason} at byte {exc.start}",
                              field=field) from exc
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} "
                              f"column {exc.colno}", field=field) from exc
    except RecursionError:
        raise InvalidArgument(f"{where} nests too deep to be a config.json", field=field) \
            from None
    if not isinstance(data, dict):
        raise InvalidArgument(
            f"{where} holds a JSON {type(data).__name__}, expected an object", field=field)
    return data


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_CHARS + 1)
    except OSError as exc:
        raise InvalidArgument(f"cannot read model config {path}: {exc.strerror or exc}",
                              field=FIELD) from exc
    return parse_config_json(raw, f"model config {path}")


def _resolve(path: Path) -> Path:
    # a model directory stands for its config.json
    return path / "config.json" if path.is_dir() else path


def load_model_config(path: Path, *, assume: str | None = None,
                      ) -> tuple[ModelSpec, ArchitectureSource]:
    """Read a HF ``config.json`` (or a model directory holding one).

    Returns:
        ``(spec, source)`` as :func:`spec_from_hf`.

    Raises:
        InvalidArgument: missing file, not JSON, not an object, or a bad config; names the path.
    """
    path = _resolve(Path(path))
    return spec_from_hf(_read_json_object(path), where=str(path), assume=assume)


def read_config_json(path: Path) -> tuple[dict[str, Any], Path]:
    """A HF ``config.json`` (or a model directory holding one) as a mapping, read and parsed
    as :func:`parse_config_json` does, with the file's path (for engines that read the config
    their own way: the vLLM profile).

    Raises:
        InvalidArgument: missing file, not JSON, or not an object; names the path.
    """
    path = _resolve(Path(path))
    return _read_json_object(path), path


def load_model(path: Path, *, assume: str | None = None) -> tuple[ModelSpec, ArchitectureSource]:
    """:func:`read_model`'s spec and source.

    Raises:
        InvalidArgument: as :func:`read_model`.
    """
    model = read_model(path, assume=assume)
    return model.spec, model.source


def read_model(path: Path, *, assume: str | None = None) -> HfModel:
    """Read either a HF ``config.json`` or a hand-written spec file.

    A ``.toml`` file, or a ``.json`` object with a top-level ``attention`` key, is a
    :class:`ModelSpec` written by hand (source ``"spec"``); anything else is a HF config
    (:func:`read_hf`).

    Returns:
        The spec, its source (``"spec"``, ``"hf_config"`` or ``"assumed"``) and, for a HF
        config, the fields that decided its family.

    Raises:
        InvalidArgument: missing file, malformed content, or an invalid spec; names the path.
    """
    path = _resolve(Path(path))
    if path.suffix == ".toml":
        if not path.is_file():
            raise InvalidArgument(f"cannot read model spec {path}: no such file", field=FIELD)
        return HfModel(load_spec_file(path), "spec")
    data = _read_json_object(path)
    if "attention" in data:
        return HfModel(decode_spec(data, source=str(path)), "spec")
    return read_hf(data, where=str(path), assume=assume)

"""Hugging Face ``config.json`` -> :class:`ModelSpec`, read the way SGLang 0.5.23 reads it.

:data:`LOADERS` maps the HF class name (``LlamaForCausalLM``) to a :class:`Loader`; an unknown
class with the standard fields is planned as plain MHA (source ``"fallback"``). The rules, each
SGLang's (``configs/model_config.py``, ``utils/hf_transformers/common.py``):

- **Text config.** A multimodal config is read through its first sub-config present among
  ``thinker_config``, ``llm_config``, ``language_config``, ``text_config``; a sub-config without a
  dtype inherits the parent's.
- **KV geometry.** ``head_dim`` given explicitly wins over ``hidden_size // num_attention_heads``;
  ``multi_query: true`` means one KV head; otherwise the first of ``n_head_kv``,
  ``num_kv_heads``, ``num_key_value_heads``, ``multi_query_group_num`` that is not null, else
  ``num_attention_heads``.
- **dtype** (``--dtype auto``): the config's ``dtype``, else ``torch_dtype``; none means
  float32, and float32 is served as float16, or bfloat16 when ``model_type`` starts with
  ``gemma``; gpt-oss with an ``mxfp4`` ``quantization_config`` runs in bfloat16. A checkpoint's
  ``kv_cache_quant_algo: FP8`` makes ``auto`` KV fp8_e4m3.
- **Context length**: the first present of ``max_sequence_length``, ``seq_length``,
  ``max_seq_len``, ``model_max_length``, ``max_position_embeddings`` (else 2048), times the
  ``rope_scaling`` ``factor`` unless that has ``original_max_position_embeddings`` or
  ``rope_type: llama3``.
- **Sliding window pools** only for SGLang's hybrid-SWA allowlist (:data:`HYBRID_SWA`: gpt-oss,
  Llama-4, Gemma-4, MiMo-V2, Step-3.5, ...) or a config saying ``is_hybrid_swa: true``. Gemma-2,
  Gemma-3, Mistral, Qwen2/3, Phi-3 and the like get a plain full-attention pool even with
  ``sliding_window`` or ``layer_types`` (the window is applied in attention only). An
  allowlisted model whose layers all slide gets an SWA-only pool.
- Qwen3-Next: full attention on ``(i + 1) % full_attention_interval == 0`` (or the
  ``"full_attention"`` entries of ``layer_types``), linear attention elsewhere.

Worked example, Llama-3.1-8B: 32 layers, 32 heads, 8 KV heads, hidden 4096 -> head_dim 128,
context 131,072 (rope_type llama3: no scaling), bfloat16:
``ModelSpec(num_layers=32, attention=MHAAttention(8, 128), context_length=131072, ...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvpool.contract.errors import InvalidArgument, echo
from kvpool.contract.limits import MAX_LAYERS
from kvpool.contract.plan import ArchitectureSource
from kvpool.contract.spec import ModelDType, ModelSpec, decode_spec, load_spec_file

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
TEXT_CONFIG_KEYS = ("thinker_config", "llm_config", "language_config", "text_config")
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")
DEFAULT_CONTEXT_LENGTH = 2048
# Key names of the KV head count, in the order SGLang tries them.
KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num")

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
    if r.config.get("multi_query") is True and not r.config.get("new_decoder_architecture"):
        return 1
    for key in KV_HEAD_KEYS:
        value = r.opt_int(key)
        if value is not None:
            return value
    return heads


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
    return {"type": "mha", "num_kv_heads": kv_heads, "head_dim": head_dim}


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


def _kv_cache_quant_fp8(r: _Reader) -> bool:
    quant = r.config.get("quantization_config")
    if not isinstance(quant, Mapping):
        return False
    algo = quant.get("kv_cache_quant_algo")
    return isinstance(algo, str) and algo.upper() == "FP8"


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


def _sliding(r: _Reader, n: int, architecture: str) -> dict[str, Any] | None:
    """The spec's ``sliding_window`` entry: only for the allowlist or ``is_hybrid_swa: true``."""
    rule = HYBRID_SWA.get(architecture)
    if rule is None and r.config.get("is_hybrid_swa") is True:
        rule = _by_pattern
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


# ---- loaders -----------------------------------------------------------------------------------


def _mha(r: _Reader, architecture: str) -> SpecFields:
    """An MHA/GQA model, with an SWA pool when SGLang gives it one (:func:`_sliding`)."""
    fields = _common(r, architecture)
    fields["attention"] = _mha_attention(r)
    window = _sliding(r, fields["num_layers"], architecture)
    if window is not None:
        fields["sliding_window"] = window
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
    fields = _mla(r, architecture)
    indexer: dict[str, Any] = {}
    if r.has("index_head_dim"):
        indexer["index_head_dim"] = r.get_int("index_head_dim")
    fields["indexer"] = indexer
    return fields


def _hybrid_linear(r: _Reader, architecture: str) -> SpecFields:
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


@dataclass(frozen=True)
class Loader:
    """How to read one HF architecture class.

    ``defaults`` are the HF config class defaults for keys real checkpoints omit (Gemma-3's
    ``text_config`` lists only what differs from ``Gemma3TextConfig``).
    """

    load: Callable[[_Reader, str], SpecFields]
    defaults: Mapping[str, Any] = field(default_factory=dict)


_GEMMA2_DEFAULTS = {
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 8192,
}
_GEMMA3_DEFAULTS = {
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 131072,
}

LOADERS: dict[str, Loader] = {
    "LlamaForCausalLM": Loader(_mha),
    "MistralForCausalLM": Loader(_mha),
    "Qwen2ForCausalLM": Loader(_mha),
    "Qwen3ForCausalLM": Loader(_mha),
    "Qwen3MoeForCausalLM": Loader(_mha),
    "Phi3ForCausalLM": Loader(_mha),
    "Gemma2ForCausalLM": Loader(_mha, _GEMMA2_DEFAULTS),
    "Gemma3ForCausalLM": Loader(_mha, _GEMMA3_DEFAULTS),
    "Gemma3ForConditionalGeneration": Loader(_mha, _GEMMA3_DEFAULTS),
    "DeepseekV2ForCausalLM": Loader(_mla),
    "DeepseekV3ForCausalLM": Loader(_mla),
    "DeepseekV32ForCausalLM": Loader(_dsa),
    "Qwen3NextForCausalLM": Loader(_hybrid_linear),
    **{name: Loader(_mha) for name in HYBRID_SWA},
}



def _architecture_names(config: Config) -> list[str]:
    names = config.get("architectures")
    if isinstance(names, str):
        return [names]
    if isinstance(names, list):
        return [n for n in names if isinstance(n, str)]
    return []


def _text_view(config: Config, defaults: Mapping[str, Any]) -> Config:
    """The mapping a loader reads: the class defaults, then the text config's own keys.

    A multimodal config's text settings are its first sub-config among
    :data:`TEXT_CONFIG_KEYS` (Qwen2.5-Omni's thinker nests one more ``text_config``); a
    sub-config that states no dtype inherits the parent's, and quantization stated once at the
    top applies to it.
    """
    parent = config
    for key in TEXT_CONFIG_KEYS:
        sub = config.get(key)
        if not isinstance(sub, Mapping):
            continue
        if key == "thinker_config" and isinstance(sub.get("text_config"), Mapping):
            parent, sub = sub, sub["text_config"]
        # a sub-config's own class knows its model_type (gemma3 -> gemma3_text); the parent's
        # has the same family prefix, which is what the dtype rule reads
        inherited = {k: parent[k] for k in ("dtype", "torch_dtype", "quantization_config",
                                            "model_type")
                     if k in parent and sub.get(k) is None}
        return {**defaults, **inherited, **sub}
    return {**defaults, **config}


def _to_spec(fields: SpecFields, r: _Reader) -> ModelSpec:
    try:
        return msgspec.convert(fields, ModelSpec)
    except msgspec.ValidationError as exc:
        raise r.fail(f"config gives an invalid model spec: {exc}") from exc


def _fallback(config: Config, name: str, r: _Reader) -> SpecFields:
    missing = [k for k in ("num_hidden_layers", "num_attention_heads") if config.get(k) is None]
    if config.get("head_dim") is None and config.get("hidden_size") is None:
        missing.append("hidden_size (or head_dim)")
    if missing:
        what = f"architecture {echo(name)} has no loader" if name else "no architectures listed"
        raise r.fail(
            f"{what} and the MHA fallback needs {', '.join(missing)} "
            f"(supported architectures: {', '.join(sorted(LOADERS))})"
        )
    return _mha(r, name)


def spec_from_hf(config: Config, *, where: str = "config.json", field: str = FIELD,
                 ) -> tuple[ModelSpec, ArchitectureSource]:
    """Build the spec of a model from its parsed HF ``config.json``.

    Args:
        config: the parsed JSON object.
        where: how to name the config in errors (the file path).
        field: the input field errors blame (``model_config``; the daemon: its RPC field).

    Returns:
        ``(spec, "hf_config")`` for a class in :data:`LOADERS`, ``(spec, "fallback")`` for an
        unknown class planned as MHA from the standard fields.

    Raises:
        InvalidArgument: a missing or mistyped field, naming it (and, for an unknown class
            without the standard fields, the supported architectures).
    """
    names = _architecture_names(config)
    known = next((n for n in names if n in LOADERS), None)
    if known is None:
        view = _Reader(_text_view(config, {}), where, field)
        # a wrapper around a known text model (LLaVA's text_config names LlamaForCausalLM)
        inner = next((n for n in _architecture_names(view.config) if n in LOADERS), None)
        if inner is None:
            model_type = config.get("model_type")
            name = names[0] if names else (model_type if isinstance(model_type, str) else "")
            return _to_spec(_fallback(view.config, name, view), view), "fallback"
        known = inner
    loader = LOADERS[known]
    view = _Reader(_text_view(config, loader.defaults), where, field)
    return _to_spec(loader.load(view, known), view), "hf_config"


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read model config {path}: {exc.strerror or exc}",
                              field=FIELD) from exc
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"model config {path} is not valid JSON: {exc}",
                              field=FIELD) from exc
    if not isinstance(data, dict):
        raise InvalidArgument(
            f"model config {path} holds a JSON {type(data).__name__}, expected an object",
            field=FIELD,
        )
    return data


def _resolve(path: Path) -> Path:
    # a model directory stands for its config.json
    return path / "config.json" if path.is_dir() else path


def load_model_config(path: Path) -> tuple[ModelSpec, ArchitectureSource]:
    """Read a HF ``config.json`` (or a model directory holding one).

    Returns:
        ``(spec, source)`` as :func:`spec_from_hf`.

    Raises:
        InvalidArgument: missing file, not JSON, not an object, or a bad config; names the path.
    """
    path = _resolve(Path(path))
    return spec_from_hf(_read_json_object(path), where=str(path))


def load_model(path: Path) -> tuple[ModelSpec, ArchitectureSource]:
    """Read either a HF ``config.json`` or a hand-written spec file.

    A ``.toml`` file, or a ``.json`` object with a top-level ``attention`` key, is a
    :class:`ModelSpec` written by hand (source ``"spec"``); anything else is a HF config.

    Returns:
        ``(spec, source)`` with source ``"spec"``, ``"hf_config"`` or ``"fallback"``.

    Raises:
        InvalidArgument: missing file, malformed content, or an invalid spec; names the path.
    """
    path = _resolve(Path(path))
    if path.suffix == ".toml":
        if not path.is_file():
            raise InvalidArgument(f"cannot read model spec {path}: no such file", field=FIELD)
        return load_spec_file(path), "spec"
    data = _read_json_object(path)
    if "attention" in data:
        return decode_spec(data, source=str(path)), "spec"
    return spec_from_hf(data, where=str(path))

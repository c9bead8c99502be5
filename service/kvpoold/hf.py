"""Hugging Face ``config.json`` -> :class:`ModelSpec`, one loader per architecture class in a table.

:data:`LOADERS` maps the HF class name (``LlamaForCausalLM``) to a :class:`Loader`; an unknown
class with the standard fields is planned as plain MHA (source ``"fallback"``). Conventions,
each as the Hugging Face config classes define them:

- ``head_dim`` given explicitly wins over ``hidden_size // num_attention_heads``;
  ``num_key_value_heads`` defaults to ``num_attention_heads``.
- No sliding window when ``use_sliding_window`` is false or ``sliding_window`` is null/absent
  (Qwen2/Qwen3 configs also need ``use_sliding_window: true``: false is their HF default).
  Otherwise ``layer_types`` (``"sliding_attention"`` / ``"full_attention"``) decides which
  layers slide; without it each family's default pattern applies:
  Mistral: every layer (all-SWA); Qwen2/Qwen3/Qwen3-MoE: layers ``i >= max_window_layers``
  (HF default 28), the first ``max_window_layers`` stay full; Gemma-2 and gpt-oss: even layers
  slide, odd are full (HF: ``sliding if (i + 1) % 2 else full``, so layer 0 slides);
  Gemma-3: every ``sliding_window_pattern``-th layer is full (``(i + 1) % pattern == 0``, HF
  default 6), the rest slide. Llama and DeepSeek never slide.
- Qwen3-Next: full attention on ``(i + 1) % full_attention_interval == 0`` (or the
  ``"full_attention"`` entries of ``layer_types``), linear attention elsewhere.
- dtype from ``torch_dtype`` (or ``dtype``), default bfloat16; context length is
  ``max_position_embeddings``; ``quantization_config.kv_cache_quant_algo == "FP8"`` sets
  ``kv_cache_quant_fp8``.

Worked example, Llama-3.1-8B: 32 layers, 32 heads, 8 KV heads, hidden 4096 -> head_dim 128,
context 131,072, bfloat16: ``ModelSpec(num_layers=32, attention=MHAAttention(8, 128), ...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvpool.errors import InvalidArgument
from kvpool.plan import ArchitectureSource
from kvpool.spec import ModelDType, ModelSpec, decode_spec, load_spec_file

FIELD = "model_config"
SLIDING = "sliding_attention"
FULL = "full_attention"
LINEAR = "linear_attention"

# HF dtype spellings -> ours; "auto" and null mean "not said", i.e. the bfloat16 default.
_DTYPES: dict[str, ModelDType] = {
    "bfloat16": ModelDType.bfloat16,
    "bf16": ModelDType.bfloat16,
    "float16": ModelDType.float16,
    "fp16": ModelDType.float16,
    "half": ModelDType.float16,
    "float32": ModelDType.float32,
    "fp32": ModelDType.float32,
    "float": ModelDType.float32,
}
DEFAULT_DTYPE = ModelDType.bfloat16
QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2Config / Qwen3Config default
GEMMA3_DEFAULT_SLIDING_WINDOW_PATTERN = 6  # Gemma3TextConfig default

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
            raise self.fail(f"{key} must be an integer, got {value!r}")
        return value


def _mha_attention(r: _Reader) -> dict[str, Any]:
    """KV geometry of an MHA/GQA model: explicit head_dim wins over hidden / heads."""
    heads = r.get_int("num_attention_heads")
    if heads < 1:
        raise r.fail(f"num_attention_heads must be >= 1, got {heads}")
    kv_heads = r.opt_int("num_key_value_heads", heads)
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


def _model_dtype(r: _Reader) -> ModelDType:
    raw = r.config.get("torch_dtype")
    if raw is None:  # newer transformers write ``dtype``
        raw = r.config.get("dtype")
    if raw is None or raw == "auto":
        return DEFAULT_DTYPE
    name = raw.removeprefix("torch.") if isinstance(raw, str) else ""
    if name not in _DTYPES:
        raise r.fail(
            f"torch_dtype {raw!r} is not supported (accepted: {', '.join(_DTYPES)}, auto)"
        )
    return _DTYPES[name]


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
        "context_length": r.get_int("max_position_embeddings"),
        "dtype": _model_dtype(r),
        "architecture": architecture,
        "num_nextn_predict_layers": r.opt_int("num_nextn_predict_layers", 0),
        "kv_cache_quant_fp8": _kv_cache_quant_fp8(r),
    }


# ---- sliding window ---------------------------------------------------------------------------

# (reader, num_layers) -> global ids of the sliding layers when the config has no layer_types
SlidingPattern = Callable[[_Reader, int], list[int]]


def _window(r: _Reader, flag_default: bool) -> int | None:
    """The window size, or None when the config turns sliding off (``flag_default`` is what an
    absent ``use_sliding_window`` means for the family)."""
    flag = r.config.get("use_sliding_window")
    if not (flag_default if flag is None else flag):
        return None
    return r.opt_int("sliding_window")


def _layer_types(r: _Reader, n: int, accepted: tuple[str, ...]) -> list[str] | None:
    raw = r.config.get("layer_types")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != n:
        raise r.fail(f"layer_types must be a list of num_hidden_layers = {n} entries")
    bad = [t for t in raw if t not in accepted]
    if bad:
        raise r.fail(f"layer_types has {bad[0]!r} (accepted: {', '.join(accepted)})")
    return raw


def _sliding(r: _Reader, n: int, pattern: SlidingPattern | None,
             flag_default: bool) -> dict[str, Any] | None:
    """The spec's ``sliding_window`` entry: layer_types first, then the family pattern."""
    window = _window(r, flag_default)
    if window is None:
        return None
    types = _layer_types(r, n, (SLIDING, FULL))
    if types is not None:
        layers = [i for i, t in enumerate(types) if t == SLIDING]
    elif pattern is not None:
        layers = pattern(r, n)
    else:
        return None
    if not layers:
        return None
    return {"window": window, "layers": layers}


def _all_layers(r: _Reader, n: int) -> list[int]:
    return list(range(n))


def _even_layers(r: _Reader, n: int) -> list[int]:
    return list(range(0, n, 2))


def _after_max_window_layers(r: _Reader, n: int) -> list[int]:
    first = r.opt_int("max_window_layers", QWEN2_DEFAULT_MAX_WINDOW_LAYERS)
    assert first is not None
    return list(range(max(first, 0), n))


def _gemma3_pattern(r: _Reader, n: int) -> list[int]:
    key = "sliding_window_pattern" if r.has("sliding_window_pattern") \
        else "_sliding_window_pattern"
    every = r.opt_int(key, GEMMA3_DEFAULT_SLIDING_WINDOW_PATTERN)
    assert every is not None
    if every < 1:
        raise r.fail(f"{key} must be >= 1, got {every}")
    return [i for i in range(n) if (i + 1) % every != 0]


# ---- loaders -----------------------------------------------------------------------------------


def _mha_family(pattern: SlidingPattern | None, *, use_sliding_window_default: bool = True,
                ) -> Callable[[_Reader, str], SpecFields]:
    """Loader body for an MHA/GQA family whose default sliding layers follow ``pattern``;
    ``use_sliding_window_default`` is the family's value of an absent ``use_sliding_window``."""

    def load(r: _Reader, architecture: str) -> SpecFields:
        fields = _common(r, architecture)
        fields["attention"] = _mha_attention(r)
        window = _sliding(r, fields["num_layers"], pattern, use_sliding_window_default)
        if window is not None:
            fields["sliding_window"] = window
        return fields

    return load


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
    ``text_config`` lists only what differs from ``Gemma3TextConfig``); ``text_config`` says the
    text model's fields are nested there (multimodal wrappers).
    """

    load: Callable[[_Reader, str], SpecFields]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    text_config: bool = False


_GEMMA2_DEFAULTS = {
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 8192, "sliding_window": 4096,
}
_GEMMA3_DEFAULTS = {
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 131072, "sliding_window": 4096,
}
_gemma3 = _mha_family(_gemma3_pattern)
# Qwen2Config / Qwen3Config default use_sliding_window to false
_qwen = _mha_family(_after_max_window_layers, use_sliding_window_default=False)

LOADERS: dict[str, Loader] = {
    "LlamaForCausalLM": Loader(_mha_family(None)),
    "MistralForCausalLM": Loader(_mha_family(_all_layers)),
    "Qwen2ForCausalLM": Loader(_qwen),
    "Qwen3ForCausalLM": Loader(_qwen),
    "Qwen3MoeForCausalLM": Loader(_qwen),
    "Gemma2ForCausalLM": Loader(_mha_family(_even_layers), _GEMMA2_DEFAULTS),
    "Gemma3ForCausalLM": Loader(_gemma3, _GEMMA3_DEFAULTS),
    "Gemma3ForConditionalGeneration": Loader(_gemma3, _GEMMA3_DEFAULTS, text_config=True),
    "GptOssForCausalLM": Loader(_mha_family(_even_layers)),
    "DeepseekV2ForCausalLM": Loader(_mla),
    "DeepseekV3ForCausalLM": Loader(_mla),
    "DeepseekV32ForCausalLM": Loader(_dsa),
    "Qwen3NextForCausalLM": Loader(_hybrid_linear),
}

# What the MHA fallback needs; ``hidden_size`` may stand in for ``head_dim``.
FALLBACK_FIELDS = ("num_hidden_layers", "num_attention_heads", "max_position_embeddings")


def _architecture_names(config: Config) -> list[str]:
    names = config.get("architectures")
    if isinstance(names, str):
        return [names]
    if isinstance(names, list):
        return [n for n in names if isinstance(n, str)]
    return []


def _text_view(config: Config, loader: Loader, r: _Reader) -> Config:
    """The mapping the loader reads: HF defaults, then the (text) config's own keys."""
    if not loader.text_config:
        return {**loader.defaults, **config}
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise r.fail("missing text_config (the text model's settings)")
    # dtype and quantization are usually stated once at the top level of a wrapper config
    inherited = {k: config[k] for k in ("torch_dtype", "dtype", "quantization_config")
                 if k in config}
    return {**loader.defaults, **inherited, **text}


def _to_spec(fields: SpecFields, r: _Reader) -> ModelSpec:
    try:
        return msgspec.convert(fields, ModelSpec)
    except msgspec.ValidationError as exc:
        raise r.fail(f"config gives an invalid model spec: {exc}") from exc


def _fallback(config: Config, name: str, r: _Reader) -> SpecFields:
    missing = [k for k in FALLBACK_FIELDS if config.get(k) is None]
    if config.get("head_dim") is None and config.get("hidden_size") is None:
        missing.append("hidden_size (or head_dim)")
    if missing:
        what = f"architecture {name!r} has no loader" if name else "no architectures listed"
        raise r.fail(
            f"{what} and the MHA fallback needs {', '.join(missing)} "
            f"(supported architectures: {', '.join(LOADERS)})"
        )
    fields = _common(r, name)
    fields["attention"] = _mha_attention(r)
    return fields


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
    top = _Reader(config, where, field)
    if known is None:
        model_type = config.get("model_type")
        name = names[0] if names else (model_type if isinstance(model_type, str) else "")
        return _to_spec(_fallback(config, name, top), top), "fallback"
    loader = LOADERS[known]
    view = _Reader(_text_view(config, loader, top), where, field)
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

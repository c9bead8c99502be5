"""The model spec: what the configurator needs to know about a model, validated at decode.

A spec is built from a Hugging Face ``config.json`` by :mod:`kvpoold.hf`, or written by hand as a
JSON/TOML file for models without a loader (DeepSeek-V4 included). Every edge input goes through
:func:`decode_spec` / :func:`msgspec.convert`, so a bad value comes back with its path
(``Expected `int` >= 1 - at `$.num_layers```). Dtypes are string enums, never ``torch.dtype``.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.limits import MAX_LAYERS, MAX_NAME_CHARS
from kvpool.contract.spec_hints import explain

PositiveInt = Annotated[int, Meta(ge=1, le=1 << 40)]
NonNegInt = Annotated[int, Meta(ge=0, le=1 << 40)]
# Layer counts and ids are bounded (kvpool.contract.limits.MAX_LAYERS): planning is O(layers).
LayerCount = Annotated[int, Meta(ge=1, le=MAX_LAYERS)]
LayerId = Annotated[int, Meta(ge=0, le=MAX_LAYERS - 1)]
LayerIds = Annotated[tuple[LayerId, ...], Meta(max_length=MAX_LAYERS)]


class ModelDType(enum.StrEnum):
    """The model's activation dtype (``torch_dtype`` in a HF config); ``auto`` KV follows it."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Base(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Policy for every edge Struct: frozen, keyword-only, unknown fields rejected."""


class MHAAttention(Base, tag="mha", tag_field="type"):
    """Multi-head / grouped-query attention: K and V per KV head."""

    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    v_head_dim: PositiveInt | None = None  # defaults to head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim


class MLAAttention(Base, tag="mla", tag_field="type"):
    """Multi-head latent attention: one compressed latent per token, not split by TP."""

    kv_lora_rank: PositiveInt
    qk_rope_head_dim: PositiveInt


class SlidingWindow(Base):
    """Sliding-window layers of a hybrid (or all-SWA) model.

    ``layers`` are global layer ids that slide; the others are full attention. The SWA layers may
    have their own KV geometry (``num_kv_heads``/``head_dim``); by default they share the model's.
    """

    window: PositiveInt
    layers: LayerIds
    num_kv_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    v_head_dim: PositiveInt | None = None


class DSAIndexer(Base):
    """DeepSeek sparse attention (V3.2) lightning indexer: fp8 K + fp32 scale per token/layer."""

    index_head_dim: Annotated[int, Meta(ge=128, le=128)] = 128


class LinearAttention(Base):
    """Hybrid linear attention (Qwen3-Next gated delta net / Mamba2-style state).

    ``full_attention_layers`` use the regular KV cache; the state layers (``state_layers``, by
    default every layer not in ``full_attention_layers``) keep a conv state
    ``(conv_dim / tp, conv_kernel - 1)`` and an SSM state ``(num_value_heads / tp,
    value_head_dim, key_head_dim)`` per request slot. Mamba2 hybrids map onto it as
    ``num_key_heads = n_groups``, ``key_head_dim = ssm_state_size``, ``num_value_heads =
    mamba heads``, ``value_head_dim = mamba head dim``; their MLP/MoE layers are in neither
    list (Nemotron-H), and a layer may be in both (Falcon-H1: attention and Mamba2 in every
    layer). Kimi delta attention (Kimi Linear) maps onto it with ``num_key_heads =
    num_value_heads = linear_attn_config.num_heads`` and ``key_head_dim = value_head_dim =
    head_dim`` (its conv state holds q, k and v: ``conv_dim = 3 * heads * head_dim``) and
    ``conv_layout = "window_first"``: SGLang keeps that conv state as ``(conv_kernel - 1,
    conv_dim / tp)`` per slot, the same bytes in the other axis order.
    """

    full_attention_layers: LayerIds
    conv_kernel: PositiveInt
    num_key_heads: PositiveInt
    num_value_heads: PositiveInt
    key_head_dim: PositiveInt
    value_head_dim: PositiveInt
    conv_dtype: ModelDType = ModelDType.bfloat16
    ssm_dtype: ModelDType = ModelDType.float32
    state_layers: LayerIds | None = None
    # the conv state's axis order per slot: (conv_dim / tp, conv_kernel - 1), SGLang's Mamba2 /
    # gated-delta-net pools, or (conv_kernel - 1, conv_dim / tp), its Kimi delta attention pool
    conv_layout: Literal["dim_first", "window_first"] = "dim_first"

    def state_layer_ids(self, num_layers: int) -> tuple[int, ...]:
        """The layers holding conv/SSM state: ``state_layers``, else the non-full layers."""
        if self.state_layers is not None:
            return self.state_layers
        full = set(self.full_attention_layers)
        return tuple(i for i in range(num_layers) if i not in full)


class DSV4Compression(Base):
    """DeepSeek-V4 compressed attention: per-layer compress ratio (0, 4 or 128) plus an SWA ring."""

    compress_ratios: Annotated[tuple[Literal[0, 4, 128], ...], Meta(max_length=MAX_LAYERS)]
    window_size: PositiveInt = 128
    nope_head_dim: PositiveInt = 448
    rope_head_dim: PositiveInt = 64
    index_head_dim: PositiveInt = 128
    state_dtype: Literal["float32", "bfloat16"] = "float32"


class ModelSpec(Base):
    """Everything the configurator reads about a model.

    Cross-field rules are checked in ``__post_init__`` (layer ids in range, one attention kind).
    """

    num_layers: LayerCount
    attention: MHAAttention | MLAAttention
    context_length: PositiveInt
    dtype: ModelDType = ModelDType.bfloat16
    # The HF class name, informational (kept in the plan: bounded).
    architecture: Annotated[str, Meta(max_length=MAX_NAME_CHARS)] = ""
    sliding_window: SlidingWindow | None = None
    indexer: DSAIndexer | None = None
    linear: LinearAttention | None = None
    dsv4: DSV4Compression | None = None
    num_nextn_predict_layers: Annotated[int, Meta(ge=0, le=MAX_LAYERS)] = 0
    kv_cache_quant_fp8: bool = False  # checkpoint says kv_cache_quant_algo=FP8: `auto` -> fp8_e4m3
    # SGLang serves it as multimodal: it reserves its multimodal cache out of the KV budget
    multimodal: bool = False

    def __post_init__(self) -> None:
        n = self.num_layers
        for label, ids in (
            ("sliding_window.layers", self.sliding_window.layers if self.sliding_window else ()),
            ("linear.full_attention_layers",
             self.linear.full_attention_layers if self.linear else ()),
            ("linear.state_layers",
             (self.linear.state_layers or ()) if self.linear else ()),
        ):
            bad = [i for i in ids if i >= n]
            if bad:
                raise ValueError(f"{label} has layer id {bad[0]} but num_layers is {n}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{label} repeats a layer id")
        if self.indexer is not None and not isinstance(self.attention, MLAAttention):
            raise ValueError("indexer (DSA) needs attention.type = 'mla'")
        if self.dsv4 is not None and len(self.dsv4.compress_ratios) != n:
            raise ValueError(
                f"dsv4.compress_ratios has {len(self.dsv4.compress_ratios)} entries, "
                f"expected num_layers = {n}"
            )
        extras = [k for k in ("sliding_window", "linear", "dsv4") if getattr(self, k) is not None]
        if len(extras) > 1 and extras != ["sliding_window", "dsv4"]:
            raise ValueError(f"{' and '.join(extras)} cannot be combined in one spec")


def decode_spec(data: bytes | str | dict, *, source: str = "spec",
                field: str = "model") -> ModelSpec:
    """Validate a spec given as JSON text or an already-parsed mapping.

    Raises:
        InvalidArgument: with the msgspec path of the first bad field (``field`` names the
            request field that carried the spec).
    """
    try:
        if isinstance(data, dict):
            return msgspec.convert(data, ModelSpec)
        return msgspec.json.decode(data, type=ModelSpec)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidArgument(f"invalid model spec in {source}: {explain(exc, ModelSpec)}",
                              field=field) from exc


def load_spec_file(path: Path) -> ModelSpec:
    """Read a spec from a ``.json`` or ``.toml`` file (a hand-written :class:`ModelSpec`)."""
    raw = path.read_bytes()
    if path.suffix == ".toml":
        try:
            return msgspec.toml.decode(raw, type=ModelSpec)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise InvalidArgument(f"invalid model spec in {path}: {explain(exc, ModelSpec)}",
                                  field="model") from exc
    return decode_spec(raw, source=str(path))

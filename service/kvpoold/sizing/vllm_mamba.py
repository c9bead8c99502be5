"""The Mamba hybrids of vLLM 0.32 the profile reads, by text ``model_type``: which layers are
Mamba mixers, attention or MLP blocks, the mixers' state geometry and vLLM's module names.

Nemotron-H places its blocks by ``hybrid_override_pattern``, Jamba by period and offset,
Granite-4.0-H by ``layer_types`` (transformers' names: ``mamba`` / ``linear_attention`` a
Mamba-2 mixer, ``attention`` / ``full_attention`` attention); Falcon-H1 runs an attention and
a Mamba-2 mixer side by side in every layer (vLLM names the mixer of layer ``i``
``model.{num_hidden_layers + i}.mixer``, outside ``model.layers``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.contract.errors import InvalidArgument
from kvpoold.sizing.vllm_layers import (
    DTYPE_NAMES,
    FIELD,
    VLLM_VERSION,
    LayerKind,
    MambaMixer,
)
from kvpoold.sizing.vllm_layers import positive_int as _int


@dataclass(frozen=True)
class StateLayers:
    """A Mamba hybrid's layers as its vLLM model class builds them."""

    mixer: MambaMixer | None  # None: no Mamba layer (vLLM plans plain attention)
    kinds: tuple[LayerKind, ...]  # per layer: mamba, full or ffn
    fields: tuple[str, ...]  # the config fields that placed them
    attention_module: str
    state_module: str
    # Falcon-H1: every decoder layer holds an attention beside its mixer (registered first)
    parallel_attention: bool = False
    # what vLLM adds to a decoder layer's index in its mixer's module name (Falcon-H1: n)
    state_index_offset: int = 0
    head_size: int | None = None  # the attention's head size when the class fixes it


# Nemotron-H's block letters (``hybrid_override_pattern``) and what each caches
NEMOTRON_H_BLOCKS = {"M": LayerKind.mamba, "*": LayerKind.full, "-": LayerKind.ffn,
                     "E": LayerKind.ffn}


def _nemotron_h(text: Mapping[str, Any], n: int, where: str) -> StateLayers:
    """Nemotron-H: one block per letter of ``hybrid_override_pattern``, Mamba-2 mixers of
    ``mamba_num_heads`` heads; vLLM's config hook sets an ``auto`` SSM dtype to the config's
    ``mamba_ssm_cache_dtype``, else float32."""
    pattern = text.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or len(pattern) != n:
        raise InvalidArgument(
            f"{where}: hybrid_override_pattern must be a string of num_hidden_layers ({n}) "
            f"block letters, got {pattern!r}", field=FIELD)
    kinds = _layer_kinds(pattern, NEMOTRON_H_BLOCKS, where, "hybrid_override_pattern",
                         "Nemotron-H", "blocks")
    heads, head_dim = _int(text, "mamba_num_heads", where), _int(text, "mamba_head_dim", where)
    mixer = MambaMixer(heads * head_dim, _int(text, "ssm_state_size", where),
                       _int(text, "conv_kernel", where), _int(text, "n_groups", where),
                       heads, head_dim,
                       auto_ssm_dtype=DTYPE_NAMES.get(
                           str(text.get("mamba_ssm_cache_dtype")), "float32"))
    return StateLayers(mixer, tuple(kinds), ("hybrid_override_pattern",),
                       "model.layers.{i}.mixer.attn", "model.layers.{i}.mixer")


def _jamba(text: Mapping[str, Any], n: int, where: str) -> StateLayers:
    """Jamba: attention where ``i % attn_layer_period == attn_layer_offset``, Mamba-1
    mixers of ``mamba_expand * hidden_size`` channels elsewhere."""
    period = _int(text, "attn_layer_period", where)
    offset = text.get("attn_layer_offset")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise InvalidArgument(f"{where}: attn_layer_offset must be an integer in [0, "
                              f"attn_layer_period), got {offset!r}", field=FIELD)
    kinds = tuple(LayerKind.full if i % period == offset else LayerKind.mamba
                  for i in range(n))
    mixer = MambaMixer(_int(text, "mamba_expand", where) * _int(text, "hidden_size", where),
                       _int(text, "mamba_d_state", where), _int(text, "mamba_d_conv", where))
    return StateLayers(mixer, kinds, ("attn_layer_period", "attn_layer_offset"),
                       "model.layers.{i}.attn", "model.layers.{i}.mixer")


def _mamba2(text: Mapping[str, Any], where: str, intermediate: int,
            linear_layer_types: bool) -> MambaMixer:
    """A ``MambaMixer2`` of the ``mamba_*`` keys (Falcon-H1, Granite-4.0-H): ``mamba_d_head``
    ``auto`` (or absent) is ``intermediate / mamba_n_heads``, as their transformers classes
    resolve it; vLLM sets no SSM dtype of its own for them."""
    heads = _int(text, "mamba_n_heads", where)
    head_dim = text.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = intermediate // heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise InvalidArgument(f"{where}: mamba_d_head must be a positive integer or 'auto', "
                              f"got {head_dim!r}", field=FIELD)
    if head_dim * heads != intermediate:
        raise InvalidArgument(
            f"{where}: mamba_n_heads x mamba_d_head ({heads} x {head_dim}) is not the Mamba "
            f"intermediate size {intermediate:,} (transformers refuses such a config)",
            field=FIELD)
    return MambaMixer(intermediate, _int(text, "mamba_d_state", where),
                      _int(text, "mamba_d_conv", where), _int(text, "mamba_n_groups", where),
                      heads, head_dim, linear_layer_types=linear_layer_types)


# FalconH1Config's mamba_d_ssm when a config leaves it out (transformers' and SGLang's class)
FALCON_H1_D_SSM = 1024


def _falcon_h1(text: Mapping[str, Any], n: int, where: str) -> StateLayers:
    """Falcon-H1: every layer is an attention and a Mamba-2 mixer in parallel (vLLM's
    ``FalconH1ParallelHybrid``: attention ``model.layers.{i}.attn``, mixer
    ``model.{n + i}.mixer``); the mixer's intermediate size is ``mamba_d_ssm``, or
    ``mamba_expand * hidden_size`` when it is null; absent, transformers' FalconH1Config
    default (:data:`FALCON_H1_D_SSM`), which is what vLLM reads."""
    d_ssm = text.get("mamba_d_ssm", FALCON_H1_D_SSM)
    intermediate = (_int(text, "mamba_expand", where) * _int(text, "hidden_size", where)
                    if d_ssm is None else _int({"mamba_d_ssm": d_ssm}, "mamba_d_ssm", where))
    # transformers maps Falcon-H1's layer_types to its layers_block_type ("hybrid" per
    # layer): vLLM's CPU platform sees no linear_attention layer in it
    mixer = _mamba2(text, where, intermediate, linear_layer_types=False)
    return StateLayers(mixer, (LayerKind.mamba,) * n, ("model_type",),
                       "model.layers.{i}.attn", "model.{i}.mixer",
                       parallel_attention=True, state_index_offset=n)


# Granite-4.0-H's layer_types entries (transformers renames the legacy mamba / attention)
GRANITE_LAYER_TYPES = {"mamba": LayerKind.mamba, "linear_attention": LayerKind.mamba,
                       "attention": LayerKind.full, "full_attention": LayerKind.full}


def _granitemoehybrid(text: Mapping[str, Any], n: int, where: str) -> StateLayers:
    """Granite-4.0-H: layer ``i`` is a Mamba-2 mixer (``model.layers.{i}.mixer``) or an
    attention (``model.layers.{i}.self_attn.attn``) by ``layer_types[i]`` (transformers'
    default when absent: every layer Mamba); Mamba intermediate ``mamba_expand *
    hidden_size``; the attention's head size is ``hidden_size / num_attention_heads`` (vLLM's
    class reads no ``head_dim``). Every layer attention (Granite-4.0-Micro) is not hybrid to
    vLLM: plain attention, no state. No attention layer at all is refused (an attention-free
    plan)."""
    types = text.get("layer_types", text.get("layers_block_type"))
    field_name = "layer_types" if "layer_types" in text or "layers_block_type" not in text \
        else "layers_block_type"
    if types is None:
        types = ["linear_attention"] * n
    if not isinstance(types, list) or len(types) != n:
        raise InvalidArgument(f"{where}: {field_name} must list num_hidden_layers ({n}) layer "
                              f"types, got {types!r}", field=FIELD)
    kinds = _layer_kinds(types, GRANITE_LAYER_TYPES, where, field_name, "GraniteMoeHybrid",
                         "layers")
    hidden, heads = _int(text, "hidden_size", where), _int(text, "num_attention_heads", where)
    head_dim = text.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads and LayerKind.mamba in kinds:
        raise InvalidArgument(
            f"{where}: head_dim {head_dim!r} is not hidden_size / num_attention_heads "
            f"({hidden // heads}): vLLM's GraniteMoeHybrid attention uses the latter while its "
            f"block alignment reads head_dim; kvpool does not plan the mismatch", field=FIELD)
    if LayerKind.full not in kinds:
        raise InvalidArgument(
            f"{where}: {field_name} lists no attention layer: vLLM {VLLM_VERSION} plans such a "
            f"GraniteMoeHybrid as an attention-free model (block 16, no alignment), which the "
            f"vLLM profile does not plan", field=FIELD)
    # only Mamba layers make vLLM's ModelConfig.is_hybrid (Granite-4.0-Micro: none)
    mixer = _mamba2(text, where, _int(text, "mamba_expand", where) * hidden,
                    linear_layer_types=True) if LayerKind.mamba in kinds else None
    return StateLayers(mixer, tuple(kinds), (field_name,), "model.layers.{i}.self_attn.attn",
                       "model.layers.{i}.mixer", head_size=hidden // heads)


# The Mamba hybrids the profile sizes, by text model_type (vLLM's is_hybrid classes).
MAMBA_HYBRIDS: dict[str, Callable[[Mapping[str, Any], int, str], StateLayers]] = {
    "nemotron_h": _nemotron_h, "jamba": _jamba, "falcon_h1": _falcon_h1,
    "granitemoehybrid": _granitemoehybrid}


def _layer_kinds(codes: Any, table: Mapping[Any, LayerKind], where: str, field_name: str,
                 family: str, noun: str) -> list[LayerKind]:
    """Each layer's code (a pattern letter, a ``layer_types`` entry) as its kind, as ``table``
    maps the family's codes.

    Raises:
        InvalidArgument: a code the family does not build, naming the layer and the field.
    """
    kinds = []
    for i, code in enumerate(codes):
        if code not in table:
            raise InvalidArgument(
                f"{where}: {field_name} has {code!r} at layer {i}; vLLM {VLLM_VERSION}'s "
                f"{family} builds {', '.join(map(str, table))} {noun}", field=FIELD)
        kinds.append(table[code])
    return kinds

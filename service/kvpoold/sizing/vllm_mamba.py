"""The Mamba hybrids of vLLM 0.32 the profile reads, by text ``model_type``: which layers are
Mamba mixers, attention or MLP blocks, the mixers' state geometry and vLLM's module names."""

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

    mixer: MambaMixer
    kinds: tuple[LayerKind, ...]  # per layer: mamba, full or ffn
    fields: tuple[str, ...]  # the config fields that placed them
    attention_module: str
    state_module: str


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
    kinds = []
    for i, letter in enumerate(pattern):
        if letter not in NEMOTRON_H_BLOCKS:
            raise InvalidArgument(
                f"{where}: hybrid_override_pattern has {letter!r} at layer {i}; vLLM "
                f"{VLLM_VERSION}'s Nemotron-H builds {', '.join(NEMOTRON_H_BLOCKS)} blocks",
                field=FIELD)
        kinds.append(NEMOTRON_H_BLOCKS[letter])
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


# The Mamba hybrids the profile sizes, by text model_type (vLLM's is_hybrid classes).
MAMBA_HYBRIDS: dict[str, Callable[[Mapping[str, Any], int, str], StateLayers]] = {
    "nemotron_h": _nemotron_h, "jamba": _jamba}

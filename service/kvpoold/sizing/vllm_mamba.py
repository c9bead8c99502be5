"""The Mamba models of vLLM 0.32 the profile reads, by text ``model_type``: which layers are
Mamba mixers, attention or MLP blocks, the mixers' state geometry and vLLM's module names.

The hybrids (:data:`MAMBA_HYBRIDS`): Nemotron-H places its blocks by
``hybrid_override_pattern``, Jamba by period and offset, Granite-4.0-H by ``layer_types``
(transformers' names: ``mamba`` / ``linear_attention`` a Mamba-2 mixer, ``attention`` /
``full_attention`` attention; none listed: every layer a mixer, which vLLM plans
attention-free); Falcon-H1 runs an attention and a Mamba-2 mixer side by side in every layer
(vLLM names the mixer of layer ``i`` ``model.{num_hidden_layers + i}.mixer``, outside
``model.layers``); Zamba2 runs a Mamba-2 mixer in every layer and, at its ``hybrid`` layers,
shared transformer blocks whose every use is an attention module of its own
(``model.attn.{j}``, registered before the mixers). The attention-free models
(:data:`MAMBA_MODELS`, vLLM's ``IsAttentionFree`` classes): Mamba-1 (``MambaForCausalLM``, and
``FalconMambaForCausalLM``, the same vLLM class) and Mamba-2 (``Mamba2ForCausalLM``), a mixer
``backbone.layers.{i}.mixer`` in every layer."""

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
    # attention modules the class registers before every decoder layer's, in that order:
    # (the decoder layer using it, the index in its module name) (Zamba2's shared blocks)
    shared_attention: tuple[tuple[int, int], ...] = ()
    pipeline_parallel: bool = True  # the class implements vLLM's SupportsPP


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
    vLLM: plain attention, no state. No attention layer at all (transformers' default when
    ``layer_types`` is absent) is still hybrid to vLLM's ``ModelConfig`` but has no attention
    backend to align: vLLM plans it attention-free, as it plans :data:`MAMBA_MODELS`."""
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
    # (only a hybrid aligns its block: with no attention layer head_dim is read by nothing)
    if head_dim is not None and head_dim != hidden // heads and LayerKind.mamba in kinds \
            and LayerKind.full in kinds:
        raise InvalidArgument(
            f"{where}: head_dim {head_dim!r} is not hidden_size / num_attention_heads "
            f"({hidden // heads}): vLLM's GraniteMoeHybrid attention uses the latter while its "
            f"block alignment reads head_dim; kvpool does not plan the mismatch", field=FIELD)
    # only Mamba layers make vLLM's ModelConfig.is_hybrid (Granite-4.0-Micro: none)
    mixer = _mamba2(text, where, _int(text, "mamba_expand", where) * hidden,
                    linear_layer_types=True) if LayerKind.mamba in kinds else None
    return StateLayers(mixer, tuple(kinds), (field_name,), "model.layers.{i}.self_attn.attn",
                       "model.layers.{i}.mixer", head_size=hidden // heads)


# Zamba2Config's defaults (transformers 5.19) for the keys the reader takes, its default
# layers_block_type (54 layers) and the legacy layer names it renames
ZAMBA2_DEFAULTS = {"mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2,
                   "mamba_ngroups": 1, "n_mamba_heads": 8, "num_mem_blocks": 1}
ZAMBA2_LAYERS = ("mamba",) + (("mamba",) * 5 + ("hybrid",)) * 7 + ("mamba",) * 4 + (
    "hybrid",) + ("mamba",) * 3 + ("hybrid",) + ("mamba",) * 2
# a Zamba2 layer is a Mamba-2 mixer, a hybrid one also a shared transformer block before it
ZAMBA2_LAYER_TYPES = {"mamba": LayerKind.mamba, "linear_attention": LayerKind.mamba,
                      "hybrid": LayerKind.full}


def _zamba2(text: Mapping[str, Any], n: int, where: str) -> StateLayers:
    """Zamba2: every layer is a Mamba-2 mixer, and each ``hybrid`` layer of
    ``layers_block_type`` runs one of ``num_mem_blocks`` shared transformer blocks (cycled)
    before it. vLLM's ``Zamba2ForCausalLM`` gives each use of a block its own attention
    module, ``model.attn.{j}``, all registered before the mixers (block ``b``'s uses numbered
    from ``b * (h + blocks - 1) // blocks``, ``h`` the hybrid layers), and names layer ``i``'s
    mixer ``{h + i}.mixer`` (outside ``model.``). The attention keeps ``num_attention_heads``
    KV heads of ``attention_head_dim`` (transformers' default ``2 * hidden_size /
    num_attention_heads``); the mixer's intermediate size is ``mamba_expand * hidden_size``
    in ``n_mamba_heads`` heads of ``mamba_headdim``, SSM dtype the model's under ``auto``.
    No pipeline parallelism (the class does not implement ``SupportsPP``)."""
    key = "layer_types" if "layer_types" in text and "layers_block_type" not in text \
        else "layers_block_type"
    types = text.get(key)
    if types is None:
        types = list(ZAMBA2_LAYERS)
    if not isinstance(types, list) or len(types) != n:
        raise InvalidArgument(f"{where}: {key} must list num_hidden_layers ({n}) layer "
                              f"types, got {types!r}", field=FIELD)
    kinds = _layer_kinds(types, ZAMBA2_LAYER_TYPES, where, key, "Zamba2", "layers")
    hybrid = [i for i, kind in enumerate(kinds) if kind is LayerKind.full]
    ids = text.get("hybrid_layer_ids")
    if ids is not None and ids != hybrid:
        raise InvalidArgument(
            f"{where}: hybrid_layer_ids {ids!r} are not the hybrid layers of {key} "
            f"({hybrid}): vLLM {VLLM_VERSION}'s Zamba2 builds an attention per id and places "
            f"the blocks by {key}; kvpool does not plan the mismatch", field=FIELD)
    if not hybrid:
        raise InvalidArgument(
            f"{where}: {key} lists no hybrid layer: vLLM {VLLM_VERSION} plans such a Zamba2 "
            f"as an attention-free model, which the vLLM profile does not plan", field=FIELD)
    view = {**ZAMBA2_DEFAULTS, **text}
    blocks = _int(view, "num_mem_blocks", where)
    attention = []
    for b in range(blocks):
        j = b * (len(hybrid) + blocks - 1) // blocks
        for k in range(b, len(hybrid), blocks):
            attention.append((hybrid[k], j))
            j += 1
    hidden, heads = _int(text, "hidden_size", where), _int(text, "num_attention_heads", where)
    # transformers reads a config's head_dim as attention_head_dim (attribute_map)
    head_dim = text.get("head_dim") or 2 * hidden // heads
    width = text.get("attention_hidden_size") or 2 * hidden
    if head_dim * heads != width:
        raise InvalidArgument(
            f"{where}: attention_head_dim x num_attention_heads ({head_dim} x {heads}) is not "
            f"attention_hidden_size ({width}): vLLM's Zamba2Attention refuses it", field=FIELD)
    kv_heads = text.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise InvalidArgument(
            f"{where}: num_key_value_heads {kv_heads!r} is not num_attention_heads ({heads}): "
            f"vLLM's Zamba2 attention keeps one KV head per head while its block alignment "
            f"reads num_key_value_heads; kvpool does not plan the mismatch", field=FIELD)
    intermediate = _int(view, "mamba_expand", where) * hidden
    mamba_heads = _int(view, "n_mamba_heads", where)
    mamba_head_dim = text.get("mamba_headdim") or intermediate // mamba_heads
    if mamba_head_dim * mamba_heads != intermediate:
        raise InvalidArgument(
            f"{where}: n_mamba_heads x mamba_headdim ({mamba_heads} x {mamba_head_dim}) is "
            f"not the Mamba intermediate size mamba_expand x hidden_size ({intermediate:,}): "
            f"vLLM's mixer and its state shape would disagree", field=FIELD)
    # transformers calls the Mamba-only layers linear_attention (its legacy ``mamba``)
    mixer = MambaMixer(intermediate, _int(view, "mamba_d_state", where),
                       _int(view, "mamba_d_conv", where), _int(view, "mamba_ngroups", where),
                       mamba_heads, mamba_head_dim,
                       linear_layer_types=LayerKind.mamba in kinds)
    return StateLayers(mixer, (LayerKind.mamba,) * n, (key,), "model.attn.{i}", "{i}.mixer",
                       state_index_offset=len(hybrid), head_size=head_dim,
                       shared_attention=tuple(attention), pipeline_parallel=False)


# The Mamba hybrids the profile sizes, by text model_type (vLLM's is_hybrid classes).
MAMBA_HYBRIDS: dict[str, Callable[[Mapping[str, Any], int, str], StateLayers]] = {
    "nemotron_h": _nemotron_h, "jamba": _jamba, "falcon_h1": _falcon_h1,
    "granitemoehybrid": _granitemoehybrid, "zamba2": _zamba2}

# vLLM's module name of an attention-free model's mixer (its ``backbone``, not ``model``)
BACKBONE_MIXER = "backbone.layers.{i}.mixer"


def _mamba1_model(text: Mapping[str, Any], n: int, where: str) -> StateLayers:
    """Mamba-1 (``MambaForCausalLM``; ``FalconMambaForCausalLM`` is the same vLLM class):
    every layer a mixer of ``intermediate_size`` channels, ``state_size``, ``conv_kernel``.
    transformers' ``MambaConfig`` / ``FalconMambaConfig`` keep the file's
    ``intermediate_size`` (Falcon-Mamba-7B states 8,192 beside an ``expand`` of 16) and derive
    ``int(expand * hidden_size)`` when it is absent; vLLM reads the attribute."""
    if text.get("intermediate_size") is not None:
        intermediate = _int(text, "intermediate_size", where)
    else:
        intermediate = _int(text, "expand", where) * _int(text, "hidden_size", where)
    mixer = MambaMixer(intermediate, _int(text, "state_size", where),
                       _int(text, "conv_kernel", where))
    return StateLayers(mixer, (LayerKind.mamba,) * n, ("model_type",), "", BACKBONE_MIXER)


def _mamba2_model(text: Mapping[str, Any], n: int, where: str) -> StateLayers:
    """Mamba-2 (``Mamba2ForCausalLM``): every layer a ``MambaMixer2`` of ``num_heads`` heads of
    ``head_dim`` (Mamba2Config's default 64), ``n_groups``, ``state_size``, ``conv_kernel``;
    its intermediate size is ``intermediate_size`` when the file states one (vLLM's decoder
    layer reads it so), else ``expand * hidden_size``, and must be ``num_heads * head_dim``
    (transformers' ``validate_architecture``). vLLM's class has no pipeline parallelism."""
    if text.get("intermediate_size") is not None:
        intermediate = _int(text, "intermediate_size", where)
    else:
        intermediate = _int(text, "expand", where) * _int(text, "hidden_size", where)
    heads, head_dim = _int(text, "num_heads", where), _int(text, "head_dim", where)
    if heads * head_dim != intermediate:
        raise InvalidArgument(
            f"{where}: num_heads x head_dim ({heads} x {head_dim}) is not the Mamba "
            f"intermediate size {intermediate:,} (transformers refuses such a config)",
            field=FIELD)
    mixer = MambaMixer(intermediate, _int(text, "state_size", where),
                       _int(text, "conv_kernel", where), _int(text, "n_groups", where),
                       heads, head_dim)
    return StateLayers(mixer, (LayerKind.mamba,) * n, ("model_type",), "", BACKBONE_MIXER,
                       pipeline_parallel=False)


# The attention-free Mamba models the profile sizes, by text model_type (vLLM's
# IsAttentionFree classes): no attention layer, one Mamba state per layer.
MAMBA_MODELS: dict[str, Callable[[Mapping[str, Any], int, str], StateLayers]] = {
    "mamba": _mamba1_model, "falcon_mamba": _mamba1_model, "mamba2": _mamba2_model}


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

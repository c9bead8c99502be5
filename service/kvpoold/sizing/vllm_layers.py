"""What one decoder layer is to vLLM 0.32's KV cache: its kind, its attention, the geometry of
a per-request state (a gated delta net, a Mamba-1 or Mamba-2 mixer), and the checked read of a
config integer. Pure."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.contract.errors import InvalidArgument

FIELD = "model_config"
VLLM_VERSION = "0.32"  # the vLLM whose reading this profile follows
# a config's dtype name -> the dtype it means
DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16",
               "float32": "float32", "float": "float32"}


def positive_int(config: Mapping[str, Any], key: str, where: str) -> int:
    """``config[key]``, a positive integer.

    Raises:
        InvalidArgument: a missing or bad value, naming the key and ``where`` it was read.
    """
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{where}: {key} must be a positive integer, got {value!r}",
                              field=FIELD)
    return value


class LayerKind(enum.StrEnum):
    """What a decoder layer keeps per request in vLLM's KV cache."""

    full = "full"
    sliding = "sliding"
    mla = "mla"
    # gated delta net or Kimi delta attention: a conv + SSM state per request (a MambaSpec)
    linear = "linear"
    mamba = "mamba"  # a Mamba-1 or Mamba-2 mixer: a conv + SSM state per request (MambaSpec)
    ffn = "ffn"  # an MLP or MoE block alone (Nemotron-H's ``-`` / ``E``): nothing cached


@dataclass(frozen=True)
class GatedDeltaNet:
    """The state geometry of a gated-delta-net layer (Qwen3-Next), or of a Kimi delta
    attention layer (``kda``: Kimi Linear; vLLM's ``kda_state_shape`` is this one with as many
    key heads as value heads, ``key_head_dim == value_head_dim``: conv ``3 * H * D / tp``
    channels, recurrent ``(H / tp, D, D)``). A KDA layer's recurrent state is float32 whatever
    ``--mamba-ssm-cache-dtype`` says (its ``get_state_dtype`` does not pass the flag)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    kda: bool = False

    def state_bytes(self, tp: int, conv_itemsize: int, ssm_itemsize: int) -> int:
        """One request's conv state ``(conv_dim / tp, kernel - 1)`` (in the model dtype)
        plus its SSM state ``(value_heads / tp, key_dim, value_dim)`` (in vLLM's SSM state
        dtype)."""
        conv_dim = (self.num_key_heads * self.key_head_dim * 2
                    + self.num_value_heads * self.value_head_dim)
        conv = conv_dim // tp * (self.conv_kernel - 1)
        ssm = self.num_value_heads // tp * self.key_head_dim * self.value_head_dim
        return conv * conv_itemsize + ssm * ssm_itemsize


@dataclass(frozen=True)
class MambaMixer:
    """The state geometry of a Mamba mixer: Mamba-1 (``num_heads`` 0) or Mamba-2.

    Per request and TP rank (vLLM's ``MambaStateShapeCalculator``): Mamba-1 keeps a conv
    state ``(intermediate / tp, kernel - 1)`` and an SSM state ``(intermediate / tp,
    state_size)``; Mamba-2 a conv state ``((intermediate + 2 * groups * state_size) / tp,
    kernel - 1)``, ``groups`` raised to ``n_groups + tp - n_groups`` when ``n_groups`` does
    not split over ``tp`` (the groups a head shard needs are replicated; vLLM's mixer does
    that for a single group only), and an SSM state
    ``(num_heads / tp, head_dim, state_size)``.
    """

    intermediate_size: int
    state_size: int
    conv_kernel: int
    n_groups: int = 0  # Mamba-2 only
    num_heads: int = 0  # Mamba-2 only
    head_dim: int = 0  # Mamba-2 only
    # the SSM dtype the model's own config hook sets for ``--mamba-ssm-cache-dtype auto``
    # (Nemotron-H: its ``mamba_ssm_cache_dtype``, else float32), None when it sets none
    auto_ssm_dtype: str | None = None
    # transformers' ``layer_types`` of the config lists ``linear_attention`` (Nemotron-H's,
    # Jamba's and Granite-4.0-H's Mamba layers; not Falcon-H1's ``hybrid`` ones): only then
    # does vLLM's CPU platform with AVX-512 BF16 keep a named half SSM dtype
    linear_layer_types: bool = True

    @property
    def version(self) -> int:
        return 2 if self.num_heads else 1

    @property
    def checkpoint_blocks(self) -> int:
        """Blocks a request holds beside its running and previous state with prefix caching:
        a Mamba-2 mixer keeps one prefill checkpoint (vLLM's
        ``num_prefill_checkpoint_blocks``), a Mamba-1 mixer none."""
        return 1 if self.version == 2 else 0

    def split(self, tp: int) -> tuple[int, int]:
        """(conv state elements, SSM state elements) of one request on one TP rank.

        Raises:
            InvalidArgument: a dimension vLLM cannot split over ``tp``.
        """
        if self.version == 1:
            conv_dim, heads = self.intermediate_size, 0
        else:
            groups = self.n_groups + (tp - self.n_groups if self.n_groups % tp else 0)
            conv_dim, heads = self.intermediate_size + 2 * groups * self.state_size, \
                self.num_heads
        for what, value in (("conv channels", conv_dim), ("SSM heads", heads)):
            if value % tp:
                raise InvalidArgument(
                    f"the model's Mamba-{self.version} {what} ({value}) do not split over "
                    f"tp_size {tp}; choose a --tp-size that divides them", field="tp_size")
        if self.version == 2 and self.n_groups % tp and self.n_groups != 1:
            raise InvalidArgument(
                f"the model's {self.n_groups} Mamba-2 groups do not split over tp_size {tp}, "
                "and vLLM's MambaMixer2 replicates only a single group (it asserts); choose a "
                "--tp-size that divides them", field="tp_size")
        conv = conv_dim // tp * (self.conv_kernel - 1)
        if self.version == 1:
            return conv, self.intermediate_size // tp * self.state_size
        return conv, heads // tp * self.head_dim * self.state_size

    def state_bytes(self, tp: int, conv_itemsize: int, ssm_itemsize: int) -> int:
        """One request's conv state (in the model dtype) plus SSM state (in vLLM's SSM state
        dtype) on one TP rank. Nemotron-H-56B (Mamba-2: 256 heads of 64, 8 groups, state
        256, kernel 4), TP 1, bf16 conv, fp32 SSM: (16,384 + 2 * 8 * 256) * 3 * 2 = 122,880
        B + 256 * 64 * 256 * 4 = 16,777,216 B, 16,900,096 B in all."""
        conv, ssm = self.split(tp)
        return conv * conv_itemsize + ssm * ssm_itemsize


@dataclass(frozen=True)
class LayerAttention:
    """One decoder layer's attention as its KV cache sees it."""

    index: int
    kind: LayerKind
    sliding_window: int | None = None
    # the index in vLLM's module name when it is not the decoder layer's (Zamba2's shared
    # attention: one module per use, numbered per shared block)
    name_index: int | None = None

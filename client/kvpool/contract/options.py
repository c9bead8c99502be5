"""Plan options: the knobs of ``kvpoold plan`` and ``Configure``, validated at decode."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvpool.contract.devices import GpuName
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.spec import Base

# 1 PiB: anything larger is a typo, not a budget.
MAX_BUDGET_BYTES = 1 << 50
MAX_TOKENS = 1 << 40


class KVCacheDType(enum.StrEnum):
    """``--kv-cache-dtype`` values. ``auto`` follows the model dtype (or fp8 if the checkpoint
    says ``kv_cache_quant_algo=FP8``); fp8 is stored as uint8; fp4 packs two values per byte and
    adds one uint8 scale per 16 values."""

    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m2 = "fp8_e5m2"
    fp4_e2m1 = "fp4_e2m1"


# SGLang 0.5.23's other spellings of --kv-cache-dtype (its arg_groups/fields/model.py choices:
# auto, fp8_e5m2, fp8_e4m3, mxfp8, bf16, bfloat16, nvfp4, fp4_mx_block16), as the command-line
# flags take them: bf16 is bfloat16 (configure_kv_cache_dtype treats the two alike), and both
# FP4 recipes store FP4 e2m1 with a uint8 scale per 16 values, the fp4_e2m1 plan
# (docs/sglang.md, "FP4 KV"). mxfp8 has no plan (SGLang keeps that pool in its own memory).
KV_CACHE_DTYPE_ALIASES: dict[str, KVCacheDType] = {
    "bf16": KVCacheDType.bfloat16,
    "nvfp4": KVCacheDType.fp4_e2m1,
    "fp4_mx_block16": KVCacheDType.fp4_e2m1,
}


SpeculativeAlgorithm = Literal["none", "eagle", "standalone"]
# SGLang's --mamba-radix-cache-strategy: extra_buffer keeps ping-pong state slots per request;
# auto is what SGLang picks on CUDA (extra_buffer for the hybrid linear models it supports).
MambaRadixCacheStrategy = Literal["auto", "no_buffer", "extra_buffer"]
# Who pairs the full and SWA pages of a hybrid sliding-window pool: the daemon (``swa`` follows
# ``kv``, the daemon writes ``full_to_swa`` per full page) or the engine (``swa`` is its own id
# space and the engine writes ``full_to_swa`` per token slot, as SGLang's SWA allocator does).
SwaPairing = Literal["daemon", "engine"]


def _doc(text: str, **bounds: int | float) -> Meta:
    """A field's bounds and its one-line description (the flag's ``--help``)."""
    return Meta(description=text, **bounds)


class PlanOptions(Base):
    """Everything besides the model that decides a pool's layout.

    ``budget_bytes`` covers the KV buffers plus mamba / compressed state; the request->token
    table and the SWA mapping are outside it (reported as ``aux_bytes``), and so is the padding
    page, which comes on top as in SGLang. Give a budget, a ``max_total_tokens``, or both (the
    token count is then the smaller of the two). Each field is also a flag of ``kvpoold plan``
    and ``kvpool configure`` (``kvpool.contract.option_flags``), with this description as its help.
    """

    budget_bytes: Annotated[int, _doc(
        "bytes for KV + state: 42949672960, 40GiB, 512MiB, 1.5GB ...",
        ge=0, le=MAX_BUDGET_BYTES)] | None = None
    max_total_tokens: Annotated[int, _doc(
        "cap on the token count (alone: size by tokens instead of bytes)",
        ge=1, le=MAX_TOKENS)] | None = None
    page_size: Annotated[int, _doc("tokens per page", ge=1, le=1 << 16)] = 1
    kv_cache_dtype: Annotated[KVCacheDType, _doc(
        "KV element type; auto: the model dtype, or fp8_e4m3 when the checkpoint quantizes "
        "its KV cache")] = KVCacheDType.auto
    tp_size: Annotated[int, _doc("tensor-parallel ranks", ge=1, le=4096)] = 1
    pp_size: Annotated[int, _doc("pipeline stages", ge=1, le=4096)] = 1
    pp_rank: Annotated[int, _doc("this device's pipeline stage, 0-based", ge=0, le=4095)] = 0
    context_length: Annotated[int, _doc(
        "override the model's context length (above it only with --allow-longer-context)",
        ge=1, le=1 << 30)] | None = None
    allow_longer_context: Annotated[bool, _doc(
        "accept a --context-length above the model's (SGLang: "
        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1)")] = False
    max_running_requests: Annotated[int, _doc(
        "requests served at once (default: from the token count, 2048 to 4096, at most half "
        "the tokens)", ge=1, le=1 << 24)] | None = None
    swa_full_tokens_ratio: Annotated[float, _doc(
        "SWA tokens per full-attention token in hybrid SWA pools (default: 0.8; 0.1 for "
        "DeepSeek-V4, as SGLang sets it)", gt=0.0, le=1.0)] | None = None
    swa_pairing: Annotated[SwaPairing, _doc(
        "hybrid SWA pools: daemon pairs every kv page with an swa page and writes full_to_swa "
        "per page; engine makes swa an id space of its own and full_to_swa one int64 per full "
        "token slot plus a trailing -1, which the engine writes (SGLang's SWA allocator)")
    ] = "daemon"
    mamba_full_memory_ratio: Annotated[float, _doc(
        "mamba state memory per KV memory in hybrid linear pools", gt=0.0, le=100.0)] = 0.9
    mamba_radix_cache_strategy: Annotated[MambaRadixCacheStrategy, _doc(
        "hybrid linear pools with the radix cache: extra_buffer keeps two ping-pong state "
        "slots per request, no_buffer none (page size 1 only); auto: extra_buffer, as SGLang "
        "on CUDA")] = "auto"
    chunked_prefill_size: Annotated[int, _doc(
        "the engine's prefill chunk in tokens (default: SGLang's for the --gpu profile's "
        "memory: 2048 below 20 GiB, 4096 below 60, 8192 below 160, else 16384; 0: unchunked); "
        "sizes the SWA pool of a hybrid SWA model served without the radix cache at a fixed "
        "max_running_requests", ge=0, le=1 << 24)] | None = None
    gpu: Annotated[GpuName, _doc(
        "the device SGLang runs on, as the facts that change its sizing (see docs/sizing.md): "
        "h100-80g (kvpoold plan's default), h200, b200, a100-80g, cpu; Configure's default is "
        "the daemon's own device")] | None = None
    disable_radix_cache: Annotated[bool, _doc(
        "no prefix cache: one state slot per request (hybrid linear)")] = False
    disable_overlap_schedule: Annotated[bool, _doc(
        "the engine runs without SGLang's overlap scheduler (always so under pipeline "
        "parallelism): one extra_buffer tracking slot and one prefill chunk in flight")] = False
    speculative_algorithm: Annotated[SpeculativeAlgorithm, _doc(
        "speculative decoding whose draft layers share the pool")] = "none"
    speculative_num_draft_layers: Annotated[int, _doc(
        "draft layers sharing the pool (default: the model's MTP layers, or 1)",
        ge=0, le=1024)] | None = None
    speculative_num_draft_tokens: Annotated[int, _doc(
        "tokens verified per speculative step; hybrid linear models keep that many "
        "intermediate conv/SSM states per running request (required there, with "
        "--max-running-requests)", ge=1, le=1024)] | None = None

    elastic: Annotated[bool, _doc(
        "an elastic pool: the same views, sized at the budget's (or --max-total-tokens') "
        "token count as a virtual range, backed by memory only in the groups the daemon "
        "grants it from the device budget it shares with other pools (see docs/elastic.md)")
    ] = False
    elastic_floor_tokens: Annotated[int, _doc(
        "elastic pools: tokens always granted (rounded up to whole groups; default one "
        "request at the context length; at least one group)", ge=0, le=MAX_TOKENS)] | None = None
    elastic_cap_tokens: Annotated[int, _doc(
        "elastic pools: tokens never exceeded (rounded up to whole groups; default the "
        "virtual range)", ge=1, le=MAX_TOKENS)] | None = None
    elastic_weight: Annotated[float, _doc(
        "elastic pools: the pool's weight in the fair share of a short budget",
        gt=0.0, le=1e6)] = 1.0

    def __post_init__(self) -> None:
        if self.pp_rank >= self.pp_size:
            raise ValueError(
                f"pp_rank {self.pp_rank} must be < pp_size {self.pp_size} (ranks are 0-based)"
            )
        if self.budget_bytes is None and self.max_total_tokens is None:
            raise ValueError("give budget_bytes, max_total_tokens, or both")
        if not self.elastic:
            for name in ("elastic_floor_tokens", "elastic_cap_tokens"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs elastic (--elastic)")
            if self.elastic_weight != 1.0:
                raise ValueError("elastic_weight needs elastic (--elastic)")
        for name in ("speculative_num_draft_layers", "speculative_num_draft_tokens"):
            if self.speculative_algorithm == "none" and getattr(self, name):
                raise ValueError(f"{name} needs speculative_algorithm eagle or standalone")


def make_options(**fields: object) -> PlanOptions:
    """Build options from loose values (CLI flags, proto fields), validating every one.

    Raises:
        InvalidArgument: naming the field (``$.page_size``) and the accepted range.
    """
    clean = {k: v for k, v in fields.items() if v is not None}
    try:
        return msgspec.convert(clean, PlanOptions, str_keys=True)
    except msgspec.ValidationError as exc:
        message = str(exc)
        field = _path_field(message)
        if field == "kv_cache_dtype":
            message += f" (accepted: {', '.join(d.value for d in KVCacheDType)})"
        elif field == "speculative_algorithm":
            message += " (accepted: none, eagle, standalone)"
        elif field == "mamba_radix_cache_strategy":
            message += " (accepted: auto, no_buffer, extra_buffer)"
        elif field == "swa_pairing":
            message += " (accepted: daemon, engine)"
        raise InvalidArgument(f"invalid plan option: {message}", field=field) from exc


def _path_field(message: str) -> str | None:
    """Name the field: msgspec's ``... - at `$.page_size```, or a ``__post_init__`` message
    that starts with the field name."""
    marker = "at `$."
    if marker in message:
        return message.split(marker, 1)[1].rstrip("`").split("[")[0].split(".")[0]
    first = message.split(" ", 1)[0]
    return first if first in PlanOptions.__struct_fields__ else None

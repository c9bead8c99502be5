"""Hybrid linear attention / Mamba sizing (Qwen3-Next, Mamba2 hybrids, Kimi Linear): full-
attention KV plus per-slot state.

The full-attention layers keep a KV cache; every linear (gated delta net, Mamba2 mixer or Kimi
delta attention) layer keeps a fixed-size conv + SSM state per request slot. Kimi delta
attention is the Mamba2 shape with ``HK = HV = H`` and ``Kd = Vd = D`` (conv ``3 * H * D / tp``
channels: q, k and v), its conv state laid out window first (``linear.conv_layout``:
``(k - 1, conv_dim / tp)`` per slot, SGLang's ``KimiLinearStateShape``); the sizing is the same.
Kimi-Linear-48B (7 MLA layers, 20 KDA layers of H 32, D 128, k 4; bf16 conv, fp32 SSM), TP 1,
page 16, 20 GiB: per_req = 20 * (3 * 12,288 * 2 + 32 * 128 * 128 * 4) = 43,417,600 B; 233 slots;
cell 576 * 7 * 2 = 8,064 B; 1,403,152 tokens; max_running_requests 233 // 5 = 46 (SGLang 0.5.23
agrees: tests/integration/test_sglang_corpus.py).

KV side, over the ``L`` full-attention layers of this PP stage (``linear.full_attention_layers``
intersected with the stage), per-layer bytes as in mha.py (or mla.py for an MLA model):

    cell = kv_layer_bytes * L, then int(cell * (1 + Dl / L))    with Dl EAGLE draft layers

State side, per request slot and linear layer (Mamba2 shapes with the Qwen3-Next mapping;
``HV``/``HK`` value/key heads, ``Vd``/``Kd`` their dims, ``k`` the conv kernel, TP ``tp``):

    n_groups = HK, raised to tp when tp does not divide it (replicated groups, only HK < tp)
    conv_dim = Vd * HV + 2 * n_groups * Kd
    conv     = (conv_dim / tp, k - 1)          in conv_dtype
    ssm      = (HV / tp, Vd, Kd)               in ssm_dtype
    per_req  = (numel(conv) * conv_itemsize + numel(ssm) * ssm_itemsize) * n_linear_in_stage

Budget (``budget`` pays for KV and state; ``m`` = --mamba-full-memory-ratio, taken as the exact
decimal fraction so 0.9 is 9/10; ``ratio`` = state slots per running request, SGLang's: 1
without the radix cache, else 3 plus the extra_buffer strategy's tracking slots, 2 under the
overlap schedule and 1 without it (``auto`` is extra_buffer; PP turns the overlap schedule off;
``no_buffer`` adds none and needs page size 1 and --disable-overlap-schedule). The default is
5.)

    mamba_budget = floor(budget * m / (1 + m))
    state_slots  = (mamba_budget - per_req) // per_req        (slot 0 is padding and is built)
    kv_budget    = budget - (state_slots + 1) * per_req
    num_pages    = kv_budget // cell // page_size              (the common rule: the padding
                                                               page comes on top)
    max_running_requests = min(usual rule, state_slots // ratio)

An error names ``per_req`` and the budget needed when ``state_slots < ratio`` (not even one
running request; below 1 this is the plain "no state slot" case).

``--disable-radix-cache`` with ``--max-running-requests N`` sets ``state_slots = N`` instead
and the KV side gets the rest. Without a budget (``max_total_tokens`` only) the state pool is
``max_running_requests * ratio`` slots; ``max_running_requests`` is then required. The state
slots are the most the state budget buys; the KV pages the most the rest buys, and the KV
buffers' padding page comes on top, so ``total_bytes`` may exceed the budget by up to a page.

Edge stages (decided here; SGLang's per-stage results are MIN-reduced by a collective we lack):

- No full-attention layer in the stage (and no draft layers): cell 0, no KV buffers; the whole
  budget goes to state (``state_slots = budget // per_req - 1``, or N as above) and the token
  id space is ``max_total_tokens``, else the context length, page-aligned. Callers combining
  stages should take the token count from the stages that hold KV.
- No linear layer in the stage: per_req 0, the whole budget goes to KV and the state id space
  is ``max_running_requests * ratio`` slots with no state buffers (only ``req_to_state``).

Speculative decoding (any algorithm, with ``D`` = ``speculative_num_draft_tokens``, which it
then needs; ``max_running_requests`` is SGLang's 48 unless given): each running request also
keeps D intermediate conv/SSM states, and the state budget is solved jointly for both:

    state_slots  = (mamba_budget - per_req * (1 + D)) * ratio // (per_req * (ratio + D))
    intermediate = (min(max_running_requests, state_slots // ratio) + 1) * D * per_req
    kv_budget    = budget - (state_slots + 1) * per_req - intermediate

(without the radix cache: ``state_slots = max_running_requests`` and intermediate ``(slots + 1)
* D * per_req``). ``D / ratio`` is kept exact, where SGLang computes it in floats. The buffers
``spec_conv.<l>`` ``(max_running_requests + 1, D, conv_dim / tp, k - 1)`` and ``spec_ssm.<l>``
``(max_running_requests + 1, D, HV / tp, Vd, Kd)`` (kind spec_state, one row per request row)
are SGLang's plain layout, not the deduplicated conv window of its CUDA path.

The extra_buffer tracking slots enter only through ``ratio``. Not modelled: the PP "max stage
share" of per_req.

Worked example, Qwen3-Next-80B-A3B (48 layers, full attention every 4th: 3, 7, ..., 47 = 12
layers, 36 linear; k 4, HK 16, HV 32, Kd = Vd = 128; 2 KV heads of 256; bf16 KV, bf16 conv,
fp32 SSM), TP 1, page 1, 40 GiB = 42,949,672,960 B, m 0.9:

    conv_dim = 4096 + 2*16*128 = 8,192;  conv (8192, 3) bf16 = 49,152 B
    ssm (32, 128, 128) fp32 = 2,097,152 B;  per layer 2,146,304 B;  per_req * 36 = 77,266,944 B
    mamba_budget = 42,949,672,960 * 9 // 19 = 20,344,581,928 B;  state_slots = 262
    kv_budget = 42,949,672,960 - 263 * 77,266,944 = 22,628,466,688 B
    cell = 2 * (256 + 256) * 12 * 2 = 24,576 B;  tokens = 22,628,466,688 // 24,576 = 920,754
    max_running_requests = min(2048, 460,377, 262 // 5) = 52       (ratio 5: auto, overlap)

Buffers, in this order: ``k.<l>``/``v.<l>`` (``kv.<l>`` for MLA) of the full layers, kind kv,
global ids; ``conv.<l>`` ``(state_slots + 1, conv_dim / tp, k - 1)`` of every linear layer, then
``ssm.<l>`` ``(state_slots + 1, HV / tp, Vd, Kd)`` of every linear layer (the conv shape's last
two axes swapped for ``window_first``), kind state, one slot
per page (grouped so each kind is one strided stack, the ``(layers, slots, ...)`` tensor
SGLang's mamba pool indexes); under speculative
decoding ``spec_conv.<l>`` / ``spec_ssm.<l>`` (above); ``draft_k.<i>`` / ``draft_v.<i>``; and
the aux ``req_to_state`` int32 ``(max_running_requests + 1,)``, kind map, outside the budget
(request row -> state slot).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from kvpool.contract.dtypes import DType
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import BufferKind, BufferSpec
from kvpool.contract.spec import LinearAttention, MHAAttention, ModelSpec
from kvpoold.sizing import mha, mla
from kvpoold.sizing.common import (
    Sizing,
    SizingContext,
    align_down,
    draft_scaled_cell,
    kv_pages,
    mamba_state_ratio,
    overlap_schedule,
    resolve_max_running_requests,
    tp_heads,
)
from kvpoold.sizing.layout import buffer, token_rows

NAME = "hybrid_linear"
# State slots each running request may hold: with the radix cache a request pins its own slot
# plus cached prefix states, so SGLang budgets 3 per request, plus the extra_buffer strategy's
# tracking slots (2 under the overlap schedule, else 1); without it exactly 1.


def matches(spec: ModelSpec) -> bool:
    return spec.linear is not None


@dataclass(frozen=True)
class StateShape:
    """Per-slot shapes and dtypes of one linear layer's conv and SSM (temporal) states."""

    conv: tuple[int, int]  # (conv_dim / tp, k - 1), or (k - 1, conv_dim / tp): window_first
    ssm: tuple[int, int, int]
    conv_dtype: DType
    ssm_dtype: DType

    @property
    def conv_bytes(self) -> int:
        return self.conv[0] * self.conv[1] * self.conv_dtype.itemsize

    @property
    def ssm_bytes(self) -> int:
        return self.ssm[0] * self.ssm[1] * self.ssm[2] * self.ssm_dtype.itemsize

    @property
    def slot_bytes(self) -> int:
        """Bytes of one request slot in one linear layer (conv + SSM)."""
        return self.conv_bytes + self.ssm_bytes


def state_shape(linear: LinearAttention, tp_size: int) -> StateShape:
    """The conv / SSM state shapes of one linear layer on one TP rank.

    Args:
        linear: the spec's linear-attention block.
        tp_size: tensor-parallel ranks the state is split over.

    Returns:
        Per-slot shapes ``conv (conv_dim / tp, k - 1)`` (``(k - 1, conv_dim / tp)`` for the
        ``window_first`` layout of Kimi delta attention) and ``ssm (HV / tp, Vd, Kd)``.

    Raises:
        InvalidArgument: when the value heads or key groups do not split over ``tp_size``.
    """
    tp = tp_size
    if linear.num_value_heads % tp:
        raise InvalidArgument(
            f"linear attention has {linear.num_value_heads} value heads, which do not split "
            f"over tp_size {tp}; choose a --tp-size that divides {linear.num_value_heads}",
            field="tp_size",
        )
    n_groups = linear.num_key_heads
    if n_groups % tp:
        if n_groups > tp:
            # Replication only works when every rank holds whole copies of fewer groups.
            raise InvalidArgument(
                f"linear attention has {n_groups} key heads, which do not split over "
                f"tp_size {tp}; choose a --tp-size that divides {n_groups} or is a multiple "
                "of it",
                field="tp_size",
            )
        n_groups = tp  # each rank keeps a replica of its group
    conv_dim = linear.value_head_dim * linear.num_value_heads + 2 * n_groups * linear.key_head_dim
    conv = (conv_dim // tp, linear.conv_kernel - 1)
    return StateShape(
        conv=conv if linear.conv_layout == "dim_first" else (conv[1], conv[0]),
        ssm=(linear.num_value_heads // tp, linear.value_head_dim, linear.key_head_dim),
        conv_dtype=DType(linear.conv_dtype.value),
        ssm_dtype=DType(linear.ssm_dtype.value),
    )


def stage_split(ctx: SizingContext) -> tuple[list[int], list[int]]:
    """(full-attention, state) global layer ids of this PP stage."""
    linear = _linear(ctx.spec)
    full = set(linear.full_attention_layers)
    state = set(linear.state_layer_ids(ctx.spec.num_layers))
    return ([lay for lay in ctx.layers if lay in full],
            [lay for lay in ctx.layers if lay in state])


def per_request_state_bytes(ctx: SizingContext) -> int:
    """Bytes of one state slot across this stage's linear layers (``per_req``).

    Raises:
        InvalidArgument: as :func:`state_shape`.
    """
    _, linear_layers = stage_split(ctx)
    return state_shape(_linear(ctx.spec), ctx.tp_size).slot_bytes * len(linear_layers)


def mamba_budget_bytes(budget_bytes: int, mamba_full_memory_ratio: float) -> int:
    """``floor(budget * m / (1 + m))``, with ``m`` read as its exact decimal (0.9 -> 9/10)."""
    m = Fraction(str(mamba_full_memory_ratio))
    return budget_bytes * m.numerator // (m.denominator + m.numerator)


def state_ratio(ctx: SizingContext) -> int:
    """State slots reserved per running request (:func:`common.mamba_state_ratio`: 5 by
    default, 4 without the overlap schedule, 3 with no_buffer, 1 without the radix cache)."""
    return mamba_state_ratio(ctx.options)


def _linear(spec: ModelSpec) -> LinearAttention:
    assert spec.linear is not None
    return spec.linear


def _kv_layer_bytes(ctx: SizingContext) -> int:
    attn = ctx.spec.attention
    if isinstance(attn, MHAAttention):
        return mha.layer_bytes(ctx.kv, tp_heads(attn.num_kv_heads, ctx.tp_size), attn.head_dim,
                               attn.v_dim)
    return mla.layer_bytes(ctx.kv, mla.kv_dim(ctx.spec))


def _check(ctx: SizingContext) -> None:
    if ctx.spec.indexer is not None:
        raise InvalidArgument(
            "hybrid linear attention with a DSA indexer is not supported; drop `indexer` "
            "from the spec",
            field="model",
        )
    options = ctx.options
    if options.mamba_radix_cache_strategy != "no_buffer" or options.disable_radix_cache:
        return
    if options.page_size != 1:
        raise InvalidArgument(
            f"mamba_radix_cache_strategy no_buffer caches prefix states per token, so SGLang "
            f"accepts it only at page_size 1, got {options.page_size}; use extra_buffer (or "
            "auto), --page-size 1, or --disable-radix-cache",
            field="mamba_radix_cache_strategy",
        )
    if overlap_schedule(options):
        raise InvalidArgument(
            "mamba_radix_cache_strategy no_buffer does not work with SGLang's overlap "
            "scheduler; give --disable-overlap-schedule (as the engine must), or use "
            "extra_buffer (or auto)",
            field="mamba_radix_cache_strategy",
        )


def _kv_cell(ctx: SizingContext, num_full: int) -> int:
    per_layer = _kv_layer_bytes(ctx)
    if num_full == 0:
        # No target KV here; draft layers (if any) still keep one KV row per token each.
        return per_layer * ctx.num_draft_layers
    return draft_scaled_cell(per_layer * num_full, ctx.num_draft_layers, num_full)


def draft_tokens(ctx: SizingContext) -> int:
    """``D``, the intermediate conv/SSM states kept per running request: the draft tokens
    verified per step under speculative decoding, else 0.

    Raises:
        InvalidArgument: speculative decoding over linear layers without
            ``speculative_num_draft_tokens`` or ``max_running_requests`` (SGLang requires both).
    """
    options = ctx.options
    if options.speculative_algorithm == "none" or not stage_split(ctx)[1]:
        return 0
    for name, flag in (("speculative_num_draft_tokens", "--speculative-num-draft-tokens"),
                       ("max_running_requests", "--max-running-requests")):
        if getattr(options, name) is None:
            raise InvalidArgument(
                f"speculative decoding ({options.speculative_algorithm}) over linear attention "
                f"keeps draft-token intermediate conv/SSM states for every running request, so "
                f"it needs {name}; give {flag} (as SGLang's server does)",
                field=name,
            )
    assert options.speculative_num_draft_tokens is not None
    return options.speculative_num_draft_tokens


def _budget_state_slots(
    ctx: SizingContext, per_req: int, cell: int, draft: int
) -> tuple[int, int]:
    """State slots paid from the budget, and the bytes of the speculative intermediate states
    reserved with them (``per_req > 0``, a budget is set, ``draft`` = D)."""
    options = ctx.options
    budget = options.budget_bytes
    assert budget is not None
    if options.disable_radix_cache and options.max_running_requests is not None:
        slots = options.max_running_requests
        spec = (slots + 1) * draft * per_req
        if (slots + 1) * per_req + spec > budget:
            states = f" and {draft} intermediate states each ({spec:,} B)" if draft else ""
            raise InvalidArgument(
                f"max_running_requests {slots} without the radix cache needs {slots} state "
                f"slots plus the padding slot at {per_req:,} B each "
                f"({(slots + 1) * per_req:,} B){states}, more than the budget {budget:,} B; "
                "raise --budget or lower --max-running-requests",
                field="budget_bytes",
            )
        return slots, spec
    # One running request needs `ratio` slots (its own plus cached prefix states) besides the
    # padding slot, so that is the least a budget must buy, not just one slot; under
    # speculative decoding also D intermediate states for it and for the padding row.
    ratio = state_ratio(ctx)
    state_bytes_needed = (ratio + 1 + 2 * draft) * per_req
    if cell == 0:
        state_budget, needed = budget, state_bytes_needed
        share = "the whole budget (no KV layers in this stage)"
    else:
        state_budget = mamba_budget_bytes(budget, options.mamba_full_memory_ratio)
        m = Fraction(str(options.mamba_full_memory_ratio))
        needed = -(-state_bytes_needed * (m.numerator + m.denominator) // m.numerator)
        share = (f"{state_budget:,} B of it at mamba_full_memory_ratio "
                 f"{options.mamba_full_memory_ratio}")
    if draft:
        # The state budget pays for the slots and, per `ratio` slots, D intermediate states:
        # slots * per * (1 + D / ratio) after the padding slot and its D states.
        slots = (state_budget - per_req * (1 + draft)) * ratio // (per_req * (ratio + draft))
    else:
        slots = (state_budget - per_req) // per_req
    if slots < ratio:
        spec = f" and {draft} intermediate states for it and the padding row" if draft else ""
        raise InvalidArgument(
            f"budget {budget:,} B leaves {share} for mamba state, {max(slots, 0)} slots; one "
            f"running request needs {ratio} slot(s) plus the padding slot{spec} at "
            f"{per_req:,} B each (per_req over this stage's linear layers), "
            f"{state_bytes_needed:,} B; raise --budget to at least {needed:,} B"
            + ("" if cell == 0 else " or raise --mamba-full-memory-ratio"),
            field="budget_bytes",
        )
    if not draft:
        return slots, 0
    assert options.max_running_requests is not None  # draft_tokens() checked it
    return slots, (min(options.max_running_requests, slots // ratio) + 1) * draft * per_req


def _no_kv_pages(ctx: SizingContext, notes: list[str]) -> int:
    """Token id space of a stage without KV layers: max_total_tokens, else the context."""
    page = ctx.page_size
    if ctx.options.max_total_tokens is not None:
        tokens, knob = ctx.options.max_total_tokens, "max_total_tokens"
    else:
        tokens, knob = ctx.context_length, "context_length"
    if tokens < page:
        raise InvalidArgument(
            f"{knob} {tokens} is below one page of {page} tokens; raise --{knob.replace('_', '-')}"
            " or lower --page-size",
            field=knob,
        )
    notes.append("no full-attention layers in this stage: no KV buffers; "
                 f"{align_down(tokens, page)} token ids from {knob}")
    return tokens // page


def size(ctx: SizingContext) -> Sizing:
    """Size the KV token space and the state slot pool of one hybrid-linear stage.

    Raises:
        InvalidArgument: for an unsplittable TP, a budget too small for one running request's
            state slots (the ratio, plus the padding slot) and two KV pages, no budget and no
            ``max_running_requests``, or ``no_buffer`` above page size 1 or under the overlap
            schedule.
    """
    _check(ctx)
    options = ctx.options
    page = ctx.page_size
    full, _ = stage_split(ctx)
    cell = _kv_cell(ctx, len(full))
    per_req = per_request_state_bytes(ctx)
    ratio = state_ratio(ctx)
    draft = draft_tokens(ctx)
    notes: list[str] = []
    spec_bytes = 0

    if options.budget_bytes is None:
        if options.max_running_requests is None and per_req > 0:
            raise InvalidArgument(
                "hybrid linear attention without a budget needs a state pool size: give "
                "--budget (KV plus state) or --max-running-requests (state slots = "
                f"max_running_requests x {ratio})",
                field="max_running_requests",
            )
        slots: int | None = (options.max_running_requests or 0) * ratio if per_req else None
    elif per_req == 0:
        slots = None  # no linear layers here: the state id space follows max_running_requests
    else:
        slots, spec_bytes = _budget_state_slots(ctx, per_req, cell, draft)

    state_bytes = (0 if slots is None else (slots + 1) * per_req) + spec_bytes
    if cell == 0:
        pages = _no_kv_pages(ctx, notes)
    else:
        if options.budget_bytes is not None:
            kv_budget = options.budget_bytes - state_bytes
            if kv_budget < cell * page:
                spec = ", speculative states included" if spec_bytes else ""
                raise InvalidArgument(
                    f"after {slots} state slots plus the padding slot ({state_bytes:,} B at "
                    f"{per_req:,} B each{spec}) the budget {options.budget_bytes:,} B keeps "
                    f"{kv_budget:,} B for KV, less than one page ({cell * page:,} B); raise "
                    "--budget, or lower --mamba-full-memory-ratio / --max-running-requests",
                    field="budget_bytes",
                )
        pages = kv_pages(cell * page, options, notes, fixed_bytes=state_bytes)
    tokens = pages * page

    mrr = resolve_max_running_requests(tokens, ctx.context_length, options, notes,
                                       state_slots=slots)
    if slots is None:
        slots = mrr * ratio
        notes.append(f"no linear layers in this stage: {slots} state ids, no state buffers")
    else:
        notes.append(f"mamba state: {slots} slots + 1 padding slot, {per_req:,} B each")
    if draft and per_req:
        notes.append(f"speculative intermediate state: {draft} per request row, "
                     f"{mrr + 1} rows ({(mrr + 1) * draft * per_req:,} B"
                     + (f"; {spec_bytes:,} B reserved)" if spec_bytes else ")"))
    return Sizing(NAME, cell, pages, mrr, mamba_cache_size=slots, notes=tuple(notes))


def _kv_layer_buffers(ctx: SizingContext, suffix: str, rows: int, prefix: str) -> list[BufferSpec]:
    attn = ctx.spec.attention
    if isinstance(attn, MHAAttention):
        return mha.layer_buffers(suffix, ctx.kv, rows, tp_heads(attn.num_kv_heads, ctx.tp_size),
                                 attn.head_dim, attn.v_dim, ctx.page_size, prefix=prefix)
    return mla.layer_buffers(suffix, ctx.kv, rows, mla.kv_dim(ctx.spec), ctx.page_size, prefix)


def layout(ctx: SizingContext, sizing: Sizing) -> list[BufferSpec]:
    """KV buffers of the full layers, conv/SSM state of the linear layers, draft KV, and the
    ``req_to_state`` map (outside the budget)."""
    assert sizing.mamba_cache_size is not None
    rows = token_rows(sizing.num_pages, ctx.page_size)
    slots = sizing.mamba_cache_size + 1  # slot 0 is the padding slot
    shape = state_shape(_linear(ctx.spec), ctx.tp_size)
    full, state = stage_split(ctx)
    out: list[BufferSpec] = []
    for layer in full:
        out += _kv_layer_buffers(ctx, str(layer), rows, "")
    # Every conv.<l>, then every ssm.<l>, one after the other: equal buffers at one stride, so
    # SGLang's (layers, slots, ...) state tensors are single views over them (one layer's
    # buffer a multiple of the 256 B alignment, as real models' are, makes them contiguous).
    out += [buffer(f"conv.{layer}", shape.conv_dtype, (slots, *shape.conv), BufferKind.state)
            for layer in state]
    out += [buffer(f"ssm.{layer}", shape.ssm_dtype, (slots, *shape.ssm), BufferKind.state)
            for layer in state]
    draft = draft_tokens(ctx)
    if draft:
        # Intermediate states of the draft tokens being verified, one row per request row.
        reqs = sizing.max_running_requests + 1
        for layer in state:
            out.append(buffer(f"spec_conv.{layer}", shape.conv_dtype,
                              (reqs, draft, *shape.conv), BufferKind.spec_state))
            out.append(buffer(f"spec_ssm.{layer}", shape.ssm_dtype,
                              (reqs, draft, *shape.ssm), BufferKind.spec_state))
    for i in range(ctx.num_draft_layers):
        out += _kv_layer_buffers(ctx, str(i), rows, "draft_")
    out.append(buffer("req_to_state", DType.int32, (sizing.max_running_requests + 1,),
                      BufferKind.map, in_budget=False))
    return out

"""Hybrid sliding-window sizing (gpt-oss, Llama-4, Gemma-4, MiMo-V2...): full and SWA spaces.

The HF loader gives a spec sliding layers only for SGLang's hybrid-SWA allowlist (see
kvpoold.hf); Mistral, Gemma-2/3 and Qwen are sized as plain MHA there, as SGLang sizes them.

The layers of this PP stage split into ``nf`` full-attention and ``ns`` sliding-window layers.
Per layer and token, ``F`` bytes for a full layer and ``S`` for an SWA layer (``mha.layer_bytes``
with ``max(1, kv_heads // tp)`` heads; the SWA layers use ``sliding_window``'s own heads/dims
when given). ``D`` EAGLE draft layers count as full layers. With ``r = swa_full_tokens_ratio``,
SGLang's rule, in floats as Python computes it:

    Fb     = F * (nf + D)                bytes per token of the full space (all its layers)
    Sb     = S * ns                      bytes per token of the SWA space
    cell_f = Fb + r * Sb                 float; reported as cell_size_bytes = int(cell_f)
    full   = int(budget // cell_f) // page * page
    swa    = int(full * r) // page * page

Both spaces keep a padding page 0 on top of that, so with ``fp = full // page`` and
``sp = swa // page`` the buffers cost ``page * ((fp + 1) * Fb + (sp + 1) * Sb)`` bytes, which
exceeds the budget, if at all, by less than one page of every layer (``page * (Fb + Sb)``),
since ``full * cell_f <= budget`` and ``swa <= full * r``.
``--max-total-tokens`` caps ``full`` (then ``swa`` is derived again); without a budget
``full = align_down(max_total_tokens, page)``. The SWA space must hold more than the window
plus one page, else InvalidArgument. ``max_running_requests`` comes from ``full``.

SGLang's SWA request cap: without the radix cache, with a fixed ``max_running_requests`` N and
a chunked prefill (``chunked_prefill_size`` C > 0), the SWA space is sized from the requests
instead of ``r``: per request the window W, the 128 tokens between SWA evictions (times the
draft tokens under speculative decoding), a page, and one decode step's allocation (a page;
two per draft token under speculative decoding); plus the prefill chunks in flight (2 under
the overlap schedule, else 1) and a page:

    swa  = ceil_page((W + 128 + page + page) * N + chunks * C + page)   (no speculation)
    full = (budget - swa * Sb) // Fb // page * page                      cell_size_bytes = Fb

gpt-oss, page 16, N 64, C 8,192, overlap on: (127 + 128 + 16 + 16) * 64 + 2 * 8,192 + 16 =
34,768 SWA tokens; at 40 GiB full = (42,949,672,960 - 34,768 * 24,576) // 24,576 = 1,712,858
-> 1,712,848.

All-SWA (``nf == 0`` in this stage, reported as ``all_swa``): one token space; ``cell = Sb +
F * D`` (an int) and the common budget rule (``tokens = budget // cell // page * page``) sizes
it; ``full_max_total_num_tokens`` is None (SGLang says 0), ``max_total_num_tokens`` is the SWA
count.

Worked example, gpt-oss-20b (24 layers, sliding = even ids 0, 2, ..., 22, window 128 in the HF
config, 127 as SGLang's gpt-oss model reports it; 8 KV heads, head_dim 64), bf16, TP 1, PP 1,
r = 0.8, page 16, 40 GiB = 42,949,672,960 B: F = S = 8 * (64 + 64) * 2 = 2,048 B; Fb = Sb =
12 * 2,048 = 24,576 B; cell_f = 44,236.8 (cell_size_bytes 44,236). 42,949,672,960 / 44,236.8 =
970,903.7 -> full = 970,896 tokens (fp = 60,681); swa = int(776,716.8) = 776,716 -> 776,704
(sp = 48,544); bytes = 16 * 24,576 * (60,682 + 48,545) = 42,949,804,032 B (the budget plus
131,072). max_running_requests = min(clamp(int(970,896 / 131,072 * 512), 2,048, 4,096),
485,448) = 3,792.

Buffers: full layers ``k.<l>``/``v.<l>`` (kind kv, ``(fp + 1) * page`` rows), SWA layers
``k.<l>``/``v.<l>`` (kind swa_kv, ``(sp + 1) * page`` rows), ``draft_k.<i>``/``draft_v.<i>`` as
full layers, all ``(rows, H, head_dim)`` (FP4: packed plus scales, see fp4.py); plus the aux
``full_to_swa`` int64 ``(fp + 1,)``: full page id (token slot at page 1) -> SWA page id, 0 =
none. All-SWA: every buffer has ``(sp + 1) * page`` rows and there is no mapping.

``swa_pairing="engine"`` (SGLang's SWA allocator pairs the pages itself): ``full_to_swa`` is
SGLang's ``full_to_swa_index_mapping``, int64 ``((fp + 1) * page + 1,)``: full token slot -> SWA
token slot (0 = none) and a trailing entry the engine sets to -1 (a ``last_loc`` of -1 indexes
it). No id space addresses it, and ``swa`` is an id space of its own (space_table.py). Tiny
example, page 4, fp = 24: 25 * 4 + 1 = 101 entries, 808 B of aux.

Layer ranges are this stage's half-open ``ctx.layers``. SGLang narrows its SWA/full id lists to
``range(start, end + 1)`` (an inclusive end, which looks like an off-by-one); that is not
reproduced here.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvpool.contract.dtypes import DType
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import FULL_TO_SWA, BufferKind, BufferSpec
from kvpool.contract.spec import MHAAttention, ModelSpec
from kvpoold.sizing import mha
from kvpoold.sizing.common import (
    Sizing,
    SizingContext,
    align_down,
    cap_tokens,
    overlap_schedule,
    pages_for_budget,
    resolve_max_running_requests,
    tp_heads,
)
from kvpoold.sizing.layout import buffer, token_rows

NAME = "hybrid_swa"
ALL_SWA = "all_swa"
REPORTS = (NAME, ALL_SWA)
MAPPING_BUFFER = FULL_TO_SWA


def matches(spec: ModelSpec) -> bool:
    """MHA specs with at least one sliding layer (DeepSeek-V4's SWA ring is dsv4's)."""
    return (
        spec.sliding_window is not None
        and bool(spec.sliding_window.layers)
        and spec.dsv4 is None
        and isinstance(spec.attention, MHAAttention)
    )


@dataclass(frozen=True)
class LayerGeometry:
    """KV heads per TP rank and head dims of one kind of layer."""

    heads: int
    head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class StageSplit:
    """This stage's global layer ids split by kind, with their per-layer geometries."""

    full_layers: tuple[int, ...]
    swa_layers: tuple[int, ...]
    full: LayerGeometry
    swa: LayerGeometry

    @property
    def all_swa(self) -> bool:
        return not self.full_layers


def split_stage(ctx: SizingContext) -> StageSplit:
    """Split ``ctx.layers`` into full and sliding layers and resolve both geometries.

    SWA overrides in ``spec.sliding_window`` win; an SWA ``v_head_dim`` defaults to the SWA
    ``head_dim`` when that is overridden, else to the model's V dim.
    """
    attn = ctx.spec.attention
    sw = ctx.spec.sliding_window
    assert isinstance(attn, MHAAttention) and sw is not None
    sliding = set(sw.layers)
    full_layers = tuple(layer for layer in ctx.layers if layer not in sliding)
    swa_layers = tuple(layer for layer in ctx.layers if layer in sliding)
    full = LayerGeometry(tp_heads(attn.num_kv_heads, ctx.tp_size), attn.head_dim, attn.v_dim)
    swa_hd = sw.head_dim if sw.head_dim is not None else attn.head_dim
    if sw.v_head_dim is not None:
        swa_vd = sw.v_head_dim
    else:
        swa_vd = sw.head_dim if sw.head_dim is not None else attn.v_dim
    swa_heads = sw.num_kv_heads if sw.num_kv_heads is not None else attn.num_kv_heads
    swa = LayerGeometry(tp_heads(swa_heads, ctx.tp_size), swa_hd, swa_vd)
    return StageSplit(full_layers, swa_layers, full, swa)


def _layer_bytes(ctx: SizingContext, geo: LayerGeometry) -> int:
    return mha.layer_bytes(ctx.kv, geo.heads, geo.head_dim, geo.v_head_dim)


def token_bytes(ctx: SizingContext, split: StageSplit) -> tuple[int, int]:
    """``(Fb, Sb)``: bytes per token of the full space (full + draft layers) and of the SWA
    space (SWA layers)."""
    full = _layer_bytes(ctx, split.full) * (len(split.full_layers) + ctx.num_draft_layers)
    swa = _layer_bytes(ctx, split.swa) * len(split.swa_layers)
    return full, swa


def swa_tokens_for(full_tokens: int, ratio: float, page_size: int) -> int:
    """SWA tokens for ``full_tokens`` full tokens: ``int(full * r) // page * page``."""
    return align_down(int(full_tokens * ratio), page_size)


def _check_window(ctx: SizingContext, full_tokens: int | None, swa_tokens: int,
                  capped: bool) -> None:
    """The SWA space must hold a whole window plus one page, or no request can decode."""
    assert ctx.spec.sliding_window is not None
    window = ctx.spec.sliding_window.window
    page = ctx.page_size
    if window + page < swa_tokens:
        return
    ratio = ctx.options.swa_full_tokens_ratio
    if full_tokens is not None and ratio < 1.0 and window + page < full_tokens:
        field, knob = "swa_full_tokens_ratio", "raise --swa-full-tokens-ratio or --budget"
    elif capped:
        field, knob = "max_total_tokens", "raise --max-total-tokens"
    else:
        field, knob = "budget_bytes", "raise --budget" + (
            " or --swa-full-tokens-ratio" if full_tokens is not None and ratio < 1.0 else "")
    source = f" ({ratio} of {full_tokens} full tokens)" if full_tokens is not None else ""
    raise InvalidArgument(
        f"the SWA pool holds {swa_tokens} tokens{source}, not more than the window {window} "
        f"plus one page of {page}; {knob}",
        field=field,
    )


def _size_all_swa(ctx: SizingContext, split: StageSplit) -> Sizing:
    options = ctx.options
    page = ctx.page_size
    full_token_bytes, swa_token_bytes = token_bytes(ctx, split)  # Fb: the draft layers only
    cell = swa_token_bytes + full_token_bytes
    notes = [f"all {len(split.swa_layers)} layers of this stage slide: one SWA token space"]
    if options.budget_bytes is None:
        assert options.max_total_tokens is not None  # PlanOptions guarantees one of them
        swa_tokens = cap_tokens(align_down(options.max_total_tokens, page), options, notes)
        capped = True
    else:
        budget_tokens = pages_for_budget(options.budget_bytes, cell * page, what="SWA") * page
        swa_tokens = cap_tokens(budget_tokens, options, notes)
        capped = swa_tokens < budget_tokens
    _check_window(ctx, None, swa_tokens, capped)
    mrr = resolve_max_running_requests(swa_tokens, ctx.context_length, options, notes)
    pages = swa_tokens // page
    return Sizing(
        ALL_SWA, cell, pages, mrr,
        full_max_total_num_tokens=None,
        swa_max_total_num_tokens=swa_tokens,
        swa_num_pages=pages,
        max_total_num_tokens=swa_tokens,
        notes=tuple(notes),
    )


def size(ctx: SizingContext) -> Sizing:
    """Token counts of both spaces for this stage.

    Raises:
        InvalidArgument: when the budget holds no full page, when ``--max-total-tokens`` is
            below one page, or when the SWA space is not larger than the window plus one page.
    """
    split = split_stage(ctx)
    if split.all_swa:
        return _size_all_swa(ctx, split)
    if request_cap_applies(ctx):
        return _size_request_cap(ctx, split)
    options = ctx.options
    page = ctx.page_size
    ratio = options.swa_full_tokens_ratio
    full_token_bytes, swa_token_bytes = token_bytes(ctx, split)
    # SGLang's per-token cost of the full space, in float: what it divides the budget by
    cell_f = full_token_bytes + ratio * swa_token_bytes
    cell = int(cell_f)
    notes: list[str] = []
    if options.budget_bytes is None:
        assert options.max_total_tokens is not None  # PlanOptions guarantees one of them
        full_tokens = cap_tokens(align_down(options.max_total_tokens, page), options, notes)
        capped = True
    else:
        budget_tokens = align_down(int(options.budget_bytes // cell_f), page)
        if budget_tokens < page:
            raise InvalidArgument(
                f"budget {options.budget_bytes:,} B is too small for one full page: a token "
                f"of the full space with its share of the SWA space costs {cell_f:,.1f} B, a "
                f"page of {page} tokens {cell_f * page:,.0f} B; raise --budget or lower "
                "--page-size",
                field="budget_bytes",
            )
        full_tokens = cap_tokens(budget_tokens, options, notes)
        capped = full_tokens < budget_tokens
    swa_tokens = swa_tokens_for(full_tokens, ratio, page)
    _check_window(ctx, full_tokens, swa_tokens, capped)
    return _two_space_sizing(ctx, cell, full_tokens, swa_tokens, notes)


def _two_space_sizing(ctx: SizingContext, cell: int, full_tokens: int, swa_tokens: int,
                      notes: list[str]) -> Sizing:
    """The full and SWA token counts as a Sizing (pages of each, ``max_running_requests``
    from the full tokens)."""
    page = ctx.page_size
    mrr = resolve_max_running_requests(full_tokens, ctx.context_length, ctx.options, notes)
    return Sizing(
        NAME, cell, full_tokens // page, mrr,
        full_max_total_num_tokens=full_tokens,
        swa_max_total_num_tokens=swa_tokens,
        swa_num_pages=swa_tokens // page,
        max_total_num_tokens=full_tokens,
        notes=tuple(notes),
    )


# SGLang's SGLANG_SWA_EVICTION_INTERVAL default: tokens between SWA evictions of a request.
SWA_EVICTION_INTERVAL = 128


def request_cap_applies(ctx: SizingContext) -> bool:
    """SGLang's SWA request cap: without the radix cache and with a fixed
    ``max_running_requests`` and chunked prefill, the SWA space is sized from the worst case of
    those requests instead of ``swa_full_tokens_ratio``."""
    o = ctx.options
    return (o.disable_radix_cache and o.max_running_requests is not None
            and o.chunked_prefill_size > 0)


def swa_request_cap(ctx: SizingContext) -> int:
    """SWA tokens live at ``max_running_requests``: per request the window, the tokens
    between evictions and a page of padding plus one decode step's allocation (two draft
    steps under speculative decoding), and the prefill chunks in flight plus a page."""
    assert ctx.spec.sliding_window is not None and ctx.options.max_running_requests is not None
    o, page = ctx.options, ctx.page_size
    draft = o.speculative_num_draft_tokens or 1 if o.speculative_algorithm != "none" else 1
    trailing = ctx.spec.sliding_window.window + SWA_EVICTION_INTERVAL * draft + page
    decode = page if o.speculative_algorithm == "none" else 2 * draft
    chunks_in_flight = 2 if overlap_schedule(o) else 1
    return ((trailing + decode) * o.max_running_requests
            + chunks_in_flight * o.chunked_prefill_size + page)


def _size_request_cap(ctx: SizingContext, split: StageSplit) -> Sizing:
    """The request-cap split: the SWA space holds the cap (page-aligned up), the full space
    what the budget has left at ``Fb`` per token.

    Raises:
        InvalidArgument: when the SWA cap leaves the full space no page.
    """
    options, page = ctx.options, ctx.page_size
    full_token_bytes, swa_token_bytes = token_bytes(ctx, split)
    cap = -(-swa_request_cap(ctx) // page) * page
    notes = [f"SWA space sized from {options.max_running_requests} requests without the radix "
             f"cache (SGLang's request cap): {cap} tokens"]
    if options.budget_bytes is None:
        assert options.max_total_tokens is not None
        full_tokens = align_down(options.max_total_tokens, page)
        swa_tokens = min(cap, options.max_total_tokens)
    else:
        left = options.budget_bytes - cap * swa_token_bytes
        budget_tokens = align_down(max(left, 0) // full_token_bytes, page)
        if budget_tokens <= 0:
            raise InvalidArgument(
                f"the SWA space for {options.max_running_requests} requests without the radix "
                f"cache takes {cap:,} tokens = {cap * swa_token_bytes:,} B, leaving the budget "
                f"{options.budget_bytes:,} B no full page; lower --max-running-requests or "
                "--chunked-prefill-size, or raise --budget",
                field="budget_bytes",
            )
        full_tokens = cap_tokens(budget_tokens, options, notes)
        # capped by --max-total-tokens, SGLang re-derives the SWA side from that raw count
        swa_tokens = cap if full_tokens == budget_tokens else min(cap, options.max_total_tokens
                                                                  or cap)
    return _two_space_sizing(ctx, full_token_bytes, full_tokens, swa_tokens, notes)


def _layer_buffers(ctx: SizingContext, suffix: str, geo: LayerGeometry, rows: int,
                   kind: BufferKind, prefix: str = "") -> list[BufferSpec]:
    return mha.layer_buffers(suffix, ctx.kv, rows, geo.heads, geo.head_dim, geo.v_head_dim,
                             ctx.page_size, kind, prefix)


def layout(ctx: SizingContext, sizing: Sizing) -> list[BufferSpec]:
    """The buffers of :func:`size`'s counts.

    Returns:
        KV buffers of both spaces in layer order, the draft layers, then ``full_to_swa``
        (hybrid only), all with ``offset_bytes = 0`` for :func:`layout.place`.
    """
    split = split_stage(ctx)
    assert sizing.swa_num_pages is not None
    page = ctx.page_size
    full_rows = token_rows(sizing.num_pages, page)  # all-SWA: num_pages is the SWA count
    swa_rows = token_rows(sizing.swa_num_pages, page)
    swa_ids = set(split.swa_layers)
    out: list[BufferSpec] = []
    for layer in ctx.layers:
        if layer in swa_ids:
            out += _layer_buffers(ctx, str(layer), split.swa, swa_rows, BufferKind.swa_kv)
        else:
            out += _layer_buffers(ctx, str(layer), split.full, full_rows, BufferKind.kv)
    for i in range(ctx.num_draft_layers):
        out += _layer_buffers(ctx, str(i), split.full, full_rows, BufferKind.kv, "draft_")
    if split.all_swa:
        # One token space: its pages are the pool's kv ids (there is no full side to follow).
        return [msgspec.structs.replace(b, id_space="kv") for b in out]
    if ctx.options.swa_pairing == "engine":
        out.append(buffer(MAPPING_BUFFER, DType.int64, (full_rows + 1,), BufferKind.map,
                          rows_per_page=page, in_budget=False, space=""))
    else:
        out.append(buffer(MAPPING_BUFFER, DType.int64, (sizing.num_pages + 1,), BufferKind.map,
                          rows_per_page=1, in_budget=False))
    return out

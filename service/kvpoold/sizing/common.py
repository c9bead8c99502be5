"""Sizing rules shared by every architecture: KV format, PP/TP split, token counts, request rows.

No torch, no environment, no I/O. The budget rule used everywhere, SGLang's:

    max_total_num_tokens = budget // cell // page_size * page_size
    num_pages = max_total_num_tokens // page_size

and the padding page 0 comes on top: the KV buffers hold ``(num_pages + 1) * page_size`` rows,
so they exceed the budget by up to one page of cells (``total_bytes`` and ``backing_bytes`` say
what is really allocated, and the daemon admits a pool by its ``backing_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.contract.dtypes import DType
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.options import KVCacheDType, PlanOptions
from kvpool.contract.spec import ModelDType, ModelSpec

# Extra req_to_token columns beyond the context length (SGLang: 4 + draft tokens).
REQ_TO_TOKEN_EXTRA_COLUMNS = 4
MIN_RUNNING_REQUESTS_ESTIMATE = 2048
MAX_RUNNING_REQUESTS_ESTIMATE = 4096
# Mamba state slots per running request (SGLang's _calculate_mamba_ratio): its own plus cached
# prefix states with the radix cache (3), one without it; the extra_buffer strategy adds one
# ping-pong tracking slot, two under the overlap schedule.
RADIX_STATE_RATIO = 3
NO_RADIX_STATE_RATIO = 1


def overlap_schedule(options: PlanOptions) -> bool:
    """Whether SGLang runs its overlap scheduler: on unless disabled, and off under pipeline
    parallelism (SGLang turns it off when ``pp_size > 1``)."""
    return not options.disable_overlap_schedule and options.pp_size == 1


def mamba_state_ratio(options: PlanOptions) -> int:
    """State slots one running request needs: 1 without the radix cache, else 3, plus the
    extra_buffer strategy's tracking slots (``auto`` resolves to it, as SGLang does on CUDA):
    2 with the overlap schedule, 1 without."""
    if options.disable_radix_cache:
        return NO_RADIX_STATE_RATIO
    if options.mamba_radix_cache_strategy == "no_buffer":
        return RADIX_STATE_RATIO
    return RADIX_STATE_RATIO + (2 if overlap_schedule(options) else 1)


@dataclass(frozen=True)
class KVFormat:
    """A resolved KV cache dtype: ``itemsize`` bytes per stored element before FP4 packing."""

    name: str
    itemsize: int
    store: DType
    is_fp4: bool = False


_MODEL_FORMATS = {
    ModelDType.bfloat16: KVFormat("bfloat16", 2, DType.bfloat16),
    ModelDType.float16: KVFormat("float16", 2, DType.float16),
    ModelDType.float32: KVFormat("float32", 4, DType.float32),
}
_KV_FORMATS = {
    KVCacheDType.bfloat16: _MODEL_FORMATS[ModelDType.bfloat16],
    KVCacheDType.float16: _MODEL_FORMATS[ModelDType.float16],
    KVCacheDType.float32: _MODEL_FORMATS[ModelDType.float32],
    KVCacheDType.fp8_e4m3: KVFormat("fp8_e4m3", 1, DType.uint8),
    KVCacheDType.fp8_e5m2: KVFormat("fp8_e5m2", 1, DType.uint8),
    KVCacheDType.fp4_e2m1: KVFormat("fp4_e2m1", 1, DType.uint8, is_fp4=True),
}


def resolve_kv_format(requested: KVCacheDType, spec: ModelSpec) -> KVFormat:
    """``auto`` -> the model dtype, or fp8_e4m3 when the checkpoint quantizes its KV cache."""
    if requested is KVCacheDType.auto:
        if spec.kv_cache_quant_fp8:
            return _KV_FORMATS[KVCacheDType.fp8_e4m3]
        return _MODEL_FORMATS[spec.dtype]
    return _KV_FORMATS[requested]


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Global layer ids of one pipeline stage: an even split, the remainder given one each to
    the last stages (12 layers over 5 stages: 2, 2, 2, 3, 3).

    Raises:
        InvalidArgument: when there are more stages than layers.
    """
    if pp_size > num_layers:
        raise InvalidArgument(
            f"pp_size {pp_size} exceeds the model's {num_layers} layers; "
            "lower --pp-size",
            field="pp_size",
        )
    base, rem = divmod(num_layers, pp_size)
    first_big = pp_size - rem  # stages from here on take base + 1
    start = pp_rank * base + max(0, pp_rank - first_big)
    size = base + (1 if pp_rank >= first_big else 0)
    return range(start, start + size)


def tp_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads per TP rank; heads are replicated when there are fewer heads than ranks."""
    return max(1, num_kv_heads // tp_size)


def draft_scaled_cell(cell: int, num_draft_layers: int, num_layers: int) -> int:
    """EAGLE/STANDALONE: the draft model's KV shares the token count, so the per-token cell
    grows to ``int(cell * (1 + D / L))``, computed exactly in integers."""
    if num_draft_layers == 0 or num_layers == 0:
        return cell
    return cell * (num_layers + num_draft_layers) // num_layers


def align_down(value: int, page_size: int) -> int:
    return value // page_size * page_size


def pages_for_budget(budget_bytes: int, page_bytes: int, *, what: str = "KV") -> int:
    """Pages that ``budget_bytes`` buys at ``page_bytes`` per page (the padding page comes on
    top, as in SGLang).

    Raises:
        InvalidArgument: when not even one page fits.
    """
    if page_bytes <= 0:
        raise InvalidArgument(f"{what} page size in bytes is {page_bytes}; nothing to size")
    pages = budget_bytes // page_bytes
    if pages < 1:
        raise InvalidArgument(
            f"budget {budget_bytes:,} B is too small for one {what} page of "
            f"{page_bytes:,} B; raise --budget or lower --page-size",
            field="budget_bytes",
        )
    return pages


def cap_tokens(tokens: int, options: PlanOptions, notes: list[str]) -> int:
    """Apply ``--max-total-tokens`` to a budget-derived count and re-align to the page size.

    Raises:
        InvalidArgument: when the cap is below one page.
    """
    cap = options.max_total_tokens
    page = options.page_size
    if cap is None:
        return tokens
    if cap < page:
        raise InvalidArgument(
            f"max_total_tokens {cap} is below one page of {page} tokens; "
            "raise --max-total-tokens or lower --page-size",
            field="max_total_tokens",
        )
    if cap < tokens:
        notes.append(f"max_total_tokens {cap} caps the budget's {tokens} tokens")
        return align_down(cap, page)
    if options.budget_bytes is not None and cap > tokens:
        notes.append(f"max_total_tokens {cap} exceeds what the budget holds ({tokens}); ignored")
    return tokens


def kv_pages(budget_page_bytes: int, options: PlanOptions, notes: list[str],
             *, fixed_bytes: int = 0, what: str = "KV") -> int:
    """The number of KV pages for a pool whose pages cost ``budget_page_bytes`` each and whose
    budget first pays ``fixed_bytes`` for something else (state).

    Uses the budget, the ``max_total_tokens`` cap, or the cap alone when no budget is given.
    """
    page = options.page_size
    if options.budget_bytes is None:
        assert options.max_total_tokens is not None  # PlanOptions guarantees one of them
        return cap_tokens(align_down(options.max_total_tokens, page), options, notes) // page
    available = options.budget_bytes - fixed_bytes
    pages = pages_for_budget(max(0, available), budget_page_bytes, what=what)
    return cap_tokens(pages * page, options, notes) // page


def resolve_max_running_requests(
    total_tokens: int,
    context_length: int,
    options: PlanOptions,
    notes: list[str],
    *,
    state_slots: int | None = None,
) -> int:
    """``clamp(int(T / context_len * 512), 2048, 4096)``, or the user's value, capped at
    ``T // 2``; for mamba models also at ``state_slots // ratio`` (:func:`mamba_state_ratio`:
    1 without the radix cache, else 3 plus the extra_buffer tracking slots).

    Raises:
        InvalidArgument: when the result is < 1 (the pool is too small for one request).
    """
    half = total_tokens // 2
    if options.max_running_requests is not None:
        mrr = min(options.max_running_requests, half)
        if mrr < options.max_running_requests:
            notes.append(
                f"max_running_requests {options.max_running_requests} reduced to {mrr} "
                f"(at most half of {total_tokens} tokens)"
            )
    else:
        estimate = int(total_tokens / context_length * 512)
        estimate = min(max(estimate, MIN_RUNNING_REQUESTS_ESTIMATE), MAX_RUNNING_REQUESTS_ESTIMATE)
        mrr = min(estimate, half)
    if state_slots is not None:
        ratio = mamba_state_ratio(options)
        by_state = state_slots // ratio
        if by_state < mrr:
            notes.append(
                f"max_running_requests {mrr} reduced to {by_state} "
                f"({state_slots} state slots / {ratio} per request)"
            )
            mrr = by_state
    if mrr < 1:
        raise InvalidArgument(
            f"the pool holds {total_tokens} tokens"
            + (f" and {state_slots} state slots" if state_slots is not None else "")
            + ", not enough for one running request; raise --budget",
            field="budget_bytes",
        )
    return mrr


@dataclass(frozen=True)
class SizingContext:
    """What every architecture's sizing reads: the spec, the options, and their resolutions."""

    spec: ModelSpec
    options: PlanOptions
    kv: KVFormat
    layers: range  # this PP stage's global layer ids
    context_length: int
    num_draft_layers: int

    @property
    def page_size(self) -> int:
        return self.options.page_size

    @property
    def tp_size(self) -> int:
        return self.options.tp_size


@dataclass(frozen=True)
class Sizing:
    """An architecture's numbers, before the buffers are laid out."""

    architecture: str
    cell_size_bytes: int
    num_pages: int  # pages of the full (or only) token space, excluding the padding page
    max_running_requests: int
    full_max_total_num_tokens: int | None = None
    swa_max_total_num_tokens: int | None = None
    swa_num_pages: int | None = None
    mamba_cache_size: int | None = None
    c4_max_total_num_tokens: int | None = None
    c128_max_total_num_tokens: int | None = None
    c4_state_pool_size: int | None = None
    c128_state_pool_size: int | None = None
    max_total_num_tokens: int | None = None  # default: num_pages * page_size
    notes: tuple[str, ...] = field(default=())
    # (name, capacity) of allocatable id spaces beyond kv/swa/req/state (DSV4's state rings)
    extra_spaces: tuple[tuple[str, int], ...] = field(default=())


def uniform_sizing(name: str, ctx: SizingContext, layer_bytes: int) -> Sizing:
    """A pool of identical layers (MHA, MLA, DSA): ``cell = layer_bytes * L`` scaled for the
    draft layers (:func:`draft_scaled_cell`), pages from the budget (:func:`kv_pages`), and
    ``max_running_requests`` from the tokens."""
    num_layers = len(ctx.layers)
    cell = draft_scaled_cell(layer_bytes * num_layers, ctx.num_draft_layers, num_layers)
    notes: list[str] = []
    pages = kv_pages(cell * ctx.page_size, ctx.options, notes)
    mrr = resolve_max_running_requests(pages * ctx.page_size, ctx.context_length, ctx.options,
                                       notes)
    return Sizing(name, cell, pages, mrr, notes=tuple(notes))

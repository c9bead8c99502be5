"""DeepSeek-V4 compressed-attention sizing: an SWA ring per layer plus c4 / c128 compressed KV.

Every layer of this PP stage keeps an SWA token space; a layer with ``compress_ratios[l] == 4``
also keeps a c4 compressed KV (one entry per 4 tokens), a c4 lightning-indexer key and two c4
compress states; a ratio-128 layer keeps a c128 compressed KV and a request-scoped c128 compress
state. ``L``, ``L4``, ``L128`` count this stage's layers; ``D`` draft (MTP) layers are SWA-only.

Per token and layer, the KV entry is ``kv = nope + 2 * rope + nope / 64 + 1`` bytes (448 fp8 nope,
64 bf16 rope, 7 one-byte scales, 1 pad = 584), stored page-major with each page padded to a
multiple of 576 B (what the FlashMLA kernels read). For page size ``P`` (a multiple of 128) and
window ``W``, with ``pad(t) = ceil(t * kv / 576) * 576``:

    pages       Bs = pad(P)  (SWA),   B4 = pad(P / 4)  (c4),   B128 = pad(P / 128)  (c128)
    index page  I4 = P / 4 * (idx + idx / 128 * 4)               (132 B per c4 entry)
    state rows  c4: 4 * A * s B (+ 4 * idx * s indexer),  c128: 2 * A * s B,  A = nope + rope

where ``idx`` is the index head dim and ``s`` the state element size (4 float32, 2 bfloat16).

With ``N`` full pages, ``S = floor(N * r)`` SWA pages (``r = swa_full_tokens_ratio``, read as the
decimal it prints as) and ``slots`` request slots for the c128 state, the buffers are

    bytes(N) = (L + D) * (S + 1) * Bs + (N + 1) * (L4 * (B4 + I4) + L128 * B128)
             + L4 * ceil4(c4_state + ring4 + 1) * 4 * (A + idx) * s
             + L128 * ceil128(slots * ring128 + ring128 + 1) * 2 * A * s
    c4_state = S * ring4                   rings: c4 8, c128 128 (16 / 256 with speculative)

and ``N`` follows SGLang's DSV4 configurator: ``bpt = (dN + r * dS) / P`` as a float (``dN`` the
bytes one more full page adds, ``dS`` one more SWA page with its ``ring4`` c4 state rows),
``full = int((budget - c128 state) / bpt)`` aligned down to the page, ``N = full / P``. The
padding page of every token space and the rings' sentinel rows are not paid by the budget:
they come on top, as in SGLang (``bytes(N)`` exceeds the budget by less than one SWA page of
every layer, one full page and a few state rows). ``slots = max_running_requests + 1`` with the
user's value (SGLang sets 256 for DeepseekV4ForCausalLM), else the estimate
``min(clamp(int(T1 / context * 512), 2048, 4096), T1 // 2)`` from ``T1 = int(budget / bpt)``
(SGLang's first pass). ``cell = int(bpt)``. Sizes: full = ``N * P``, swa = ``S * P``, c4 =
full // 4, c128 = full // 128, c4_state as above, c128_state = slots * ring128.

Worked example, 61 layers (0, 0, then 4 / 128 alternating: L4 = 30, L128 = 29), page 256, window
128, fp32 state, r = 0.8 (given; SGLang's default for the class is 0.1), no speculative,
max_running_requests 256, 40 GiB = 42,949,672,960 B:
Bs = 149,760, B4 = 37,440, I4 = 8,448, B128 = 1,728; dN = 30 * 45,888 + 29 * 1,728 = 1,426,752;
dS = 61 * 149,760 + 30 * 8 * 10,240 = 11,592,960; bpt = 10,701,120 / 256 = 41,801.25. c128 state =
29 * ceil128(257 * 128 + 129) * 4,096 = 29 * 33,152 * 4,096 = 3,937,927,168 B. full =
int(39,011,745,792 / 41,801.25) = 933,267 -> 933,120 (N = 3,645), S = 2,916: swa = 746,496,
c4 = 233,280, c128 = 7,290, c4_state = 23,328, c128_state = 32,896; laid out 42,957,758,080 B.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from kvpool.contract.dtypes import DType
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import FULL_TO_SWA, BufferFill, BufferKind, BufferSpec
from kvpool.contract.spec import DSV4Compression, ModelSpec
from kvpoold.sizing.common import (
    Sizing,
    SizingContext,
    align_down,
    cap_tokens,
    resolve_max_running_requests,
)
from kvpoold.sizing.layout import buffer

NAME = "dsv4"
PAGE_SIZE_MULTIPLE = 128  # the c128 space needs whole compressed entries per page
SGLANG_CUDA_PAGE_SIZE = 256  # SGLang's CUDA DSV4 pool asserts exactly this page size
KV_PAGE_ALIGN_BYTES = 576  # FlashMLA reads packed KV pages in 576-byte units
NOPE_SCALE_BLOCK = 64  # one one-byte scale per 64 fp8 nope values
INDEX_SCALE_BLOCK = 128  # one fp32 scale per 128 fp8 indexer values
C4, C128 = 4, 128
# The allocatable id spaces of the compress-state rings.
C4_STATE, C128_STATE = "c4_state", "c128_state"
MAPPING_BUFFER = FULL_TO_SWA
STATE_DTYPES = {"float32": DType.float32, "bfloat16": DType.bfloat16}


def page_size_for(asked: int) -> int:
    """SGLang's DSV4 override sets page size 256 on CUDA; kvpool keeps any multiple of 128 it is
    given (docs/dsv4-layout.md) and takes SGLang's 256 for any other page size."""
    return asked if asked % PAGE_SIZE_MULTIPLE == 0 else SGLANG_CUDA_PAGE_SIZE


def matches(spec: ModelSpec) -> bool:
    return spec.dsv4 is not None


def kv_bytes_per_token(nope_head_dim: int, rope_head_dim: int) -> int:
    """Packed bytes of one token's KV entry: fp8 nope, bf16 rope, one scale per 64 nope, 1 pad."""
    return nope_head_dim + 2 * rope_head_dim + nope_head_dim // NOPE_SCALE_BLOCK + 1


def packed_page_bytes(tokens_per_page: int, nope_head_dim: int, rope_head_dim: int) -> int:
    """Bytes of one packed KV page of ``tokens_per_page`` entries, padded to 576 B."""
    raw = tokens_per_page * kv_bytes_per_token(nope_head_dim, rope_head_dim)
    return -(-raw // KV_PAGE_ALIGN_BYTES) * KV_PAGE_ALIGN_BYTES


def index_bytes_per_token(index_head_dim: int) -> int:
    """One c4 indexer key: fp8 values plus one fp32 scale per 128 (132 B for 128)."""
    return index_head_dim + index_head_dim // INDEX_SCALE_BLOCK * 4


def ring_sizes(speculative: bool) -> tuple[int, int]:
    """Compress-state ring rows per SWA page (c4) and per request (c128)."""
    return (16, 256) if speculative else (8, 128)


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Geometry:
    """Everything the byte count of a DSV4 pool depends on, resolved for one PP stage."""

    page_size: int
    window: int
    swa_ratio: Fraction
    layers: tuple[int, ...]
    c4_layers: tuple[int, ...]
    c128_layers: tuple[int, ...]
    num_draft_layers: int
    ring4: int
    ring128: int
    swa_page_bytes: int  # Bs
    c4_page_bytes: int  # B4
    c128_page_bytes: int  # B128
    index_page_bytes: int  # I4
    state_dtype: DType
    attn_dim: int  # A = nope + rope
    index_dim: int

    @property
    def c4_state_row_bytes(self) -> int:
        """kv|score halves with overlap: 2 * (1 + 1) * A elements."""
        return 4 * self.attn_dim * self.state_dtype.itemsize

    @property
    def c4_index_state_row_bytes(self) -> int:
        return 4 * self.index_dim * self.state_dtype.itemsize

    @property
    def c128_state_row_bytes(self) -> int:
        """kv|score halves without overlap: 2 * A elements."""
        return 2 * self.attn_dim * self.state_dtype.itemsize

    def swa_pages(self, full_pages: int) -> int:
        """``int(full * r) // page``, exact for the decimal ratio."""
        return int(full_pages * self.page_size * self.swa_ratio) // self.page_size

    def c4_state_size(self, swa_pages: int) -> int:
        """Logical c4 state entries: ``ring4`` per SWA page (SGLang addresses the ring by
        ``swa_loc // page_size``)."""
        return swa_pages * self.ring4

    def c4_state_rows(self, swa_pages: int) -> int:
        """Rows of one c4 state buffer: entries, one ring of headroom, the sentinel last row,
        rounded up to the ratio."""
        return _ceil_to(self.c4_state_size(swa_pages) + self.ring4 + 1, C4)

    def c128_state_rows(self, slots: int) -> int:
        return _ceil_to(slots * self.ring128 + self.ring128 + 1, C128)

    def c128_state_bytes(self, slots: int) -> int:
        """The fixed c128 bias; 0 for the first pass (``slots == 0``) or without c128 layers."""
        if slots == 0 or not self.c128_layers:
            return 0
        return len(self.c128_layers) * self.c128_state_rows(slots) * self.c128_state_row_bytes

    @property
    def full_page_bytes(self) -> int:
        """``dN``: what every full page adds (c4 KV + indexer, c128 KV)."""
        return (len(self.c4_layers) * (self.c4_page_bytes + self.index_page_bytes)
                + len(self.c128_layers) * self.c128_page_bytes)

    def swa_page_cost(self, drafts: bool = True) -> int:
        """``dS``: what one more SWA page lays out (SWA KV of the stage's layers, and of its
        draft layers unless ``drafts`` is False, plus ``ring4`` c4 state rows)."""
        layers = len(self.layers) + (self.num_draft_layers if drafts else 0)
        return (layers * self.swa_page_bytes + len(self.c4_layers) * self.ring4
                * (self.c4_state_row_bytes + self.c4_index_state_row_bytes))

    def cell_size_bytes(self) -> int:
        """The per-full-token coefficient, ``int(bytes_per_full_token)``."""
        return int(self.bytes_per_full_token())

    def pool_bytes(self, full_pages: int, slots: int) -> int:
        """Exact in-budget bytes with ``full_pages`` full pages and ``slots`` c128 slots."""
        swa_pages = self.swa_pages(full_pages)
        swa = (len(self.layers) + self.num_draft_layers) * (swa_pages + 1) * self.swa_page_bytes
        compressed = (full_pages + 1) * self.full_page_bytes
        c4_states = (len(self.c4_layers) * self.c4_state_rows(swa_pages)
                     * (self.c4_state_row_bytes + self.c4_index_state_row_bytes))
        return swa + compressed + c4_states + self.c128_state_bytes(slots)

    def bytes_per_full_token(self) -> float:
        """SGLang's coefficient: ``(dN + r * dS') / P`` as a float, ``dS'`` an SWA page of the
        stage's own layers with its c4 state rows; with draft layers, times ``(L + 1) / L``
        (SGLang reserves its draft worker so, whatever the draft layer costs)."""
        target = self.swa_page_cost(drafts=False)
        bpt = (self.full_page_bytes + float(self.swa_ratio) * target) / self.page_size
        if self.num_draft_layers:
            bpt *= (len(self.layers) + 1) / len(self.layers)
        return bpt

    def full_tokens(self, budget_bytes: int, slots: int) -> int:
        """SGLang's DSV4 rule: ``int((budget - c128 state) / bytes_per_full_token)`` tokens,
        not yet page-aligned. The padding pages and the rings' sentinel rows are not charged
        (they come on top, as in SGLang's configurator)."""
        avail = max(budget_bytes - self.c128_state_bytes(slots), 0)
        return int(avail / self.bytes_per_full_token())

    def max_full_pages(self, budget_bytes: int, slots: int) -> int:
        """Full pages of :meth:`full_tokens` (0 when not even one fits)."""
        return self.full_tokens(budget_bytes, slots) // self.page_size


def _compression(spec: ModelSpec) -> DSV4Compression:
    assert spec.dsv4 is not None
    return spec.dsv4


def geometry(ctx: SizingContext) -> Geometry:
    """Resolve this stage's DSV4 geometry from ``spec.dsv4`` and the options.

    Raises:
        InvalidArgument: for a page size that is not a multiple of 128, a KV dtype other than
            fp8_e4m3, head dims the packed layout cannot hold, or a ``sliding_window`` whose
            window disagrees with ``dsv4.window_size``.
    """
    comp = _compression(ctx.spec)
    page = ctx.page_size
    if page % PAGE_SIZE_MULTIPLE:
        raise InvalidArgument(
            f"DeepSeek-V4 compressed attention needs page_size a multiple of "
            f"{PAGE_SIZE_MULTIPLE} (one c128 entry per 128 tokens), got {page}; use --page-size "
            f"{SGLANG_CUDA_PAGE_SIZE} (what SGLang's CUDA kernels require)",
            field="page_size",
        )
    if ctx.kv.name != "fp8_e4m3":
        raise InvalidArgument(
            f"DeepSeek-V4 pools store packed fp8_e4m3 KV, but the KV dtype resolved to "
            f"{ctx.kv.name!r}; pass --kv-cache-dtype fp8_e4m3 or set kv_cache_quant_fp8 = true "
            "in the spec",
            field="kv_cache_dtype",
        )
    if comp.nope_head_dim % NOPE_SCALE_BLOCK or comp.index_head_dim % INDEX_SCALE_BLOCK:
        raise InvalidArgument(
            f"dsv4.nope_head_dim must be a multiple of {NOPE_SCALE_BLOCK} and "
            f"dsv4.index_head_dim of {INDEX_SCALE_BLOCK}, got {comp.nope_head_dim} and "
            f"{comp.index_head_dim}; fix the spec",
            field="model",
        )
    sw = ctx.spec.sliding_window
    if sw is not None and sw.window != comp.window_size:
        raise InvalidArgument(
            f"sliding_window.window {sw.window} disagrees with dsv4.window_size "
            f"{comp.window_size}; DSV4 sizing reads dsv4.window_size, drop sliding_window or "
            "make them equal",
            field="model",
        )
    ratios = comp.compress_ratios
    layers = tuple(ctx.layers)
    ring4, ring128 = ring_sizes(ctx.options.speculative_algorithm != "none")
    nope, rope = comp.nope_head_dim, comp.rope_head_dim
    return Geometry(
        page_size=page,
        window=comp.window_size,
        # the decimal the user typed (0.8 -> 4/5), so int(full * r) has no float rounding
        swa_ratio=Fraction(repr(ctx.options.swa_full_tokens_ratio)),
        layers=layers,
        c4_layers=tuple(layer for layer in layers if ratios[layer] == C4),
        c128_layers=tuple(layer for layer in layers if ratios[layer] == C128),
        num_draft_layers=ctx.num_draft_layers,
        ring4=ring4,
        ring128=ring128,
        swa_page_bytes=packed_page_bytes(page, nope, rope),
        c4_page_bytes=packed_page_bytes(page // C4, nope, rope),
        c128_page_bytes=packed_page_bytes(page // C128, nope, rope),
        index_page_bytes=page // C4 * index_bytes_per_token(comp.index_head_dim),
        state_dtype=STATE_DTYPES[comp.state_dtype],
        attn_dim=nope + rope,
        index_dim=comp.index_head_dim,
    )


def _request_slots(ctx: SizingContext, geo: Geometry) -> int:
    """Slots the c128 state is charged (and laid out) for: ``max_running_requests + 1``, with
    the user's value or the estimate from a first pass that ignores the c128 state."""
    options = ctx.options
    if options.max_running_requests is not None:
        return options.max_running_requests + 1
    if options.budget_bytes is None:
        assert options.max_total_tokens is not None  # PlanOptions guarantees one of them
        # raises for a cap below one page, naming max_total_tokens
        tokens = cap_tokens(align_down(options.max_total_tokens, ctx.page_size), options, [])
    else:
        # SGLang's first pass: the budget over the coefficient, unaligned, no state charged
        tokens = int(options.budget_bytes / geo.bytes_per_full_token())
        if tokens < ctx.page_size:
            _raise_too_small(ctx, geo, 0)
    return resolve_max_running_requests(tokens, ctx.context_length, options, []) + 1


def _raise_too_small(ctx: SizingContext, geo: Geometry, slots: int) -> None:
    budget = ctx.options.budget_bytes
    assert budget is not None
    state = geo.c128_state_bytes(slots)
    need = state + int(geo.bytes_per_full_token() * ctx.page_size) + 1
    detail = (f", of which the c128 compress state for {slots} request slots over "
              f"{len(geo.c128_layers)} layers takes {state:,} B; lower --max-running-requests "
              "or raise --budget") if state else "; raise --budget"
    raise InvalidArgument(
        f"budget {budget:,} B is too small for one DeepSeek-V4 page of {ctx.page_size} tokens: "
        f"it needs about {need:,} B{detail}",
        field="budget_bytes",
    )


def _check_window(ctx: SizingContext, geo: Geometry, full_tokens: int, swa_tokens: int,
                  capped: bool) -> None:
    """The SWA ring must hold a whole window plus one page, or no request can decode."""
    if geo.window + geo.page_size < swa_tokens:
        return
    knob = "raise --max-total-tokens" if capped else "raise --budget"
    raise InvalidArgument(
        f"the SWA space holds {swa_tokens} tokens ({ctx.options.swa_full_tokens_ratio} of "
        f"{full_tokens} full tokens), not more than the window {geo.window} plus one page of "
        f"{geo.page_size}; {knob} or --swa-full-tokens-ratio",
        field="max_total_tokens" if capped else "budget_bytes",
    )


def size(ctx: SizingContext) -> Sizing:
    """Token counts of the full, SWA, c4 and c128 spaces and the state pool sizes.

    Raises:
        InvalidArgument: see :func:`geometry`; also when the budget holds no page after the
            c128 state, when ``--max-total-tokens`` is below one page, or when the SWA space is
            not larger than the window plus one page, or ``swa_pairing="engine"`` (the DSV4
            pool's pages are paired by the daemon only).
    """
    if ctx.options.swa_pairing != "daemon":
        raise InvalidArgument(
            f"DeepSeek-V4 pools pair their full and SWA pages in the daemon; swa_pairing "
            f"{ctx.options.swa_pairing!r} is for hybrid sliding-window pools: leave it unset",
            field="swa_pairing")
    geo = geometry(ctx)
    options = ctx.options
    page = ctx.page_size
    notes: list[str] = []
    if page != SGLANG_CUDA_PAGE_SIZE:
        notes.append(f"page_size {page}: SGLang's CUDA DSV4 pool requires "
                     f"{SGLANG_CUDA_PAGE_SIZE}")
    slots = _request_slots(ctx, geo)
    if options.budget_bytes is None:
        assert options.max_total_tokens is not None  # PlanOptions guarantees one of them
        full_tokens = cap_tokens(align_down(options.max_total_tokens, page), options, notes)
        capped = True
    else:
        pages = geo.max_full_pages(options.budget_bytes, slots)
        if pages < 1:
            _raise_too_small(ctx, geo, slots)
        full_tokens = cap_tokens(pages * page, options, notes)
        capped = full_tokens < pages * page
    full_pages = full_tokens // page
    swa_pages = geo.swa_pages(full_pages)
    _check_window(ctx, geo, full_tokens, swa_pages * page, capped)
    mrr = resolve_max_running_requests(full_tokens, ctx.context_length, options, notes)
    # mrr never exceeds the charged slots: the user's value is only ever lowered, and the
    # estimate grows with T, which the c128 bias (and a cap) only shrink.
    assert mrr + 1 <= slots
    if mrr + 1 < slots:
        notes.append(f"c128 compress state laid out for the {slots - 1} requests it was "
                     f"charged for (max_running_requests is {mrr})")
    return Sizing(
        NAME,
        geo.cell_size_bytes(),
        full_pages,
        mrr,
        full_max_total_num_tokens=full_tokens,
        swa_max_total_num_tokens=swa_pages * page,
        swa_num_pages=swa_pages,
        c4_max_total_num_tokens=full_tokens // C4,
        c128_max_total_num_tokens=full_tokens // C128,
        c4_state_pool_size=geo.c4_state_size(swa_pages),
        c128_state_pool_size=slots * geo.ring128,
        max_total_num_tokens=full_tokens,
        notes=tuple(notes),
        # Compress-state rings as allocatable units: id u owns ring rows u * ring .. + ring - 1
        # (row block 0 is the sentinel block the budget already pays for).
        extra_spaces=(
            (C4_STATE, geo.c4_state_size(swa_pages) // geo.ring4),
            (C128_STATE, slots),
        ),
    )


def layout(ctx: SizingContext, sizing: Sizing) -> list[BufferSpec]:
    """Per stage layer (in order) its SWA KV, then its c4 or c128 buffers; the draft layers'
    SWA KV; then the aux ``full_to_swa`` page map. See docs/dsv4-layout.md."""
    geo = geometry(ctx)
    assert sizing.swa_num_pages is not None and sizing.c128_state_pool_size is not None
    full_pages, swa_pages = sizing.num_pages, sizing.swa_num_pages
    slots = sizing.c128_state_pool_size // geo.ring128
    state = geo.state_dtype
    c4_rows = geo.c4_state_rows(swa_pages)
    c4_ids, c128_ids = set(geo.c4_layers), set(geo.c128_layers)
    u8 = DType.uint8
    out: list[BufferSpec] = []
    for layer in geo.layers:
        out.append(buffer(f"swa_kv.{layer}", u8, (swa_pages + 1, geo.swa_page_bytes),
                          BufferKind.swa_kv))
        if layer in c4_ids:
            out += [
                buffer(f"c4_kv.{layer}", u8, (full_pages + 1, geo.c4_page_bytes),
                       BufferKind.compressed),
                buffer(f"c4_index_k.{layer}", u8, (full_pages + 1, geo.index_page_bytes),
                       BufferKind.index),
                buffer(f"c4_state.{layer}", state, (c4_rows, 4 * geo.attn_dim),
                       BufferKind.state, rows_per_page=geo.ring4, space=C4_STATE,
                       fill=BufferFill.kv_score),
                buffer(f"c4_index_state.{layer}", state, (c4_rows, 4 * geo.index_dim),
                       BufferKind.state, rows_per_page=geo.ring4, space=C4_STATE,
                       fill=BufferFill.kv_score),
            ]
        elif layer in c128_ids:
            out += [
                buffer(f"c128_kv.{layer}", u8, (full_pages + 1, geo.c128_page_bytes),
                       BufferKind.compressed),
                buffer(f"c128_state.{layer}", state,
                       (geo.c128_state_rows(slots), 2 * geo.attn_dim),
                       BufferKind.state, rows_per_page=geo.ring128, space=C128_STATE,
                       fill=BufferFill.kv_score),
            ]
    for i in range(geo.num_draft_layers):
        out.append(buffer(f"draft_swa_kv.{i}", u8, (swa_pages + 1, geo.swa_page_bytes),
                          BufferKind.swa_kv))
    out.append(buffer(MAPPING_BUFFER, DType.int64, (full_pages + 1,), BufferKind.map,
                      in_budget=False))
    return out

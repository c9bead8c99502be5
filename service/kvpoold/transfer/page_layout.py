"""Page layouts: what two pools must share for pages to move between them byte for byte.

Prefill and decode pools usually hold different token counts, so their fingerprints differ;
a transfer checks the *page* layout instead: architecture, KV dtype, page size, layer range,
and each buffer of the ``kv`` and ``swa`` id spaces (name, dtype, kind, bytes per page), in
plan order. A different TP split of the KV heads shows as different bytes per page; moving
pages between such pools (re-sharding heads) is out of scope, and the refusal says so.
"""

from __future__ import annotations

from kvpool.contract.plan import BufferSpec, PoolPlan
from kvpool.v1 import kvpool_pb2 as pb

# The id spaces whose pages a transfer moves: full-attention KV pages, and the SWA page paired
# with each (hybrid SWA). State slots, request rows and compressed spaces do not move.
KV_SPACE = "kv"
SWA_SPACE = "swa"
TRANSFER_SPACES = (KV_SPACE, SWA_SPACE)


def page_buffers(plan: PoolPlan) -> tuple[BufferSpec, ...]:
    """The buffers a transfer moves, in plan order: those indexed by kv or swa pages."""
    return tuple(b for b in plan.buffers if b.id_space in TRANSFER_SPACES)


def page_layout(plan: PoolPlan) -> pb.PageLayout:
    """The page layout of a plan, as sent to a peer."""
    return pb.PageLayout(
        architecture=plan.architecture, kv_cache_dtype=plan.kv_cache_dtype,
        page_size=plan.page_size, layer_start=plan.layer_start, layer_end=plan.layer_end,
        tp_size=plan.tp_size,
        buffers=[pb.PageBuffer(name=b.name, dtype=b.dtype.value, kind=b.kind.value,
                               page_bytes=b.page_bytes, id_space=b.id_space)
                 for b in page_buffers(plan)],
    )


def layout_mismatch(mine: pb.PageLayout, theirs: pb.PageLayout) -> str | None:
    """Why pages of a pool laid out as ``theirs`` cannot be written into ``mine`` (None: they
    can). Names the first difference, both values, and the knob."""
    tp = (f" (tp_size {theirs.tp_size} on the sender, {mine.tp_size} here: moving pages "
          "between different TP splits of the KV heads is not supported; give both pools the "
          "same tp_size)") if mine.tp_size != theirs.tp_size else ""
    for name, knob in (("architecture", "the same model"),
                       ("kv_cache_dtype", "the same kv_cache_dtype"),
                       ("page_size", "the same page_size")):
        a, b = getattr(theirs, name), getattr(mine, name)
        if a != b:
            return f"{name} is {a} on the sender, {b} here; configure both pools with {knob}"
    if (theirs.layer_start, theirs.layer_end) != (mine.layer_start, mine.layer_end):
        return (f"the sender holds layers {theirs.layer_start}..{theirs.layer_end - 1}, this "
                f"pool {mine.layer_start}..{mine.layer_end - 1}; pair pools of the same "
                "pp_rank and pp_size")
    if len(theirs.buffers) != len(mine.buffers):
        return (f"the sender's pages span {len(theirs.buffers)} buffers, this pool's "
                f"{len(mine.buffers)}; configure both pools from the same model and options"
                f"{tp}")
    for a, b in zip(theirs.buffers, mine.buffers, strict=True):
        for name in ("name", "dtype", "kind", "id_space", "page_bytes"):
            va, vb = getattr(a, name), getattr(b, name)
            if va != vb:
                what = "bytes per page" if name == "page_bytes" else name
                return (f"buffer {b.name}: {what} is {va} on the sender, {vb} here; "
                        f"configure both pools from the same model and options{tp}")
    return None

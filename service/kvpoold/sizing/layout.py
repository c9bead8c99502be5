"""Buffer layout helpers: declare buffers, then place them in one backing region.

Architectures return :class:`BufferSpec` records with ``offset_bytes=0``; :func:`place` assigns
offsets (in-budget buffers first, then the aux buffers), each aligned to :data:`ALIGN_BYTES`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from kvpool.contract.dtypes import DType
from kvpool.contract.plan import BufferFill, BufferKind, BufferSpec

ALIGN_BYTES = 256
# The id space that addresses a buffer of each kind unless its module says otherwise: compressed
# and indexer rows follow the full KV page, per-request rows the request row.
DEFAULT_SPACE: dict[BufferKind, str] = {
    BufferKind.kv: "kv",
    BufferKind.index: "kv",
    BufferKind.compressed: "kv",
    BufferKind.map: "kv",
    BufferKind.swa_kv: "swa",
    BufferKind.state: "state",
    BufferKind.spec_state: "req",
    BufferKind.req_to_token: "req",
}


def buffer(
    name: str,
    dtype: DType,
    shape: tuple[int, ...],
    kind: BufferKind,
    *,
    rows_per_page: int = 1,
    in_budget: bool = True,
    space: str | None = None,
    fill: BufferFill = BufferFill.zeros,
) -> BufferSpec:
    """Declare one buffer; ``rows_per_page`` rows of dim 0 make one allocation unit, addressed
    by an id of ``space`` (default: :data:`DEFAULT_SPACE` of ``kind``)."""
    nbytes = math.prod(shape) * dtype.itemsize
    row_bytes = nbytes // shape[0] if shape and shape[0] else 0
    return BufferSpec(
        name=name,
        dtype=dtype,
        shape=tuple(shape),
        offset_bytes=0,
        nbytes=nbytes,
        kind=kind,
        page_bytes=row_bytes * rows_per_page,
        in_budget=in_budget,
        id_space=DEFAULT_SPACE[kind] if space is None else space,
        fill=fill,
    )


def place(buffers: Iterable[BufferSpec]) -> tuple[tuple[BufferSpec, ...], int]:
    """Assign aligned, non-overlapping offsets; returns the placed buffers and the region size.

    Raises:
        ValueError: on a repeated buffer name (a bug in an architecture module).
    """
    ordered = sorted(buffers, key=lambda b: not b.in_budget)  # stable: budget first, then aux
    names = [b.name for b in ordered]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"buffer name {dup!r} declared twice")
    placed = []
    offset = 0
    for b in ordered:
        offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
        placed.append(msgspec.structs.replace(b, offset_bytes=offset))
        offset += b.nbytes
    return tuple(placed), offset


def token_rows(num_pages: int, page_size: int) -> int:
    """Rows of a token-major KV buffer: the pages plus the padding page 0."""
    return (num_pages + 1) * page_size

"""The mapped region type: buffer layouts checked against a region, and named zero-copy views.

What every way of sharing yields (:func:`kvpool.mapping.regions.map_region` makes one for
``shm`` and ``cuda_ipc``, :class:`kvpool.mapping.elastic_map.ElasticRegion` extends it for
elastic pools); torch is imported only for annotations.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.contract.dtypes import check_dtype_name, itemsize, torch_dtype
from kvpool.contract.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    import torch

class BufferLike(Protocol):
    """Anything with a buffer's layout fields: :class:`BufferLayout`, a plan's ``BufferSpec``.

    An optional ``page_bytes`` (one allocation unit: a KV page, a state slot, a request row)
    enables :meth:`MappedRegion.page`.
    """

    name: str
    dtype: str
    shape: Sequence[int]
    offset_bytes: int
    nbytes: int


@dataclass(frozen=True)
class BufferLayout:
    """One named view's place in the region, as plain values (dtype by name).

    ``page_bytes`` is one allocation unit of the buffer (0: unknown, :meth:`MappedRegion.page`
    then refuses it); it must be a whole number of rows (``nbytes / shape[0]``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int
    page_bytes: int = 0

    @property
    def rows_per_page(self) -> int:
        """Rows (first-dimension entries) in one allocation unit; 0 when unknown."""
        if not self.page_bytes or not self.shape or not self.shape[0]:
            return 0
        return self.page_bytes // (self.nbytes // self.shape[0])


def check_layout(size: int, buffers: Sequence[BufferLike]) -> tuple[BufferLayout, ...]:
    """Validate buffer layouts against a region of ``size`` bytes.

    Each buffer needs a unique name, a known dtype, ``nbytes == prod(shape) * itemsize``, an
    offset aligned to its itemsize, must lie inside the region, and an optional
    ``page_bytes`` must be a whole number of rows.

    Returns:
        The buffers as :class:`BufferLayout` values.

    Raises:
        InvalidArgument: naming the first bad buffer field (``buffers[2].offset_bytes``).
    """
    out: list[BufferLayout] = []
    seen: set[str] = set()
    for i, b in enumerate(buffers):
        where = f"buffers[{i}]"
        name = str(b.name)
        if not name or name in seen:
            raise InvalidArgument(f"buffer name {name!r} is empty or repeated",
                                  field=f"{where}.name")
        seen.add(name)
        dtype = check_dtype_name(b.dtype, field=f"{where}.dtype")
        shape = tuple(int(d) for d in b.shape)
        offset, nbytes = int(b.offset_bytes), int(b.nbytes)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"buffer {name!r} has a negative dimension in {shape}",
                                  field=f"{where}.shape")
        want = math.prod(shape) * itemsize(dtype)
        if nbytes != want:
            raise InvalidArgument(
                f"buffer {name!r}: nbytes {nbytes:,} != {want:,} for shape {shape} of {dtype}",
                field=f"{where}.nbytes",
            )
        if offset < 0 or offset % itemsize(dtype) or offset + nbytes > size:
            raise InvalidArgument(
                f"buffer {name!r} at offset {offset:,} (+{nbytes:,} B) does not fit a region of "
                f"{size:,} B aligned to {itemsize(dtype)} B",
                field=f"{where}.offset_bytes",
            )
        page_bytes = int(getattr(b, "page_bytes", 0) or 0)
        row_bytes = nbytes // shape[0] if shape and shape[0] else 0
        if page_bytes and (page_bytes < 0 or not row_bytes or page_bytes % row_bytes):
            raise InvalidArgument(
                f"buffer {name!r}: page_bytes {page_bytes:,} is not a whole number of its "
                f"{row_bytes:,}-byte rows",
                field=f"{where}.page_bytes",
            )
        out.append(BufferLayout(name, dtype, shape, offset, nbytes, page_bytes))
    return tuple(out)


class MappedRegion(Mapping[str, "torch.Tensor"]):
    """A mapped pool region: a read-only mapping of buffer name -> zero-copy tensor view.

    Use as a context manager; :meth:`close` drops this object's references so the mapping
    goes away once no view taken from it is still alive (torch cannot unmap memory a tensor
    still points at, so keep views inside the ``with`` block).

    Made by :func:`kvpool.mapping.regions.map_region`; ``KVPoolClient.attach`` also fills
    ``plan`` (the daemon's ``PoolPlan``), ``fingerprint`` and ``attach_id``.
    """

    def __init__(
        self,
        sharing: str,
        device: torch.device,
        base: torch.Tensor,
        views: dict[str, torch.Tensor],
        path: str = "",
        *,
        layout: Sequence[BufferLayout] = (),
        plan: Any = None,
        fingerprint: str = "",
        attach_id: int = 0,
    ) -> None:
        self.sharing = sharing
        self.device = device
        self.path = path
        self.size = base.numel()
        self.plan = plan
        self.fingerprint = fingerprint
        self.attach_id = attach_id
        self.layout: dict[str, BufferLayout] = {b.name: b for b in layout}
        self._base: torch.Tensor | None = base
        self._views: dict[str, torch.Tensor] | None = views

    @property
    def page_size(self) -> int:
        """Tokens per KV page, from the plan (1 when the region was mapped without one)."""
        return int(self.plan.page_size) if self.plan is not None else 1

    def page(self, name: str, page_id: int) -> torch.Tensor:
        """The rows of allocation unit ``page_id`` of buffer ``name`` (a view, no copy).

        One unit is what one id names: for ``kv``/``swa_kv`` buffers page ``p`` is rows
        ``p * page_size`` to ``(p + 1) * page_size - 1``; for page-major (``index``) and
        per-slot buffers (``state``, ``req_to_token``) it is row ``p``. The unit's size comes
        from the buffer's ``page_bytes``.

        Raises:
            KeyError: no buffer ``name``.
            InvalidArgument: the buffer's layout has no ``page_bytes``, a negative id, or an
                id past the buffer (says how many units it has).
            FailedPrecondition: the region is closed.
        """
        tensor = self[name]
        rows = self.layout[name].rows_per_page if name in self.layout else 0
        if rows < 1:
            raise InvalidArgument(
                f"buffer {name!r} was mapped without page_bytes, so its page size is unknown; "
                "map it with the plan's buffers (KVPoolClient.attach does) or use page_view",
                field="page_bytes",
            )
        if page_id < 0:
            raise InvalidArgument(f"page id must be >= 0, got {page_id}", field="page_id")
        units = tensor.shape[0] // rows
        if page_id >= units:
            raise InvalidArgument(
                f"page {page_id} is beyond buffer {name!r}: it has {units} units of {rows} "
                f"row(s) (ids 0..{units - 1})",
                field="page_id",
            )
        return tensor[page_id * rows : (page_id + 1) * rows]

    @property
    def closed(self) -> bool:
        return self._views is None

    @property
    def base(self) -> torch.Tensor:
        """The whole region as a flat uint8 tensor."""
        if self._base is None:
            raise FailedPrecondition("the mapped region is closed")
        return self._base

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """Buffer name -> view (a new dict each time; the tensors are the shared ones)."""
        if self._views is None:
            raise FailedPrecondition("the mapped region is closed")
        return dict(self._views)

    def __getitem__(self, name: str) -> torch.Tensor:
        views = self._views
        if views is None:
            raise FailedPrecondition("the mapped region is closed")
        try:
            return views[name]
        except KeyError:
            known = ", ".join(list(views)[:8])
            raise KeyError(f"no buffer {name!r} in this pool (buffers: {known}, ...)") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._views or {})

    def __len__(self) -> int:
        return len(self._views or {})

    # Identity, not Mapping's item-wise equality (which would compare tensors).
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __enter__(self) -> MappedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the region and its views. Idempotent."""
        self._views = None
        self._base = None


def carve_views(base: torch.Tensor, layout: Sequence[BufferLayout]) -> dict[str, torch.Tensor]:
    """Typed views of a flat uint8 ``base`` at each buffer's offset (no copies)."""
    return {
        b.name: base.narrow(0, b.offset_bytes, b.nbytes).view(torch_dtype(b.dtype)).view(b.shape)
        for b in layout
    }

"""Client side of sharing: map a pool's region from its handle and carve the named views.

A handle and a buffer layout are plain values (what Attach returns): for ``shm`` the file path
and size, for ``cuda_ipc`` the IPC handle bytes, offsets and the device UUID. Nothing is
unpickled and nothing is copied: every view is a window on the daemon's memory. The shm file is
checked before it is mapped (regular file, owned by us, mode 0600, exactly ``size`` bytes) and
mapped through the checked descriptor, so what is mapped is what was checked.

The importers are one module per way of sharing (:mod:`kvpool.mapping.shm_mapper`,
:mod:`kvpool.mapping.cuda_mapper`, :mod:`kvpool.mapping.elastic_map` for ``shm_sparse``); this
module checks the layout, dispatches on ``sharing`` and carves the views. torch is imported
inside the functions that need it; ``import kvpool`` stays light.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.contract.dtypes import check_dtype_name, itemsize, torch_dtype
from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.shared_handle import SharedHandle

# The importers live in their own modules; their public names stay importable from here.
from kvpool.mapping.cuda_mapper import (
    map_cuda_ipc,
    normalize_uuid,
    ordinal_for_uuid,
    release_export,
    visible_cuda_uuids,
)
from kvpool.mapping.shm_mapper import SHM_FILE_MODE, map_shm, open_shm

if TYPE_CHECKING:
    import torch

__all__ = [
    "SHM_FILE_MODE",
    "BufferLayout",
    "BufferLike",
    "MappedRegion",
    "carve_views",
    "check_layout",
    "map_cuda_ipc",
    "map_region",
    "map_shm",
    "normalize_uuid",
    "open_shm",
    "ordinal_for_uuid",
    "page_rows",
    "page_view",
    "release_export",
    "visible_cuda_uuids",
]


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

    Made by :func:`map_region`; ``KVPoolClient.attach`` also fills ``plan`` (the daemon's
    ``PoolPlan``), ``fingerprint`` and ``attach_id``.
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


_MAPPERS = {"shm": map_shm, "cuda_ipc": map_cuda_ipc}


def carve_views(base: torch.Tensor, layout: Sequence[BufferLayout]) -> dict[str, torch.Tensor]:
    """Typed views of a flat uint8 ``base`` at each buffer's offset (no copies)."""
    return {
        b.name: base.narrow(0, b.offset_bytes, b.nbytes).view(torch_dtype(b.dtype)).view(b.shape)
        for b in layout
    }


def map_region(handle: SharedHandle, buffers: Sequence[BufferLike], *, plan: Any = None,
               fingerprint: str = "", attach_id: int = 0, groups: Sequence[int] = (),
               pool: str = "", lease: tuple[int, bytes] | None = None) -> MappedRegion:
    """Map a pool's region and return its named zero-copy views.

    Args:
        handle: the region's handle as plain values
        (:class:`kvpool.contract.shared_handle.SharedHandle`,     or anything with the same fields).
        buffers: the pool's buffer layouts (name, dtype name, shape, offset_bytes, nbytes,
            optionally page_bytes): ``plan.buffers`` or :class:`BufferLayout` values.
        plan, fingerprint, attach_id: kept on the region for the caller (Attach's values).
        groups: for ``shm_sparse`` (an elastic pool), the groups granted now
            (``AttachInfo.elastic_groups``); ``plan`` is then required.
        pool: the pool's name, kept on an elastic region (its lease routes unmaps by it).
        lease: ``(lease_id, secret)`` an elastic ``cuda_vmm`` region fetches its descriptors
            with from the daemon's side socket.

    Returns:
        A :class:`MappedRegion`; ``region["k.0"]`` is a tensor on the pool's device. For
        ``shm_sparse`` a :class:`kvpool.mapping.elastic_map.ElasticRegion`, in which only the
        fixed part and the mapped groups are reachable.

    Raises:
        InvalidArgument: malformed handle or layout.
        NotFound: the shm file is gone.
        PermissionDenied: the shm file is not a 0600 regular file owned by this user.
        FailedPrecondition: size mismatch, sharing ``none``, CUDA device not visible here, or
            the IPC handle cannot be opened.
    """
    sharing = str(handle.sharing)
    if sharing == "none":
        raise FailedPrecondition(
            "this pool's memory is not shareable (the daemon runs with --sharing none)",
            field="sharing",
        )
    mapper = _MAPPERS.get(sharing)
    if mapper is None and sharing not in ("shm_sparse", "cuda_vmm"):
        raise InvalidArgument(
            f"unknown sharing {sharing!r} (known: shm, shm_sparse, cuda_ipc, cuda_vmm, none)",
            field="sharing")
    size = int(handle.size)
    try:
        if size < 1:
            raise InvalidArgument(f"handle size must be >= 1 byte, got {size}", field="size")
        layout = check_layout(size, buffers)
    except InvalidArgument:
        if sharing == "cuda_ipc":
            release_export(handle)
        raise
    if mapper is None:  # an elastic pool, mapped group by group
        from kvpool.mapping.elastic_map import map_elastic, map_elastic_vmm

        if sharing == "cuda_vmm":
            return map_elastic_vmm(handle, layout, plan=plan, lease=lease, groups=groups,
                                   fingerprint=fingerprint, attach_id=attach_id, pool=pool)
        return map_elastic(handle, layout, plan=plan, groups=groups, fingerprint=fingerprint,
                           attach_id=attach_id, pool=pool)
    device, base = mapper(handle)
    return MappedRegion(sharing, device, base, carve_views(base, layout), path=str(handle.path),
                        layout=layout, plan=plan, fingerprint=fingerprint, attach_id=attach_id)


def page_rows(page_id: int, page_size: int) -> slice:
    """The token rows of page ``page_id``: ``page_id * page_size`` to ``(page_id + 1) *
    page_size - 1`` inclusive, as a slice.

    For token-major buffers (kinds ``kv``, ``swa_kv``, ``compressed``); page-major buffers
    (``index``) and per-slot ones (``state``) are indexed by the id directly.

    Raises:
        InvalidArgument: negative page id or page size < 1.
    """
    if page_size < 1:
        raise InvalidArgument(f"page_size must be >= 1, got {page_size}", field="page_size")
    if page_id < 0:
        raise InvalidArgument(f"page id must be >= 0, got {page_id}", field="page_id")
    return slice(page_id * page_size, (page_id + 1) * page_size)


def page_view(tensor: torch.Tensor, page_id: int, page_size: int) -> torch.Tensor:
    """The rows of page ``page_id`` of a token-major ``tensor`` (a view, no copy).

    Raises:
        InvalidArgument: the page lies beyond the tensor's rows (says how many pages fit).
    """
    rows = page_rows(page_id, page_size)
    num_rows = tensor.shape[0]
    if rows.stop > num_rows:
        raise InvalidArgument(
            f"page {page_id} (rows {rows.start}..{rows.stop - 1}) is beyond this buffer's "
            f"{num_rows} rows ({num_rows // page_size} pages of {page_size})",
            field="page_id",
        )
    return tensor[rows]


"""Client side of sharing: map a pool's region from its handle and carve the named views.

A handle and a buffer layout are plain values (what Attach returns): for ``shm`` the file path
and size, for ``cuda_ipc`` the IPC handle bytes, offsets and the device UUID. Nothing is
unpickled and nothing is copied: every view is a window on the daemon's memory. The shm file is
checked before it is mapped (regular file, owned by us, mode 0600, exactly ``size`` bytes) and
mapped through the checked descriptor, so what is mapped is what was checked.

The importers are one module per way of sharing (:mod:`kvpool.mapping.shm_mapper`,
:mod:`kvpool.mapping.cuda_mapper`, :mod:`kvpool.mapping.elastic_map` for ``shm_sparse`` and
``cuda_vmm``), over the region type of :mod:`kvpool.mapping.mapped_region`; this module
dispatches on ``sharing``. torch is imported inside the functions that need it; ``import
kvpool`` stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.shared_handle import SharedHandle

# The importers and the region type live in their own modules; their public names stay
# importable from here.
from kvpool.mapping.cuda_mapper import (
    map_cuda_ipc,
    normalize_uuid,
    ordinal_for_uuid,
    release_export,
    visible_cuda_uuids,
)
from kvpool.mapping.elastic_map import map_elastic, map_elastic_vmm
from kvpool.mapping.mapped_region import (
    BufferLayout,
    BufferLike,
    MappedRegion,
    carve_views,
    check_layout,
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


_MAPPERS = {"shm": map_shm, "cuda_ipc": map_cuda_ipc}


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
        lease: ``(lease_id, secret)`` an elastic region (``cuda_vmm``, or ``shm_sparse`` whose
            handle names the side socket) fetches its descriptors with from the daemon's side
            socket.

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
        if sharing == "cuda_vmm":
            return map_elastic_vmm(handle, layout, plan=plan, lease=lease, groups=groups,
                                   fingerprint=fingerprint, attach_id=attach_id, pool=pool)
        return map_elastic(handle, layout, plan=plan, groups=groups, fingerprint=fingerprint,
                           attach_id=attach_id, pool=pool, lease=lease)
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


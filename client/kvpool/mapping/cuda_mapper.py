"""Client-side CUDA IPC importer: find the pool's GPU by UUID and rebuild its storage here.

The handle carries plain values (IPC handle bytes, storage offset and size, the export's
ref-counter slot and event, the device UUID). The ordinal is found by UUID because the daemon
and the engine may see the same GPU under different ``CUDA_VISIBLE_DEVICES``; the storage is
rebuilt with torch's own importer, and an importer that gives up before opening the handle
gives the export's counter slot back. torch is imported inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.contract.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    import torch

    from kvpool.contract.shared_handle import SharedHandle


def normalize_uuid(uuid: str) -> str:
    """A device UUID in one form: lower case, without nvidia-smi's ``GPU-``/``MIG-`` prefix.

    torch prints ``5a1b...``, nvidia-smi and ``CUDA_VISIBLE_DEVICES`` use ``GPU-5a1b...``.
    """
    u = str(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            return u[len(prefix) :]
    return u


def ordinal_for_uuid(device_uuid: str, visible: Sequence[str]) -> int:
    """This process's CUDA ordinal of the device named ``device_uuid``.

    Args:
        device_uuid: the pool's device, from the handle.
        visible: this process's device UUIDs, indexed by ordinal.

    Raises:
        InvalidArgument: the handle names no device.
        FailedPrecondition: the device is not visible here (lists what is visible).
    """
    if not device_uuid:
        raise InvalidArgument("the CUDA IPC handle names no device UUID", field="device_uuid")
    want = normalize_uuid(device_uuid)
    for ordinal, uuid in enumerate(visible):
        if normalize_uuid(uuid) == want:
            return ordinal
    seen = ", ".join(f"cuda:{i}={normalize_uuid(u)}" for i, u in enumerate(visible)) or "none"
    raise FailedPrecondition(
        f"device UUID mismatch: the pool lives on GPU {want}, which this process cannot see "
        f"(visible: {seen}); run the engine on the daemon's GPU (check CUDA_VISIBLE_DEVICES "
        "and the container's --gpus)",
        field="device_uuid",
    )


def visible_cuda_uuids() -> list[str]:
    """UUIDs of the CUDA devices this process sees, by ordinal (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [
        normalize_uuid(str(torch.cuda.get_device_properties(i).uuid))
        for i in range(torch.cuda.device_count())
    ]


def release_export(handle: SharedHandle) -> None:
    """Give back the export's ref-counter slot when we will never import it.

    The daemon's export counts one importer; torch's importer decrements when it lets go.
    An importer that fails before opening the handle must decrement instead, or the daemon's
    block would sit in torch's limbo list after the pool is dropped. Best effort: needs a
    CUDA build of torch, not a visible GPU.

    Args:
        handle: the CUDA IPC handle that will not be imported.
    """
    import torch

    if not handle.ref_counter_handle:
        return
    try:
        torch.UntypedStorage._release_ipc_counter_cuda(
            bytes(handle.ref_counter_handle), int(handle.ref_counter_offset)
        )
    except RuntimeError:
        pass  # CPU build of torch or the daemon is gone: nothing to give back to


def map_cuda_ipc(handle: SharedHandle) -> tuple[torch.device, torch.Tensor]:
    """Import a ``cuda_ipc`` handle as a flat uint8 tensor on this process's ordinal of its GPU.

    Args:
        handle: the region's handle (kind ``cuda_ipc``).

    Returns:
        ``(device, base)``: ``cuda:<ordinal>`` and the whole region, ``handle.size`` bytes.

    Raises:
        InvalidArgument: the handle names no device, or its region exceeds its storage.
        FailedPrecondition: no CUDA here, the GPU is not visible here, or the handle cannot
            be opened. The export's counter slot is given back before either is raised.
    """
    try:
        return _open_cuda_ipc(handle)
    except (FailedPrecondition, InvalidArgument):
        release_export(handle)
        raise


def _open_cuda_ipc(handle: SharedHandle) -> tuple[torch.device, torch.Tensor]:
    import torch

    if not torch.cuda.is_available():
        raise FailedPrecondition(
            "the pool is in GPU memory (CUDA IPC) but CUDA is not available in this process",
            field="device_uuid",
        )
    ordinal = ordinal_for_uuid(str(handle.device_uuid), visible_cuda_uuids())
    size, storage_size = int(handle.size), int(handle.storage_size)
    if size > storage_size:
        raise InvalidArgument(
            f"CUDA IPC handle: region of {size:,} B exceeds its storage of {storage_size:,} B",
            field="size",
        )
    torch.cuda._lazy_init()
    try:
        # The argument order of torch's rebuild_cuda_tensor (torch/multiprocessing/
        # reductions.py); every value is plain data from the handle. The storage's deleter
        # syncs the stream and decrements the export's ref counter when the last view goes.
        storage = torch.UntypedStorage._new_shared_cuda(
            ordinal,
            bytes(handle.ipc_handle),
            storage_size,
            int(handle.storage_offset),
            bytes(handle.ref_counter_handle),
            int(handle.ref_counter_offset),
            bytes(handle.event_handle),
            bool(handle.event_sync_required),
        )
    except RuntimeError as exc:
        raise FailedPrecondition(
            f"cannot open the pool's CUDA IPC handle on cuda:{ordinal}: {exc}. A handle opens "
            "only in another process on the same host (not in the daemon itself), while the "
            "daemon lives; in containers share the daemon's IPC and PID namespaces "
            "(--ipc=host --pid=host)",
            field="ipc_handle",
        ) from exc
    device = torch.device("cuda", ordinal)
    base = torch.empty((0,), dtype=torch.uint8, device=device)
    base.set_(storage, 0, (size,), (1,))
    return device, base

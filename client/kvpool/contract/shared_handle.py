"""The one handle type: what a process needs to map a pool's region, as plain values (no torch).

The daemon's backings make it (``kvpoold.sharing`` re-exports it), the daemon's conversion
module turns it into the proto ``kvpool.v1.SharedHandle``, the client's turns the proto back
into it, and ``kvpool.mapping.regions.map_region`` maps it. Nothing here imports torch or grpc, so
both sides share it without pulling in either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# How a pool's memory reaches other processes (``kvpoold serve --sharing``).
Sharing = Literal["shm", "cuda_ipc", "none", "shm_sparse", "cuda_vmm"]
SHARINGS: tuple[Sharing, ...] = ("shm", "cuda_ipc", "none", "shm_sparse", "cuda_vmm")


@dataclass(frozen=True)
class SharedHandle:
    """Everything an importer needs to map a pool's backing region.

    ``sharing`` says how. ``shm``: ``path`` of the shared-memory file and ``size`` bytes (the
    importer maps the whole file). ``cuda_ipc``: ``ipc_handle`` (torch's shareable handle of
    the cudaMalloc allocation that holds the region), ``storage_offset`` bytes into that allocation,
    ``storage_size`` bytes of it, ``size`` bytes of region, and the device ``device_uuid``
    (importers may see other ``CUDA_VISIBLE_DEVICES``), plus the ref-counter and event fields
    torch's IPC import needs. ``shm_sparse`` (an elastic pool on CPU): ``path`` of its sparse
    file and ``fd_socket``, the daemon's descriptor side socket where a lease that attached
    the pool fetches the file's descriptor (``""``: it serves none; map ``path``).
    ``cuda_vmm``: ``path`` is the side socket. ``none``: the region cannot be shared
    (``--sharing none``); only ``size`` is meaningful.
    """

    sharing: Sharing
    size: int
    path: str = ""
    device_uuid: str = ""
    ipc_handle: bytes = b""
    storage_offset: int = 0
    storage_size: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False
    fd_socket: str = ""

"""Backings: where pool memory lives (plain, shared memory on CPU, CUDA IPC) and its handles."""

from kvpoold.sharing.base import (
    Backing,
    BackingFactory,
    PlainBacking,
    PlainBackingFactory,
    SharedHandle,
)
from kvpoold.sharing.cleanup import InstanceLock, sweep_orphans
from kvpoold.sharing.cuda_ipc import (
    CudaIpcBacking,
    CudaIpcBackingFactory,
    check_allocator_conf,
)
from kvpoold.sharing.shm import ShmBacking, ShmBackingFactory

__all__ = [
    "Backing",
    "BackingFactory",
    "CudaIpcBacking",
    "CudaIpcBackingFactory",
    "InstanceLock",
    "PlainBacking",
    "PlainBackingFactory",
    "SharedHandle",
    "ShmBacking",
    "ShmBackingFactory",
    "check_allocator_conf",
    "sweep_orphans",
]

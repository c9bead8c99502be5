"""The backing factory for a device and sharing mode: shm on cpu, CUDA IPC on cuda, or none."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpoold.settings import ServeSettings, check_shm_dir
from kvpoold.sharing.base import BackingFactory, PlainBackingFactory
from kvpoold.sharing.cuda_ipc import CudaIpcBackingFactory, check_allocator_conf
from kvpoold.sharing.shm import ShmBackingFactory

log = logging.getLogger(__name__)


def make_backing_factory(settings: ServeSettings) -> BackingFactory:
    """The backing factory for the device: shared memory on cpu, CUDA IPC on cuda.

    On cpu the shared-memory factory first removes the files of dead daemons from
    ``settings.shm_dir`` (logged as ``event=shm_orphans_removed``) and takes this daemon's
    instance lock; on cuda the allocator settings are checked before CUDA is touched.
    ``settings.sharing == "none"`` gives unshared memory (tests and benchmarks).

    Args:
        settings: the checked settings (``device``, ``sharing``, ``shm_dir``,
            ``shm_preallocate``).

    Returns:
        The factory; the caller closes it (the daemon does, on shutdown).

    Raises:
        InvalidArgument: a CUDA device this process cannot see, ``expandable_segments`` or
            ``cudaMallocAsync`` in the allocator settings, or a missing shm directory (all
            exit 2: fix the flags or the environment).
        FailedPrecondition: the shm directory is not writable.
    """
    device = torch.device(settings.device)
    if device.type == "cuda":
        _check_cuda(settings, device)
    if settings.sharing == "none":
        log.warning("sharing is off: clients cannot map pools (--sharing none)",
                    extra={"fields": {"event": "sharing_none", "device": settings.device}})
        return PlainBackingFactory(device)
    if device.type == "cuda":
        factory = CudaIpcBackingFactory(device)
        log.info("cuda ipc ready", extra={"fields": {
            "event": "cuda_ipc_ready", "device": settings.device,
            "device_uuid": factory.device_uuid,
        }})
        return factory
    shm_dir = Path(settings.shm_dir)
    check_shm_dir(shm_dir)
    shm = ShmBackingFactory(shm_dir, preallocate=settings.shm_preallocate)
    if shm.swept:
        log.warning("removed files of dead daemons", extra={"fields": {
            "event": "shm_orphans_removed", "shm_dir": str(shm_dir),
            "count": len(shm.swept), "files": ",".join(p.name for p in shm.swept),
        }})
    log.info("shared memory ready", extra={"fields": {
        "event": "shm_ready", "shm_dir": str(shm_dir), "instance": shm.instance,
        "lock": str(shm.lock_path), "preallocate": settings.shm_preallocate,
    }})
    return shm


def _check_cuda(settings: ServeSettings, device: torch.device) -> None:
    """A CUDA device this process sees and, when shared, allocator settings IPC can export.

    Raises:
        InvalidArgument: either is wrong (a setting to change, like a bad flag: exit 2).
    """
    if settings.sharing != "none":
        try:
            check_allocator_conf(os.environ)
        except FailedPrecondition as exc:
            raise InvalidArgument(str(exc), field=exc.field) from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (device.index or 0) >= count:
        raise InvalidArgument(
            f"device {settings.device}: this process sees {count} CUDA devices; check "
            "--device and CUDA_VISIBLE_DEVICES",
            field="device",
        )

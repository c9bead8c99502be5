"""A thin adapter over ``cuda.bindings.driver`` for CUDA VMM (virtual memory management).

Both ends of an elastic pool on a GPU use it: the daemon creates physical allocations
(``cuMemCreate`` with POSIX file descriptor handles), maps them into a reserved virtual range
and exports them as descriptors; a client imports the descriptors and maps them into its own
range. :class:`CudaDriver` is one device's primary context (the one torch uses) and a method
per driver call, each returning plain ints; every failure becomes a typed kvpool error naming
the call and the ``CUresult`` (:func:`driver_error`).

``cuda-bindings`` is optional (``pip install 'kvpool[cuda]'``): :func:`load_driver` refuses
with FailedPrecondition when it is missing, and nothing here imports it at module load.
"""

from __future__ import annotations

import threading
import uuid
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.contract.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KVPoolError,
    ResourceExhausted,
)
from kvpool.contract.plan import CHUNK_BYTES

if TYPE_CHECKING:
    import torch

INSTALL_HINT = "pip install 'kvpool[cuda]' (or pip install 'cuda-bindings>=12.8,<14')"

# CUresult names and the kvpool error each one is: out of memory is the budget's business,
# a missing or unusable driver/device is the deployment's, anything else is a bug here.
_EXHAUSTED = frozenset({"CUDA_ERROR_OUT_OF_MEMORY"})
_PRECONDITION = frozenset({
    "CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_DEINITIALIZED",
    "CUDA_ERROR_INVALID_DEVICE", "CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_NOT_PERMITTED",
    "CUDA_ERROR_INSUFFICIENT_DRIVER", "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
    "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", "CUDA_ERROR_DEVICE_UNAVAILABLE",
    "CUDA_ERROR_SYSTEM_NOT_READY", "CUDA_ERROR_STUB_LIBRARY",
    "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER",
})


def load_driver() -> ModuleType:
    """``cuda.bindings.driver``, imported now.

    Raises:
        FailedPrecondition: cuda-bindings is not installed (says how to install it).
    """
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise FailedPrecondition(
            f"elastic pools on a GPU (sharing cuda_vmm) need cuda-bindings, which is not "
            f"importable here ({exc}); {INSTALL_HINT}, or run the pool without --elastic",
            field="sharing") from None
    return driver


def driver_error(call: str, result: str, code: int, detail: str = "") -> KVPoolError:
    """The kvpool error for driver call ``call`` failing with ``CUresult`` ``result``.

    Args:
        call: the call and what it was for (``"cuMemCreate(2,097,152 B)"``).
        result: the ``CUresult`` name (``"CUDA_ERROR_OUT_OF_MEMORY"``).
        code: its number.
        detail: what to do about it, appended to the message.

    Returns:
        ResourceExhausted for out of memory, FailedPrecondition for a missing, unsupported or
        unusable driver or device, InvalidArgument for an invalid value, else Internal.
    """
    message = f"{call} failed: {result} ({code})" + (f"; {detail}" if detail else "")
    if result in _EXHAUSTED:
        return ResourceExhausted(message + ("" if detail else "; lower --budget"),
                                 field="budget")
    if result in _PRECONDITION:
        return FailedPrecondition(message, field="device")
    if result == "CUDA_ERROR_INVALID_VALUE":
        return InvalidArgument(message)
    return Internal(message)


def check(call: str, ret: Any, detail: str = "") -> Any:
    """The value(s) of a cuda-bindings call's return ``(CUresult, *values)``.

    Returns:
        None, the one value, or a tuple of the values.

    Raises:
        KVPoolError: the result is not ``CUDA_SUCCESS`` (see :func:`driver_error`).
    """
    if not isinstance(ret, tuple):
        ret = (ret,)
    err, values = ret[0], ret[1:]
    if int(err) != 0:  # CUDA_SUCCESS
        raise driver_error(call, getattr(err, "name", str(err)), int(err), detail)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def check_granularity(granularity: int, device: str = "the device") -> None:
    """Refuse a device whose VMM allocation granularity does not divide a chunk: every grant,
    map and unmap is whole 2 MiB chunks.

    Raises:
        FailedPrecondition: ``granularity`` is not a positive divisor of ``CHUNK_BYTES``.
    """
    if granularity <= 0 or CHUNK_BYTES % granularity:
        raise FailedPrecondition(
            f"{device}'s CUDA VMM allocation granularity is {granularity:,} B, which does not "
            f"divide the elastic chunk ({CHUNK_BYTES:,} B): elastic pools cannot run on it; "
            "run the pool without --elastic (CUDA IPC)", field="device")


class VmmDriver(Protocol):
    """The VMM calls a region makes (what :class:`CudaDriver` offers), in plain ints."""

    ordinal: int
    granularity: int

    def reserve(self, size: int, alignment: int = CHUNK_BYTES) -> int: ...
    def free_address(self, address: int, size: int) -> None: ...
    def create(self, size: int) -> int: ...
    def release(self, handle: int) -> None: ...
    def map(self, address: int, size: int, handle: int) -> None: ...
    def unmap(self, address: int, size: int) -> None: ...
    def zero(self, address: int, size: int) -> None: ...
    def synchronize(self) -> None: ...
    def export_fd(self, handle: int) -> int: ...
    def import_fd(self, fd: int) -> int: ...


def device_tensor(address: int, nbytes: int, ordinal: int) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` of device virtual memory at ``address`` on
    ``cuda:ordinal``, not owning it: the range must outlive every view of the tensor.

    Built on torch's non-owning storage over a raw pointer, so no pointer query runs on the
    range (most of an elastic region is reserved but unmapped, which such a query rejects).
    """
    import torch

    device = torch.device("cuda", ordinal)
    storage = torch._C._construct_storage_from_data_pointer(address, device, nbytes)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,))


def uuid_text(raw: bytes) -> str:
    """A ``CUuuid``'s 16 bytes as torch prints a device UUID (``8-4-4-4-12`` hex)."""
    return str(uuid.UUID(bytes=bytes(raw)))


class CudaDriver:
    """One CUDA device's primary context and the VMM calls on it, in plain ints.

    Every call first makes the primary context current on the calling thread (the daemon
    grants from worker threads); torch shares the same primary context.

    Args:
        ordinal: the device's ordinal in this process.

    Raises:
        FailedPrecondition: cuda-bindings missing, no driver or no such device, or a
            granularity that does not divide a chunk.
    """

    def __init__(self, ordinal: int) -> None:
        self.drv = drv = load_driver()
        self.ordinal = ordinal
        try:
            check("cuInit", drv.cuInit(0))
        except KVPoolError:
            raise
        except Exception as exc:  # the driver library itself is missing (no NVIDIA driver)
            raise FailedPrecondition(f"cuInit failed: {exc}; no usable NVIDIA driver",
                                     field="device") from None
        self.device = check(f"cuDeviceGet({ordinal})", drv.cuDeviceGet(ordinal))
        self.context = check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(
            self.device))
        self._closed = False
        self._mutex = threading.Lock()  # guards _closed against a concurrent close (leaf)
        self.uuid = uuid_text(check("cuDeviceGetUuid", drv.cuDeviceGetUuid(self.device)).bytes)
        self.posix_fd = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._prop = self._allocation_prop()
        self._access = self._access_desc()
        self.granularity = int(check("cuMemGetAllocationGranularity", self._enter(
            drv.cuMemGetAllocationGranularity, self._prop,
            drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        check_granularity(self.granularity, f"cuda:{ordinal} ({self.uuid})")

    def _allocation_prop(self) -> Any:
        drv = self.drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.ordinal
        prop.requestedHandleTypes = self.posix_fd  # the enum: 13.0.x rejects a plain int
        return prop

    def _access_desc(self) -> Any:
        drv = self.drv
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.ordinal
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def _enter(self, fn: Any, *args: Any) -> Any:
        if self._closed:
            raise FailedPrecondition(f"the CUDA driver of cuda:{self.ordinal} is closed")
        check("cuCtxSetCurrent", self.drv.cuCtxSetCurrent(self.context))
        return fn(*args)

    def reserve(self, size: int, alignment: int = CHUNK_BYTES) -> int:
        """A virtual range of ``size`` bytes (no memory), aligned to ``alignment``."""
        return int(check(f"cuMemAddressReserve({size:,} B)",
                         self._enter(self.drv.cuMemAddressReserve, size, alignment, 0, 0)))

    def free_address(self, address: int, size: int) -> None:
        """Give back a range from :meth:`reserve` (everything in it unmapped first)."""
        check("cuMemAddressFree", self._enter(self.drv.cuMemAddressFree, address, size))

    def create(self, size: int) -> int:
        """A physical allocation of ``size`` bytes exportable as a descriptor; its handle.

        Raises:
            ResourceExhausted: the device is out of memory.
        """
        handle = check(f"cuMemCreate({size:,} B)",
                       self._enter(self.drv.cuMemCreate, size, self._prop, 0))
        return int(handle)

    def release(self, handle: int) -> None:
        """Drop a handle (the memory goes once no mapping and no exported descriptor is
        left)."""
        check("cuMemRelease", self._enter(self.drv.cuMemRelease, handle))

    def map(self, address: int, size: int, handle: int) -> None:
        """Map allocation ``handle`` (all ``size`` bytes) at ``address`` and make it
        readable and writable from this device."""
        check(f"cuMemMap({size:,} B)", self._enter(self.drv.cuMemMap, address, size, 0,
                                                    handle, 0))
        try:
            check("cuMemSetAccess", self._enter(self.drv.cuMemSetAccess, address, size,
                                                [self._access], 1))
        except BaseException:
            self.unmap(address, size)
            raise

    def unmap(self, address: int, size: int) -> None:
        """Unmap what :meth:`map` mapped at ``address`` (the whole mapping)."""
        check(f"cuMemUnmap({size:,} B)", self._enter(self.drv.cuMemUnmap, address, size))

    def zero(self, address: int, size: int) -> None:
        """Fill ``size`` mapped bytes at ``address`` with zeros and wait for it."""
        check("cuMemsetD8", self._enter(self.drv.cuMemsetD8, address, 0, size))
        self.synchronize()

    def synchronize(self) -> None:
        """Wait for all work on the device's primary context (before an unmap)."""
        check("cuCtxSynchronize", self._enter(self.drv.cuCtxSynchronize))

    def export_fd(self, handle: int) -> int:
        """A new descriptor for allocation ``handle`` (the caller closes it; while it is open
        the memory stays)."""
        return int(check("cuMemExportToShareableHandle(POSIX_FD)", self._enter(
            self.drv.cuMemExportToShareableHandle, handle, self.posix_fd, 0)))

    def import_fd(self, fd: int) -> int:
        """The handle of the allocation behind descriptor ``fd`` (which stays the caller's)."""
        return int(check("cuMemImportFromShareableHandle(POSIX_FD)", self._enter(
            self.drv.cuMemImportFromShareableHandle, fd, self.posix_fd)))

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device (``cuMemGetInfo``)."""
        free, total = check("cuMemGetInfo", self._enter(self.drv.cuMemGetInfo))
        return int(free), int(total)

    def close(self) -> None:
        """Release the primary context reference. Idempotent."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
        self.drv.cuDevicePrimaryCtxRelease(self.device)

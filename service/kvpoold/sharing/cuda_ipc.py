"""GPU backings exported with CUDA IPC, addressed by device UUID.

Each pool is one ``torch.zeros(nbytes, uint8, device)``. :meth:`CudaIpcBacking.handle` exports
its storage with torch's own CUDA IPC export (``UntypedStorage._share_cuda_``) and turns the
tuple into a :class:`SharedHandle` of plain values: the allocation's IPC handle bytes, the
storage's offset and size in that allocation, the ref-counter file name and slot torch's
importer decrements when it lets go, and the event the importer waits on so it never reads
before the daemon's writes land. The device is named by UUID because an engine may run under
a different ``CUDA_VISIBLE_DEVICES``; the importer (``kvpool.mapping.cuda_mapper``) finds its own
ordinal.

Why each export is fresh: torch gives every ``_share_cuda_`` call its own ref-counter slot set
to 1, and one importer decrements it once. Handing one cached handle to many clients would
drive the counter negative and strand the block in torch's limbo list forever.

Refused configurations: ``expandable_segments:True`` (handles of expandable segments are not
plain ``cudaIpcMemHandle``s and cannot be opened by another process in general,
pytorch#165685) and ``backend:cudaMallocAsync`` (its allocator has no IPC export).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping

import torch

from kvpool.contract.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvpool.contract.limits import check_pool_name
from kvpool.contract.plan import PoolPlan
from kvpool.mapping.cuda_driver import CudaDriver
from kvpool.mapping.cuda_mapper import normalize_uuid
from kvpoold.sharing.base import Region, SharedHandle, Sharing
from kvpoold.sharing.vmm import CudaVmmBacking, create_vmm_region

ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_EXPANDABLE_ON = re.compile(r"(?:^|,)\s*expandable_segments\s*:\s*true\s*(?:,|$)", re.IGNORECASE)
_MALLOC_ASYNC = re.compile(r"(?:^|,)\s*backend\s*:\s*cudamallocasync\s*(?:,|$)", re.IGNORECASE)
# torch's shareable-handle header: version byte, then 'c' (cudaMalloc) or 'e' (expandable).
_HANDLE_EXPANDABLE = ord("e")


def check_allocator_conf(env: Mapping[str, str]) -> None:
    """Refuse allocator settings under which CUDA IPC export cannot work.

    Both variables are checked (torch reads ``PYTORCH_ALLOC_CONF`` and falls back to the older
    ``PYTORCH_CUDA_ALLOC_CONF``); either one enabling a bad setting refuses.

    Args:
        env: the environment to inspect (``os.environ``).

    Raises:
        FailedPrecondition: ``expandable_segments:True`` or ``backend:cudaMallocAsync`` is set.
    """
    for var in ALLOC_CONF_VARS:
        conf = env.get(var, "")
        if _EXPANDABLE_ON.search(conf):
            raise FailedPrecondition(
                f"{var}={conf!r} enables expandable_segments: CUDA IPC handles of expandable "
                "segments cannot be opened in another process (pytorch#165685), so engines "
                f"could not map the pools. Unset {var} (or set expandable_segments:False) in "
                "kvpoold's environment; engines may keep their own setting",
                field=var,
            )
        if _MALLOC_ASYNC.search(conf):
            raise FailedPrecondition(
                f"{var}={conf!r} selects the cudaMallocAsync allocator, which cannot export "
                f"CUDA IPC handles. Remove backend:cudaMallocAsync from {var} in kvpoold's "
                "environment",
                field=var,
            )


def check_ipc_handle_kind(ipc_handle: bytes) -> None:
    """Refuse a handle torch made for an expandable segment (set at runtime, not by env).

    Raises:
        FailedPrecondition: the handle's type byte says expandable segment.
    """
    if len(ipc_handle) >= 2 and ipc_handle[1] == _HANDLE_EXPANDABLE:
        raise FailedPrecondition(
            "the pool's memory is in an expandable segment (enabled via "
            "torch.cuda.memory._set_allocator_settings?); its CUDA IPC handle cannot be "
            "opened in another process (pytorch#165685). Disable expandable_segments in "
            "kvpoold"
        )


def _resolve_index(device: int | str | torch.device) -> int:
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise InvalidArgument(f"CUDA IPC needs a cuda device, got {str(dev)!r}", field="device")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise InvalidArgument(
            f"device cuda:{index} does not exist ({count} visible: cuda:0..cuda:{count - 1})",
            field="device",
        )
    return index


class CudaIpcBacking(Region):
    """One pool's region in device memory, exportable by CUDA IPC.

    Made by :meth:`CudaIpcBackingFactory.create`. The tensor is kept until :meth:`close`;
    the daemon counts attachments and closes only when none is left (or when forced).
    """

    def __init__(
        self, tensor: torch.Tensor, device_uuid: str, on_close: Callable[[CudaIpcBacking], None]
    ) -> None:
        super().__init__(tensor, tensor.numel())
        self.device_uuid = device_uuid
        self._on_close = on_close

    def describe(self) -> str:
        return "CUDA IPC region"

    @property
    def sharing(self) -> Sharing:
        return "cuda_ipc"

    def handle(self) -> SharedHandle:
        """Export the region for one importer (a fresh export each call; see module doc).

        Raises:
            FailedPrecondition: after :meth:`close`, or when the memory sits in an
                expandable segment.
        """
        tensor = self.tensor
        (
            _exporter_ordinal,  # meaningless to an importer with other CUDA_VISIBLE_DEVICES
            ipc_handle,
            storage_size,
            storage_offset,
            ref_counter_handle,
            ref_counter_offset,
            event_handle,
            event_sync_required,
        ) = tensor.untyped_storage()._share_cuda_()
        check_ipc_handle_kind(ipc_handle)
        return SharedHandle(
            sharing="cuda_ipc",
            size=self.nbytes,
            device_uuid=self.device_uuid,
            ipc_handle=bytes(ipc_handle),
            storage_offset=int(storage_offset),
            storage_size=int(storage_size),
            ref_counter_handle=bytes(ref_counter_handle),
            ref_counter_offset=int(ref_counter_offset),
            event_handle=bytes(event_handle),
            event_sync_required=bool(event_sync_required),
        )

    def close(self) -> None:
        """Drop the daemon's reference. Idempotent.

        If an importer still maps the block, torch's ref counter keeps it out of the caching
        allocator's reuse until the importer lets go; the daemon should not get here while
        clients are attached unless the operator forced it.
        """
        if self._tensor is None:
            return
        self._tensor = None
        self._on_close(self)


class CudaIpcBackingFactory:
    """Creates :class:`CudaIpcBacking` regions on one CUDA device.

    Elastic pools (:meth:`create_elastic`) are CUDA VMM regions instead
    (:mod:`kvpoold.sharing.vmm`), made through cuda-bindings, loaded at the first one.

    Args:
        device: ``cuda:N``, ``N`` or a ``torch.device``.
        env: the environment whose allocator settings are checked (``os.environ``).
        fd_socket: the descriptor side socket elastic pools' handles name (empty: clients
            derive it from their gRPC socket).

    Raises:
        FailedPrecondition: expandable segments or cudaMallocAsync configured (checked
            first, so it is reported even where CUDA is missing), or CUDA not available.
        InvalidArgument: for a non-CUDA or missing device.
    """

    def __init__(
        self, device: int | str | torch.device = "cuda", env: Mapping[str, str] | None = None,
        *, fd_socket: str = "",
    ) -> None:
        check_allocator_conf(os.environ if env is None else env)
        if not torch.cuda.is_available():
            raise FailedPrecondition(
                "CUDA is not available (torch.cuda.is_available() is False): no driver, no "
                "GPU, or a CPU build of torch; run kvpoold with --device cpu to share pools "
                "through shared memory instead",
                field="device",
            )
        index = _resolve_index(device)
        self._device = torch.device("cuda", index)
        self.device_uuid = normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))
        self.fd_socket = fd_socket
        self._backings: list[CudaIpcBacking | CudaVmmBacking] = []
        self._driver: CudaDriver | None = None
        self._closed = False
        # Pools are built in worker threads: guards _backings, _driver and _closed (a leaf
        # lock).
        self._mutex = threading.Lock()

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def backings(self) -> tuple[CudaIpcBacking | CudaVmmBacking, ...]:
        with self._mutex:
            return tuple(self._backings)

    def __enter__(self) -> CudaIpcBackingFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self, nbytes: int, pool_name: str) -> CudaIpcBacking:
        """A new zero-filled region of ``nbytes`` on the device.

        Raises:
            InvalidArgument: for a bad pool name or size.
            ResourceExhausted: the device has not enough free memory.
            FailedPrecondition: after :meth:`close`.
        """
        if self._closed:
            raise FailedPrecondition("the CUDA IPC factory is closed; start a new one")
        check_pool_name(pool_name)
        if not isinstance(nbytes, int) or nbytes < 1:
            raise InvalidArgument(f"region size must be >= 1 byte, got {nbytes!r}",
                                  field="nbytes")
        try:
            tensor = torch.zeros(nbytes, dtype=torch.uint8, device=self._device)
        except torch.OutOfMemoryError as exc:
            free, total = torch.cuda.mem_get_info(self._device)
            raise ResourceExhausted(
                f"pool {pool_name!r} needs {nbytes:,} B on {self._device} but only {free:,} B "
                f"of {total:,} B are free; lower --budget",
                field="budget",
            ) from exc
        backing = CudaIpcBacking(tensor, self.device_uuid, self._forget)
        with self._mutex:
            closed = self._closed
            if not closed:
                self._backings.append(backing)
        if closed:  # closed while we allocated: do not hand out memory nobody will free
            backing.close()
            raise FailedPrecondition("the CUDA IPC factory is closed; start a new one")
        return backing

    def create_elastic(self, plan: PoolPlan, pool_name: str) -> CudaVmmBacking:
        """An elastic pool's region (``plan.elastic``) in CUDA virtual memory: the whole range
        reserved, the fixed part backed now, each group backed by
        :meth:`~kvpoold.sharing.vmm.CudaVmmBacking.grant`.

        Raises:
            FailedPrecondition: cuda-bindings is not installed (``pip install
                'kvpool[cuda]'``), the device's VMM granularity does not divide 2 MiB, or
                the factory is closed.
            InvalidArgument: a fixed plan or a bad pool name.
            ResourceExhausted: the device cannot hold the fixed part.
        """
        with self._mutex:
            if self._closed:
                raise FailedPrecondition("the CUDA IPC factory is closed; start a new one")
            if self._driver is None:
                index = self._device.index
                assert index is not None
                self._driver = CudaDriver(index)
            driver = self._driver
        backing = create_vmm_region(driver, plan, pool_name, device_uuid=self.device_uuid,
                                    fd_socket=self.fd_socket, on_close=self._forget)
        with self._mutex:
            closed = self._closed
            if not closed:
                self._backings.append(backing)
        if closed:
            backing.close()
            raise FailedPrecondition("the CUDA IPC factory is closed; start a new one")
        return backing

    def _forget(self, backing: CudaIpcBacking | CudaVmmBacking) -> None:
        with self._mutex:
            if backing in self._backings:
                self._backings.remove(backing)

    def close(self) -> None:
        """Close every region this factory created. Idempotent."""
        with self._mutex:
            self._closed = True
            backings = list(self._backings)
            driver, self._driver = self._driver, None
        for backing in backings:
            backing.close()
        if driver is not None:
            driver.close()

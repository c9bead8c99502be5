"""An elastic pool's region on a GPU: one reserved virtual range, CUDA VMM allocations behind
the fixed part and the granted groups only (the GPU twin of ``SparseShmBacking``).

Layout: ``plan.backing_bytes`` of virtual address space reserved at creation (no memory) and
viewed whole as a flat uint8 tensor. The fixed part (``elastic.fixed_offset`` to the end: the
aux buffers) is one allocation, created, mapped and zeroed at creation. Group ``g`` is one
allocation per view, at the ranges ``plan.group_ranges(g)``: ``grant`` creates them
(``cuMemCreate`` with POSIX descriptor handles), maps them (``cuMemMap``, ``cuMemSetAccess``)
and zeroes them, all or nothing; ``release`` unmaps and releases them. One allocation per
range because ``cuMemMap`` maps a whole allocation from its start (its offset must be 0).

Clients get the memory as descriptors over the side channel (``kvpool.contract.fd_channel``):
:meth:`CudaVmmBacking.export` makes fresh ones for the groups (and fixed part) a client asks
for, which the channel closes once sent. Exported descriptors keep an allocation alive while
they are open, and so do clients' mappings: a released group's memory returns to the device
once every client unmapped it, which the daemon waits for before it releases.

Touching the tensor outside the fixed part and the granted groups is an illegal address (it
kills the CUDA context): the daemon never touches a group it has not granted.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.limits import check_pool_name
from kvpool.contract.plan import CHUNK_BYTES, PoolPlan
from kvpool.mapping.cuda_driver import VmmDriver, device_tensor
from kvpoold.sharing.base import FdGrant, Region, SharedHandle, Sharing

KIND = "cuda_vmm"


@dataclass(frozen=True)
class Allocation:
    """One VMM allocation mapped at ``offset`` of the region, ``length`` bytes."""

    offset: int
    length: int
    handle: int


def check_layout(plan: PoolPlan) -> None:
    """Refuse a plan whose region is not whole chunks, laid out as this backing maps it.

    Raises:
        InvalidArgument: a fixed plan, or a region, fixed part or group range that is not
            whole :data:`CHUNK_BYTES` chunks, or a fixed part that is not the region's end.
    """
    e = plan.elastic
    if e is None:
        raise InvalidArgument(f"pool layout {plan.fingerprint()} is not elastic",
                              field="elastic")
    if plan.backing_bytes % CHUNK_BYTES or e.fixed_offset % CHUNK_BYTES:
        raise InvalidArgument(
            f"an elastic region is whole {CHUNK_BYTES:,} B chunks; this plan's is "
            f"{plan.backing_bytes:,} B with the fixed part at {e.fixed_offset:,}",
            field="elastic")
    if e.fixed_offset + e.fixed_bytes != plan.backing_bytes:
        raise InvalidArgument(
            f"the fixed part ({e.fixed_bytes:,} B at {e.fixed_offset:,}) is not the end of the "
            f"{plan.backing_bytes:,} B region", field="elastic")
    for g in (0, e.groups - 1):
        for offset, length in plan.group_ranges(g):
            if offset % CHUNK_BYTES or length % CHUNK_BYTES or length <= 0:
                raise InvalidArgument(f"group {g} range {offset:,}+{length:,} is not whole "
                                      "chunks", field="elastic")
            if offset + length > e.fixed_offset:
                raise InvalidArgument(f"group {g} range {offset:,}+{length:,} overlaps the "
                                      f"fixed part at {e.fixed_offset:,}", field="elastic")


class CudaVmmBacking(Region):
    """One elastic pool's region in CUDA virtual memory (see the module doc).

    Made by :func:`create_vmm_region`; not constructed directly. Thread-safe: grants,
    releases and exports of one region take its lock (a leaf lock, held across driver calls
    of milliseconds).
    """

    def __init__(self, driver: VmmDriver, plan: PoolPlan, pool: str, address: int,
                 tensor: torch.Tensor, device_uuid: str, fd_socket: str,
                 on_close: Callable[[CudaVmmBacking], None]) -> None:
        super().__init__(tensor, plan.backing_bytes)
        self.driver = driver
        self.plan = plan
        self.pool = pool
        self.address = address
        self.device_uuid = device_uuid
        self.fd_socket = fd_socket
        self._on_close = on_close
        self._fixed: Allocation | None = None
        self._groups: dict[int, tuple[Allocation, ...]] = {}
        self._mutex = threading.Lock()

    def describe(self) -> str:
        return f"CUDA VMM region of pool {self.pool!r}"

    @property
    def sharing(self) -> Sharing:
        return "cuda_vmm"

    @property
    def granted(self) -> frozenset[int]:
        """The groups backed now."""
        with self._mutex:
            return frozenset(self._groups)

    def handle(self) -> SharedHandle:
        """``SharedHandle(sharing="cuda_vmm", size, device_uuid, path)``: ``path`` is the
        descriptor side socket to ask (empty when the factory was not told it: the client
        then asks ``fd_socket_path(<its gRPC socket>)``).

        Raises:
            FailedPrecondition: after :meth:`close`.
        """
        self._check_open()
        return SharedHandle(sharing="cuda_vmm", size=self.nbytes,
                            device_uuid=self.device_uuid, path=self.fd_socket)

    def _allocate(self, ranges: Iterable[tuple[int, int]]) -> tuple[Allocation, ...]:
        """Create, map and zero one allocation per range; all or nothing."""
        done: list[Allocation] = []
        try:
            for offset, length in ranges:
                handle = self.driver.create(length)
                try:
                    self.driver.map(self.address + offset, length, handle)
                except BaseException:
                    self.driver.release(handle)
                    raise
                done.append(Allocation(offset, length, handle))
                self.driver.zero(self.address + offset, length)
        except BaseException:
            self._free(done)
            raise
        return tuple(done)

    def _free(self, allocations: Iterable[Allocation]) -> None:
        for a in allocations:
            self.driver.unmap(self.address + a.offset, a.length)
            self.driver.release(a.handle)

    def map_fixed(self) -> None:
        """Create the fixed part (at creation; a no-op when the plan has none)."""
        e = self.plan.elastic
        assert e is not None
        with self._mutex:
            if self._fixed is None and e.fixed_bytes:
                (self._fixed,) = self._allocate([(e.fixed_offset, e.fixed_bytes)])

    def grant(self, group: int) -> None:
        """Back group ``group`` (one allocation per view); all or nothing, idempotent.

        Raises:
            InvalidArgument: a group outside the range.
            ResourceExhausted: the device is out of memory (nothing of the group is left).
            FailedPrecondition: after :meth:`close`.
        """
        ranges = self._ranges(group)
        with self._mutex:
            self._check_open()
            if group not in self._groups:
                self._groups[group] = self._allocate(ranges)

    def release(self, group: int) -> None:
        """Unmap and release group ``group`` (every client has unmapped it). Idempotent.

        The device is synchronized first: no work of the daemon's may still touch it.
        """
        with self._mutex:
            allocations = self._groups.pop(group, None)
            if allocations is None:
                return
            self.driver.synchronize()
            self._free(allocations)

    def backed_bytes(self) -> int:
        """Bytes of the allocations this region holds now (fixed part and granted groups)."""
        with self._mutex:
            held = [a.length for g in self._groups.values() for a in g]
            return sum(held) + (self._fixed.length if self._fixed else 0)

    def export(self, groups: Iterable[int], fixed: bool) -> FdGrant:
        """Fresh descriptors for the fixed part (``fixed``) and ``groups``, in the side
        channel's order (fixed part, then each group's views in plan order).

        Returns:
            An owned :class:`FdGrant` (the channel closes the descriptors once sent).

        Raises:
            FailedPrecondition: a group asked for is not granted (or the region is closed,
                or it has no fixed part and ``fixed`` was asked).
        """
        groups = tuple(groups)
        with self._mutex:
            self._check_open()
            parts: list[Allocation] = []
            if fixed:
                if self._fixed is None:
                    raise FailedPrecondition(f"{self.describe()} has no fixed part",
                                             field="fixed")
                parts.append(self._fixed)
            missing = [g for g in groups if g not in self._groups]
            if missing:
                raise FailedPrecondition(
                    f"groups {missing} of pool {self.pool!r} are not granted (granted: "
                    f"{sorted(self._groups)}); map only the groups the daemon granted",
                    field="groups")
            for g in groups:
                parts.extend(self._groups[g])
            fds: list[int] = []
            try:
                for a in parts:
                    fds.append(self.driver.export_fd(a.handle))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
        return FdGrant(tuple(fds), tuple((a.offset, a.length) for a in parts),
                       self.nbytes, KIND)

    def _ranges(self, group: int) -> list[tuple[int, int]]:
        try:
            return self.plan.group_ranges(group)
        except ValueError as exc:
            raise InvalidArgument(f"pool {self.pool!r}: {exc}", field="group") from None

    def _check_open(self) -> None:
        if self._tensor is None:
            raise FailedPrecondition(f"{self.describe()} is closed")

    def close(self) -> None:
        """Release every allocation and the virtual range. Idempotent.

        The pool's views over :attr:`tensor` must be gone (they do not own the range);
        clients that still map allocations keep that memory until they unmap.
        """
        with self._mutex:
            if self._tensor is None:
                return
            self._tensor = None
            with contextlib.suppress(Exception):
                self.driver.synchronize()
            allocations = [a for g in self._groups.values() for a in g]
            if self._fixed is not None:
                allocations.append(self._fixed)
            self._groups.clear()
            self._fixed = None
            first: BaseException | None = None
            for a in allocations:  # best effort: one failure must not leak the rest
                try:
                    self._free([a])
                except Exception as exc:
                    first = first or exc
            try:
                self.driver.free_address(self.address, self.nbytes)
            except Exception as exc:
                first = first or exc
        self._on_close(self)
        if first is not None:
            raise first


def create_vmm_region(driver: VmmDriver, plan: PoolPlan, pool_name: str, *,
                      device_uuid: str, fd_socket: str = "",
                      tensor_of: Callable[[int, int, int], torch.Tensor] = device_tensor,
                      on_close: Callable[[CudaVmmBacking], None] = lambda _b: None,
                      ) -> CudaVmmBacking:
    """Reserve an elastic pool's virtual range, view it as a tensor and back the fixed part.

    Args:
        driver: the device's VMM calls (a granularity dividing a chunk, checked when made).
        plan: an elastic plan (``plan.elastic``).
        pool_name: for messages and handles.
        device_uuid: the device, as clients find it (``normalize_uuid`` form).
        fd_socket: the descriptor side socket, put in the handle (see
            :meth:`CudaVmmBacking.handle`).
        tensor_of: builds the flat tensor over ``(address, nbytes, ordinal)``.
        on_close: told when the region closes (the factory forgets it).

    Raises:
        InvalidArgument: a fixed plan or a layout that is not whole chunks.
        ResourceExhausted: the device cannot hold the fixed part (nothing is left behind).
    """
    check_pool_name(pool_name)
    check_layout(plan)
    address = driver.reserve(plan.backing_bytes, CHUNK_BYTES)
    try:
        tensor = tensor_of(address, plan.backing_bytes, driver.ordinal)
    except BaseException:
        driver.free_address(address, plan.backing_bytes)
        raise
    backing = CudaVmmBacking(driver, plan, pool_name, address, tensor, device_uuid,
                             fd_socket, on_close)
    try:
        backing.map_fixed()
    except BaseException:
        backing.close()
        raise
    return backing

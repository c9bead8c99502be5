"""A client's view of an elastic pool on a GPU (sharing ``cuda_vmm``): the daemon's allocations
imported from descriptors and mapped into a virtual range of the client's own.

The client reserves the region's whole range (``plan.backing_bytes``, no memory), maps the
fixed part at once and each group when asked (:meth:`CudaVmmRegion.ensure_groups`): it asks
the daemon's descriptor side channel for the group's descriptors (one per view, see
:mod:`kvpool.contract.fd_channel`), imports each (``cuMemImportFromShareableHandle``), maps it
at the offset the answer names (``cuMemMap``, ``cuMemSetAccess``), drops the imported handle
(the mapping keeps the memory) and closes the descriptor. :meth:`CudaVmmRegion.unmap_groups`
unmaps a group after the device finished with it, so the daemon can take its memory back.
Touching a group not mapped here is an illegal address, as on CPU it is a SIGSEGV.

The method names are those of the CPU region (``kvpool.mapping.elastic_map``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvpool.contract.errors import FailedPrecondition, Internal, InvalidArgument
from kvpool.contract.fd_channel import FdAnswer, FdAsk, groups_per_ask
from kvpool.contract.plan import CHUNK_BYTES, PoolPlan
from kvpool.mapping.cuda_driver import CudaDriver, VmmDriver, device_tensor
from kvpool.mapping.cuda_mapper import ordinal_for_uuid, visible_cuda_uuids
from kvpool.mapping.fd_client import fetch_fds

if TYPE_CHECKING:
    import torch

# (groups, fixed) -> the descriptors and the answer naming their ranges (the caller of the
# callable owns the descriptors).
AskFds = Callable[[tuple[int, ...], bool], tuple[list[int], FdAnswer]]


def socket_asker(path: str, pool: str, lease_id: int, secret: str,
                 timeout_s: float = 10.0) -> AskFds:
    """An :data:`AskFds` over the daemon's side socket ``path`` for lease ``lease_id``."""
    def ask(groups: tuple[int, ...], fixed: bool) -> tuple[list[int], FdAnswer]:
        return fetch_fds(path, FdAsk(pool=pool, lease_id=lease_id, secret=secret,
                                     groups=groups, fixed=fixed), timeout_s)
    return ask


def expected_ranges(plan: PoolPlan, groups: Iterable[int], fixed: bool
                    ) -> list[tuple[int, int]]:
    """The ``(offset, length)`` of each descriptor an ask of ``groups`` (and ``fixed``) gets,
    in the side channel's order: the fixed part, then each group's views in plan order.

    Raises:
        InvalidArgument: a fixed plan or a group outside the range.
    """
    e = plan.elastic
    if e is None:
        raise InvalidArgument("the pool is not elastic", field="elastic")
    out = [(e.fixed_offset, e.fixed_bytes)] if fixed else []
    for g in groups:
        try:
            out += plan.group_ranges(g)
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="groups") from None
    return out


class CudaVmmRegion:
    """An elastic pool mapped into this process's device address space.

    Args:
        driver: this process's VMM calls on the pool's device (``CudaDriver(ordinal)``, the
            ordinal found from the handle's device UUID).
        plan: the pool's plan (``plan.elastic``).
        ask: how to get descriptors (:func:`socket_asker`).
        tensor_of: builds the flat tensor over ``(address, nbytes, ordinal)``.

    Raises:
        InvalidArgument: a fixed plan.
        KVPoolError: the daemon's refusal of the fixed part, or a driver failure (nothing
            is left mapped or reserved).
    """

    def __init__(self, driver: VmmDriver, plan: PoolPlan, ask: AskFds,
                 tensor_of: Callable[[int, int, int], torch.Tensor] = device_tensor) -> None:
        e = plan.elastic
        if e is None:
            raise InvalidArgument(f"pool layout {plan.fingerprint()} is not elastic",
                                  field="elastic")
        self.driver = driver
        self.plan = plan
        self._ask = ask
        self._per_ask = groups_per_ask(len(e.views))
        self.size = plan.backing_bytes
        self.address = driver.reserve(self.size, CHUNK_BYTES)
        self._mapped: dict[int, list[tuple[int, int]]] = {}
        self._fixed: list[tuple[int, int]] = []
        self._tensor: torch.Tensor | None = None
        try:
            if e.fixed_bytes:
                self._fixed = self._map_parts((), True)
            self._tensor = tensor_of(self.address, self.size, driver.ordinal)
        except BaseException:
            self.close()
            raise

    @property
    def tensor(self) -> torch.Tensor:
        """The region as a flat uint8 tensor (only the fixed part and mapped groups may be
        touched).

        Raises:
            FailedPrecondition: after :meth:`close`.
        """
        if self._tensor is None:
            raise FailedPrecondition("the CUDA VMM region is closed")
        return self._tensor

    @property
    def mapped_groups(self) -> frozenset[int]:
        """The groups mapped here now."""
        return frozenset(self._mapped)

    def ensure_groups(self, groups: Iterable[int]) -> None:
        """Map every group of ``groups`` not mapped yet (asking for as many per answer as one
        carries). A group the daemon refuses (not granted) raises; groups mapped before it
        stay mapped.

        Raises:
            FailedPrecondition: the daemon has not granted a group asked for.
            KVPoolError: the side channel or a driver call failed.
        """
        self._check_open()
        missing = sorted(set(groups) - self._mapped.keys())
        for i in range(0, len(missing), self._per_ask):
            batch = tuple(missing[i:i + self._per_ask])
            mapped = self._map_parts(batch, False)
            per_group = len(mapped) // len(batch)
            for j, g in enumerate(batch):
                self._mapped[g] = mapped[j * per_group:(j + 1) * per_group]

    def unmap_groups(self, groups: Iterable[int]) -> None:
        """Unmap ``groups`` (those mapped) after the device finished all work queued so far:
        from now on touching them is an illegal address, and the daemon may free them."""
        self._check_open()
        drop = [g for g in set(groups) if g in self._mapped]
        if not drop:
            return
        self.driver.synchronize()
        for g in drop:
            for offset, length in self._mapped.pop(g):
                self.driver.unmap(self.address + offset, length)

    def _map_parts(self, groups: tuple[int, ...], fixed: bool) -> list[tuple[int, int]]:
        """Ask for, import and map the descriptors of ``groups`` (and ``fixed``); all or
        nothing. Returns the ranges mapped."""
        want = expected_ranges(self.plan, groups, fixed)
        fds, answer = self._ask(groups, fixed)
        done: list[tuple[int, int]] = []
        try:
            got = [tuple(r) for r in answer.ranges]
            if got != want or len(fds) != len(want):
                raise Internal(f"the daemon sent {len(fds)} descriptors for ranges {got[:4]}"
                               f"... where {len(want)} ranges {want[:4]}... were expected "
                               "(daemon and client disagree on the pool's layout)")
            for fd, (offset, length) in zip(fds, want, strict=True):
                handle = self.driver.import_fd(fd)
                try:
                    self.driver.map(self.address + offset, length, handle)
                finally:
                    self.driver.release(handle)  # the mapping keeps the allocation
                done.append((offset, length))
        except BaseException:
            for offset, length in done:
                self.driver.unmap(self.address + offset, length)
            raise
        finally:
            for fd in fds:
                os.close(fd)
        return done

    def _check_open(self) -> None:
        if self.address == 0:
            raise FailedPrecondition("the CUDA VMM region is closed")

    def close(self) -> None:
        """Unmap everything and give the range back (views of :attr:`tensor` must be gone:
        they do not own it). Idempotent."""
        if self.address == 0:
            return
        self._tensor = None
        ranges = [r for rs in self._mapped.values() for r in rs] + self._fixed
        if ranges:
            self.driver.synchronize()
        for offset, length in ranges:
            self.driver.unmap(self.address + offset, length)
        self._mapped.clear()
        self._fixed = []
        self.driver.free_address(self.address, self.size)
        self.address = 0

    def __enter__(self) -> CudaVmmRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_vmm_region(device_uuid: str, plan: PoolPlan, ask: AskFds) -> CudaVmmRegion:
    """Map an elastic pool of the device ``device_uuid`` (the handle's) in this process: the
    ordinal found by UUID (``CUDA_VISIBLE_DEVICES`` may differ from the daemon's), a driver
    on it, the region with its fixed part mapped. Closing the region does not close the
    driver (``region.driver.close()``).

    Raises:
        FailedPrecondition: the device is not visible here, or cuda-bindings is missing.
    """
    driver = CudaDriver(ordinal_for_uuid(device_uuid, visible_cuda_uuids()))
    try:
        return CudaVmmRegion(driver, plan, ask)
    except BaseException:
        driver.close()
        raise

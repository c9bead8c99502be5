"""Client-side mapping of an elastic pool (sharing ``shm_sparse``): reserve the whole region with
no access, map the fixed part and the granted groups into it, map more as pages are allocated,
unmap groups the daemon takes back.

The region file is checked as for ``shm`` (:func:`kvpool.mapping.shm_mapper.open_shm`), then a
:class:`~kvpool.mapping.sparse.Reservation` of its whole size is made and the flat uint8 tensor
is built over the reservation's address (no copy), so every view spans its whole virtual range
from the start. Only mapped chunks are reachable: touching a group that is not mapped faults
(SIGSEGV), it never reads zeros or allocates memory. Group ``g`` is the ranges
``plan.group_ranges(g)``, one per view; the fixed part (``fixed_bytes`` at
``plan.elastic.fixed_offset``, up to the end: ``req_to_token`` and other aux buffers, what the
daemon committed for the pool's life) is mapped for the region's life.

The reservation is released once the region is closed and no view taken from it is alive
(a ``weakref.finalize`` on the buffer the tensors share): closing first takes every range back
to no access, so a view kept past ``close`` faults instead of reaching whatever the address
space holds there later.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.fd_channel import FdAsk
from kvpool.contract.plan import group_ranges
from kvpool.contract.shared_handle import SharedHandle
from kvpool.mapping.fd_client import fetch_fd
from kvpool.mapping.mapped_region import BufferLayout, MappedRegion, carve_views
from kvpool.mapping.shm_mapper import open_shm
from kvpool.mapping.sparse import Reservation

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvpool.mapping.elastic_map")

# The id space whose ids lie in groups (page p in group p // pages_per_group).
ELASTIC_SPACE = "kv"

# What an attach under no lease (or a lease with no KeepAlive stream here) is refused with;
# the daemon refuses it with the same words.
NO_LEASE = ("attach to an elastic pool under a lease: its groups are taken back over the "
            "lease's KeepAlive stream")


class GroupMapper(Protocol):
    """How one process maps the groups of an elastic region: file chunks into a reservation
    (CPU, :class:`ReservationMapper`), or CUDA VMM allocations into a reserved device range
    (:class:`VmmMapper`)."""

    def map_group(self, group: int) -> None:
        """Map every view's range of ``group``: all of it or none."""
        ...

    def unmap_group(self, group: int) -> None:
        """Take ``group`` back to no access."""
        ...

    def close(self) -> None:
        """Take the whole range back to no access (views kept past it fault)."""
        ...


class ReservationMapper:
    """CPU: file chunks mapped into a :class:`~kvpool.mapping.sparse.Reservation`."""

    def __init__(self, reservation: Reservation, shares: list[tuple[int, int]]) -> None:
        self.reservation = reservation
        self._shares = shares  # (offset, share) of each view (kvpool.contract.plan.group_ranges)

    def map_group(self, group: int) -> None:
        done: list[tuple[int, int]] = []
        try:
            for offset, length in group_ranges(self._shares, group):
                self.reservation.map(offset, length)
                done.append((offset, length))
        except BaseException:
            for offset, length in done:  # all of the group or none of it
                self.reservation.unmap(offset, length)
            raise

    def unmap_group(self, group: int) -> None:
        for offset, length in group_ranges(self._shares, group):
            self.reservation.unmap(offset, length)

    def close(self) -> None:
        r = self.reservation
        if r.address:
            r.unmap(0, r.size)


class VmmMapper:
    """CUDA: a :class:`~kvpool.mapping.cuda_vmm.CudaVmmRegion` (descriptors fetched from the
    daemon's side socket, imported and mapped into a reserved device range)."""

    def __init__(self, region: Any) -> None:
        self.region = region

    def map_group(self, group: int) -> None:
        self.region.ensure_groups([group])

    def unmap_group(self, group: int) -> None:
        self.region.unmap_groups([group])

    def close(self) -> None:
        self.region.close()
        self.region.driver.close()


class ElasticRegion(MappedRegion):
    """A mapped elastic pool: the views of :class:`MappedRegion` over a reserved range in which
    only the fixed part and the mapped groups are reachable.

    Made by :func:`map_elastic` (CPU) or :func:`map_elastic_vmm` (CUDA). Thread-safe:
    allocating threads map groups while the lease's keep-alive thread unmaps others (one leaf
    lock per region).
    """

    def __init__(self, device: torch.device, base: torch.Tensor,
                 views: dict[str, torch.Tensor], path: str, *, mapper: GroupMapper,
                 layout: Sequence[BufferLayout], plan: Any, fingerprint: str = "",
                 attach_id: int = 0, pool: str = "", sharing: str = "shm_sparse") -> None:
        super().__init__(sharing, device, base, views, path, layout=layout, plan=plan,
                         fingerprint=fingerprint, attach_id=attach_id)
        e = plan.elastic
        self.pool = pool
        self.space = ELASTIC_SPACE
        self.pages_per_group: int = e.pages_per_group
        self.groups: int = e.groups
        self._mapper = mapper
        self._mapped = np.zeros(e.groups, dtype=bool)
        self._lock = threading.Lock()  # a leaf: guards _mapped and the reservation's mappings
        self._on_close: list[Callable[[ElasticRegion], None]] = []

    @property
    def mapped_groups(self) -> frozenset[int]:
        """The groups mapped in this process now."""
        with self._lock:
            return frozenset(int(g) for g in np.flatnonzero(self._mapped))

    def _check_groups(self, groups: np.ndarray) -> None:
        # One pass: a negative group wraps to a huge unsigned one.
        if groups.size and int(groups.view(np.uint64).max()) >= self.groups:
            bad = int(groups[(groups < 0) | (groups >= self.groups)][0])
            raise InvalidArgument(
                f"group {bad} is not in pool {self.pool or '?'} (groups 0..{self.groups - 1})",
                field="groups")

    def ensure_groups(self, groups: Iterable[int]) -> list[int]:
        """Map each of ``groups`` not mapped yet (the daemon must have granted it).

        Returns:
            The groups this call mapped.

        Raises:
            InvalidArgument: a group outside the pool.
            FailedPrecondition: the region is closed.
            OSError: an mmap failed (that group is left unmapped; the ones before it stay).
        """
        return self._ensure(np.fromiter(groups, dtype=np.int64))

    def ensure_pages(self, page_ids: Any) -> list[int]:
        """Map the groups ``page_ids`` (kv page ids) lie in; O(len(page_ids)), and no mmap at
        all when they are mapped already. For a process that reads pages another process
        allocated (its own allocations are mapped before they return).

        Returns:
            The groups this call mapped.

        Raises:
            As :meth:`ensure_groups`.
        """
        ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
        return self._ensure(ids // self.pages_per_group)

    def _ensure(self, groups: np.ndarray) -> list[int]:
        self._check_groups(groups)
        done: list[int] = []
        with self._lock:
            if self.closed:
                raise FailedPrecondition("the mapped region is closed")
            present = self._mapped[groups]
            if present.all():  # the common case: one gather, no mmap
                return done
            for g in np.unique(groups[~present]).tolist():
                self._map_group(g)
                done.append(g)
        return done

    def _map_group(self, group: int) -> None:
        self._mapper.map_group(group)  # all of the group or none of it
        self._mapped[group] = True

    def unmap_groups(self, groups: Iterable[int]) -> list[int]:
        """Take ``groups`` back to no access: a touch of them faults from now on. Groups not
        mapped are skipped.

        Returns:
            The groups this call unmapped.

        Raises:
            InvalidArgument: a group outside the pool.
            OSError: an mmap failed (that group may be partly mapped still: do not tell the
                daemon it is unmapped).
        """
        arr = np.fromiter(groups, dtype=np.int64)
        self._check_groups(arr)
        done: list[int] = []
        with self._lock:
            if self.closed:
                return done  # closing took every range back already
            for g in np.unique(arr[self._mapped[arr]]).tolist():
                self._mapper.unmap_group(g)
                self._mapped[g] = False
                done.append(g)
        return done

    def on_close(self, callback: Callable[[ElasticRegion], None]) -> None:
        """Call ``callback(region)`` when the region closes (a lease unregisters it)."""
        self._on_close.append(callback)

    def close(self) -> None:
        """Take the whole range back to no access, drop the views, unregister from the lease;
        the reservation is released once no view taken from the region is alive. Idempotent.
        """
        with self._lock:
            if self.closed:
                return
            self._mapper.close()
            self._mapped[:] = False
            super().close()
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback(self)


def map_elastic(handle: SharedHandle, layout: Sequence[BufferLayout], *, plan: Any,
                groups: Iterable[int] = (), fingerprint: str = "", attach_id: int = 0,
                pool: str = "", lease: tuple[int, bytes] | None = None) -> ElasticRegion:
    """Map a ``shm_sparse`` handle: reserve it whole, map the fixed part and ``groups``.

    Args:
        handle: the region's handle (path and size of the daemon's sparse 0600 file, and its
            descriptor side socket).
        layout: the checked buffer layouts (:func:`kvpool.mapping.mapped_region.check_layout`).
        plan: the pool's plan; ``plan.elastic`` says where the groups and the fixed part lie.
        groups: the groups granted now (``AttachInfo.elastic_groups``).
        fingerprint, attach_id, pool: kept on the region for the caller.
        lease: ``(lease_id, secret)``: with the handle's side socket and ``pool``, the file's
            descriptor is fetched there under the lease (the daemon then knows this process
            maps the pool under it); without, the file is opened by its path.

    Returns:
        An :class:`ElasticRegion`.

    Raises:
        InvalidArgument: no elastic plan, or a group outside it.
        NotFound, PermissionDenied, FailedPrecondition: see
            :func:`kvpool.mapping.shm_mapper.open_shm`.
    """
    import torch

    e = getattr(plan, "elastic", None)
    if e is None:
        raise InvalidArgument("a shm_sparse handle needs the pool's elastic plan (Attach "
                              "returns it; map with kvpool.mapping.attach.region_of)",
                              field="plan")
    size = int(handle.size)
    fd = _elastic_fd(handle, size, pool, lease)
    try:
        reservation = Reservation(fd, size)
    except BaseException:
        os.close(fd)
        raise
    try:
        if e.fixed_bytes:
            reservation.map(e.fixed_offset, e.fixed_bytes)  # what the daemon committed
        buffer = (ctypes.c_uint8 * size).from_address(reservation.address)
        # The reservation (and the fd its later maps use) goes when the last view does.
        weakref.finalize(buffer, _release, reservation, fd)
        base = torch.frombuffer(buffer, dtype=torch.uint8)
    except BaseException:
        _release(reservation, fd)
        raise
    del buffer
    region = ElasticRegion(torch.device("cpu"), base, carve_views(base, layout),
                           str(handle.path),
                           mapper=ReservationMapper(reservation, plan.group_shares()),
                           layout=layout, plan=plan, fingerprint=fingerprint,
                           attach_id=attach_id, pool=pool)
    return _with_groups(region, groups)


def _elastic_fd(handle: SharedHandle, size: int, pool: str,
                lease: tuple[int, bytes] | None) -> int:
    """The pool file's descriptor: from the daemon's side socket under ``lease`` when the
    handle names one, else opened by path (:func:`kvpool.mapping.shm_mapper.open_shm`).

    Raises:
        FailedPrecondition: the descriptor is not a regular file of ``size`` bytes.
        KVPoolError: the daemon's refusal (NotFound: an unproven lease; FailedPrecondition:
            no attachment of the pool under it), or Unavailable (no side socket there).
    """
    socket_path = str(getattr(handle, "fd_socket", "") or "")
    if not socket_path or lease is None or not pool:
        return open_shm(str(handle.path), size)
    lease_id, secret = lease
    fd, _answer = fetch_fd(socket_path, FdAsk(pool=pool, lease_id=lease_id, secret=secret.hex()))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise FailedPrecondition(
                f"the daemon's descriptor of pool {pool!r} is not a regular file of {size:,} "
                f"bytes (mode {st.st_mode:o}, {st.st_size:,} bytes): attach again",
                field="fd_socket")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _with_groups(region: ElasticRegion, groups: Iterable[int]) -> ElasticRegion:
    """``region`` with ``groups`` mapped, or closed and the error raised."""
    try:
        region.ensure_groups(groups)
    except BaseException:
        region.close()
        raise
    return region


def map_elastic_vmm(handle: SharedHandle, layout: Sequence[BufferLayout], *, plan: Any,
                    lease: tuple[int, bytes] | None, groups: Iterable[int] = (),
                    fingerprint: str = "", attach_id: int = 0, pool: str = "") -> ElasticRegion:
    """Map a ``cuda_vmm`` handle: reserve the device range, fetch the fixed part's and
    ``groups``' descriptors from the daemon's side socket (``handle.path``) for ``lease``,
    import and map them.

    Raises:
        FailedPrecondition: no lease, no side socket, cuda-bindings missing, the device not
            visible here, or the daemon's refusal.
        InvalidArgument: no elastic plan.
    """
    from kvpool.mapping.cuda_vmm import open_vmm_region, socket_asker

    if getattr(plan, "elastic", None) is None:
        raise InvalidArgument("a cuda_vmm handle needs the pool's elastic plan", field="plan")
    if lease is None:
        raise FailedPrecondition(NO_LEASE, field="lease")
    if not handle.path:
        raise FailedPrecondition(
            "the daemon hands this pool's memory out on a descriptor socket beside its Unix "
            "socket, and serves none: run kvpoold serve with a --listen unix://... address",
            field="path")
    lease_id, secret = lease
    vmm = open_vmm_region(str(handle.device_uuid), plan,
                          socket_asker(str(handle.path), pool, lease_id, secret.hex()))
    try:
        base = vmm.tensor
        region = ElasticRegion(base.device, base, carve_views(base, layout), str(handle.path),
                               mapper=VmmMapper(vmm), layout=layout, plan=plan,
                               fingerprint=fingerprint, attach_id=attach_id, pool=pool,
                               sharing="cuda_vmm")
    except BaseException:
        VmmMapper(vmm).close()
        raise
    return _with_groups(region, groups)


def _release(reservation: Reservation, fd: int) -> None:
    reservation.close()
    os.close(fd)


__all__ = ["ELASTIC_SPACE", "NO_LEASE", "ElasticRegion", "GroupMapper", "ReservationMapper",
           "VmmMapper", "map_elastic", "map_elastic_vmm"]

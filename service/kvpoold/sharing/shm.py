"""CPU backings in shared-memory files: one ``/dev/shm/kvpool-<instance>-<pool>-<hex>`` per pool.

The daemon creates the file (``O_EXCL | O_NOFOLLOW``, mode exactly 0600), sizes it with
``ftruncate`` (sparse, so it reads as zeros and costs nothing until touched) and maps it shared
with ``torch.from_file``; a client maps the same file from its path and size and sees every
write both ways. Nothing goes through torch's shm manager or a pickle. ``close()`` unlinks the
file; mappings already made survive the unlink. A daemon that dies without closing leaves its
files behind; the next factory in the same directory removes them (see
:mod:`kvpoold.sharing.cleanup`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from kvpool.contract.errors import FailedPrecondition, Internal, InvalidArgument, ResourceExhausted
from kvpool.contract.limits import check_pool_name
from kvpool.contract.plan import PoolPlan
from kvpool.mapping.sparse import backed_bytes, commit, punch
from kvpoold.sharing.base import FdGrant, Region, SharedHandle, Sharing
from kvpoold.sharing.cleanup import (
    FILE_MODE,
    InstanceLock,
    check_instance,
    region_prefix,
    sweep_orphans,
)
from kvpoold.sharing.sparse_groups import SparseBacking, plan_geometry

log = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
_NO_SPACE = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)


def free_bytes(shm_dir: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged process may still allocate in ``shm_dir``'s file system."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def _exhausted(nbytes: int, pool: str, shm_dir: Path, free: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"pool {pool!r} needs {nbytes:,} B of shared memory but {shm_dir} has {free:,} B free; "
        f"lower --budget or enlarge {shm_dir} (mount -o remount,size=... or docker --shm-size)",
        field="budget",
    )


class ShmBacking(Region):
    """One pool's region: a shared-memory file mapped into a flat uint8 tensor.

    Made by :meth:`ShmBackingFactory.create`; not constructed directly.
    """

    def __init__(
        self, path: Path, nbytes: int, tensor: torch.Tensor, on_close: Callable[[Path], None],
        fd_socket: Callable[[], str] = str,
    ) -> None:
        super().__init__(tensor, nbytes)
        self.path = path
        self._on_close = on_close
        self._fd_socket = fd_socket  # the factory's side socket, known once it listens

    def describe(self) -> str:
        return f"shared-memory region {self.path.name}"

    @property
    def sharing(self) -> Sharing:
        return "shm"

    def handle(self) -> SharedHandle:
        """``SharedHandle(sharing="shm", path, size)`` for a client to map the file.

        Raises:
            FailedPrecondition: after :meth:`close`.
        """
        # the tensor property refuses after close
        return SharedHandle(sharing="shm", size=self.tensor.numel(), path=str(self.path),
                            fd_socket=self._fd_socket())

    def unbacked_bytes(self) -> int:
        """Bytes of the file not yet backed by pages (0 after close): what it may still take."""
        if self._tensor is None:
            return 0
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return 0
        return max(0, self.nbytes - st.st_blocks * 512)

    def close(self) -> None:
        """Unlink the file and drop this backing's reference to the mapping. Idempotent.

        Clients that mapped the file keep their mapping; the daemon's own mapping goes away
        when the last view over :attr:`tensor` (the pool's views) is dropped.
        """
        if self._tensor is None:
            return
        self._tensor = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self._on_close(self.path)


class SparseShmBacking(ShmBacking):
    """An elastic pool's region: the file sized to the virtual range, memory committed only
    where the daemon grants it (:meth:`commit`, :meth:`punch` of whole chunks); a client maps
    granted chunks into a reservation (``kvpool.mapping.sparse``).

    Made by :meth:`ShmBackingFactory.create_sparse`; it keeps its descriptor open and hands
    copies of it out on the daemon's descriptor side socket (:meth:`export`), so the daemon
    knows which process under which lease holds the file (``kvpoold.elastic.backing_audit``).
    """

    def __init__(self, path: Path, nbytes: int, tensor: torch.Tensor,
                 on_close: Callable[[Path], None], fd: int,
                 fd_socket: Callable[[], str] = str) -> None:
        super().__init__(path, nbytes, tensor, on_close, fd_socket)
        self.fd = fd
        self.groups: SparseBacking | None = None  # set by create_elastic

    def grant(self, group: int) -> None:
        """Back group ``group`` of the pool (every view's chunks of it); all or nothing.

        Raises:
            ResourceExhausted: the file system cannot hold it.
        """
        if self.groups is None:
            raise FailedPrecondition(f"{self.describe()} has no groups")
        self.groups.grant(group)

    def release(self, group: int) -> None:
        """Free group ``group``'s memory (every process unmapped it first)."""
        if self.groups is not None:
            self.groups.release(group)

    @property
    def sharing(self) -> Sharing:
        return "shm_sparse"

    def handle(self) -> SharedHandle:
        return SharedHandle(sharing="shm_sparse", size=self.tensor.numel(), path=str(self.path),
                            fd_socket=self._fd_socket())

    def export(self, groups: Iterable[int], fixed: bool) -> FdGrant:
        """A copy of the file's descriptor for the side socket to send (closed after
        sending): the one file, whose granted ranges the client maps itself.

        Raises:
            FailedPrecondition: an ask of parts (groups or the fixed part: that is the CUDA
                VMM protocol), or the pool is closed.
        """
        if tuple(groups) or fixed:
            raise FailedPrecondition(
                f"{self.describe()} is one file: ask for it without groups and map the "
                "granted ranges of it", field="groups")
        lock = self.groups.lock if self.groups is not None else contextlib.nullcontext()
        with lock:  # close() closes the descriptor under the same lock
            if self._tensor is None:
                raise FailedPrecondition(f"{self.describe()} is closed", field="pool")
            return FdGrant((os.dup(self.fd),), (), self.nbytes, "shm_sparse", owned=True)

    def commit(self, offset: int, length: int) -> None:
        """Back ``length`` bytes at ``offset`` (whole chunks) with memory now.

        Raises:
            ResourceExhausted: the file system cannot hold them (nothing changed).
        """
        commit(self.fd, offset, length)

    def punch(self, offset: int, length: int) -> None:
        """Free the memory of ``length`` bytes at ``offset`` (every process unmapped it)."""
        punch(self.fd, offset, length)

    def backed_bytes(self) -> int:
        """Memory behind the file now (``st_blocks``)."""
        return 0 if self._tensor is None else backed_bytes(self.fd)

    def unbacked_bytes(self) -> int:
        return 0  # it grows only by grants, each inside the daemon's budget

    def close(self) -> None:
        if self._tensor is None:
            return
        super().close()
        if self.groups is None:
            os.close(self.fd)
            return
        with self.groups.lock:  # an audit in a worker thread must not use a reused number
            self.groups.closed = True
            os.close(self.fd)


class ShmBackingFactory:
    """Creates :class:`ShmBacking` regions in ``shm_dir`` for one daemon instance.

    On construction it removes dead daemons' files (:func:`sweep_orphans`) and takes this
    instance's lock, held until :meth:`close`. No atexit hook: the daemon calls close(); a
    crash is cleaned up by the next factory's sweep.

    Thread-safe: the daemon builds pools in worker threads, so two Configures may create
    regions at once; one lock guards the table of regions and the free-space check.

    Args:
        shm_dir: a tmpfs directory (``/dev/shm``).
        instance: this daemon's instance name (``[a-z0-9]{1,32}``); random by default.
        preallocate: reserve every page at create (``posix_fallocate``) instead of leaving
            the file sparse. Slower to create, but a full /dev/shm is then reported as
            ResourceExhausted at create instead of a SIGBUS in whichever process first
            touches a page that cannot be backed.

    Raises:
        InvalidArgument: for a bad instance name.
        FailedPrecondition: when the instance's lock is held by a live daemon or the
            directory cannot be written.
    """

    def __init__(
        self,
        shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
        instance: str | None = None,
        *,
        preallocate: bool = False,
    ) -> None:
        self.shm_dir = Path(shm_dir)
        self.instance = check_instance(instance if instance is not None else secrets.token_hex(8))
        self.preallocate = preallocate
        # The descriptor side socket (set by the server once it listens): elastic pools' files
        # are handed out there (SparseShmBacking.export); "" while it serves none.
        self.fd_socket = ""
        if not self.shm_dir.is_dir():
            raise FailedPrecondition(
                f"shared-memory directory {self.shm_dir} does not exist; create it or pass "
                "another --shm-dir",
                field="shm_dir",
            )
        self.swept: tuple[Path, ...] = tuple(sweep_orphans(self.shm_dir))
        self._lock: InstanceLock | None = InstanceLock(self.shm_dir, self.instance)
        self._backings: dict[Path, ShmBacking] = {}
        # Guards _backings and the free-space check + file creation (a leaf lock).
        self._mutex = threading.Lock()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def lock_path(self) -> Path:
        """This instance's lock file."""
        if self._lock is None:
            raise FailedPrecondition("the shared-memory factory is closed")
        return self._lock.path

    @property
    def backings(self) -> tuple[ShmBacking, ...]:
        """The regions created and not yet closed."""
        with self._mutex:
            return tuple(self._backings.values())

    def __enter__(self) -> ShmBackingFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self, nbytes: int, pool_name: str) -> ShmBacking:
        """A new zero-filled shared-memory region of ``nbytes`` for pool ``pool_name``.

        Args:
            nbytes: region size in bytes (>= 1).
            pool_name: ``[a-z0-9][a-z0-9._-]{0,62}``; it goes into the file name.

        Returns:
            The backing; ``backing.tensor`` is the daemon's mapping, ``backing.handle()`` the
            client's way in.

        Raises:
            InvalidArgument: for a bad pool name or size.
            ResourceExhausted: when the shared-memory file system cannot hold ``nbytes``
                (counting what this factory's sparse regions may still take).
            FailedPrecondition: after :meth:`close`.
        """
        check_pool_name(pool_name)
        if not isinstance(nbytes, int) or nbytes < 1:
            raise InvalidArgument(f"region size must be >= 1 byte, got {nbytes!r}",
                                  field="nbytes")
        # Held across check and create: two concurrent creates must not both count the
        # same free bytes.
        with self._mutex:
            if self._lock is None:
                raise FailedPrecondition("the shared-memory factory is closed; start a new one")
            # Sparse files take pages only when touched, so statvfs alone overstates what is
            # left: subtract what our own regions may still claim. Failing here beats a SIGBUS
            # in an engine process when tmpfs runs out under a write.
            free = free_bytes(self.shm_dir) - sum(
                b.unbacked_bytes() for b in self._backings.values()
            )
            if nbytes > free:
                raise _exhausted(nbytes, pool_name, self.shm_dir, max(free, 0))
            name = f"{region_prefix(self.instance)}{pool_name}-{secrets.token_hex(8)}"
            path = self.shm_dir / name
            tensor = self._create_file(path, nbytes, pool_name)
            backing = ShmBacking(path, nbytes, tensor, self._forget, lambda: self.fd_socket)
            self._backings[path] = backing
        return backing

    def create_sparse(self, nbytes: int, pool_name: str, committed: tuple[int, int]
                      ) -> SparseShmBacking:
        """An elastic pool's region: a sparse file of ``nbytes`` (whole chunks) whose range
        ``committed`` (offset, length: the fixed part) is backed now and the rest only as
        groups are granted.

        Raises:
            As :meth:`create`; ResourceExhausted when the fixed part does not fit.
        """
        check_pool_name(pool_name)
        offset, length = committed
        with self._mutex:
            if self._lock is None:
                raise FailedPrecondition("the shared-memory factory is closed; start a new one")
            free = free_bytes(self.shm_dir) - sum(
                b.unbacked_bytes() for b in self._backings.values())
            if length > free:
                raise _exhausted(length, pool_name, self.shm_dir, max(free, 0))
            name = f"{region_prefix(self.instance)}{pool_name}-{secrets.token_hex(8)}"
            path = self.shm_dir / name
            tensor = self._create_file(path, nbytes, pool_name, sparse=True)
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            backing = SparseShmBacking(path, nbytes, tensor, self._forget, fd,
                                       lambda: self.fd_socket)
            self._backings[path] = backing
        try:
            if length:
                backing.commit(offset, length)
        except BaseException:
            backing.close()
            raise
        return backing

    def create_elastic(self, plan: PoolPlan, pool_name: str) -> SparseShmBacking:
        """An elastic pool's region (``plan.elastic``): the fixed part backed now, each group
        backed by :meth:`SparseShmBacking.grant`.

        Raises:
            As :meth:`create_sparse`; InvalidArgument for a fixed plan.
        """
        geometry, offsets = plan_geometry(plan)
        e = plan.elastic
        assert e is not None  # plan_geometry refused a fixed plan
        backing = self.create_sparse(plan.backing_bytes, pool_name,
                                     (e.fixed_offset, e.fixed_bytes))
        backing.groups = SparseBacking(backing.fd, geometry, offsets,
                                       (e.fixed_offset, e.fixed_bytes))
        return backing

    def _create_file(self, path: Path, nbytes: int, pool_name: str, *,
                     sparse: bool = False) -> torch.Tensor:
        fd = os.open(
            path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE
        )
        try:
            os.fchmod(fd, FILE_MODE)  # umask can only remove bits; make it exactly 0600
            st = os.fstat(fd)
            if st.st_mode & 0o777 != FILE_MODE or st.st_uid != os.geteuid():
                raise Internal(f"{path} has mode {st.st_mode & 0o777:o} owner {st.st_uid} "
                               f"after creation; expected 600 owned by {os.geteuid()}")
            try:
                if self.preallocate and not sparse:
                    os.posix_fallocate(fd, 0, nbytes)
                else:
                    os.ftruncate(fd, nbytes)
            except OSError as exc:
                if exc.errno in _NO_SPACE:
                    raise _exhausted(nbytes, pool_name, self.shm_dir,
                                     free_bytes(self.shm_dir)) from exc
                raise
            # Map through our own fd so the mapping is of the inode we just checked.
            try:
                return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes,
                                       dtype=torch.uint8)
            except RuntimeError as exc:
                if "Cannot allocate memory" in str(exc):
                    raise ResourceExhausted(
                        f"cannot map {nbytes:,} B of shared memory for pool {pool_name!r} "
                        f"(out of address space or memory): {exc}; lower --budget",
                        field="budget",
                    ) from exc
                raise Internal(f"cannot map {path}: {exc}") from exc
        except BaseException:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            raise
        finally:
            os.close(fd)

    def _forget(self, path: Path) -> None:
        with self._mutex:
            self._backings.pop(path, None)

    def close(self) -> None:
        """Close every region this factory created, then release and remove the lock.

        Idempotent. Regions go first so a crash in between leaves only a lock whose flock
        is free, which the next sweep removes.
        """
        with self._mutex:  # no create can start once the lock attribute is gone
            lock, self._lock = self._lock, None
            backings = list(self._backings.values())
        for backing in backings:
            backing.close()
        if lock is not None:
            lock.release()

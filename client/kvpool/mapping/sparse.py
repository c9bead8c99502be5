"""Sparse shared memory for elastic pools on CPU: the daemon commits and punches 2 MiB chunks of
one file; a client reserves the whole range with no access and maps only granted chunks into it,
so touching memory that is not granted faults (SIGSEGV), as on a GPU under CUDA VMM, instead of
reading zeros or silently allocating.

Both sides use libc through ``ctypes`` (``fallocate`` for a hole punch, ``mmap`` at a fixed
address): Python's ``os`` and ``mmap`` modules offer neither. Linux only.

- Daemon: :func:`commit` (``fallocate`` mode 0: the range is backed, or ENOSPC and nothing
  changed), :func:`punch` (``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE``: the range's memory is
  freed; mappings elsewhere read zeros from it until they unmap), :func:`backed_bytes`.
- Client: :class:`Reservation` (``PROT_NONE`` over the range, then ``map``/``unmap`` of chunks
  with ``MAP_FIXED``), whose :attr:`Reservation.address` a tensor can view.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os

from kvpool.contract.errors import InvalidArgument, ResourceExhausted
from kvpool.contract.plan import CHUNK_BYTES  # the unit of commit, punch and map

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MAP_FIXED = 0x10
PROT_NONE = 0x0  # Python's mmap module names PROT_READ and PROT_WRITE only
MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int64]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int


def _check_range(offset: int, length: int, size: int | None = None) -> None:
    if offset < 0 or length <= 0 or offset % CHUNK_BYTES or length % CHUNK_BYTES:
        raise InvalidArgument(
            f"range {offset:,}+{length:,} is not whole {CHUNK_BYTES:,} B chunks", field="range")
    if size is not None and offset + length > size:
        raise InvalidArgument(f"range {offset:,}+{length:,} is past the end ({size:,} B)",
                              field="range")


def commit(fd: int, offset: int, length: int) -> None:
    """Back ``length`` bytes at ``offset`` of the file with memory now.

    Raises:
        ResourceExhausted: the filesystem (tmpfs size) cannot hold them; nothing changed.
        InvalidArgument: a range that is not whole chunks.
    """
    _check_range(offset, length)
    if _libc.fallocate(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        if err == errno.ENOSPC:
            raise ResourceExhausted(
                f"cannot commit {length:,} B at {offset:,}: the shared-memory filesystem is "
                "full (raise its size, e.g. a container's --shm-size)", field="budget")
        raise OSError(err, f"fallocate(commit {offset:,}+{length:,}): {os.strerror(err)}")


def punch(fd: int, offset: int, length: int) -> None:
    """Free the memory of ``length`` bytes at ``offset``; the file keeps its size."""
    _check_range(offset, length)
    mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(punch {offset:,}+{length:,}): {os.strerror(err)}")


def backed_bytes(fd: int) -> int:
    """Bytes of the file backed by memory now (``st_blocks``)."""
    return os.fstat(fd).st_blocks * 512


class Reservation:
    """A client's view of a sparse file: ``size`` bytes reserved with no access, granted chunks
    mapped shared and read-write at their offsets.

    Args:
        fd: the file (it may be closed after the chunks are mapped; mappings keep it).
        size: the file's virtual size, whole chunks.
    """

    def __init__(self, fd: int, size: int) -> None:
        _check_range(0, size)
        self.fd = fd
        self.size = size
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        base = _libc.mmap(None, size, PROT_NONE, flags, -1, 0)
        if base in (None, MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap(reserve {size:,} B): {os.strerror(err)}")
        self.address: int = base
        self.mapped: set[int] = set()  # chunk offsets mapped now

    def map(self, offset: int, length: int) -> None:
        """Map ``length`` bytes of the file at ``offset`` into the reservation (read-write)."""
        _check_range(offset, length, self.size)
        self._fixed(offset, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, self.fd)
        self.mapped.update(range(offset, offset + length, CHUNK_BYTES))

    def unmap(self, offset: int, length: int) -> None:
        """Take the range back to no access: a touch of it faults from now on."""
        _check_range(offset, length, self.size)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        self._fixed(offset, length, PROT_NONE, flags, -1)
        self.mapped.difference_update(range(offset, offset + length, CHUNK_BYTES))

    def _fixed(self, offset: int, length: int, prot: int, flags: int, fd: int) -> None:
        if self.address == 0:
            raise InvalidArgument("the reservation is closed", field="range")
        want = self.address + offset
        got = _libc.mmap(want, length, prot, flags | MAP_FIXED, fd, offset if fd >= 0 else 0)
        if got != want:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap(fixed {offset:,}+{length:,}): {os.strerror(err)}")

    def close(self) -> None:
        """Unmap everything (views over :attr:`address` must be gone first). Idempotent."""
        if self.address:
            _libc.munmap(self.address, self.size)
            self.address = 0
            self.mapped.clear()

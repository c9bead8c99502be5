"""Client-side shared-memory importer: check the pool's /dev/shm file, then map it.

The file is opened ``O_NOFOLLOW`` and must be a regular file owned by this user, mode 0600,
exactly ``size`` bytes; it is mapped through the checked descriptor, so what is mapped is what
was checked. torch is imported inside the function that needs it.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from kvpool.contract.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

if TYPE_CHECKING:
    import torch

    from kvpool.contract.shared_handle import SharedHandle

SHM_FILE_MODE = 0o600


def open_shm(path: str, size: int) -> int:
    """An O_RDWR fd of the region file after checking it is safe to map; the caller closes it.

    Args:
        path: the region file, absolute.
        size: the size the handle promises, in bytes.

    Raises:
        InvalidArgument: the path is not absolute.
        NotFound: the file is gone (the pool was dropped or the daemon restarted).
        PermissionDenied: a symlink, not a regular file, another user's file, or not 0600.
        FailedPrecondition: the file's size differs from ``size``.
    """
    if not path or not os.path.isabs(path):
        raise InvalidArgument(f"shm handle path {path!r} must be absolute", field="path")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(
            f"region file {path} does not exist: the pool was dropped or the daemon "
            "restarted; attach again",
            field="path",
        ) from None
    except OSError as exc:
        raise PermissionDenied(
            f"cannot open region file {path}: {exc.strerror} (a symlink, or another user's "
            "file); run the engine as the daemon's user",
            field="path",
        ) from exc
    try:
        st = os.fstat(fd)
        uid = os.geteuid()
        if not stat.S_ISREG(st.st_mode):
            raise PermissionDenied(f"region {path} is not a regular file; refusing to map it",
                                   field="path")
        if st.st_uid != uid:
            raise PermissionDenied(
                f"region file {path} is owned by uid {st.st_uid}, this process runs as uid "
                f"{uid}; refusing to map it (run the engine as the daemon's user)",
                field="path",
            )
        mode = st.st_mode & 0o777
        if mode != SHM_FILE_MODE:
            raise PermissionDenied(
                f"region file {path} has mode {mode:o}, expected 600; refusing to map a file "
                "others can read or write",
                field="path",
            )
        if st.st_size != size:
            raise FailedPrecondition(
                f"region file {path} has {st.st_size:,} B, the handle says {size:,} B; the "
                "pool changed since the handle was issued: attach again",
                field="size",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_shm(handle: SharedHandle) -> tuple[torch.device, torch.Tensor]:
    """Map a ``shm`` handle's file as a flat shared uint8 CPU tensor.

    Args:
        handle: the region's handle (kind ``shm``).

    Returns:
        ``(cpu, base)``: the whole region, ``handle.size`` bytes, shared with the daemon.

    Raises:
        The errors of :func:`open_shm`.
    """
    import torch

    size = int(handle.size)
    fd = open_shm(str(handle.path), size)
    try:
        # Through /proc/self/fd: the checked inode, not whatever the path names by now.
        base = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
    finally:
        os.close(fd)
    return torch.device("cpu"), base

"""Shared-memory file names, the per-daemon instance lock, and the sweep of dead daemons' files.

Every daemon instance holds ``<shm_dir>/kvpool-<instance>.lock`` under ``flock(LOCK_EX)`` for
its lifetime and names its regions ``kvpool-<instance>-<pool>-<hex>``. The kernel drops a flock
when its holder dies (even on SIGKILL), so a lock file whose flock can be taken belongs to a
dead daemon: its region files are orphans. Instance names have no ``-`` so the prefix
``kvpool-<instance>-`` names one instance's regions and nobody else's.

Lock discipline: a lock file is created with ``O_EXCL`` and flocked right after; between the
two a sweeper could take the flock and unlink it, so the creator checks, after locking, that
the path still names the inode it locked and retries otherwise. Region files are unlinked
before their lock file, on close and in the sweep, so a region never outlives its lock.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
import time
from pathlib import Path

from kvpool.contract.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

PREFIX = "kvpool-"
LOCK_SUFFIX = ".lock"
# No "-": the instance part of a region name ends at the first "-" after the prefix.
INSTANCE_RE = re.compile(r"[a-z0-9]{1,32}")
FILE_MODE = 0o600

_LOCK_ATTEMPTS = 50
_LOCK_RETRY_S = 0.01


def check_instance(instance: str) -> str:
    """Return ``instance`` if it is a valid instance name: ``[a-z0-9]{1,32}``.

    Raises:
        InvalidArgument: otherwise.
    """
    if not isinstance(instance, str) or INSTANCE_RE.fullmatch(instance) is None:
        raise InvalidArgument(
            f"instance {instance!r} is not valid: use 1-32 characters of a-z, 0-9 (no '-')",
            field="instance",
        )
    return instance


def lock_path(shm_dir: Path, instance: str) -> Path:
    """``<shm_dir>/kvpool-<instance>.lock``."""
    return shm_dir / f"{PREFIX}{instance}{LOCK_SUFFIX}"


def region_prefix(instance: str) -> str:
    """The file-name prefix of every region of ``instance``: ``kvpool-<instance>-``."""
    return f"{PREFIX}{instance}-"


def _instance_of_lock(name: str) -> str | None:
    if not (name.startswith(PREFIX) and name.endswith(LOCK_SUFFIX)):
        return None
    inst = name[len(PREFIX) : -len(LOCK_SUFFIX)]
    return inst if INSTANCE_RE.fullmatch(inst) else None


def _instance_of_region(name: str) -> str | None:
    if not name.startswith(PREFIX) or name.endswith(LOCK_SUFFIX):
        return None
    inst, sep, _ = name[len(PREFIX) :].partition("-")
    return inst if sep and INSTANCE_RE.fullmatch(inst) else None


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


class InstanceLock:
    """The flock on ``<shm_dir>/kvpool-<instance>.lock``, held from construction to release().

    Args:
        shm_dir: the shared-memory directory.
        instance: the instance name (``[a-z0-9]{1,32}``).

    Raises:
        InvalidArgument: for a bad instance name.
        FailedPrecondition: when a live daemon already holds this instance's lock, or
            ``shm_dir`` is missing or not writable.
    """

    def __init__(self, shm_dir: Path, instance: str) -> None:
        self.path = lock_path(shm_dir, check_instance(instance))
        self._fd: int | None = self._acquire()

    def _acquire(self) -> int:
        for _ in range(_LOCK_ATTEMPTS):
            try:
                fd = os.open(
                    self.path,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    FILE_MODE,
                )
            except FileExistsError:
                # A dead daemon of this name (died after our sweep): clear it and go again.
                # Else a live one, or a sweeper about to unlink the lock: wait and look again.
                dead = _try_lock_dead(self.path)
                if dead is not None:
                    _remove_instance(self.path.parent, self.path.name, dead)
                else:
                    time.sleep(_LOCK_RETRY_S)
                continue
            except OSError as exc:
                raise FailedPrecondition(
                    f"cannot create the instance lock {self.path}: {exc.strerror}; "
                    "check that the shared-memory directory exists and is writable "
                    "(--shm-dir)",
                    field="shm_dir",
                ) from exc
            try:
                os.fchmod(fd, FILE_MODE)  # umask may have removed bits; we want exactly 0600
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # a sweeper holds it for a moment; it will unlink it
                time.sleep(_LOCK_RETRY_S)
                continue
            if self._still_named(fd):
                return fd
            os.close(fd)  # swept between create and flock: the path is gone, start over
        raise FailedPrecondition(
            f"instance lock {self.path} is held by a live daemon; give this daemon another "
            "instance name (--instance) or stop the other one",
            field="instance",
        )

    def _still_named(self, fd: int) -> bool:
        return _same_file(self.path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlink the lock file and drop the flock. Idempotent.

        The unlink comes first so no other process can take the flock on a path that is
        about to disappear.
        """
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._still_named(fd):
                self.path.unlink()
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)


def _try_lock_dead(path: Path) -> int | None:
    """An fd holding the flock of ``path`` if its owner is dead, else None."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # gone, a symlink, or not ours to open
    try:
        if not _ours(os.fstat(fd)):
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            log.warning("cannot test lock %s: %s", path, exc)
        return None
    # Another sweeper may have removed this lock since we opened it, and a new daemon of the
    # same name may own the path now: only a lock still at its path is a dead daemon's.
    if not _same_file(path, fd):
        os.close(fd)
        return None
    return fd


def _unlink_if_ours(path: Path) -> bool:
    try:
        if not _ours(os.lstat(path)):
            return False
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("cannot remove orphan %s: %s", path, exc)
        return False
    return True


def _remove_instance(root: Path, lock_name: str, fd: int) -> list[Path]:
    """Remove a dead instance's regions, then its lock; ``fd`` holds the lock and is closed."""
    removed: list[Path] = []
    try:
        inst = _instance_of_lock(lock_name)
        if inst is not None:
            for region in sorted(root.glob(f"{region_prefix(inst)}*")):
                if _unlink_if_ours(region):
                    removed.append(region)
        if _unlink_if_ours(root / lock_name):
            removed.append(root / lock_name)
    finally:
        os.close(fd)
    return removed


def sweep_orphans(shm_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove the files of dead kvpool daemons from ``shm_dir``.

    A lock file ``kvpool-<inst>.lock`` whose flock can be taken belongs to a dead daemon:
    its regions ``kvpool-<inst>-*`` are removed, then the lock file. Region files of an
    instance with no lock file at all are removed too (a daemon creates its lock before any
    region and removes its regions before its lock). Files of live daemons (lock held),
    files owned by other users and names that do not follow the pattern are left alone.

    Args:
        shm_dir: the shared-memory directory (``/dev/shm``).

    Returns:
        The paths removed, sorted.
    """
    root = Path(shm_dir)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    removed: list[Path] = []
    for name in names:
        inst = _instance_of_lock(name)
        if inst is None:
            continue
        fd = _try_lock_dead(root / name)
        if fd is not None:
            removed += _remove_instance(root, name, fd)
    # Regions with no lock file: their instance died after (or while) its lock was removed.
    for name in sorted(os.listdir(root)):
        inst = _instance_of_region(name)
        if inst is None or lock_path(root, inst).exists():
            continue
        if _unlink_if_ours(root / name):
            removed.append(root / name)
    if removed:
        log.info("removed %d orphaned shared-memory file(s) from %s: %s", len(removed), root,
                 ", ".join(p.name for p in removed))
    return sorted(removed)

"""The hot loop of one id space: the free stack plus the owner array, in C or in numpy.

``IdPool`` keeps the policy (argument checks, per-owner holdings, counters, error text) and
hands the three O(count) loops to a ledger:

- ``take(owner, out)``: the next ``len(out)`` free ids into ``out`` (int32), marked as owner's.
- ``give(owner, ids)``: free ``ids`` if every one is in ``1..N``, held by ``owner`` and listed
  once; returns -1, or a position >= 0 of a bad id (the C ledger gives the first bad position,
  the numpy one 0) with nothing changed.
- ``check(owner, ids)``: what ``give`` would return, changing nothing.
- ``collect(owner, log, out)``: the distinct ids of a list of int32 arrays that ``owner`` holds
  now, into ``out`` (sized to the held count); returns how many (``len(out) + 1`` if more).
  ``Holding`` uses it to read back and compact an owner's log (reclaim in O(held)).

Both work in place on the same two int32 arrays: ``stack`` (N ids, ``stack[head:]`` free) and
``owners`` (N + 2, the lease of each id, 0 when free, sentinels at 0 and N + 1), and both give
ids back in the same LIFO order, so a pool behaves identically on either.

The C ledger (``_ledger.c``, built by ``pip install`` when a compiler is there) does each call
in one pass; the numpy one needs ~9 numpy calls per free. ``KVPOOL_LEDGER=numpy`` forces numpy,
``KVPOOL_LEDGER=native`` makes a missing C build an error; the default, ``auto``, takes C when
it is built.
"""

from __future__ import annotations

import os
from typing import Literal, Protocol

import numpy as np

from kvpool.errors import InvalidArgument

try:
    from kvpoold.alloc._ledger import Ledger as NativeLedger
except ImportError:  # no C compiler at install time: numpy does the same job
    NativeLedger = None

Backend = Literal["native", "numpy"]
BACKENDS: tuple[Backend, ...] = ("native", "numpy")
ENV = "KVPOOL_LEDGER"
# Positions get distinct "pending free" marks -2, -3, ...: a repeated id keeps only one of them.
_TAGS_CACHED = 1 << 16


class Ledger(Protocol):
    """What ``IdPool`` needs from a ledger (see the module docstring)."""

    @property
    def head(self) -> int:
        """Ids in use: ``stack[head:]`` are free."""
        ...

    def take(self, owner: int, out: np.ndarray) -> None: ...

    def give(self, owner: int, ids: np.ndarray) -> int: ...

    def check(self, owner: int, ids: np.ndarray) -> int: ...

    def collect(self, owner: int, log: list[np.ndarray], out: np.ndarray) -> int: ...


def native_available() -> bool:
    """Whether the C ledger was built and imports."""
    return NativeLedger is not None


def default_backend() -> Backend:
    """The backend new pools use: ``$KVPOOL_LEDGER`` (``auto``, ``native``, ``numpy``).

    Raises:
        InvalidArgument: for another value, or ``native`` when the C ledger is not built.
    """
    want = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if want == "auto":
        return "native" if NativeLedger is not None else "numpy"
    return check_backend(want)


def check_backend(backend: str) -> Backend:
    """``backend`` if it is usable here.

    Raises:
        InvalidArgument: an unknown name, or ``native`` without the C build.
    """
    if backend == "numpy":
        return "numpy"
    if backend == "native":
        if NativeLedger is None:
            raise InvalidArgument(
                "allocator ledger 'native' asked for but kvpoold.alloc._ledger is not built; "
                "reinstall with a C compiler (gcc and the Python headers) or set "
                f"{ENV}=numpy",
                field=ENV,
            )
        return "native"
    raise InvalidArgument(
        f"allocator ledger must be one of auto, native, numpy (from ${ENV}), got {backend!r}",
        field=ENV,
    )


def new_ledger(stack: np.ndarray, owners: np.ndarray, backend: Backend) -> Ledger:
    """A ledger over ``stack`` (int32, N) and ``owners`` (int32, N + 2), all ids free."""
    if backend == "native":
        assert NativeLedger is not None, "check_backend first"
        return NativeLedger(stack, owners)  # type: ignore[no-any-return]
    return NumpyLedger(stack, owners)


class NumpyLedger:
    """The ledger in numpy calls; the fallback when ``_ledger.c`` is not built.

    A free is checked with one gather (range and ownership together: out-of-range ids are
    clipped onto a sentinel) and then one distinct negative mark per position written and read
    back (a repeated id kept only one of them).
    """

    def __init__(self, stack: np.ndarray, owners: np.ndarray) -> None:
        self.stack = stack
        self.owners = owners
        self.capacity = stack.shape[0]
        self.head = 0
        self._tags = -2 - np.arange(min(self.capacity, _TAGS_CACHED), dtype=np.int32)
        self._tag_bytes = self._tags.tobytes()

    def take(self, owner: int, out: np.ndarray) -> None:
        head = self.head
        end = head + out.shape[0]
        if end > self.capacity:
            raise ValueError(f"take {out.shape[0]} ids: only {self.capacity - head} free")
        out[:] = self.stack[head:end]
        self.owners[out] = owner
        self.head = end

    def give(self, owner: int, ids: np.ndarray) -> int:
        idx = _index(ids)
        if self._mark(owner, idx) >= 0:
            return 0
        count = idx.shape[0]
        self.owners[idx] = 0
        head = self.head - count
        self.stack[head : self.head] = idx
        self.head = head
        return -1

    def check(self, owner: int, ids: np.ndarray) -> int:
        idx = _index(ids)
        if self._mark(owner, idx) >= 0:
            return 0
        self.owners[idx] = owner  # undo the pending marks
        return -1

    def collect(self, owner: int, log: list[np.ndarray], out: np.ndarray) -> int:
        owners = self.owners
        logged = np.concatenate(log).astype(np.intp, copy=False) if log else np.zeros(0, np.intp)
        mine = logged[owners[logged] == owner]
        # An id freed and handed back to the same owner is logged twice: keep its first copy,
        # as the C ledger does. Each position writes its own mark; a repeated id keeps one.
        marks = -2 - np.arange(mine.shape[0], dtype=np.int32)
        owners[mine] = marks
        repeated = not np.array_equal(owners[mine], marks)
        owners[mine] = owner
        if repeated:
            _, first = np.unique(mine, return_index=True)
            mine = mine[np.sort(first)]
        found = mine.shape[0]
        if found > out.shape[0]:
            return out.shape[0] + 1
        out[:found] = mine
        return found

    def _mark(self, owner: int, idx: np.ndarray) -> int:
        """Mark ``idx`` pending (-1) or change nothing and return 0 (a bad id somewhere)."""
        count = idx.shape[0]
        if count == 0:
            return -1
        owners = self.owners
        if owners.take(idx, mode="clip").tobytes() != np.int32(owner).tobytes() * count:
            return 0
        if count <= self._tags.shape[0]:
            tags, tag_bytes = self._tags[:count], self._tag_bytes[: 4 * count]
        else:
            tags = -2 - np.arange(count, dtype=np.int32)
            tag_bytes = tags.tobytes()
        owners[idx] = tags
        if owners.take(idx).tobytes() != tag_bytes:
            owners[idx] = owner
            return 0
        return -1


def _index(ids: object) -> np.ndarray:
    """``ids`` as intp if it is a 1-D int32/int64 ndarray, else TypeError (as the C ledger)."""
    if type(ids) is not np.ndarray or ids.ndim != 1 or ids.dtype not in _ID_DTYPES:
        raise TypeError("ids must be a 1-D int32 or int64 array")
    return ids.astype(np.intp, copy=False)


_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))

"""The hot loops of one id space: free stack, owner array and per-owner held sets, in C or numpy.

``IdPool`` keeps the policy (argument checks, counters, error text) and hands the O(count)
loops to a ledger:

- ``new_set(owner)``: an empty ``HeldSet`` for ``owner``: the ids it holds, exactly (``len()``
  is how many, ``tobytes()`` the ids as native int32). The ledger alone changes it.
- ``take(owner, out, held)``: the next ``len(out)`` free ids into ``out`` (int32), marked as
  owner's and added to ``held``; returns the new ``head``. ValueError (nothing changed) when
  fewer are free.
- ``give(owner, ids, held)``: free ``ids`` if every one is in ``1..N``, held by ``owner`` and
  listed once, dropping them from ``held``; returns -1, or a position >= 0 of a bad id (the C
  ledger gives the first bad position, the numpy one 0) with nothing changed. TypeError for
  anything but a 1-D int32/int64 array (the caller converts and calls again).
- ``check(owner, ids)``: what ``give`` would return, changing nothing.

The arrays (int32, owned by ``IdPool``): ``stack`` (N ids, ``stack[head:]`` free, handed out
LIFO), ``owners`` (N + 2: the lease of each id, 0 when free, sentinels -1 at 0 and N + 1) and
``slots`` (N + 2: a held id's position in its owner's set). A held set is a sparse set (a free
moves the set's last ids into its holes), so a reclaim reads exactly the owner's ids in
O(held), and every call is O(count), never O(N).

Both ledgers leave every array and every set identical for the same calls
(``tests/unit/test_ledger.py`` runs one program on both). The C ledger (``_ledger.c``, built by
``pip install`` when a compiler is there) does each call in one pass; the numpy one needs ~10
numpy calls per free. ``KVPOOL_LEDGER=numpy`` forces numpy, ``KVPOOL_LEDGER=native`` makes a
missing C build an error; the default, ``auto``, takes C when it is built.
"""

from __future__ import annotations

import os
from typing import Literal, Protocol

import numpy as np

from kvpool.errors import InvalidArgument

try:
    from kvpoold.ids._ledger import Ledger as NativeLedger
except ImportError:  # no C compiler at install time: numpy does the same job
    NativeLedger = None

Backend = Literal["native", "numpy"]
BACKENDS: tuple[Backend, ...] = ("native", "numpy")
ENV = "KVPOOL_LEDGER"
# Positions get distinct "pending free" marks -2, -3, ...: a repeated id keeps only one of them.
_TAGS_CACHED = 1 << 16
# A held set's smallest array, and the size up to which it never shrinks (an owner cycling
# between a few and a few thousand ids must not resize on every call). The C ledger has the
# same two (``_ledger.MIN_ROOM``, ``_ledger.SHRINK_ABOVE``; a test checks they agree).
MIN_ROOM = 16
SHRINK_ABOVE = 1 << 16


class HeldSet(Protocol):
    """The ids one owner holds in one ledger."""

    @property
    def owner(self) -> int: ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def room(self) -> int:
        """Ids its array has room for (it grows by doubling and, past ``SHRINK_ABOVE``, halves
        when three quarters are unused)."""
        ...

    def __len__(self) -> int: ...

    def tobytes(self) -> bytes: ...


class Ledger(Protocol):
    """What ``IdPool`` needs from a ledger (see the module docstring)."""

    @property
    def head(self) -> int:
        """Ids in use: ``stack[head:]`` are free."""
        ...

    def new_set(self, owner: int) -> HeldSet: ...

    def take(self, owner: int, out: np.ndarray, held: HeldSet) -> int:
        """Returns the new ``head``."""
        ...

    def give(self, owner: int, ids: np.ndarray, held: HeldSet) -> int: ...

    def check(self, owner: int, ids: np.ndarray) -> int: ...


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
                "allocator ledger 'native' asked for but kvpoold.ids._ledger is not built; "
                "reinstall with a C compiler (gcc and the Python headers) or set "
                f"{ENV}=numpy",
                field=ENV,
            )
        return "native"
    raise InvalidArgument(
        f"allocator ledger must be one of auto, native, numpy (from ${ENV}), got {backend!r}",
        field=ENV,
    )


def new_ledger(
    stack: np.ndarray, owners: np.ndarray, slots: np.ndarray, backend: Backend
) -> Ledger:
    """A ledger over ``stack`` (int32, N), ``owners`` and ``slots`` (int32, N + 2), all free."""
    if backend == "native":
        assert NativeLedger is not None, "check_backend first"
        return NativeLedger(stack, owners, slots)  # type: ignore[no-any-return]
    return NumpyLedger(stack, owners, slots)


class NumpyHeldSet:
    """``HeldSet`` for the numpy ledger: ``ids[:n]`` are the owner's ids."""

    __slots__ = ("ids", "ledger", "n", "owner")

    def __init__(self, ledger: NumpyLedger, owner: int) -> None:
        self.ledger = ledger
        self.owner = owner
        self.n = 0
        self.ids = np.zeros(MIN_ROOM, dtype=np.int32)

    @property
    def room(self) -> int:
        return self.ids.shape[0]

    def __len__(self) -> int:
        return self.n

    def tobytes(self) -> bytes:
        return self.ids[: self.n].tobytes()

    def resize(self, room: int) -> None:
        ids = np.zeros(room, dtype=np.int32)
        ids[: self.n] = self.ids[: self.n]
        self.ids = ids


class NumpyLedger:
    """The ledger in numpy calls; the fallback when ``_ledger.c`` is not built.

    A free is checked with one gather (range and ownership together: out-of-range ids are
    clipped onto a sentinel) and then one distinct negative mark per position written and read
    back (a repeated id kept only one of them). The held set loses its k ids at once: the ones
    among its last k entries that stay move into the holes the others leave.
    """

    def __init__(self, stack: np.ndarray, owners: np.ndarray, slots: np.ndarray) -> None:
        cap = stack.shape[0]
        if owners.shape != (cap + 2,) or slots.shape != (cap + 2,) or not 1 <= cap < 2**31 - 1:
            raise ValueError(
                f"Ledger needs stack of N in 1..{2**31 - 2} ids, owners of N + 2 and slots of "
                f"N + 2; got N={cap}, owners {owners.shape}, slots {slots.shape}"
            )
        problem = _all_free_problem(stack, owners, slots)
        if problem:
            raise ValueError(f"Ledger needs an all-free id space: {problem}")
        self.stack = stack
        self.owners = owners
        self.slots = slots
        self.capacity = cap
        self.head = 0
        self._tags = -2 - np.arange(min(self.capacity, _TAGS_CACHED), dtype=np.int32)
        self._tag_bytes = self._tags.tobytes()

    def new_set(self, owner: int) -> NumpyHeldSet:
        return NumpyHeldSet(self, owner)

    def take(self, owner: int, out: np.ndarray, held: NumpyHeldSet) -> int:
        self._check_set(owner, held)
        self._refuse_overlap(out, "out")
        count = out.shape[0]
        head = self.head
        end = head + count
        if end > self.capacity:
            raise ValueError(f"take {count} ids: only {self.capacity - head} free")
        top = self.stack[head:end]
        # The stack is a numpy array Python could write: hand out only free ids in range
        # (clipping maps an out-of-range entry onto a sentinel, which is not 0).
        if self.owners.take(top, mode="clip").any():
            bad = (top < 1) | (top > self.capacity)
            bad |= self.owners[np.where(bad, 0, top)] != 0
            i = int(bad.argmax())
            raise RuntimeError(
                f"free stack corrupted: entry {head + i} holds {int(top[i])}, not a free id in "
                f"1..{self.capacity}"
            )
        n = held.n
        if n + count > held.room:
            room = held.room
            while room < n + count:
                room *= 2
            held.resize(room)
        out[:] = self.stack[head:end]
        held.ids[n : n + count] = out
        idx = out.astype(np.intp)  # numpy indexes with intp ~3x faster than with int32
        self.owners[idx] = owner
        self.slots[idx] = np.arange(n, n + count, dtype=np.int32)
        held.n = n + count
        self.head = end
        return end

    def give(self, owner: int, ids: np.ndarray, held: NumpyHeldSet) -> int:
        self._check_set(owner, held)
        idx = _index(ids)
        self._refuse_overlap(ids, "ids")
        count = idx.shape[0]
        if count == 0:
            return -1
        if self._mark(owner, idx) >= 0:
            return 0
        owners, slots, n = self.owners, self.slots, held.n
        pos = slots[idx].astype(np.intp)
        if (pos.min() < 0 or pos.max() >= n or count > self.head
                or held.ids[pos].astype(np.intp).tobytes() != idx.tobytes()):
            owners[idx] = owner  # the owner's by the owner array but not in this set: refuse
            return count
        # The set's last k entries that stay (still marked with the owner: the freed ids carry
        # negative marks) fill the holes the freed ids leave below n - k.
        keep = n - count
        holes = pos[pos < keep]
        if holes.shape[0]:  # none when the ids freed are the ones allocated last
            tail = held.ids[keep:n].astype(np.intp)
            stay = tail[owners[tail] > 0]
            held.ids[holes] = stay
            slots[stay] = holes
        owners[idx] = 0
        head = self.head - count
        self.stack[head : self.head] = idx
        self.head = head
        held.n = keep
        if held.room > SHRINK_ABOVE and keep * 4 <= held.room:
            room = held.room
            while room > MIN_ROOM and keep * 4 <= room:
                room //= 2
            held.resize(room)
        return -1

    def check(self, owner: int, ids: np.ndarray) -> int:
        idx = _index(ids)
        self._refuse_overlap(ids, "ids")
        if self._mark(owner, idx) >= 0:
            return 0
        self.owners[idx] = owner  # undo the pending marks
        return -1

    def _refuse_overlap(self, arr: np.ndarray, name: str) -> None:
        base = arr.base
        if base is None or type(base) is bytes:  # owns its memory, or wraps wire bytes
            return
        if any(np.may_share_memory(arr, own) for own in (self.stack, self.owners, self.slots)):
            raise ValueError(f"{name} shares memory with the ledger's own arrays; pass a copy")

    def _check_set(self, owner: int, held: NumpyHeldSet) -> None:
        if type(held) is not NumpyHeldSet:
            raise TypeError(f"held must be a HeldSet from new_set, got {type(held).__name__}")
        if held.ledger is not self or held.owner != owner:
            whose = "this" if held.ledger is self else "another"
            raise ValueError(
                f"the held set of owner {held.owner} (of {whose} ledger) used for owner {owner}"
            )

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


def _all_free_problem(stack: np.ndarray, owners: np.ndarray, slots: np.ndarray) -> str:
    """What keeps the arrays from being an all-free id space (as ``_ledger.c`` checks), or ""."""
    cap = stack.shape[0]
    arrays = (stack, owners, slots)
    if any(arr.dtype != np.int32 or not arr.flags.c_contiguous or not arr.flags.writeable
           for arr in arrays):
        return "stack, owners and slots must be writable contiguous int32 arrays"
    pairs = ((stack, owners), (stack, slots), (owners, slots))
    if any(np.may_share_memory(a, b) for a, b in pairs):
        return "stack, owners and slots share memory"
    if owners[0] != -1 or owners[cap + 1] != -1:
        return "owners[0] and owners[N + 1] must be the sentinel -1"
    if owners[1 : cap + 1].any():
        return "owners[1..N] must be 0 (free)"
    if stack.min() < 1 or stack.max() > cap or np.unique(stack).shape[0] != cap:
        return "stack must hold each id 1..N once"
    return ""


def _index(ids: object) -> np.ndarray:
    """``ids`` as intp if it is a 1-D int32/int64 ndarray, else TypeError (as the C ledger)."""
    if type(ids) is not np.ndarray or ids.ndim != 1:
        raise TypeError("ids must be a 1-D int32 or int64 array")
    dtype = ids.dtype
    if dtype.kind != "i" or dtype.itemsize not in (4, 8) or not dtype.isnative:
        raise TypeError("ids must be a 1-D int32 or int64 array in native byte order")
    return ids.astype(np.intp, copy=False)

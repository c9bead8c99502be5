"""Hybrid sliding-window pair: a full and an SWA id space allocated together, linked per id.

Every full id handed out gets an SWA id at the same time; ``full_to_swa[full_id] = swa_id`` is
written into the pool's shared mapping buffer, which the engines read. Freeing full ids frees
both sides; ``release_swa`` returns only the SWA side once the window has slid past (the full
page stays held and its mapping entry goes back to 0).

The daemon never reads the shared buffer back: a private copy (``_swa_of``) is the truth, so a
client that scribbles on the shared mapping cannot make the daemon free someone else's pages.

Not thread-safe: the caller (``PoolAllocator``) holds one lock around every call.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvpool.errors import Internal, InvalidArgument
from kvpoold.ids.faults import (
    EMPTY_IDS,
    Fault,
    IdsLike,
    Reason,
    as_ids,
    check_count,
    check_owner,
    fault_error,
    position_label,
    to_index,
)
from kvpoold.ids.space import IdPool


class SwaPair:
    """Full ids ``1..N_full`` each paired with an SWA id ``1..N_swa`` while both are held.

    Args:
        full: the full-attention space; its ids are what callers see.
        swa: the sliding-window space.
        full_to_swa: the shared mapping buffer, a writable 1-D signed-integer array of length
            ``>= full.capacity + 1``; entries ``1..N_full`` are zeroed here, the others (index
            0, a trailing -1) are left alone.
        on_write: called with the (intp) full ids whose entries were just written, under the
            caller's lock; a pool on an accelerator passes a host ``full_to_swa`` and copies
            those entries to the device buffer here (O(count)).

    Raises:
        InvalidArgument: for a mapping of the wrong type, dtype, shape or length, or read-only.
    """

    def __init__(
        self,
        full: IdPool,
        swa: IdPool,
        full_to_swa: np.ndarray,
        on_write: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        need = full.capacity + 1
        problem = None
        if not isinstance(full_to_swa, np.ndarray):
            problem = f"must be a numpy array, got {type(full_to_swa).__name__}"
        elif full_to_swa.ndim != 1 or full_to_swa.dtype.kind != "i":
            problem = f"must be 1-D signed integers, got {full_to_swa.dtype} {full_to_swa.shape}"
        elif full_to_swa.dtype.itemsize < 4:
            problem = f"must hold int32 ids at least, got {full_to_swa.dtype}"
        elif full_to_swa.shape[0] < need:
            problem = f"has {full_to_swa.shape[0]:,} entries, the full space needs {need:,}"
        elif not full_to_swa.flags.writeable:
            problem = "is read-only"
        if problem is not None:
            raise InvalidArgument(
                f"SwaPair {full.name}: full_to_swa {problem} (full ids 1..{full.capacity:,} "
                "index it); pass the pool's full_to_swa view",
                field="full_to_swa",
            )
        self.full = full
        self.swa = swa
        self._shared = full_to_swa
        self._on_write = on_write
        full_to_swa[1:need] = 0
        self._swa_of = np.zeros(need, dtype=np.int32)

    def allocate(self, owner: int, count: int) -> np.ndarray:
        """``count`` full ids, each with an SWA id, all or none.

        Returns:
            The full ids (int32); their SWA ids are in ``full_to_swa``.

        Raises:
            InvalidArgument: bad owner or count.
            ResourceExhausted: either side has fewer than ``count`` free.
        """
        action = f"allocate {self.full.name}"
        owner = check_owner(owner, action)
        count = check_count(count, action)
        if count == 0:
            return EMPTY_IDS
        self.require_free(count, action=action)
        full_ids = self.full.allocate(owner, count)
        swa_ids = self.swa.allocate(owner, count)
        self._link(to_index(full_ids), swa_ids)
        return full_ids

    def require_free(
        self, count: int, *, action: str, field: str = "count", note: str = ""
    ) -> None:
        """Raise unless both sides have ``count`` ids free (see ``IdPool.require_free``)."""
        self.full.require_free(count, action=action, field=field, note=note)
        self.swa.require_free(count, action=action, field=field, note=note)

    def free(self, owner: int, full_ids: IdsLike) -> int:
        """Free full ids and the SWA ids still linked to them; a refusal changes nothing.

        Returns:
            How many full ids were freed.

        Raises:
            InvalidArgument: bad owner, ids dtype/shape, an id out of range or repeated.
            FailedPrecondition: an id not allocated or held by another lease.
        """
        action = f"free {self.full.name}"
        owner, arr, idx = self._checked(owner, full_ids, action)
        fault = self.full.find_fault(owner, idx)
        if fault is not None:
            raise self._error(fault, owner, arr, action, "nothing was freed")
        return self.commit_free(owner, idx)

    def release_swa(self, owner: int, full_ids: IdsLike) -> int:
        """Free only the SWA side of held full ids (the window slid past them).

        Returns:
            How many SWA ids were released.

        Raises:
            InvalidArgument: bad owner, ids dtype/shape, an id out of range or repeated.
            FailedPrecondition: a full id not held by ``owner``, or its SWA side already released.
        """
        action = f"release_swa {self.full.name}"
        owner, arr, idx = self._checked(owner, full_ids, action)
        fault = self.find_fault(owner, idx, np.ones(idx.shape[0], dtype=bool))
        if fault is not None:
            raise self._error(fault, owner, arr, action, "nothing was released")
        return self.commit_release(owner, idx)

    def find_fault(self, owner: int, idx: np.ndarray, release: np.ndarray) -> Fault | None:
        """The first full id of ``idx`` (intp) that ``owner`` may not free, or, where
        ``release`` is True, whose swa side may not be released; None when all are fine.

        Args:
            owner: the lease.
            idx: full ids as ``np.intp``.
            release: per position, True for a release_swa, False for a free.
        """
        fault = self.full.find_fault(owner, idx)
        # Positions before the first ownership fault are in range and held: their link is valid.
        end = idx.shape[0] if fault is None else fault.pos
        gone = release[:end] & (self._swa_of[idx[:end]] == 0)
        if gone.any():
            return Fault(int(gone.argmax()), Reason.SWA_RELEASED)
        return fault

    def commit_free(self, owner: int, idx: np.ndarray) -> int:
        """Free full ids ``idx`` (intp), checked with :meth:`find_fault` under the same lock."""
        swa = self._swa_of[idx]
        linked = swa[swa > 0].astype(np.intp)
        self._unlink(idx)
        self.swa.commit_free(owner, linked)
        return self.full.commit_free(owner, idx)

    def commit_release(self, owner: int, idx: np.ndarray) -> int:
        """Release the SWA side of ``idx`` (intp), checked with :meth:`find_fault` under the
        same lock."""
        swa = self._swa_of[idx].astype(np.intp)
        self._unlink(idx)
        return self.swa.commit_free(owner, swa)

    def reclaim(self, owner: int) -> tuple[int, int]:
        """Free everything ``owner`` holds on both sides; O(held).

        Returns:
            ``(full ids freed, swa ids freed)``.
        """
        full_ids = self.full.reclaim_ids(owner)
        self._unlink(to_index(full_ids))
        return int(full_ids.shape[0]), self.swa.reclaim(owner)

    def swa_of(self, full_ids: IdsLike) -> np.ndarray:
        """The SWA id linked to each full id (0: none), from the daemon's private copy."""
        idx = to_index(as_ids(full_ids, f"swa_of {self.full.name}"))
        self.full.owner_of(idx)  # range check
        return self._swa_of[idx].copy()

    def audit(self) -> None:
        """Check both ledgers and the links in O(N); for tests and debugging.

        Raises:
            Internal: naming the first broken invariant.
        """
        self.full.audit()
        self.swa.audit()
        cap = self.full.capacity
        linked = np.flatnonzero(self._swa_of[1:]) + 1
        swa_ids = self._swa_of[linked]
        full_owner = self.full.owner_of(linked)
        checks = [
            (bool((self._shared[1 : cap + 1] == self._swa_of[1:]).all()), "shared != private"),
            (bool((full_owner > 0).all()), "a free full id has a swa link"),
            (np.unique(swa_ids).shape[0] == swa_ids.shape[0], "a swa id linked twice"),
            (linked.shape[0] == self.swa.stats().used, "linked count != swa used"),
        ]
        if linked.shape[0]:
            same = self.swa.owner_of(swa_ids) == full_owner
            checks.append((bool(same.all()), "full and swa owners differ"))
        for ok, what in checks:
            if not ok:
                raise Internal(f"SwaPair {self.full.name} broken: {what}")

    def _checked(self, owner: int, ids: IdsLike, action: str) -> tuple[int, np.ndarray, np.ndarray]:
        owner = check_owner(owner, action)
        arr = as_ids(ids, action)
        return owner, arr, to_index(arr)

    def _error(
        self, fault: Fault, owner: int, arr: np.ndarray, action: str, done: str
    ) -> Exception:
        label: Callable[[int], str] = position_label()
        return fault_error(
            fault,
            action=action,
            space=self.full.space,
            owner=owner,
            value=int(arr[fault.pos]),
            label=label,
            done=done,
        )

    def _link(self, idx: np.ndarray, swa_ids: np.ndarray) -> None:
        self._swa_of[idx] = swa_ids
        self._shared[idx] = swa_ids
        if self._on_write is not None:
            self._on_write(idx)

    def _unlink(self, idx: np.ndarray) -> None:
        self._swa_of[idx] = 0
        self._shared[idx] = 0
        if self._on_write is not None:
            self._on_write(idx)

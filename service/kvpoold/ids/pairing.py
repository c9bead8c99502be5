"""A leader id space and a following one taken together, linked per id (full -> SWA pages).

Every leader id handed out brings a follower id; ``mapping[leader_id] = follower_id`` is written
into the pool's shared mapping buffer, which the engines read. Freeing leader ids frees both
sides; a release (a free item of the following space) takes leader ids and returns only their
follower ids (the sliding window passed them): the leader id stays held and its entry goes back
to 0.

The daemon never reads the shared buffer back: a private int32 copy (``_link``) is the truth, so
a client that scribbles on the shared mapping cannot make the daemon free someone else's ids.

Not thread-safe and needs no lock: the daemon's event loop owns all allocator state.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvpool.contract.errors import Internal, InvalidArgument, KVPoolError
from kvpoold.ids.faults import FREE, RELEASE, Asked, Fault, Reason, fault_error, position_label
from kvpoold.ids.space import IdSpace, distinct


class Pairing:
    """Leader ids ``1..N_lead`` each linked to a follower id ``1..N_follow`` while both are held.

    Invariant: the follower ids an owner holds are exactly the links of the leader ids it holds
    (the follower space is only ever changed through its pairing).

    Args:
        leader: the space callers allocate and name ids in (``kv``).
        follower: the space that follows it (``swa``).
        mapping: the shared mapping buffer, a writable 1-D signed-integer array of length
            ``>= leader.capacity + 1``; entries ``1..N_lead`` are zeroed here, the others (index
            0, a trailing -1) are left alone.
        on_write: called with the (intp) leader ids whose entries were just written; a pool on an
            accelerator passes a host ``mapping`` and copies those entries to the device here
            (O(count)).

    Raises:
        InvalidArgument: a mapping of the wrong type, dtype, shape or length, or read-only.
    """

    def __init__(
        self,
        leader: IdSpace,
        follower: IdSpace,
        mapping: np.ndarray,
        on_write: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        name = follower.spec.mapping or "mapping"
        need = leader.capacity + 1
        problem = None
        if not isinstance(mapping, np.ndarray):
            problem = f"must be a numpy array, got {type(mapping).__name__}"
        elif mapping.ndim != 1 or mapping.dtype.kind != "i":
            problem = f"must be 1-D signed integers, got {mapping.dtype} {mapping.shape}"
        elif mapping.dtype.itemsize < 4:
            problem = f"must hold int32 ids at least, got {mapping.dtype}"
        elif mapping.shape[0] < need:
            problem = f"has {mapping.shape[0]:,} entries, the {leader.name} space needs {need:,}"
        elif not mapping.flags.writeable:
            problem = "is read-only"
        if problem is not None:
            raise InvalidArgument(
                f"Pairing {leader.label}: {name} {problem} ({leader.name} ids "
                f"1..{leader.capacity:,} index it); pass the pool's {name} view",
                field=name,
            )
        self.leader = leader
        self.follower = follower
        self._shared = mapping
        self._on_write = on_write
        mapping[1:need] = 0
        if on_write is not None:
            on_write(np.arange(1, need, dtype=np.intp))
        self._link = np.zeros(need, dtype=np.int32)

    # -- take -------------------------------------------------------------------------------

    def take(self, owner: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """``count`` leader ids, each with a follower id, all or none.

        Args:
            owner: the lease.
            count: how many, ``>= 0``.

        Returns:
            ``(leader ids, follower ids)``, new int32 arrays; ``follower[k]`` is linked to
            ``leader[k]`` (and written into the mapping).

        Raises:
            ResourceExhausted: either side has fewer than ``count`` free (nothing is taken).
        """
        if count == 0:
            return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
        self.require_free(count)
        lead = self.leader.take(owner, count)
        follow = self.follower.take(owner, count)
        if count == 1:  # scalar writes: the array path costs as much as the two takes
            i = int(lead[0])
            self._link[i] = self._shared[i] = int(follow[0])
            if self._on_write is not None:
                self._on_write(lead.astype(np.intp))
        else:
            self._write(lead.astype(np.intp), follow)
        return lead, follow

    @property
    def room(self) -> int:
        """Leader ids that can be taken now: the smaller side's free count."""
        return min(self.leader.num_free, self.follower.num_free)

    def require_free(
        self, count: int, *, action: str = "", field: str = "count", note: str = ""
    ) -> None:
        """Raise unless both sides have ``count`` ids free (see ``IdSpace.require_free``).

        Args:
            count: leader ids asked for.
            action: what was asked (default ``"allocate <leader label>"``).
            field: the input field of the count.
            note: said right after the count.

        Raises:
            ResourceExhausted: the first side short of ids, named in the message.
        """
        action = action or f"allocate {self.leader.label}"
        self.leader.require_free(count, action=action, field=field, note=note)
        self.follower.require_free(count, action=action, field=field, note=note)

    # -- free and release -------------------------------------------------------------------

    def free(self, owner: int, ids: np.ndarray, asked: Asked = FREE) -> int:
        """Free leader ids and the follower ids still linked to them, all or nothing.

        Args:
            owner: the lease.
            ids: 1-D native int32 leader ids.
            asked: the call, for messages (default action ``"free <leader label>"``).

        Returns:
            How many leader ids were freed.

        Raises:
            InvalidArgument: an id out of range or repeated (nothing changed).
            FailedPrecondition: an id not allocated or held by another lease (nothing changed).
        """
        # The leader's one-pass free checks every id; once it passed, each id was the owner's,
        # so its link (if any) is a follower id the owner holds.
        pinned = self._follower_pinned(ids)
        if pinned >= 0:
            raise self.error(Fault(pinned, Reason.PINNED), owner, ids,
                             asked.action_or(f"free {self.leader.label}"), asked)
        count = self.leader.free(owner, ids, asked)
        if count:
            self._unlink_and_free(owner, ids.astype(np.intp))
        return count

    def release(self, owner: int, ids: np.ndarray, asked: Asked = RELEASE) -> int:
        """Free only the follower side of held leader ids (the window slid past them); the
        arguments and refusals are :meth:`free`'s (default action ``"release <follower
        label>"``), and a leader id whose follower id is already released is refused too
        (FailedPrecondition, nothing changed). Returns how many follower ids were released."""
        idx = ids.astype(np.intp)
        fault = self.check(owner, idx, True)
        if fault is not None:
            raise self.error(fault, owner, ids,
                             asked.action_or(f"release {self.follower.label}"), asked)
        return self.commit_release(owner, idx)

    def check(self, owner: int, idx: np.ndarray, release: np.ndarray | bool) -> Fault | None:
        """The first leader id of ``idx`` that ``owner`` may not free, or, where ``release``,
        whose follower id may not be released; None when all are fine. Changes nothing.

        Args:
            owner: the lease.
            idx: leader ids as a 1-D ``np.intp`` array.
            release: per position (bool array), or for all (bool), True for a release and False
                for a free.

        Returns:
            The first fault in position order, or None.
        """
        fault = self.leader.check(owner, idx)
        # Positions before the first ownership fault are in range and held: their link is valid.
        end = idx.shape[0] if fault is None else fault.pos
        pinned = self._follower_pinned(idx[:end])
        if pinned >= 0:
            return Fault(pinned, Reason.PINNED)
        if release is False:
            return fault
        gone = self._link[idx[:end]] == 0
        if isinstance(release, np.ndarray):
            gone &= release[:end]
        if gone.any():
            return Fault(int(gone.argmax()), Reason.RELEASED)
        return fault

    def _follower_pinned(self, ids: np.ndarray) -> int:
        """The first position of leader ``ids`` whose linked follower id a transfer moves
        (a release or free of it is refused), or -1; nothing at all before any pin."""
        if not self.follower.pinned:
            return -1
        linked = self._link.take(ids.astype(np.intp), mode="clip").astype(np.intp)
        pinned = self.follower.pinned_of(linked) & (linked != 0)
        return int(pinned.argmax()) if pinned.any() else -1

    def commit_free(self, owner: int, idx: np.ndarray) -> int:
        """Free leader ids ``idx`` (intp) and their links, checked with :meth:`check` (as frees)
        with nothing changed since.

        Args:
            owner: the lease.
            idx: leader ids as ``np.intp``.

        Returns:
            How many leader ids were freed.
        """
        if not idx.shape[0]:
            return 0
        self._unlink_and_free(owner, idx)
        return self.leader.commit_free(owner, idx)

    def commit_release(self, owner: int, idx: np.ndarray) -> int:
        """Release the follower side of ``idx`` (leader ids, intp) of ``owner``, checked with
        :meth:`check` (as releases) with nothing changed since; returns how many follower ids
        were released."""
        if not idx.shape[0]:
            return 0
        follow = self._link[idx].astype(np.intp)
        self._write(idx, 0)
        return self.follower.commit_free(owner, follow)

    def _unlink_and_free(self, owner: int, idx: np.ndarray) -> None:
        """Unlink held leader ids ``idx`` (intp) and free the follower ids linked to them."""
        if idx.shape[0] == 1:  # the hot path in scalars: a fifth of the array path's cost
            i = int(idx[0])
            follow = int(self._link[i])
            self._link[i] = self._shared[i] = 0
            if self._on_write is not None:
                self._on_write(idx)
            if follow:
                self.follower.commit_free_one(owner, follow)
            return
        linked = self._link[idx]
        linked = linked[linked != 0].astype(np.intp)
        self._write(idx, 0)
        self.follower.commit_free(owner, linked)

    def error(
        self, fault: Fault, owner: int, ids: np.ndarray, action: str, asked: Asked = FREE
    ) -> KVPoolError:
        """The exception for ``fault`` found in ``ids`` (see ``faults.fault_error``).

        Args:
            fault: from :meth:`check`.
            owner: the lease.
            ids: the leader ids as sent.
            action: what was asked, its default filled in.
            asked: the input field of ``ids`` and what the refused call changed.

        Returns:
            The error to raise.
        """
        return fault_error(
            fault,
            action=action,
            space=self.leader.space,
            owner=owner,
            value=int(ids[fault.pos]),
            label=position_label(asked.field),
            done=asked.done,
            follower=self.follower.space,
        )

    # -- reclaim and queries ----------------------------------------------------------------

    def reclaim(self, owner: int) -> tuple[np.ndarray, np.ndarray]:
        """Free everything ``owner`` holds on both sides; O(held).

        Args:
            owner: the lease.

        Returns:
            ``(leader ids freed, follower ids freed)``, new int32 arrays.

        Raises:
            Internal: a held set disagrees with its owner array (see ``IdSpace.reclaim``).
        """
        held = self.leader.held_ids(owner)  # freed or quarantined below: unlinked either way
        lead = self.leader.reclaim(owner)
        if held.shape[0]:
            self._write(held.astype(np.intp), 0)
        return lead, self.follower.reclaim(owner)

    def paired_of(self, ids: np.ndarray) -> np.ndarray:
        """The follower id linked to each leader id (0: none), from the private copy.

        Args:
            ids: 1-D integer leader ids.

        Returns:
            A new int32 array.

        Raises:
            InvalidArgument: an id outside ``1..N_lead``.
        """
        idx = np.asarray(ids, dtype=np.intp)
        self.leader.owner_of(idx)  # range check
        return self._link[idx]

    def audit(self) -> None:
        """Check both ledgers and the links in O(N); for tests and debugging.

        Raises:
            Internal: naming the first broken invariant.
        """
        self.leader.audit()
        self.follower.audit()
        cap = self.leader.capacity
        linked = np.flatnonzero(self._link[1:]) + 1
        follow = self._link[linked]
        lead_owner = self.leader.owner_of(linked)
        checks = [
            (bool((self._shared[1 : cap + 1] == self._link[1:]).all()), "shared != private"),
            (self._link[0] == 0, "entry 0 linked"),
            (bool((lead_owner > 0).all()), f"a free {self.leader.name} id is linked"),
            (distinct(follow), "a follower id linked twice"),
            (linked.shape[0] == self.follower.used - self.follower.quarantined,
             "linked count != follower ids held by leases"),
        ]
        if linked.shape[0] and all(ok for ok, _ in checks):
            same = self.follower.owner_of(follow) == lead_owner
            checks.append((bool(same.all()), "leader and follower owners differ"))
        for ok, what in checks:
            if not ok:
                raise Internal(f"Pairing {self.leader.label}->{self.follower.name} broken: {what}")

    def _write(self, idx: np.ndarray, values: np.ndarray | int) -> None:
        """Set the links of leader ids ``idx``, private copy first, then the shared buffer."""
        self._link[idx] = values
        self._shared[idx] = values
        if self._on_write is not None:
            self._on_write(idx)

"""The allocator of one pool: its id spaces (kv, swa, req, state) behind one lock, batch calls.

Every call is all-or-nothing: a batch is checked in full (kinds, counts, room, every id of every
item) before anything changes, so a refused call leaves the ledger as it was.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.errors import InvalidArgument
from kvpoold.ids.batch import Item, check_space, commit_space
from kvpoold.ids.faults import (
    INT32_MAX,
    OWNER_MAX,
    IdsLike,
    as_ids,
    check_count,
    check_owner,
)
from kvpoold.ids.ledger import Backend
from kvpoold.ids.pairing import SwaPair
from kvpoold.ids.space import IdPool, PoolCounters


class Kind(enum.StrEnum):
    """An id space of a pool. ``swa`` is never allocated on its own: kv brings it in a hybrid
    pool, and freeing ``swa`` ids means releasing the window part of held kv ids."""

    KV = "kv"
    SWA = "swa"
    REQ = "req"
    STATE = "state"


_KNOWN = ", ".join(k.value for k in Kind)


class PoolAllocator:
    """Ids of one pool, lent to leases: KV pages (or token slots), SWA pages, request rows
    (``req_to_token`` rows) and mamba state slots, each space optional (0 = absent).

    Args:
        name: the pool's name, for messages.
        kv_pages: KV ids ``1..kv_pages`` (pages, or token slots when page_size == 1).
        swa_pages: SWA ids; > 0 makes the pool hybrid, every kv id then comes with a swa id.
        full_to_swa: the shared mapping buffer (required when ``swa_pages > 0``), see ``SwaPair``.
        full_to_swa_on_write: see ``SwaPair`` (device pools mirror the mapping through it).
        req_rows: request rows ``1..max_running_requests``.
        state_slots: mamba state slots.
        backend: the ledger of every space, ``"native"`` or ``"numpy"`` (None: the default, see
            ``ledger.py``).

    Raises:
        InvalidArgument: a negative size, swa without kv or without a mapping, no space at all,
            or an unusable backend.
    """

    def __init__(
        self,
        name: str,
        *,
        kv_pages: int = 0,
        swa_pages: int = 0,
        full_to_swa: np.ndarray | None = None,
        full_to_swa_on_write: Callable[[np.ndarray], None] | None = None,
        req_rows: int = 0,
        state_slots: int = 0,
        backend: Backend | None = None,
    ) -> None:
        self.name = name
        # Guards every IdPool of this pool, the SwaPair and both copies of its mapping. A leaf
        # lock: taken last (after any lease-table lock of the daemon), never held across I/O or
        # while taking another lock; calls under it are O(count) work in the ledger (C, or numpy),
        # microseconds. The C ledger also runs under the GIL and never releases it.
        # Engines read the shared full_to_swa without it: they only read entries of ids they
        # were given, which are written before the allocate call returns.
        self._lock = threading.Lock()
        sizes = {
            "kv_pages": kv_pages,
            "swa_pages": swa_pages,
            "req_rows": req_rows,
            "state_slots": state_slots,
        }
        for field, size in sizes.items():
            check_count(size, f"PoolAllocator {name}", field=field)
        if not any(sizes.values()):
            raise InvalidArgument(
                f"PoolAllocator {name}: every space is empty ({sizes}); give kv_pages at least",
                field="kv_pages",
            )
        self._spaces: dict[Kind, IdPool] = {}
        self._pair: SwaPair | None = None
        if kv_pages:
            self._spaces[Kind.KV] = IdPool(kv_pages, f"{name}/kv", unit="pages", backend=backend)
        if swa_pages:
            if not kv_pages or full_to_swa is None:
                raise InvalidArgument(
                    f"PoolAllocator {name}: swa_pages={swa_pages} needs kv_pages > 0 (got "
                    f"{kv_pages}) and the full_to_swa mapping (got {type(full_to_swa).__name__})",
                    field="swa_pages",
                )
            swa = IdPool(
                swa_pages,
                f"{name}/swa",
                unit="pages",
                knob="budget_bytes or swa_full_tokens_ratio",
                backend=backend,
            )
            self._pair = SwaPair(self._spaces[Kind.KV], swa, full_to_swa, full_to_swa_on_write)
            self._spaces[Kind.SWA] = swa
        if req_rows:
            self._spaces[Kind.REQ] = IdPool(
                req_rows, f"{name}/req", unit="rows", knob="max_running_requests", backend=backend
            )
        if state_slots:
            self._spaces[Kind.STATE] = IdPool(
                state_slots,
                f"{name}/state",
                unit="slots",
                knob="budget_bytes or mamba_full_memory_ratio",
                backend=backend,
            )

        # Item kinds accepted as given (a Kind or its value), for the batch fast paths.
        self._alloc_kinds: dict[str, Kind] = {k.value: k for k in self._spaces if k is not Kind.SWA}
        self._free_kinds: dict[str, Kind] = {k.value: k for k in self._spaces}

    @property
    def kinds(self) -> tuple[Kind, ...]:
        """The spaces this pool has."""
        return tuple(self._spaces)

    # -- allocate ----------------------------------------------------------------------------

    def allocate_batch(
        self, owner: int, items: Sequence[tuple[Kind | str, int]]
    ) -> list[np.ndarray]:
        """Allocate several ``(kind, count)`` requests for ``owner``, all or none.

        A count of 0 is allowed and gets an empty array. Room is checked per kind for the sum
        of the batch's counts before anything is taken.

        Args:
            owner: the lease, ``>= 1``.
            items: ``(kind, count)`` pairs; a kind may appear more than once.

        Returns:
            One int32 id array per item, in order (kv ids of a hybrid pool each have a swa id
            in ``full_to_swa``).

        Raises:
            InvalidArgument: bad owner, malformed item, unknown or absent kind, ``swa``, bad count.
            ResourceExhausted: a kind (or the swa side of kv) has too few free; names the item.
        """
        action = f"allocate_batch {self.name}"
        with self._lock:
            if type(owner) is not int or not 0 < owner <= OWNER_MAX:
                owner = check_owner(owner, action)
            parsed: list[tuple[Kind, int]] = []
            totals: dict[Kind, int] = {}
            for i, item in enumerate(items):
                kind, count = (
                    item
                    if type(item) is tuple and len(item) == 2
                    else _unpack(item, i, action, "count")
                )
                parsed_kind: Kind | None = (
                    self._alloc_kinds.get(kind) if isinstance(kind, str) else None
                )
                if parsed_kind is None:
                    parsed_kind = self._kind(kind, i, action, allocating=True)
                if type(count) is not int or not 0 <= count <= INT32_MAX:
                    count = check_count(count, action, field=f"items[{i}].count")
                parsed.append((parsed_kind, count))
                if count:
                    total = totals[parsed_kind] = totals.get(parsed_kind, 0) + count
                    if total > self._room(parsed_kind):
                        self._refuse(parsed_kind, total, count, i, action)
            return [self._allocate(owner, kind, count) for kind, count in parsed]

    # -- free --------------------------------------------------------------------------------

    def free_batch(
        self, owner: int, items: Sequence[tuple[Kind | str, IdsLike]]
    ) -> dict[Kind, int]:
        """Free several ``(kind, ids)`` items of ``owner``; all are checked before any is freed.

        ``kv`` frees the ids (and, in a hybrid pool, their swa ids); ``swa`` takes kv ids and
        releases only their swa side. An id may appear once per space in the whole batch (kv
        and swa items share the kv id space).

        Args:
            owner: the lease that holds the ids.
            items: ``(kind, ids)`` pairs; ids are 1-D integer arrays or sequences.

        Returns:
            Ids freed per kind of the items (kv: kv ids, swa: swa ids released).

        Raises:
            InvalidArgument: bad owner, malformed item, unknown or absent kind, bad ids dtype or
                shape, an id out of range or repeated anywhere in its space.
            FailedPrecondition: an id not allocated, held by another lease, or (swa) already
                released. The message names the item and position of the first bad id.
        """
        action = f"free_batch {self.name}"
        with self._lock:
            if type(owner) is not int or not 0 < owner <= OWNER_MAX:
                owner = check_owner(owner, action)
            groups: dict[Kind, list[Item]] = {}
            for i, item in enumerate(items):
                kind, ids = (
                    item
                    if type(item) is tuple and len(item) == 2
                    else _unpack(item, i, action, "ids")
                )
                parsed: Kind | None = self._free_kinds.get(kind) if isinstance(kind, str) else None
                if parsed is None:
                    parsed = self._kind(kind, i, action, allocating=False)
                if type(ids) is np.ndarray and ids.ndim == 1 and ids.dtype.kind in "iu":
                    arr = ids
                else:
                    arr = as_ids(ids, action, field=f"items[{i}].ids")
                space: Kind = Kind.KV if parsed is Kind.SWA else parsed
                release = parsed is Kind.SWA
                groups.setdefault(space, []).append(Item(i, parsed, release, arr))
            checks = [
                check_space(self._spaces[space], self._pair_of(space), owner, group, action)
                for space, group in groups.items()
            ]
            refused = [c for c in checks if c.error is not None]
            if refused:
                raise min(refused, key=lambda c: c.first).error  # type: ignore[misc]
            freed: dict[Kind, int] = {}
            for space, check in zip(groups, checks, strict=True):
                n_freed, n_released = commit_space(check, owner)
                if n_freed is not None:
                    freed[space] = n_freed
                if n_released is not None:
                    freed[Kind.SWA] = n_released
            return freed

    # -- reclaim and queries -----------------------------------------------------------------

    def reclaim(self, owner: int) -> dict[Kind, int]:
        """Free everything ``owner`` holds in every space (a lease that ended or crashed).

        Returns:
            Ids freed per kind, every kind of the pool listed (0 when none were held).

        Raises:
            InvalidArgument: bad owner.
        """
        with self._lock:
            owner = check_owner(owner, f"reclaim {self.name}")
            out: dict[Kind, int] = {}
            for kind, pool in self._spaces.items():
                if kind is Kind.KV and self._pair is not None:
                    out[Kind.KV], out[Kind.SWA] = self._pair.reclaim(owner)
                elif kind is not Kind.SWA:
                    out[kind] = pool.reclaim(owner)
            return out

    def stats(self) -> dict[Kind, PoolCounters]:
        """Counters per kind, all taken under the lock at one instant."""
        with self._lock:
            return {kind: pool.stats() for kind, pool in self._spaces.items()}

    def held_by_owner(self) -> dict[int, dict[Kind, int]]:
        """``{owner: {kind: ids held}}`` for every owner holding something (zeros left out)."""
        with self._lock:
            out: dict[int, dict[Kind, int]] = {}
            for kind, pool in self._spaces.items():
                for owner, held in pool.holders().items():
                    out.setdefault(owner, {})[kind] = held
            return out

    def swa_of(self, full_ids: IdsLike) -> np.ndarray:
        """The swa id linked to each kv id (0: released) of a hybrid pool.

        Raises:
            InvalidArgument: the pool is not hybrid, or bad ids.
        """
        with self._lock:
            return self._hybrid(f"swa_of {self.name}", "ids").swa_of(full_ids)

    def audit(self) -> None:
        """Check every ledger of the pool in O(N); for tests and debugging.

        Raises:
            Internal: naming the first broken invariant.
        """
        with self._lock:
            for kind, pool in self._spaces.items():
                if self._pair is None or kind not in (Kind.KV, Kind.SWA):
                    pool.audit()
            if self._pair is not None:
                self._pair.audit()

    # -- internals ---------------------------------------------------------------------------

    def _allocate(self, owner: int, kind: Kind, count: int) -> np.ndarray:
        if kind is Kind.KV and self._pair is not None:
            return self._pair.allocate(owner, count)
        return self._spaces[kind].allocate(owner, count)

    def _pair_of(self, space: Kind) -> SwaPair | None:
        """The hybrid pair behind ``space`` (kv of a hybrid pool), else None."""
        return self._pair if space is Kind.KV else None

    def _room(self, kind: Kind) -> int:
        """Ids of ``kind`` free now (kv of a hybrid pool: the smaller side)."""
        room = self._spaces[kind].num_free
        if kind is Kind.KV and self._pair is not None:
            room = min(room, self._pair.swa.num_free)
        return room

    def _refuse(self, kind: Kind, total: int, count: int, i: int, action: str) -> None:
        """Raise ResourceExhausted for batch item ``i`` (``total``: the batch's sum so far)."""
        note = "" if total == count else f" in all (items of kind {kind} up to {i})"
        where = f"{action} items[{i}] ({kind})"
        field = f"items[{i}].count"
        if kind is Kind.KV and self._pair is not None:
            self._pair.require_free(total, action=where, field=field, note=note)
        self._spaces[kind].require_free(total, action=where, field=field, note=note)
        raise AssertionError("unreachable: require_free raised")

    def _kind(self, kind: object, i: int, action: str, *, allocating: bool) -> Kind:
        """The batch item's kind, checked against the pool's spaces."""
        field = f"items[{i}].kind"
        try:
            if not isinstance(kind, str):
                raise TypeError(kind)
            parsed = Kind(kind)
        except (ValueError, TypeError):
            raise InvalidArgument(
                f"{action}: {field}={kind!r} is not a kind; known: {_KNOWN}", field=field
            ) from None
        if parsed is Kind.SWA:
            if allocating:
                raise InvalidArgument(
                    f"{action}: {field}=swa cannot be allocated on its own: allocate kv, which "
                    "brings a swa page per kv page in a hybrid pool",
                    field=field,
                )
            self._hybrid(action, field)
        elif parsed not in self._spaces:
            raise InvalidArgument(
                f"{action}: {field}={parsed.value}: pool {self.name} has no {parsed.value} space "
                f"(it has: {', '.join(self._spaces)}); Configure it with one",
                field=field,
            )
        return parsed

    def _hybrid(self, action: str, field: str) -> SwaPair:
        if self._pair is None:
            raise InvalidArgument(
                f"{action}: pool {self.name} is not a hybrid sliding-window pool, it has no swa "
                f"pages (it has: {', '.join(self._spaces)})",
                field=field,
            )
        return self._pair


def _unpack(item: object, i: int, action: str, second: str) -> tuple[object, object]:
    """Unpack a batch item given as a list (or refuse a malformed one)."""
    if isinstance(item, tuple | list) and len(item) == 2:
        return item[0], item[1]
    raise InvalidArgument(
        f"{action}: items[{i}] must be a (kind, {second}) pair, got {item!r:.60}",
        field=f"items[{i}]",
    )

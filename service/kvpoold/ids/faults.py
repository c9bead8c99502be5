"""Argument checks and error text shared by the allocators (owners, counts, id arrays, faults)."""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.errors import FailedPrecondition, InvalidArgument, KVPoolError

# Owners and ids live in int32 arrays (ids also travel as little-endian int32 on the wire).
INT32_MAX = (1 << 31) - 1
OWNER_MAX = INT32_MAX
# The largest pool: ids 1..N plus the two sentinel slots 0 and N + 1 must stay int32-indexable.
CAPACITY_MAX = INT32_MAX - 1

IdsLike = np.ndarray | Sequence[int]
EMPTY_IDS: np.ndarray = np.zeros(0, dtype=np.int32)
EMPTY_IDS.flags.writeable = False


def check_owner(owner: object, action: str) -> int:
    """The owner as an int in ``1..OWNER_MAX`` (lease ids; 0 marks a free id).

    Args:
        owner: a lease id.
        action: what was asked, for the message (``"allocate llama/kv"``).

    Returns:
        The owner as a Python int.

    Raises:
        InvalidArgument: for a bool, a non-integer or a value outside ``1..OWNER_MAX``.
    """
    if type(owner) is int and 0 < owner <= OWNER_MAX:
        return owner
    value = _as_int(owner)
    if value is None or not 0 < value <= OWNER_MAX:
        raise InvalidArgument(
            f"{action}: owner must be a lease id in 1..{OWNER_MAX} (0 means free), got {owner!r}",
            field="owner",
        )
    return value


def check_count(count: object, action: str, field: str = "count") -> int:
    """The count as an int in ``0..INT32_MAX``; 0 is allowed and asks for nothing.

    Args:
        count: how many ids are asked for.
        action: what was asked, for the message.
        field: the input field (``"count"``, ``"items[2].count"``).

    Returns:
        The count as a Python int.

    Raises:
        InvalidArgument: for a bool, a non-integer, a negative count or one past int32.
    """
    if type(count) is int and 0 <= count <= INT32_MAX:
        return count
    value = _as_int(count)
    if value is None:
        raise InvalidArgument(f"{action}: count must be an integer, got {count!r}", field=field)
    if value < 0:
        raise InvalidArgument(f"{action}: count must be >= 0, got {value}", field=field)
    if value > INT32_MAX:
        raise InvalidArgument(
            f"{action}: count {value:,} is past the int32 id space ({INT32_MAX:,}); "
            "ask for what one request needs",
            field=field,
        )
    return value


def as_ids(ids: object, action: str, field: str = "ids") -> np.ndarray:
    """The ids as a 1-D integer ndarray, without a copy when they already are one.

    Args:
        ids: an integer ndarray or a sequence of ints.
        action: what was asked, for the message.
        field: the input field (``"ids"``, ``"items[1].ids"``).

    Returns:
        A 1-D ndarray of a signed or unsigned integer dtype (an empty input gives an empty int32
        array whatever its dtype).

    Raises:
        InvalidArgument: for a non-integer dtype (bool and float included) or a shape that is not
            1-D.
    """
    if type(ids) is np.ndarray:
        arr = ids
    else:
        try:
            arr = np.asarray(ids)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidArgument(
                f"{action}: {field} must be a 1-D sequence of integer ids, got {type(ids).__name__}"
                f" ({exc})",
                field=field,
            ) from exc
    if arr.ndim != 1:
        raise InvalidArgument(
            f"{action}: {field} must be a 1-D array of ids, got shape {arr.shape}", field=field
        )
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return EMPTY_IDS
        raise InvalidArgument(
            f"{action}: {field} must hold integers (int32 on the wire), got dtype {arr.dtype}",
            field=field,
        )
    return arr


def to_index(arr: np.ndarray) -> np.ndarray:
    """``arr`` as a contiguous ``np.intp`` array: the dtype numpy fancy indexing uses without a
    cast per call, and a layout the C ledger reads (a strided int64 view is copied).

    Unsigned values past int64 wrap to negatives, which the range checks then refuse.
    """
    return np.ascontiguousarray(arr, dtype=np.intp)


class Reason(enum.Enum):
    """Why one id of a free (or SWA release) was refused."""

    OUT_OF_RANGE = "out of range"
    REPEATED = "repeated"
    NOT_ALLOCATED = "not allocated"
    OTHER_OWNER = "held by another lease"
    SWA_RELEASED = "swa already released"


@dataclass(frozen=True, slots=True)
class Fault:
    """The first bad id of a request: its position, why, and what the error text needs.

    ``holder`` is the lease holding the id (OTHER_OWNER); ``first`` the earlier position of the
    same id (REPEATED).
    """

    pos: int
    reason: Reason
    holder: int = 0
    first: int = -1


@dataclass(frozen=True, slots=True)
class Space:
    """What an error message says about an id space: its name, size and unit."""

    name: str
    capacity: int
    unit: str


def first_fault(owners: np.ndarray, owner: int, idx: np.ndarray) -> Fault | None:
    """The first id of a free request that ``owner`` may not free, or None when all may be.

    Each position in order must be in range, not a repeat of an earlier position, allocated,
    and held by ``owner``; the first position failing any of these is reported with the first
    rule it fails. Pure; O(k log k) in the request size k.

    Args:
        owners: an ``IdPool`` owner array: ids ``1..N`` at ``1..N`` (``<= 0``: free), N + 2 long.
        owner: the lease asking.
        idx: the requested ids as ``np.intp``.
    """
    count = idx.shape[0]
    if count == 0:
        return None
    in_range = (idx >= 1) & (idx <= owners.shape[0] - 2)
    holder = owners[np.where(in_range, idx, 0)]
    _, first_at, inverse = np.unique(idx, return_index=True, return_inverse=True)
    first = first_at[inverse]
    repeated = first != np.arange(count)
    bad = ~in_range | repeated | (holder != owner)
    if not bad.any():
        return None
    pos = int(bad.argmax())
    if not in_range[pos]:
        return Fault(pos, Reason.OUT_OF_RANGE)
    if repeated[pos]:
        return Fault(pos, Reason.REPEATED, first=int(first[pos]))
    if holder[pos] <= 0:
        return Fault(pos, Reason.NOT_ALLOCATED)
    return Fault(pos, Reason.OTHER_OWNER, holder=int(holder[pos]))


def fault_error(
    fault: Fault,
    *,
    action: str,
    space: Space,
    owner: int,
    value: int,
    label: Callable[[int], str],
    done: str = "nothing was freed",
) -> KVPoolError:
    """The exception for ``fault``: InvalidArgument for malformed ids, FailedPrecondition for ids
    the state forbids.

    Args:
        fault: from ``IdPool.find_fault`` (or the SWA check).
        action: what was asked (``"free llama/kv"``).
        space: the id space the ids belong to.
        owner: the lease that asked.
        value: the bad id as the caller sent it.
        label: position in the request -> input field (``3 -> "ids[3]"``).
        done: what the failed call changed (nothing).

    Returns:
        The error to raise, with ``field`` set to the bad id's position.
    """
    where = label(fault.pos)
    head = f"{action} {where}={value}"
    cls: type[KVPoolError]
    match fault.reason:
        case Reason.OUT_OF_RANGE:
            cls = InvalidArgument
            why = (
                f"out of range: {space.name} {space.unit} are 1..{space.capacity} "
                "(0 is reserved and never handed out)"
            )
        case Reason.REPEATED:
            cls = InvalidArgument
            why = f"repeated (also at {label(fault.first)}); list each id once"
        case Reason.NOT_ALLOCATED:
            cls = FailedPrecondition
            why = (
                f"not allocated (already free: a double free?); free only ids lease {owner} was "
                "given and still holds"
            )
        case Reason.OTHER_OWNER:
            cls = FailedPrecondition
            why = f"held by another lease (owner {fault.holder}), not by lease {owner}"
        case Reason.SWA_RELEASED:
            cls = FailedPrecondition
            why = (
                "its swa page was already released; free it as kv to return the full page, "
                "release each swa page once"
            )
    return cls(f"{head}: {why}; {done}", field=where)


def position_label(field: str = "ids") -> Callable[[int], str]:
    """``pos -> "ids[pos]"``, the label of a single-array request."""
    return lambda pos: f"{field}[{pos}]"


def _as_int(value: object) -> int | None:
    """``value`` as an int if it is an integer (numpy scalars included) and not a bool."""
    if isinstance(value, bool | np.bool_):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None

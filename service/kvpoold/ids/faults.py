"""Fault diagnosis and error text of the allocators: why an id of a free was refused."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvpool.contract.errors import FailedPrecondition, InvalidArgument, KVPoolError
from kvpool.contract.id_checks import FIRST_STEP, MAX_STEP, Why, first_bad_id

# Owners and ids live in int32 arrays (ids also travel as little-endian int32 on the wire).
INT32_MAX = (1 << 31) - 1
OWNER_MAX = INT32_MAX - 2
# The owner of ids whose lease ended while a transfer was moving them (``IdSpace.reclaim``):
# they are neither free nor any lease's until the last transfer unpins them.
QUARANTINE = INT32_MAX
# The owner of sealed pages no lease holds (``kvpoold.pools.sealed``): complete KV kept for the
# next engine to adopt, given back under pressure before any live page.
DIRECTORY = INT32_MAX - 1
# The largest space: ids 1..N plus the two sentinel slots 0 and N + 1 must stay int32-indexable.
CAPACITY_MAX = INT32_MAX - 1


class Reason(enum.Enum):
    """Why one id of a free (or of a release in a following space) was refused."""

    OUT_OF_RANGE = "out of range"
    REPEATED = "repeated"
    NOT_ALLOCATED = "not allocated"
    OTHER_OWNER = "held by another lease"
    RELEASED = "already released"
    PINNED = "in a transfer in flight"


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
class Asked:
    """What a call asked, for the text of its refusals.

    ``action`` names the call (``"free llama (kv)"``; empty: the space's own default, such as
    ``"free <label>"``), ``field`` the input field of its ids (``"items[2].ids"``), and ``done``
    what a refused call changed.
    """

    action: str = ""
    field: str = "ids"
    done: str = "nothing was freed"

    def action_or(self, default: str) -> str:
        """The action, or ``default`` when none was given."""
        return self.action or default


FREE = Asked()
RELEASE = Asked(done="nothing was released")


@dataclass(frozen=True, slots=True)
class Space:
    """What an error message says about an id space: its label (``"llama/kv"``), size, unit."""

    name: str
    capacity: int
    unit: str


def first_fault(owners: np.ndarray, owner: int, idx: np.ndarray, *,
                first_step: int = FIRST_STEP, max_step: int = MAX_STEP) -> Fault | None:
    """The first id of a free request that ``owner`` may not free, or None when all may be.

    Each position in order must be in range, not a repeat of an earlier position, allocated,
    and held by ``owner``; the first position failing any of these is reported with the first
    rule it fails. The rules and the steps are the contract's (``first_bad_id``, which the
    client's page cache calls too): O(position of the fault), nothing of the space's size, and
    ``owners`` is only read.

    Args:
        owners: an ``IdSpace`` owner array: ids ``1..N`` at ``1..N`` (0: free; the sentinel
            slots 0 and N + 1 hold a negative value no owner has), N + 2 long.
        owner: the lease asking (positive).
        idx: the requested ids (any integer dtype).
        first_step: positions looked at first (then twice as many each step).
        max_step: the most positions one step adds.

    Returns:
        The first fault, or None.
    """
    bad = first_bad_id(idx, owners.shape[0] - 2, lambda ids: owners[ids] == owner,
                       first_step=first_step, max_step=max_step)
    if bad is None:
        return None
    if bad.why is Why.OUT_OF_RANGE:
        return Fault(bad.pos, Reason.OUT_OF_RANGE)
    if bad.why is Why.REPEATED:
        return Fault(bad.pos, Reason.REPEATED, first=bad.first)
    holder = int(owners[int(idx[bad.pos])])
    if holder <= 0:
        return Fault(bad.pos, Reason.NOT_ALLOCATED)
    return Fault(bad.pos, Reason.OTHER_OWNER, holder=holder)


def fault_error(
    fault: Fault,
    *,
    action: str,
    space: Space,
    owner: int,
    value: int,
    label: Callable[[int], str],
    done: str = "nothing was freed",
    follower: Space | None = None,
) -> KVPoolError:
    """The exception for ``fault``: InvalidArgument for malformed ids, FailedPrecondition for ids
    the state forbids.

    Args:
        fault: from ``first_fault`` (or the release check of a ``Pairing``).
        action: what was asked (``"free llama/kv"``).
        space: the id space the ids belong to (a leader's for a release).
        owner: the lease that asked.
        value: the bad id as the caller sent it.
        label: position in the request -> input field (``3 -> "ids[3]"``).
        done: what the failed call changed (nothing).
        follower: the following space of a release (names it in a RELEASED message).

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
                "not allocated (already free: a double free?); free only ids this lease was "
                "given and still holds"
            )
        case Reason.OTHER_OWNER if fault.holder == QUARANTINE:
            cls = FailedPrecondition
            why = ("quarantined: its lease ended while a transfer was moving it, and it comes "
                   "back free when that transfer ends")
        case Reason.PINNED:
            cls = FailedPrecondition
            why = ("pinned by a transfer in flight (a receive grant or a send of this lease); "
                   "free it once WaitTransfer says the transfer ended")
        case Reason.OTHER_OWNER:
            cls = FailedPrecondition
            # Owners are internal numbers: messages name no owner (the caller knows its own
            # lease id; Stats says which lease holds what).
            why = "held by another lease, not by this one"
        case Reason.RELEASED:
            cls = FailedPrecondition
            lead, lead_unit = short_name(space.name), singular(space.unit)
            name = "paired" if follower is None else short_name(follower.name)
            unit = lead_unit if follower is None else singular(follower.unit)
            why = (
                f"its {name} {unit} was already released; free it as {lead} to return the "
                f"full {lead_unit}, release each {name} {unit} once"
            )
    return cls(f"{head}: {why}; {done}", field=where)


def position_label(field: str = "ids") -> Callable[[int], str]:
    """``pos -> "ids[pos]"``, the label of a single-array request.

    Args:
        field: the input field of the array (``"items[2].ids"``).

    Returns:
        The labelling function.
    """
    return lambda pos: f"{field}[{pos}]"


def singular(unit: str) -> str:
    """``"pages" -> "page"``: one id of a space, for messages.

    Args:
        unit: the space's unit, plural.

    Returns:
        The unit without its plural ``s`` (unchanged when it has none).
    """
    return unit[:-1] if unit.endswith("s") and len(unit) > 1 else unit


def short_name(label: str) -> str:
    """``"llama/swa" -> "swa"``: a space's own name from its label.

    Args:
        label: a space label, ``pool/name`` or just the name.

    Returns:
        The part after the last ``/``.
    """
    return label.rsplit("/", 1)[-1]

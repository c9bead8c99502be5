"""The first bad id of a request to give ids back: the one check the daemon's id spaces and the
client's page cache both make when they refuse a free.

Both refuse a free whose ids are not each in range, listed once, and in a state that allows it
(held by the lease asking, in the daemon; handed out and not freed, in a page cache). Their
fast paths check all ids at once in their own way; when one refuses, :func:`first_bad_id`
says which position is at fault and why, the same way on both sides.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# A diagnosis looks at the request in steps, growing from FIRST_STEP to MAX_STEP positions, and
# stops at the first step holding a fault: a refusal whose bad id comes early costs O(step),
# one whose bad id comes late O(p) in its position p (the ids before it are good ones).
FIRST_STEP = 1 << 12
MAX_STEP = 1 << 20


class Why(enum.Enum):
    """Which rule the first bad id breaks (they are checked in this order)."""

    OUT_OF_RANGE = "out of range"
    REPEATED = "repeated"
    STATE = "not in a state that allows it"


@dataclass(frozen=True, slots=True)
class BadId:
    """The first bad position of a request, the rule it breaks, and (REPEATED) the earlier
    position of the same id."""

    pos: int
    why: Why
    first: int = -1


def first_bad_id(idx: np.ndarray, capacity: int, allowed: Callable[[np.ndarray], np.ndarray],
                 *, first_step: int = FIRST_STEP, max_step: int = MAX_STEP) -> BadId | None:
    """The first position of ``idx`` that is out of ``1..capacity``, repeats an earlier
    position, or whose id ``allowed`` refuses; None when there is none.

    Each position in order is checked against the three rules in that order, and the first
    position failing any is reported with the first rule it fails. Positions are read in steps
    (``first_step``, then twice as many each step up to ``max_step``) that stop at the first
    step holding a fault, so a request whose first id is bad costs one small step whatever its
    length. Repeats are found by tagging each good id with its first position in a zeroed
    scratch (touched only where the request's ids fall); nothing of the caller's is written.

    Args:
        idx: the requested ids, 1-D, any integer dtype (an unsigned id past ``2**63`` reads
            as negative: out of range).
        capacity: ids are ``1..capacity``.
        allowed: in-range ids (``np.intp``) -> a bool array, True where the id's state allows
            the request (the caller's own rule: held by this lease, handed out by this cache).
        first_step: positions looked at first.
        max_step: the most positions one step adds.

    Returns:
        The first bad position, or None.
    """
    count = idx.shape[0]
    # The tag of position p: base + p, negative, an earlier position's the smaller one. The
    # scratch is zeroed memory the OS maps as it is touched: a request pays for the pages its
    # ids fall on, not for the space.
    base = -(count + 2)
    tags = np.zeros(capacity + 2, dtype=np.int64 if count >= 1 << 30 else np.int32)
    done, step = 0, first_step
    while done < count:
        end = min(count, done + step)
        ids = idx[done:end].astype(np.intp)
        ok = (ids >= 1) & (ids <= capacity)
        ok[ok] = allowed(ids[ok])
        stop = int(ok.argmin()) if not ok.all() else end - done
        # The good run before the first other position: tag its ids (``minimum.at``: the
        # earliest position wins); a position reading back another's tag repeats it.
        run = ids[:stop]
        mine = np.arange(base + done, base + done + stop, dtype=tags.dtype)
        np.minimum.at(tags, run, mine)
        again = tags[run] != mine
        if again.any():
            i = int(again.argmax())
            return BadId(done + i, Why.REPEATED, first=int(tags[run[i]]) - base)
        if stop < end - done:
            value = int(ids[stop])
            if not 1 <= value <= capacity:
                return BadId(done + stop, Why.OUT_OF_RANGE)
            if tags[value]:
                return BadId(done + stop, Why.REPEATED, first=int(tags[value]) - base)
            return BadId(done + stop, Why.STATE)
        done, step = end, min(2 * step, max_step)
    return None

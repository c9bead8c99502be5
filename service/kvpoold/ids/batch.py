"""One id space's share of a free batch: check every id of its items, then apply them together."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpool.errors import KVPoolError
from kvpoold.ids.faults import Fault, fault_error, to_index
from kvpoold.ids.pairing import SwaPair
from kvpoold.ids.space import IdPool


@dataclass(frozen=True, slots=True)
class Item:
    """One ``(kind, ids)`` item of a free batch.

    ``index`` is its position in the batch, ``kind`` its name for messages, ``release`` True
    for a swa release (kv ids whose swa side goes back) rather than a free.
    """

    index: int
    kind: str
    release: bool
    ids: np.ndarray


@dataclass(frozen=True, slots=True)
class SpaceCheck:
    """The checked items of one space: the ids in item order (``np.intp``), which positions
    are swa releases (None: none can be), and the first bad id's ``(item, position)`` and
    error (None when every id is fine)."""

    pool: IdPool
    pair: SwaPair | None
    idx: np.ndarray
    release: np.ndarray | None
    first: tuple[int, int]
    error: KVPoolError | None


def check_space(
    pool: IdPool, pair: SwaPair | None, owner: int, items: list[Item], action: str
) -> SpaceCheck:
    """Check the items of one space as one request (a repeat across items is a repeat).

    Args:
        pool: the space's ids (the full side for a hybrid kv space).
        pair: the hybrid pair when the space is hybrid kv, else None.
        owner: the lease freeing.
        items: the batch's items of this space, in batch order.
        action: what was asked, for messages (``"free_batch llama"``).

    Returns:
        The check; nothing was changed.
    """
    if len(items) == 1:
        idx = to_index(items[0].ids)
    else:
        idx = np.concatenate([to_index(item.ids) for item in items])
    release = None
    fault: Fault | None
    if pair is not None:
        release = np.concatenate([np.full(item.ids.shape[0], item.release) for item in items])
        fault = pair.find_fault(owner, idx, release)
    else:
        fault = pool.find_fault(owner, idx)
    if fault is None:
        return SpaceCheck(pool, pair, idx, release, (0, 0), None)
    starts = np.cumsum([0, *(item.ids.shape[0] for item in items)])

    def where(pos: int) -> tuple[Item, int]:
        g = int(np.searchsorted(starts, pos, side="right")) - 1
        return items[g], pos - int(starts[g])

    def label(pos: int) -> str:
        item, j = where(pos)
        return f"items[{item.index}].ids[{j}]"

    item, local = where(fault.pos)
    error = fault_error(
        fault,
        action=f"{action} ({item.kind})",
        space=pool.space,
        owner=owner,
        value=int(item.ids[local]),
        label=label,
        done="nothing in the batch was freed",
    )
    return SpaceCheck(pool, pair, idx, release, (item.index, local), error)


def commit_space(check: SpaceCheck, owner: int) -> tuple[int | None, int | None]:
    """Apply a check that found no error, under the same lock it was made.

    Returns:
        ``(ids freed, swa ids released)``, None for a kind no item asked for.
    """
    if check.pair is None or check.release is None:
        return check.pool.commit_free(owner, check.idx), None
    release = check.release
    released = check.pair.commit_release(owner, check.idx[release]) if release.any() else None
    freed = check.pair.commit_free(owner, check.idx[~release]) if not release.all() else None
    return freed, released

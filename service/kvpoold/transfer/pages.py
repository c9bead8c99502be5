"""The pages a transfer moves: checked as sent and as held by their lease, pinned in the ledger.

Every page a transfer may still move is pinned (``IdSpace.pin``) on both sides for as long as
bytes may move: a Free of a pinned page is refused, and a lease's end quarantines its pinned
pages (no other lease can be handed them) until the last unpin frees them. A pin also holds a
use of its pool (:meth:`Pool.acquire`), so a pool dropped meanwhile keeps its memory until the
last one is given back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvpool.contract import codec
from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.plan import PoolPlan
from kvpoold.ids import IdSpace
from kvpoold.ids.space import distinct
from kvpoold.transfer.grants import MAX_GRANT_PAGES
from kvpoold.transfer.page_layout import KV_SPACE, SWA_SPACE

if TYPE_CHECKING:
    from kvpoold.pools.pool import Pool


class LeaseView(Protocol):
    """What transfers read of a lease."""

    @property
    def owner(self) -> int: ...

    @property
    def identity(self) -> str: ...


class LeaseLookup(Protocol):
    """What transfers need of the daemon's lease table: a lease by id."""

    def get(self, lease_id: int) -> LeaseView:
        """The open lease ``lease_id``.

        Raises:
            NotFound: no such open lease.
        """
        ...


def check_pages(data: bytes, field: str) -> np.ndarray:
    """Page ids as sent: whole little-endian int32, 1..MAX_GRANT_PAGES of them, each once.

    Raises:
        InvalidArgument: otherwise.
    """
    if len(data) % 4:
        raise InvalidArgument(f"{field} has {len(data)} bytes, not a whole number of "
                              "little-endian int32 page ids", field=field)
    n = len(data) // 4
    if not 1 <= n <= MAX_GRANT_PAGES:
        raise InvalidArgument(f"{field} has {n} page ids; a transfer moves 1..{MAX_GRANT_PAGES}",
                              field=field)
    pages = codec.ids_from_bytes(data)
    if not distinct(pages):
        raise InvalidArgument(f"{field} lists a page twice; list each page once", field=field)
    return pages


def has_swa(plan: PoolPlan) -> bool:
    """Whether the plan pairs an SWA page with each kv page (hybrid SWA)."""
    return any(s.name == SWA_SPACE and s.follows == KV_SPACE for s in plan.id_spaces)


def held_space(entry: Pool, owner: int, lease_id: int, pages: np.ndarray,
               field: str) -> IdSpace:
    """The kv space, after checking ``owner`` holds every page.

    Raises:
        FailedPrecondition: a page it does not hold. InvalidArgument: one out of range.
    """
    space = entry.ids.space(KV_SPACE, field)
    bad = space.owner_of(pages) != owner
    if bad.any():
        pos = int(bad.argmax())
        raise FailedPrecondition(
            f"{field}[{pos}]={int(pages[pos])} of pool {entry.name!r} is not held by lease "
            f"{lease_id} ({int(bad.sum())} of {pages.shape[0]} pages are not); allocate "
            "the pages with this lease first", field=f"{field}[{pos}]")
    return space


class Pins:
    """Pins pages of a pool for a transfer.

    Args:
        on_freed: called when an unpin freed quarantined ids (Allocates waiting for ids).
    """

    def __init__(self, on_freed: Callable[[], None] | None = None) -> None:
        self._on_freed = on_freed

    def hold(self, entry: Pool, pages: np.ndarray, swa: np.ndarray | None
             ) -> Callable[[], None]:
        """Pin ``pages`` (kv) and ``swa`` pages of ``entry`` in its ledger, holding a use of
        the pool.

        Returns:
            What unpins them, once: it frees pages quarantined meanwhile and gives the use
            back (a pool dropped meanwhile closes with its last use).
        """
        kv = entry.ids.space(KV_SPACE, "pages")
        swa_space = (entry.ids.space(SWA_SPACE, "pages")
                     if swa is not None and swa.shape[0] else None)
        kv_idx = pages.astype(np.intp)
        swa_idx = None if swa_space is None or swa is None else swa.astype(np.intp)
        kv.pin(kv_idx)
        if swa_space is not None and swa_idx is not None:
            swa_space.pin(swa_idx)
        release = entry.acquire("transfer")
        done = False

        def unpin() -> None:
            nonlocal done
            if done:
                return
            done = True
            try:
                freed = kv.unpin(kv_idx)
                if swa_space is not None and swa_idx is not None:
                    freed += swa_space.unpin(swa_idx)
            finally:
                release()
            if freed and self._on_freed is not None:
                self._on_freed()

        return unpin

"""Stats replies on the loop without holding it: built in slices, shared by concurrent callers.

Issue 20 item 7: an admin's reply lists every lease (~15 us each to read and encode: 0.15 s for
10k leases), so one built in one go held the event loop that long, and every caller asking at
once paid (and imposed) it again. Here:

- **Slices.** A reply is the view's counters (``kvpoold.server.stats.take_view``, O(pools))
  and then its lease entries, ``stats.SLICE_LEASES`` at a time with an ``await
  asyncio.sleep(0)`` between slices (``stats.lease_slices``), so the loop serves the calls
  that are ready between two slices: one slice is well under a millisecond. Each slice is read
  when it is built (a lease closed meanwhile is left out); the counters are those of the
  reply's start. Entries are encoded by ``kvpool.contract.codec`` (the one owner of the wire shape)
  slice by slice.
- **Shared builds.** Callers asking for the same view (``stats.view_key``: every admin one view
  per pool, anyone else its identity's) share one build: a call joins the next build to start
  (never one already under way, which might have read the state before the caller's own last
  call), so N callers at once cost at most two builds, and at most one build per view runs at
  a time. A caller that goes away does not cancel a build others wait for.
- **Paced.** A view's next build starts once as long as its last one took has passed since
  it ended (at most :data:`MAX_PAUSE_S`): callers asking for it in a loop, however many, have
  the daemon for half the time at most, and a caller asking now and then never waits.

A caller that is not admin lists only its own leases (``LeaseTable.of_identity``): its reply
costs O(its own leases), whatever the others hold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.contract import codec
from kvpool.contract.records import Stats
from kvpoold.server.stats import SLICE_LEASES, lease_slices, take_view, view_key

if TYPE_CHECKING:
    from kvpool.v1 import kvpool_pb2 as pb
    from kvpoold.access import Caller
    from kvpoold.server.daemon import Daemon

# The longest pause between two builds of one view (see "Paced" above).
MAX_PAUSE_S = 1.0


async def build_reply(daemon: Daemon, caller: Caller, pool: str = "",
                      slice_leases: int = SLICE_LEASES) -> pb.StatsResponse:
    """The Stats reply for ``caller``, its leases read and encoded ``slice_leases`` at a time,
    yielding the loop between slices.

    Raises:
        NotFound: ``pool`` given and not (or no longer) a pool.
    """
    view = take_view(daemon, caller, pool)
    reply = codec.stats_to_pb(view.stats)
    head = view.stats.daemon
    async for part in lease_slices(daemon, view, slice_leases):
        reply.leases.extend(codec.stats_to_pb(Stats(daemon=head, pools=[], leases=part)).leases)
    return reply


@dataclass
class _Slot:
    """One view's builds: the one running (``worker``) and the one its next callers wait for."""

    worker: asyncio.Task[None] | None = None
    queued: asyncio.Future[pb.StatsResponse] | None = None


class StatsReplies:
    """The Stats replies of one daemon, shared by every servicer over it (Unix and TCP).

    Args:
        daemon: whose state the replies show.
        slice_leases: lease entries per slice (``stats.SLICE_LEASES``).
    """

    def __init__(self, daemon: Daemon, slice_leases: int = SLICE_LEASES) -> None:
        self._daemon = daemon
        self._slice = slice_leases
        self._slots: dict[Hashable, _Slot] = {}
        self.builds = 0  # builds run: what sharing saves, for tests and benchmarks

    async def reply(self, caller: Caller, pool: str = "") -> pb.StatsResponse:
        """The reply ``caller`` may see, from the next build of its view to start.

        Raises:
            InvalidArgument, PermissionDenied, NotFound: ``pool`` (checked first, O(1)).
        """
        if pool:
            self._daemon.pool(pool, caller)
        key = view_key(caller, pool)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot()
        if slot.queued is None:
            slot.queued = asyncio.get_running_loop().create_future()
            if slot.worker is None:
                slot.worker = asyncio.create_task(self._work(key, slot, caller, pool))
        # The build goes on for the others if this caller goes away.
        return await asyncio.shield(slot.queued)

    async def _work(self, key: Hashable, slot: _Slot, caller: Caller, pool: str) -> None:
        """Run the view's builds, paced, while callers queue for one; each caller of a view
        sees the same picture, so the first one's ``caller`` builds for all."""
        future: asyncio.Future[pb.StatsResponse] | None = None
        try:
            loop = asyncio.get_running_loop()
            while slot.queued is not None:
                future, slot.queued = slot.queued, None  # later callers queue for the next
                self.builds += 1
                started = loop.time()
                try:
                    reply = await build_reply(self._daemon, caller, pool, self._slice)
                except Exception as exc:
                    future.set_exception(exc)
                    future.exception()  # retrieved: no warning when every caller went away
                else:
                    future.set_result(reply)
                future = None
                # Paced: the next build of this view no sooner than this one took again.
                await asyncio.sleep(min(MAX_PAUSE_S, loop.time() - started))
        finally:
            del self._slots[key]
            for left in (future, slot.queued):  # cancelled (the loop is closing)
                if left is not None and not left.done():
                    left.cancel()

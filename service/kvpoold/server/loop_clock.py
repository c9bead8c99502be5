"""The lease clock: monotonic time that stops while the daemon's event loop is stalled.

Why: a client renews its lease by sending a KeepAlive message; the daemon reads it on its event
loop. If the loop is held (a long computation, a swapped-out process, a debugger), renewals that
arrived meanwhile wait in the transport, unread. When the loop comes back, the lease sweeper may
run before the queued renewals are read, and a plain monotonic clock says the lease's TTL has
passed, although the client did everything right: the daemon was late, not the client. A TTL is
a promise about the client's silence, so it must only run while the daemon is able to listen.

How: :class:`StallClock` reads ``base`` (``time.monotonic``) minus every stall seen so far. A
ticker task (:meth:`StallClock.run`) wakes every ``tick_s``; a wake later than
``tick_s + tolerance_s`` after the previous one means the loop was unresponsive, and the excess
is added to the stalled total. The clock also counts a stall in progress: past
``tick_s + tolerance_s`` since the last tick it stands still, so any reader on the loop after a
stall (the sweeper included, whatever order the loop runs them in) sees at most
``tick_s + tolerance_s`` of it. Leases keep their deadlines on this clock (``LeaseTable``), so
after a stall of any length a lease has at least the TTL it had left before it, less
``tick_s + tolerance_s``, to have its queued renewal read. No per-lease work: one subtraction.

Cost: a lease whose client really died also gets the stall's length on top of its TTL. Stalls are
logged (``event=loop_stall``) with their length. Without the ticker running (unit tests, a
daemon driven by hand) the clock is ``base`` exactly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("kvpoold.loop")

TICK_S = 0.05
# Lateness of a tick that is still scheduling noise (GIL hand-offs of 5 ms, a busy 2-core box),
# not a stall.
TOLERANCE_S = 0.05
# Stalls at least this long are logged.
LOG_STALL_S = 0.5


class StallClock:
    """Monotonic seconds that do not advance while the event loop is stalled (see module doc).

    Args:
        base: the underlying monotonic clock.
        tick_s: how often the ticker wakes.
        tolerance_s: lateness of a tick not counted as a stall.
    """

    def __init__(self, base: Callable[[], float] = time.monotonic, *, tick_s: float = TICK_S,
                 tolerance_s: float = TOLERANCE_S) -> None:
        self._base = base
        self.tick_s = tick_s
        self.tolerance_s = tolerance_s
        self.stalled_s = 0.0  # all stalls seen, summed
        self.longest_stall_s = 0.0
        self.stalls = 0  # stalls seen (ticks later than ``tick_s + tolerance_s``)
        self._last_tick: float | None = None  # None while the ticker is not running

    def __call__(self) -> float:
        now = self._base()
        return now - self.stalled_s - self._pending(now)

    def _pending(self, now: float) -> float:
        """The part of a stall in progress not yet folded into ``stalled_s``."""
        if self._last_tick is None:
            return 0.0
        return max(0.0, now - self._last_tick - self.tick_s - self.tolerance_s)

    def tick(self) -> float:
        """Fold a stall that ended into the total; returns its length (0: none). The ticker
        calls it each time it wakes."""
        now = self._base()
        stall = self._pending(now)
        if stall:
            self.stalls += 1
            self.stalled_s += stall
            self.longest_stall_s = max(self.longest_stall_s, stall)
        self._last_tick = now
        return stall

    async def run(self) -> None:
        """Tick every ``tick_s`` until cancelled; logs stalls of ``LOG_STALL_S`` or more."""
        self._last_tick = self._base()
        try:
            while True:
                await asyncio.sleep(self.tick_s)
                stall = self.tick()
                if stall >= LOG_STALL_S:
                    log.warning("event loop stalled; lease deadlines moved by the stall",
                                extra={"fields": {
                                    "event": "loop_stall", "stall_s": round(stall, 3),
                                    "stalled_total_s": round(self.stalled_s, 3)}})
        finally:
            self._last_tick = None

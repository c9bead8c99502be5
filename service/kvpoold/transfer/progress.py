"""The thread that progresses the daemon's NIXL agent, off the event loop.

NIXL's agent runs without its own progress thread (it spins even while the daemon is idle), so
someone must call into it for a write to move (UCX TCP) and for notifications to arrive. That
is this thread, never the event loop: while there is work it calls ``step`` (one pass over the
posted writes and the notifications, which posts what it found to the loop), sleeping between
passes with a backoff from :data:`MIN_SLEEP_S` up to the cap ``step`` returns (how urgent the
work is); with no work it sleeps until :meth:`Poller.kick` (a write posted or cancelled, a
receive window opened), costing nothing while the daemon is idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvpoold.transfer")

# For this long after a kick (a write posted) passes follow each other with only a yield of
# the GIL in between (a small write ends within tens of microseconds once looked at: sleeping
# first would add the timer's slack to every small transfer); then the backoff. Longer hurt
# on a small machine: 5 ms made 16-page transfers 2.0-2.2x raw NIXL against 1.5-1.9x on 2
# cores (bench/transfer.py), the passes competing with the other processes for the cores.
SPIN_S = 200e-6
# The first sleep after a pass that found nothing; each further one doubles, up to the cap.
MIN_SLEEP_S = 20e-6
# After a pass that raised: wait this long before the next (the error is logged once).
ERROR_SLEEP_S = 0.05

# One pass: whether it changed anything, and the longest sleep before the next (None: no work
# left, sleep until kicked).
Step = Callable[[], tuple[bool, float | None]]


class Poller:
    """Calls ``step`` on its own thread while there is work.

    Args:
        step: one pass (see :data:`Step`); called on this thread only.
        name: the thread's name.
    """

    def __init__(self, step: Step, name: str) -> None:
        self._step = step
        self._cond = threading.Condition()
        self._kicked = False
        self._closed = False
        self._failing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """New work (or more urgent work): pass now, and restart the backoff."""
        with self._cond:
            self._kicked = True
            self._cond.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (waits up to ``timeout_s`` for its current pass)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _pass(self) -> tuple[bool, float | None]:
        try:
            result = self._step()
        except Exception:
            if not self._failing:
                log.exception("progressing the NIXL agent failed; retrying")
            self._failing = True
            return False, ERROR_SLEEP_S
        self._failing = False
        return result

    def _run(self) -> None:
        sleep = 0.0
        spin_until = 0.0
        while True:
            changed, cap = self._pass()
            with self._cond:
                if self._closed:
                    return
                if self._kicked:
                    self._kicked = False
                    sleep = 0.0
                    spin_until = time.monotonic() + SPIN_S
                    continue
                if cap is None:
                    while not self._kicked and not self._closed:
                        self._cond.wait()
                    continue
                if changed or time.monotonic() < spin_until:
                    sleep = 0.0
                else:
                    sleep = min(cap, max(MIN_SLEEP_S, 2 * sleep))
                    self._cond.wait(sleep)
                    continue
            time.sleep(0)  # let the loop thread have the GIL between passes

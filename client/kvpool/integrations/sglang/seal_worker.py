"""The sealer's worker thread (``sealer.py``): the Seal calls and the Frees of sealed pages,
off the scheduler's thread, batched over ``SEAL_WINDOW_S``, a window's Seals before its Frees.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import numpy as np

from kvpool.contract.errors import KVPoolError

log = logging.getLogger("kvpool.integrations.sglang.sealer")

# The worker gathers what the scheduler's steps queue for this long, then makes one Seal and
# one Free (a few RPCs a second, not one per step: each costs both sides CPU).
SEAL_WINDOW_S = 0.25
SEAL_PAGES = 16_384  # at most this many pages (~2 MiB at page 16) a Seal, under its 8 MiB


class SealWorker:
    """The Seal calls and the Frees of sealed pages, on one thread, batched over
    ``SEAL_WINDOW_S`` (see ``_run``)."""

    def __init__(self, lease: Any, pool: str, layout: str) -> None:
        self.lease = lease
        self.pool = pool
        self.layout = layout
        self.cache: Any = None  # the page cache the Frees go through (set by ``bind``)
        self.failed: str | None = None  # why sealing stopped (the daemon refused it)
        self.sealed = 0  # pages the daemon sealed
        self._q: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._queued = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvpool-seal-{pool}")
        self._thread.start()

    def put(self, kind: str, item: Any) -> None:
        with self._idle:
            self._queued += 1
        self._q.put((kind, item))

    @property
    def busy(self) -> bool:
        """Whether calls are queued (sealed pages freed here may still be the lease's)."""
        return self._queued > 0

    def flush(self, timeout_s: float | None = None) -> bool:
        """Make every call queued so far now (the window cut short) and wait for them: the
        allocator does when the pool refused it pages while sealed frees were queued."""
        self.put("flush", None)
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout_s)

    def stop(self) -> None:
        self._q.put(None)

    def _done(self, n: int) -> None:
        with self._idle:
            self._queued -= n
            self._idle.notify_all()

    def _run(self) -> None:
        """Collect what the scheduler queues for ``SEAL_WINDOW_S`` after the first item, then
        one Seal of every page sealed meanwhile and one Free of every sealed page freed
        meanwhile, in that order (a page freed in a window was sealed in it or before; a
        freed page cannot come back to this lease before its Free is made)."""
        while True:
            first = self._q.get()
            if first is None:
                return
            items = [first]
            stop = False
            deadline = time.monotonic() + (0.0 if first[0] == "flush" else SEAL_WINDOW_S)
            while (left := deadline - time.monotonic()) > 0:
                try:
                    nxt = self._q.get(timeout=left)
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                items.append(nxt)
                if nxt[0] == "flush":
                    break
            batch: list[Any] = []
            for kind, arg in items:
                if kind == "seal":
                    batch.append(arg)
                    if sum(len(b[0]) for b in batch) >= SEAL_PAGES:
                        self._seal(batch)
                        batch = []
            if batch:
                self._seal(batch)
            frees = [arg for kind, arg in items if kind == "free"]
            if frees:
                self._free(np.concatenate(frees))
            self._done(len(items))
            if stop:
                return

    def _seal(self, parts: list[tuple[np.ndarray, list[bytes], list[bytes], np.ndarray]]
              ) -> None:
        pages = np.concatenate([p[0] for p in parts]).astype(np.int32)
        keys = [k for p in parts for k in p[1]]
        parents = [k for p in parts for k in p[2]]
        tokens = np.concatenate([p[3] for p in parts]).astype(np.int32)
        try:
            self.sealed += int(self.lease.seal(self.pool, self.layout, pages, keys, parents,
                                               tokens))
        except KVPoolError as err:
            if self.failed is None:
                self.failed = str(err)
                log.warning("kvpool pool %r: sealing stopped, the daemon refused a Seal of "
                            "%d pages: %s", self.pool, pages.shape[0], err)
        except Exception:  # never let the worker die: frees still have to go through it
            log.exception("kvpool pool %r: a Seal of %d pages failed", self.pool,
                          pages.shape[0])

    def _free(self, ids: np.ndarray) -> None:
        try:
            self.cache.return_ids(ids.astype(np.int32))
        except KVPoolError as err:
            log.warning("kvpool pool %r: freeing %d sealed pages failed: %s", self.pool,
                        ids.shape[0], err)
        except Exception:
            log.exception("kvpool pool %r: freeing %d sealed pages failed", self.pool,
                          ids.shape[0])


__all__ = ["SEAL_PAGES", "SEAL_WINDOW_S", "SealWorker"]

"""WatchStats streams held open per caller identity, capped per identity."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvpool.contract.errors import ResourceExhausted
from kvpoold.server.stats import watch_interval


class WatchStreams:
    """The WatchStats streams open now, per identity.

    Args:
        max_per_identity: streams one caller identity may hold open.
        min_interval_s: the shortest interval a stream is served at.
    """

    def __init__(self, max_per_identity: int, min_interval_s: float) -> None:
        self.max_per_identity = max_per_identity
        self.min_interval_s = min_interval_s
        self._open: dict[str, int] = {}  # identity -> streams open

    @contextlib.contextmanager
    def admit(self, identity: str, interval_s: float) -> Iterator[float]:
        """Count a stream of ``identity`` for as long as the block runs; yields the interval
        it is served at (``stats.watch_interval``). O(1).

        Raises:
            InvalidArgument: an interval negative, NaN or over an hour.
            ResourceExhausted: the identity holds its cap of streams.
        """
        interval = watch_interval(interval_s, self.min_interval_s)
        mine = self._open.get(identity, 0)
        if mine >= self.max_per_identity:
            raise ResourceExhausted(
                f"identity {identity!r} asks for a WatchStats stream and has {mine} open, the cap "
                f"per identity is {self.max_per_identity} "
                "(max_watch_streams_per_identity, --max-watch-streams-per-identity); end a "
                "stream it no longer reads (kvpool top holds one per daemon), or call Stats")
        self._open[identity] = mine + 1
        try:
            yield interval
        finally:
            left = self._open[identity] - 1
            if left:
                self._open[identity] = left
            else:
                del self._open[identity]

    def count(self, identity: str) -> int:
        """Streams ``identity`` holds open."""
        return self._open.get(identity, 0)

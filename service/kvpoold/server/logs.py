"""Structured logs: one line per event, as ``key=value`` text or one JSON object per line.

Callers pass the event's fields as ``extra={"fields": {...}}``; both formatters print them after
the message, so ``grep event=lease_expired`` and ``jq 'select(.event == "lease_expired")'`` work.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TextIO

from kvpoold.settings import LogFormat

LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


def _timestamp(record: logging.LogRecord) -> str:
    """``2025-01-01T12:00:00.123Z``: the record's time in UTC, to the millisecond (both
    formats)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """logfmt: ``ts=2025-01-01T12:00:00.123Z level=info logger=kvpoold.daemon msg="lease
    opened" lease_id=... name=...``; every part a ``key=value`` pair, values with spaces, quotes
    or ``=`` quoted."""

    def format(self, record: logging.LogRecord) -> str:
        pairs = {"ts": _timestamp(record), "level": record.levelname.lower(),
                 "logger": record.name, "msg": record.getMessage()}
        for key, value in _fields(record).items():
            pairs.setdefault(key, value)
        line = " ".join(f"{k}={_text(v)}" for k, v in pairs.items())
        if record.exc_info:
            line += f" exc={_text(self.formatException(record.exc_info))}"
        return line


def _text(value: object) -> str:
    text = str(value)
    plain = text and not any(c in text for c in ' ="\\\n\t')
    return text if plain else json.dumps(text)


# Random 63-bit ids: JSON numbers above 2**53 lose digits in jq and JavaScript, so the JSON log
# writes them as decimal strings (as ``kvpool leases --json`` does).
STRING_IDS = frozenset({"lease_id"})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (ISO 8601 UTC, as the text format), ``level``,
    ``logger``, ``msg``, then the fields (``lease_id`` as a decimal string)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _fields(record).items():
            entry.setdefault(key, str(value) if key in STRING_IDS and isinstance(value, int)
                             else value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


# Loggers kvpoold formats: its own, and NIXL's (whose package would print plain text to stdout).
DAEMON_LOGGERS = ("kvpoold", "nixl")


def configure_logging(level: str = "info", fmt: LogFormat = "text",
                      stream: TextIO | None = None) -> None:
    """Send the ``kvpoold`` loggers to ``stream`` (stderr) at ``level`` in format ``fmt``.

    Args:
        level: debug, info, warning or error.
        fmt: ``text`` or ``json``.
        stream: where lines go (default stderr).
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    for name in DAEMON_LOGGERS:
        adopt(logging.getLogger(name), [handler], level.upper())


def adopt(logger: logging.Logger, handlers: list[logging.Handler], level: int | str) -> None:
    """Make ``logger`` write through ``handlers`` only, at ``level``."""
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = False


class LogLimiter:
    """Rate limit for log lines that a client can repeat at will (refused requests, internal
    errors): per key, a token bucket of ``burst`` lines refilled at one per ``every_s``.

    :meth:`allow` says whether to log now and how many lines of that key were suppressed since
    the last one logged (put it in the line, ``suppressed=N``). At most ``max_keys`` keys are
    kept (the least recently used go first), so a client inventing keys costs bounded memory.
    O(1) per call. Not thread-safe: the daemon calls it from its event loop.

    Args:
        burst: lines of one key logged back to back before the limit applies.
        every_s: seconds per line of one key after that.
        max_keys: keys remembered.
        clock: monotonic seconds.
    """

    def __init__(self, burst: int = 1, every_s: float = 60.0, max_keys: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.every_s = every_s
        self.max_keys = max_keys
        self._clock = clock
        # key -> (tokens, time of the last refill, lines suppressed since the last logged)
        self._keys: OrderedDict[Hashable, tuple[float, float, int]] = OrderedDict()

    def allow(self, key: Hashable) -> tuple[bool, int]:
        """``(log it, suppressed before it)``; a suppressed line is counted for the next."""
        now = self._clock()
        tokens, last, suppressed = self._keys.pop(key, (float(self.burst), now, 0))
        tokens = min(float(self.burst), tokens + (now - last) / self.every_s)
        if tokens >= 1.0:
            self._keys[key] = (tokens - 1.0, now, 0)
            ok, count = True, suppressed
        else:
            self._keys[key] = (tokens, now, suppressed + 1)
            ok, count = False, suppressed + 1
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return ok, count

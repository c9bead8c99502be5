"""The daemon's side of its KV events publisher process (``kvpoold.server.kv_publisher``).

:class:`PublisherProcess` starts the publisher (``python -m kvpoold.server.kv_publisher``) and
talks to it over two ZMQ ipc sockets in a private directory (0700): a PUSH the loop sends the
numbered batches on, never blocking (queued first, at most ``max_queue_size`` batches: a full
queue drops the batch, a gap; sent a millisecond later, all the batches of that millisecond in
one go), and a PULL for what the publisher says (ready, failed, "a snapshot,
please"). The publisher binds the stream's endpoints; a failure there fails ``kvpoold serve``
at start. A publisher that dies is started again (a second later); its replay buffer is gone, so
the batches numbered meanwhile are dropped and a replay from before them gets a snapshot.
pyzmq is imported here: ``kvpool[events]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from kvpool.contract.errors import FailedPrecondition
from kvpoold.server.kv_messages import (
    Change,
    Failed,
    Mark,
    NeedSnapshot,
    Ready,
    SnapshotEnd,
    SnapshotPart,
    Stop,
    Up,
)
from kvpoold.settings import KvEventsConfig

log = logging.getLogger("kvpoold.events")

START_TIMEOUT_S = 60.0  # a ceiling: the publisher imports no torch and starts in ~0.3 s
# The queue is sent at most this long after its first batch, in one go: one wake-up of ZMQ's
# I/O thread and of the publisher for all the batches of a millisecond, not one a batch (each
# wake-up can take the loop's core on a busy host).
FLUSH_S = 0.001
PIPE_HWM = 1000  # ZMQ's own queue behind ours (the bound is max_queue_size, ours)
WATCH_INTERVAL_S = 1.0
STOP_TIMEOUT_S = 5.0
DELIVER_RETRY_S = 0.005


def child_env() -> dict[str, str]:
    """This environment, with the directories this daemon's ``kvpoold`` and ``kvpool`` were
    imported from first on PYTHONPATH (the publisher runs the same code)."""
    import kvpool
    import kvpoold

    roots = [str(Path(m.__file__).resolve().parent.parent) for m in (kvpoold, kvpool)
             if m.__file__ is not None]
    path = [*dict.fromkeys(roots), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    return {**os.environ, "PYTHONPATH": ":".join(path)}


class PublisherProcess:
    """The publisher process and the two sockets to it (:class:`~kvpoold.server.kv_stream.
    Outbox`).

    Args:
        config: the checked ``--kv-events-config`` (publishing).
        log_level, log_format: the daemon's, for the publisher's log lines.
    """

    def __init__(self, config: KvEventsConfig, log_level: str = "info",
                 log_format: str = "text") -> None:
        self._config = config
        self._log = (log_level, log_format)
        self._dir = Path(tempfile.mkdtemp(prefix="kvpool-events-"))  # 0700
        self._ctx = zmq.Context()
        self._push: zmq.Socket[bytes] = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, PIPE_HWM)
        self._push.setsockopt(zmq.LINGER, int(STOP_TIMEOUT_S * 1000))
        self._down = f"ipc://{self._dir}/down"
        self._push.bind(self._down)
        self._actx = zmq.asyncio.Context()
        self._pull: zmq.asyncio.Socket = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._up = f"ipc://{self._dir}/up"
        self._pull.bind(self._up)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Up)
        self._pending: deque[bytes] = deque()  # encoded, not yet on the socket
        self._flush_at: asyncio.TimerHandle | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._numbered: Callable[[], int] = lambda: 0
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.endpoint = ""
        self.replay_endpoint = ""
        self.restarts = 0

    # -- start, watch, stop ----------------------------------------------------------------

    async def start(self, on_snapshot: Callable[[], None], numbered: Callable[[], int]) -> None:
        """Start the publisher and wait until its endpoints are bound; then listen to it and
        start it again should it die (told ``numbered()``, the next number the daemon gives:
        it has none of the batches before).

        Raises:
            FailedPrecondition: it could not bind an endpoint (its words), or did not start.
        """
        self._numbered = numbered
        await self._spawn()
        self._tasks = [asyncio.ensure_future(self._listen(on_snapshot)),
                       asyncio.ensure_future(self._watch())]

    async def _spawn(self) -> None:
        level, fmt = self._log
        config = msgspec.json.encode(self._config).decode()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvpoold.server.kv_publisher", config, self._up,
             self._down, level, fmt, str(self._numbered())], stdin=subprocess.DEVNULL,
            env=child_env())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while True:
            if await self._pull.poll(100):
                msg = self._decoder.decode(await self._pull.recv())
                if isinstance(msg, Ready):
                    self.endpoint, self.replay_endpoint = msg.endpoint, msg.replay_endpoint
                    await self._connected(deadline)
                    log.info("kv events publisher", extra={"fields": {
                        "event": "kv_events_publisher", "pid": self._proc.pid,
                        "endpoint": msg.endpoint, "replay_endpoint": msg.replay_endpoint}})
                    return
                if isinstance(msg, Failed):
                    await asyncio.to_thread(self._proc.wait, STOP_TIMEOUT_S)
                    raise FailedPrecondition(msg.message, field="kv_events_config")
                continue  # a snapshot asked of a publisher that died: gone with it
            code = self._proc.poll()
            if code is not None or loop.time() > deadline:
                self._kill()
                raise FailedPrecondition(
                    f"the KV events publisher did not start (exit status {code}; see the "
                    "log above)", field="kv_events_config")

    async def _connected(self, deadline: float) -> None:
        """Return once the publisher's end of the queue is connected (a PUSH without a peer
        refuses every batch): a no-op mark goes through.

        Raises:
            FailedPrecondition: it did not connect before ``deadline`` (loop time).
        """
        loop = asyncio.get_running_loop()
        hello = self._encoder.encode(Mark(self._numbered() - 1))
        while True:
            try:
                self._push.send(hello, zmq.NOBLOCK)
                return
            except zmq.Again:
                if loop.time() > deadline or (self._proc and self._proc.poll() is not None):
                    self._kill()
                    raise FailedPrecondition("the KV events publisher did not connect",
                                             field="kv_events_config") from None
                await asyncio.sleep(DELIVER_RETRY_S)

    async def _listen(self, on_snapshot: Callable[[], None]) -> None:
        while True:
            try:
                msg = self._decoder.decode(await self._pull.recv())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv events publisher said something unreadable",
                              extra={"fields": {"event": "kv_events_error"}})
                continue
            if isinstance(msg, NeedSnapshot):
                on_snapshot()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            proc = self._proc
            if self._closing or proc is None or proc.poll() is None:
                continue
            self.restarts += 1
            log.error("the KV events publisher exited; starting it again (batches numbered "
                      "meanwhile are dropped: gaps a replay bridges with a snapshot)",
                      extra={"fields": {"event": "kv_events_publisher_exit",
                                        "exit_status": proc.returncode,
                                        "restarts": self.restarts}})
            try:
                await self._spawn()
            except FailedPrecondition as exc:
                log.error(f"the KV events publisher could not start again: {exc}",
                          extra={"fields": {"event": "kv_events_publisher_failed"}})

    async def close(self) -> None:
        """Send what is queued, stop the publisher (killed after a few seconds), close the
        sockets and remove their directory."""
        self._closing = True
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        proc = self._proc
        if proc is not None and proc.poll() is None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + STOP_TIMEOUT_S
            while not self._flush() and loop.time() < deadline:  # the last batches first
                await asyncio.sleep(DELIVER_RETRY_S)
            with contextlib.suppress(zmq.Again):
                self._push.send(self._encoder.encode(Stop()), zmq.NOBLOCK)
            try:
                await asyncio.to_thread(proc.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._kill()
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
        self._actx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- the queue (kvpoold.server.kv_stream.Outbox) ---------------------------------------

    def offer(self, msg: Change | Mark) -> bool:
        if len(self._pending) >= self._config.max_queue_size:
            return False
        self._pending.append(self._encoder.encode(msg))
        self._schedule(FLUSH_S)
        return True

    async def deliver(self, msg: SnapshotPart | SnapshotEnd) -> None:
        data = self._encoder.encode(msg)
        while len(self._pending) >= self._config.max_queue_size and not self._closing:
            await asyncio.sleep(DELIVER_RETRY_S)
        self._pending.append(data)
        self._schedule(FLUSH_S)

    def _schedule(self, delay: float) -> None:
        if self._flush_at is None and not self._closing:
            self._flush_at = asyncio.get_running_loop().call_later(delay, self._flush)

    def _flush(self) -> bool:
        """Send what is queued, in order, until the socket's pipe is full (then again a few
        ms later). Returns whether all was sent."""
        self._flush_at = None
        while self._pending:
            try:
                self._push.send(self._pending[0], zmq.NOBLOCK)
            except zmq.Again:
                self._schedule(DELIVER_RETRY_S)
                return False
            self._pending.popleft()
        return True

"""The daemon's one NIXL agent: each pool's backing registered once, one-sided writes posted.

NIXL is optional (``nixl_module``): :func:`make_agent` returns None without it. The agent uses
UCX (shared memory, TCP, RDMA, NVLink:
whatever UCX finds between the two daemons).

Descriptors are ``(address, length, device)`` rows of a uint64 ``Nx3`` array (NIXL's own
format); nothing here pickles (NIXL's ``get_serialized_descs`` does, and is not used).

Progress: the agent runs without NIXL's own progress thread (it spins even while the daemon is
idle); one thread of this module (``progress.Poller``) makes the calls that move writes along
and read notifications, only while a write is in flight or a receive window is open, and posts
what it found to the event loop (each write's future, :meth:`NixlAgent.ended`; the
notifications to the receiver's callback, :meth:`NixlAgent.listen`). Every call into NIXL, from
the loop, that thread or Configure's worker thread, holds the agent's lock (the agent is also
created with NIXL's strict thread sync).

What a peer learns: each pool is its own registration, and a peer is only ever given the
metadata of the registration a grant names (NIXL partial metadata), never the whole agent's.

Write deadlines and cancellation: every posted write has a deadline, and before any call that
may progress NIXL's worker (posting, polling a write, reading notifications, loading a peer) the
agent cancels the writes past theirs (the progress thread looks at least every
:data:`WRITE_POLL_S` while a write is in flight). A cancel is NIXL's ``release_xfer_handle`` on
a running handle, and that does **not** stop the UCX operations already posted (measured: a
released 256 MiB write over UCX TCP still landed whole afterwards): so a cancelled write counts
as ended only once a **flush probe** (a small READ of the same peer's memory, posted after the
release on the same connection) has completed (``DONE`` or ``ERR``), which UCX completes only
after every operation posted before it on that endpoint (measured: no byte of the cancelled
write landed after the probe completed, over UCX TCP and CMA). A write is *ended* (nothing of it
can still land) once :meth:`NixlAgent.ended` resolves: DONE or ERR as NIXL reported them (its
handle then released), or CANCELLED once that probe completed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np
import torch

from kvpool.contract.errors import Internal
from kvpoold.transfer.nixl_module import Adopt, load_nixl, mem_type
from kvpoold.transfer.progress import Poller

log = logging.getLogger("kvpoold.transfer")

# PROC: something of the write may still land; any other state: nothing can any more.
XferState = Literal["DONE", "PROC", "ERR", "CANCELLED"]
# A flush probe reads this many bytes of the peer's memory into a scratch registration.
PROBE_BYTES = 64
# Registrations of one peer agent whose metadata this agent keeps track of having loaded.
MAX_KNOWN_GENERATIONS = 64
# How often the progress thread looks at most, by what is in flight: a posted write (it moves,
# over UCX TCP, only while looked at, and its end is noticed this late at worst), a live receive
# window (its notification), only fenced windows (their writers are stopped or slow: a resumed
# one's notification still frees the pages, without a busy thread meanwhile).
WRITE_POLL_S = 200e-6
LIVE_POLL_S = 0.001
FENCED_POLL_S = 0.05
# What the receiving side waits for: nothing, live windows, or only fenced ones.
Listen = Literal["off", "live", "fenced"]
Notes = dict[str, list[bytes]]


@dataclass(eq=False)
class Write:
    """One posted WRITE, until nothing of it can land any more (``ended`` set).

    ``probe_row`` is one row of the peer's memory the write targets (address, at most
    PROBE_BYTES, device): a cancelled write's flush probe reads it. ``ended`` is the state the
    write ended in: DONE / ERR as NIXL reported them (then released), or CANCELLED once the
    probe after its release completed; ``done`` (on the event loop) resolves to it.
    """

    handle: Any
    peer: str
    remote_kind: str
    probe_row: np.ndarray
    deadline: float
    done: asyncio.Future[XferState]
    cancelled: bool = False
    probe: Any = None
    ended: XferState | None = None


class NixlAgent:
    """One NIXL agent of a daemon; its name is fresh per process, so a restarted peer is seen
    as a new agent (its metadata is fetched again).

    Attributes:
        name: the agent's name (``kvpoold-<host>-<pid>-<hex>``).
    """

    def __init__(self, nixl: ModuleType) -> None:
        self.name = f"kvpoold-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        # No NIXL progress thread: NIXL's spins (about a core's fifth, plus the loop thread it
        # contends with) even while the daemon is idle. This daemon's own (``_poller``) runs
        # only while a write is in flight or a receive window is open.
        config = nixl.nixl_agent_config(
            backends=["UCX"], enable_prog_thread=False,
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent = nixl.nixl_agent(self.name, config)
        self._generations = itertools.count(1)
        self._regs: dict[str, tuple[Any, int]] = {}  # pool -> (registration, generation)
        # remote agent -> the generations of its registrations loaded here (oldest first)
        self._peers: dict[str, OrderedDict[int, None]] = {}
        # Posted writes not yet ended; overdue ones are cancelled before any progress.
        self._writes: set[Write] = set()
        # The local end of flush probes (never read: the bytes only prove the order).
        self._scratch = np.zeros(PROBE_BYTES, dtype=np.uint8)
        self._scratch_reg = self._agent.register_memory(
            [(self._scratch.ctypes.data, PROBE_BYTES, 0, "")], "DRAM")
        # Lock order: this lock, then NIXL's own. Held by every call into the agent and every
        # change of ``_writes`` (the loop, the progress thread, Configure's worker thread).
        self._lock = threading.RLock()
        self._listen: Listen = "off"
        self._on_notes: Callable[[Notes], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: Poller | None = None

    # -- registration ----------------------------------------------------------------------

    def register(self, pool: str, backing: torch.Tensor) -> None:
        """Register a pool's whole backing region (one descriptor), under a new generation."""
        kind, dev = mem_type(backing)
        rows = [(backing.data_ptr(), backing.numel() * backing.element_size(), dev, pool)]
        with self._lock:
            self._regs[pool] = (self._agent.register_memory(rows, kind),
                                next(self._generations))

    def deregister(self, pool: str) -> None:
        """Deregister a pool's region (no-op for one never registered)."""
        with self._lock:
            reg = self._regs.pop(pool, None)
            if reg is not None:
                self._agent.deregister_memory(reg[0])

    @property
    def registered(self) -> tuple[str, ...]:
        return tuple(self._regs)

    def generation(self, pool: str) -> int:
        """The generation of ``pool``'s registration (0: not registered)."""
        reg = self._regs.get(pool)
        return 0 if reg is None else reg[1]

    # -- peers -----------------------------------------------------------------------------

    def pool_metadata(self, pool: str) -> bytes:
        """This agent's connection info and the metadata of ``pool``'s registration only (NIXL
        partial metadata), for a peer's :meth:`add_peer`: it reaches no other pool.

        Raises:
            Internal: the pool is not registered.
        """
        reg = self._regs.get(pool)
        if reg is None:
            raise Internal(f"pool {pool!r} is not registered with NIXL")
        with self._lock:
            return bytes(self._agent.get_partial_agent_metadata(reg[0], True, ["UCX"]))

    def add_peer(self, metadata: bytes, generation: int) -> str:
        """Load a peer agent's metadata (one of its registrations); returns its name."""
        with self._lock:
            self._cancel_overdue()
            name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        known = self._peers.setdefault(name, OrderedDict())
        known[generation] = None
        known.move_to_end(generation)
        while len(known) > MAX_KNOWN_GENERATIONS:
            known.popitem(last=False)
        return name

    def known_generations(self, agent: str) -> list[int]:
        """The registrations of ``agent`` whose metadata is loaded here (newest last)."""
        return list(self._peers.get(agent, ()))

    # -- transfers (the event loop) ----------------------------------------------------------

    def post_write(self, local: np.ndarray, local_kind: str, remote: np.ndarray,
                   remote_kind: str, peer: str, notification: bytes,
                   deadline: float) -> Write:
        """Post one WRITE of every ``local`` row into the matching ``remote`` row of ``peer``
        (memory types DRAM or VRAM on each side), with ``notification`` delivered to the peer
        when it is complete; cancelled if still running at ``deadline`` (``time.monotonic``).
        Called on the event loop.

        Returns:
            The write; :meth:`ended` says when nothing of it can land any more.

        Raises:
            Internal: NIXL refused the descriptors (not registered, peer unknown).
        """
        loop = self._loop = asyncio.get_running_loop()
        with self._lock:
            self._cancel_overdue()
            agent = self._agent
            try:
                handle = agent.initialize_xfer(
                    "WRITE", agent.get_xfer_descs(local, local_kind),
                    agent.get_xfer_descs(remote, remote_kind), peer, notification)
            except Exception as exc:
                raise Internal(f"NIXL refused the write to {peer}: {type(exc).__name__}: "
                               f"{exc}") from exc
            row = remote[:1].copy()
            row[0, 1] = min(int(row[0, 1]), PROBE_BYTES)
            write = Write(handle, peer, remote_kind, row, deadline, loop.create_future())
            self._writes.add(write)
            try:
                agent.transfer(handle)
            except Exception:
                # Whether any of it was posted is not known: cancel it and let the probe tell.
                log.warning("NIXL could not post the write to %s", peer, exc_info=True)
                write.cancelled = True
            # Past its deadline already (a slow answer): cancelled before anything else moves.
            write.cancelled |= deadline <= time.monotonic()
            self._advance(write)  # a small write over shared memory is done already
        if write.ended is None:
            self._progress(loop).kick()
        return write

    @staticmethod
    def ended(write: Write) -> asyncio.Future[XferState]:
        """Resolves (on the event loop) to the state ``write`` ended in, once nothing of it
        can land any more: DONE, ERR, or CANCELLED."""
        return write.done

    def cancel(self, write: Write) -> None:
        """Ask NIXL to cancel a write (no-op once ended or cancelled): its handle is released
        and a flush probe posted; :meth:`ended` resolves to CANCELLED once the probe
        completed. Called on the event loop."""
        with self._lock:
            if write.ended is not None or write.cancelled:
                return
            write.cancelled = True
            self._advance(write)
        if write.ended is None:
            self._progress(asyncio.get_running_loop()).kick()

    def listen(self, mode: Listen, on_notes: Callable[[Notes], None]) -> None:
        """Read notifications (passed to ``on_notes`` on the event loop, by sending agent)
        while ``mode`` is not ``off``: every LIVE_POLL_S at most while a live receive window
        is open, every FENCED_POLL_S while only fenced ones are. Called on the event loop."""
        if mode == self._listen:
            return
        more = mode == "live" or self._listen == "off"
        self._listen, self._on_notes = mode, on_notes
        if more:
            self._progress(asyncio.get_running_loop()).kick()

    def close(self) -> None:
        """Stop the progress thread (shutdown; writes still in flight are not looked at any
        more)."""
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.close()

    @property
    def writes(self) -> int:
        """Posted writes not yet ended."""
        return len(self._writes)

    def _progress(self, loop: asyncio.AbstractEventLoop) -> Poller:
        self._loop = loop
        if self._poller is None:
            self._poller = Poller(self._step, f"nixl-progress-{os.getpid()}")
        return self._poller

    # -- the progress thread (every method below runs with the lock held) ---------------------

    def _step(self) -> tuple[bool, float | None]:
        """One pass of the progress thread: cancel overdue writes, look at every write in
        flight, read notifications while listening; post what it found to the loop."""
        notes: Notes = {}
        with self._lock:
            self._cancel_overdue()
            before = len(self._writes)
            for write in list(self._writes):
                self._advance(write)
            changed = len(self._writes) != before
            mode, on_notes = self._listen, self._on_notes
            if mode != "off":
                notes = self._agent.get_new_notifs()
            writing = bool(self._writes)
        if notes and on_notes is not None:
            self._post(on_notes, notes)
            changed = True
        cap = (WRITE_POLL_S if writing else LIVE_POLL_S if mode == "live"
               else FENCED_POLL_S if mode == "fenced" else None)
        return changed, cap

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop (dropped once the loop has closed)."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop closed: the daemon is gone

    def _advance(self, write: Write) -> None:
        """One look at a write: release a handle that ended, move a cancel along."""
        agent = self._agent
        if not write.cancelled:
            try:
                state = agent.check_xfer_state(write.handle)
            except Exception:
                log.warning("check_xfer_state failed", exc_info=True)
                state = "ERR"
            if state == "PROC":
                return
            if self._release(write.handle):
                write.handle = None
                self._end(write, "DONE" if state == "DONE" else "ERR")
            else:
                write.cancelled = True  # NIXL holds on to it: release, then probe
            return
        if write.handle is not None:
            if not self._release(write.handle):
                return  # retried at the next look
            write.handle = None
        if write.probe is None:
            try:
                write.probe = agent.initialize_xfer(
                    "READ", agent.get_xfer_descs(self._scratch_row(), "DRAM"),
                    agent.get_xfer_descs(write.probe_row, write.remote_kind), write.peer, b"")
                agent.transfer(write.probe)
            except Exception:
                log.warning("posting a flush probe to %s failed; retried at the next look",
                            write.peer, exc_info=True)
                if write.probe is not None and self._release(write.probe):
                    write.probe = None
                return
        try:
            state = agent.check_xfer_state(write.probe)
        except Exception:
            log.warning("check_xfer_state of a flush probe failed", exc_info=True)
            state = "ERR"
        if state != "PROC" and self._release(write.probe):
            write.probe = None
            self._end(write, "CANCELLED")

    def _scratch_row(self) -> np.ndarray:
        return np.array([[self._scratch.ctypes.data, PROBE_BYTES, 0]], dtype=np.uint64)

    def _end(self, write: Write, state: XferState) -> None:
        write.ended = state
        self._writes.discard(write)
        self._post(_resolve, write.done, state)

    def _release(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            log.warning("release_xfer_handle failed; retried at the next look", exc_info=True)
            return False
        return True

    def _cancel_overdue(self) -> None:
        """Cancel every posted write past its deadline, before anything progresses NIXL."""
        if not self._writes:
            return
        now = time.monotonic()
        for write in list(self._writes):
            if write.deadline <= now and not write.cancelled:
                write.cancelled = True
                self._advance(write)


def _resolve(done: asyncio.Future[XferState], state: XferState) -> None:
    if not done.done():  # its waiter may have been cancelled (shutdown)
        done.set_result(state)


def make_agent(adopt: Adopt | None = None) -> NixlAgent | None:
    """The daemon's agent, or None when NIXL is not installed (or cannot start: logged).

    Args:
        adopt: the daemon's log setup, to route NIXL's logger through it (:func:`load_nixl`).
    """
    nixl = load_nixl(adopt)
    if nixl is None:
        return None
    try:
        return NixlAgent(nixl)
    except Exception:
        log.exception("NIXL is installed but its agent did not start; transfers are off",
                      extra={"fields": {"event": "nixl_error"}})
        return None

"""The daemon's one NIXL agent: each pool's backing registered once, one-sided writes posted.

NIXL is optional (``kvpool[nixl]``, the ``nixl-cu12`` wheel, imported as ``nixl_cu12``; the
``nixl`` meta package's module is tried too). :func:`make_agent` returns None without it and
:data:`NIXL_MISSING` says what to install. The agent uses UCX (shared memory, TCP, RDMA, NVLink:
whatever UCX finds between the two daemons). Its calls are made on the daemon's event loop
thread, except registration of a new pool, which runs in Configure's worker thread; the agent
is created with NIXL's strict thread sync so that is safe.

Descriptors are ``(address, length, device)`` rows of a uint64 ``Nx3`` array (NIXL's own
format); nothing here pickles (NIXL's ``get_serialized_descs`` does, and is not used).

What a peer learns: each pool is its own registration, and a peer is only ever given the
metadata of the registration a grant names (NIXL partial metadata), never the whole agent's.

Write deadlines and cancellation: every posted write has a deadline, and before any call that
may progress NIXL's worker (posting, polling a write, reading notifications, loading a peer) the
agent cancels the writes past theirs. A cancel is NIXL's ``release_xfer_handle`` on a running
handle, and that does **not** stop the UCX operations already posted (measured: a released
256 MiB write over UCX TCP still landed whole afterwards): so a cancelled write counts as ended
only once a **flush probe** (a small READ of the same peer's memory, posted after the release on
the same connection) has completed (``DONE`` or ``ERR``), which UCX completes only after every
operation posted before it on that endpoint (measured: no byte of the cancelled write landed
after the probe completed, over UCX TCP and CMA). :meth:`NixlAgent.state` answers ``PROC``
until then; a write is *ended* (nothing of it can still land) when it answers anything else.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np
import torch

from kvpool.contract.errors import Internal

log = logging.getLogger("kvpoold.transfer")

NIXL_MISSING = (
    "transfers between daemons need NIXL in kvpoold's environment: from the repository "
    "root, pip install -e '.[server,nixl]' (the nixl-cu12 wheel; it runs on CPU too) and "
    "restart kvpoold"
)
# PROC: something of the write may still land; any other state: nothing can any more.
XferState = Literal["DONE", "PROC", "ERR", "CANCELLED"]
# A flush probe reads this many bytes of the peer's memory into a scratch registration.
PROBE_BYTES = 64
# Registrations of one peer agent whose metadata this agent keeps track of having loaded.
MAX_KNOWN_GENERATIONS = 64


NIXL_MODULES = ("nixl_cu12", "nixl")
# Makes a logger write through the given handlers only, at a level (the daemon's log setup).
Adopt = Callable[[logging.Logger, list[logging.Handler], int | str], None]


def nixl_installed() -> bool:
    """Whether a NIXL module is importable, without importing it (NIXL bundles its own
    protobuf and gRPC C++ libraries, which crash a process that also loads grpc_tools'
    compiler: the tests check with this and leave the import to the daemons)."""
    return any(importlib.util.find_spec(name) is not None for name in NIXL_MODULES)


def load_nixl(adopt: Adopt | None = None) -> ModuleType | None:
    """The NIXL Python module (``nixl_cu12``, else ``nixl``), or None when not installed.

    Args:
        adopt: how the daemon sets up a logger; given, NIXL's logger is put back through
            kvpoold's handlers after the import (see :func:`_rehome_nixl_logs`).
    """
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            if adopt is not None:
                _rehome_nixl_logs(adopt)
            return module
    return None


def _rehome_nixl_logs(adopt: Adopt) -> None:
    """NIXL's Python package installs its own handler at import (plain text, on stdout); put
    its records back through kvpoold's (``--log-format``, ``--log-level``, stderr), so
    ``--log-format json`` stays one JSON object per line."""
    daemon = logging.getLogger("kvpoold")
    adopt(logging.getLogger("nixl"), list(daemon.handlers), daemon.level)


def mem_type(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor: ``("DRAM", 0)`` or ``("VRAM", n)``."""
    dev = tensor.get_device()
    return ("DRAM", 0) if dev < 0 else ("VRAM", dev)


@dataclass(eq=False)
class Write:
    """One posted WRITE, until nothing of it can land any more (``ended`` set).

    ``probe_row`` is one row of the peer's memory the write targets (address, at most
    PROBE_BYTES, device): a cancelled write's flush probe reads it. ``ended`` is the state the
    write ended in: DONE / ERR as NIXL reported them (then released), or CANCELLED once the
    probe after its release completed.
    """

    handle: Any
    peer: str
    remote_kind: str
    probe_row: np.ndarray
    deadline: float
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
        # No progress thread: NIXL's spins (about a core's fifth, plus the loop thread it
        # contends with) even while the daemon is idle. The daemon progresses the agent itself
        # where it waits: the sender polls its write's state, the receiver its notifications,
        # both only while a transfer is in flight.
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

    # -- registration ----------------------------------------------------------------------

    def register(self, pool: str, backing: torch.Tensor) -> None:
        """Register a pool's whole backing region (one descriptor), under a new generation."""
        kind, dev = mem_type(backing)
        rows = [(backing.data_ptr(), backing.numel() * backing.element_size(), dev, pool)]
        self._regs[pool] = (self._agent.register_memory(rows, kind), next(self._generations))

    def deregister(self, pool: str) -> None:
        """Deregister a pool's region (no-op for one never registered)."""
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
        return bytes(self._agent.get_partial_agent_metadata(reg[0], True, ["UCX"]))

    def add_peer(self, metadata: bytes, generation: int) -> str:
        """Load a peer agent's metadata (one of its registrations); returns its name."""
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

    # -- transfers ---------------------------------------------------------------------------

    def post_write(self, local: np.ndarray, local_kind: str, remote: np.ndarray,
                   remote_kind: str, peer: str, notification: bytes,
                   deadline: float) -> tuple[Write, XferState]:
        """Post one WRITE of every ``local`` row into the matching ``remote`` row of ``peer``
        (memory types DRAM or VRAM on each side), with ``notification`` delivered to the peer
        when it is complete; cancelled if still running at ``deadline`` (``time.monotonic``).

        Returns:
            The write and its first state (see :meth:`state`).

        Raises:
            Internal: NIXL refused the descriptors (not registered, peer unknown).
        """
        self._cancel_overdue()
        agent = self._agent
        try:
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, local_kind),
                                           agent.get_xfer_descs(remote, remote_kind), peer,
                                           notification)
        except Exception as exc:
            raise Internal(f"NIXL refused the write to {peer}: {type(exc).__name__}: {exc}"
                           ) from exc
        row = remote[:1].copy()
        row[0, 1] = min(int(row[0, 1]), PROBE_BYTES)
        write = Write(handle, peer, remote_kind, row, deadline)
        self._writes.add(write)
        try:
            agent.transfer(handle)
        except Exception:
            # Whether any of it was posted is not known: cancel it and let the probe tell.
            log.warning("NIXL could not post the write to %s", peer, exc_info=True)
            self.cancel(write)
        return write, self.state(write)

    def state(self, write: Write) -> XferState:
        """Where a write is: ``PROC`` while any of its bytes may still land (running, or
        cancelled and its flush probe not yet completed), else how it ended."""
        self._cancel_overdue()
        if write.ended is None:
            self._advance(write)
        return write.ended or "PROC"

    def cancel(self, write: Write) -> None:
        """Ask NIXL to cancel a write (no-op once ended or cancelled): its handle is released
        and a flush probe posted; :meth:`state` says ``CANCELLED`` once the probe completed."""
        if write.ended is None and not write.cancelled:
            write.cancelled = True
            self._advance(write)

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

    def _release(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            log.warning("release_xfer_handle failed; retried at the next look", exc_info=True)
            return False
        return True

    @property
    def writes(self) -> int:
        """Posted writes not yet ended."""
        return len(self._writes)

    def _cancel_overdue(self) -> None:
        """Cancel every posted write past its deadline, before anything progresses NIXL."""
        if not self._writes:
            return
        now = time.monotonic()
        for write in list(self._writes):
            if write.deadline <= now and not write.cancelled:
                self.cancel(write)

    def notifications(self) -> dict[str, list[bytes]]:
        """New completion notifications, by sending agent."""
        self._cancel_overdue()
        return self._agent.get_new_notifs()  # type: ignore[no-any-return]


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

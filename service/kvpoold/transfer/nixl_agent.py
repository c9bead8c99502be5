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

Write deadlines: every posted write has one. Before any call that may progress NIXL's worker
(posting, polling a write, reading notifications, loading a peer) the agent cancels the writes
past their deadline, so a sender that was stopped (SIGSTOP, a long stall) never resumes a write
its receiver has stopped waiting for: the receiver gives the pages back at its fence.
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
XferState = Literal["DONE", "PROC", "ERR", "TIMEOUT"]
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
        # id(handle) -> (deadline, handle) of posted writes; overdue ones are cancelled
        self._writes: dict[int, tuple[float, Any]] = {}
        self._cancelled: set[int] = set()

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
                   deadline: float) -> tuple[Any, XferState]:
        """Post one WRITE of every ``local`` row into the matching ``remote`` row of ``peer``
        (memory types DRAM or VRAM on each side), with ``notification`` delivered to the peer
        when it is complete; cancelled if still running at ``deadline`` (``time.monotonic``).

        Returns:
            The transfer handle and its first state.

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
        try:
            state: XferState = agent.transfer(handle)  # type: ignore[assignment]
        except Exception as exc:
            self.release(handle)
            raise Internal(f"NIXL could not post the write to {peer}: "
                           f"{type(exc).__name__}: {exc}") from exc
        self._writes[id(handle)] = (deadline, handle)
        return handle, state

    def state(self, handle: Any) -> XferState:
        """A posted write's state; ``TIMEOUT`` once it was cancelled at its deadline."""
        self._cancel_overdue()
        if id(handle) in self._cancelled:
            return "TIMEOUT"
        try:
            return self._agent.check_xfer_state(handle)  # type: ignore[no-any-return]
        except Exception:
            log.warning("check_xfer_state failed", exc_info=True)
            return "ERR"

    def release(self, handle: Any) -> bool:
        """Free a write's handle, cancelling it if it still runs; False when NIXL could not
        (the handle then stays: it is tried again at every later call of this agent)."""
        if id(handle) in self._cancelled:
            self._cancelled.discard(id(handle))
            return True
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            log.warning("release_xfer_handle failed", exc_info=True)
            self._writes[id(handle)] = (0.0, handle)  # overdue now: retried by every call
            return False
        self._writes.pop(id(handle), None)
        return True

    def is_released(self, handle: Any) -> bool:
        """Whether a write's handle is gone (released, or cancelled and then released)."""
        return id(handle) not in self._writes and id(handle) not in self._cancelled

    def _cancel_overdue(self) -> None:
        """Cancel every posted write past its deadline, before anything progresses NIXL."""
        if not self._writes:
            return
        now = time.monotonic()
        for key, (deadline, handle) in list(self._writes.items()):
            if deadline > now:
                continue
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:
                log.warning("cancelling an overdue write failed; retried at the next call",
                            exc_info=True)
                continue
            del self._writes[key]
            self._cancelled.add(key)

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

"""The daemon's one NIXL agent: each pool's backing registered once, one-sided writes posted.

NIXL is optional (``kvpool[nixl]``, the ``nixl-cu12`` wheel, imported as ``nixl_cu12``; the
``nixl`` meta package's module is tried too). :func:`make_agent` returns None without it and
:data:`NIXL_MISSING` says what to install. The agent uses UCX (shared memory, TCP, RDMA, NVLink:
whatever UCX finds between the two daemons). Its calls are made on the daemon's event loop
thread, except registration of a new pool, which runs in Configure's worker thread; the agent
is created with NIXL's strict thread sync so that is safe.

Descriptors are ``(address, length, device)`` rows of a uint64 ``Nx3`` array (NIXL's own
format); nothing here pickles (NIXL's ``get_serialized_descs`` does, and is not used).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import secrets
import socket
from types import ModuleType
from typing import Any, Literal

import numpy as np
import torch

from kvpool.errors import Internal

log = logging.getLogger("kvpoold.transfer")

NIXL_MISSING = (
    "transfers between daemons need NIXL in kvpoold's environment: pip install "
    "'kvpool[nixl]' (the nixl-cu12 wheel; it runs on CPU too) and restart kvpoold"
)
XferState = Literal["DONE", "PROC", "ERR"]


NIXL_MODULES = ("nixl_cu12", "nixl")


def nixl_installed() -> bool:
    """Whether a NIXL module is importable, without importing it (NIXL bundles its own
    protobuf and gRPC C++ libraries, which crash a process that also loads grpc_tools'
    compiler: the tests check with this and leave the import to the daemons)."""
    return any(importlib.util.find_spec(name) is not None for name in NIXL_MODULES)


def load_nixl() -> ModuleType | None:
    """The NIXL Python module (``nixl_cu12``, else ``nixl``), or None when not installed."""
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    return None


def mem_type(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor: ``("DRAM", 0)`` or ``("VRAM", n)``."""
    dev = tensor.get_device()
    return ("DRAM", 0) if dev < 0 else ("VRAM", dev)


class NixlAgent:
    """One NIXL agent of a daemon; its name is fresh per process, so a restarted peer is seen
    as a new agent (its metadata is fetched again).

    Attributes:
        name: the agent's name (``kvpoold-<host>-<pid>-<hex>``).
        generation: bumped at every registration change: peers that cached this agent's
            metadata at another generation fetch it again.
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
        self.generation = 1
        self._regs: dict[str, Any] = {}
        self._peers: dict[str, int] = {}  # remote agent -> generation loaded

    # -- registration ----------------------------------------------------------------------

    def register(self, pool: str, backing: torch.Tensor) -> None:
        """Register a pool's whole backing region (one descriptor)."""
        kind, dev = mem_type(backing)
        rows = [(backing.data_ptr(), backing.numel() * backing.element_size(), dev, pool)]
        self._regs[pool] = self._agent.register_memory(rows, kind)
        self.generation += 1

    def deregister(self, pool: str) -> None:
        """Deregister a pool's region (no-op for one never registered)."""
        reg = self._regs.pop(pool, None)
        if reg is None:
            return
        try:
            self._agent.deregister_memory(reg)
        finally:
            self.generation += 1

    @property
    def registered(self) -> tuple[str, ...]:
        return tuple(self._regs)

    # -- peers -----------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata (NIXL's format), for a peer's :meth:`add_peer`."""
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes, generation: int) -> str:
        """Load (or reload) a peer agent's metadata; returns its name."""
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers[name] = generation
        return name

    def peer_generation(self, agent: str) -> int:
        """The generation of ``agent``'s metadata loaded here (0: none)."""
        return self._peers.get(agent, 0)

    def forget_peer(self, agent: str) -> None:
        if self._peers.pop(agent, None) is not None:
            try:
                self._agent.remove_remote_agent(agent)
            except Exception:  # already gone on NIXL's side: nothing to undo
                log.debug("remove_remote_agent %s failed", agent, exc_info=True)

    # -- transfers ---------------------------------------------------------------------------

    def post_write(self, local: np.ndarray, local_kind: str, remote: np.ndarray,
                   remote_kind: str, peer: str, notification: bytes) -> tuple[Any, XferState]:
        """Post one WRITE of every ``local`` row into the matching ``remote`` row of ``peer``
        (memory types DRAM or VRAM on each side), with ``notification`` delivered to the peer
        when it is complete.

        Returns:
            The transfer handle and its first state.

        Raises:
            Internal: NIXL refused the descriptors (not registered, peer unknown).
        """
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
        return handle, state

    def state(self, handle: Any) -> XferState:
        try:
            return self._agent.check_xfer_state(handle)  # type: ignore[no-any-return]
        except Exception:
            log.warning("check_xfer_state failed", exc_info=True)
            return "ERR"

    def release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            log.warning("release_xfer_handle failed", exc_info=True)

    def notifications(self) -> dict[str, list[bytes]]:
        """New completion notifications, by sending agent."""
        return self._agent.get_new_notifs()  # type: ignore[no-any-return]


def make_agent() -> NixlAgent | None:
    """The daemon's agent, or None when NIXL is not installed (or cannot start: logged)."""
    nixl = load_nixl()
    if nixl is None:
        return None
    try:
        return NixlAgent(nixl)
    except Exception:
        log.exception("NIXL is installed but its agent did not start; transfers are off",
                      extra={"fields": {"event": "nixl_error"}})
        return None

"""The backing interface: where a pool's one region lives and how another process maps it.

The daemon asks a :class:`BackingFactory` for a region of ``nbytes`` per pool, builds the views
over ``backing.tensor`` (see ``kvpoold.pools.build_pool(allocate=...)``), and hands
``backing.handle()`` to clients on Attach. A handle is plain data (path and size, or CUDA IPC
handle bytes and a device UUID): it crosses the wire as typed proto fields, never as a pickle.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpool.contract.errors import FailedPrecondition

# The handle is the client's type (torch-free, shared by both sides); re-exported here.
from kvpool.contract.shared_handle import SharedHandle, Sharing

__all__ = [
    "Backing",
    "BackingFactory",
    "FdGrant",
    "GroupBacking",
    "PlainBacking",
    "PlainBackingFactory",
    "Region",
    "SharedHandle",
    "Sharing",
]


class Backing(Protocol):
    """One pool's region, owned by the daemon."""

    @property
    def sharing(self) -> Sharing:
        """How the region is shared (the ``sharing`` of :meth:`handle`), known without exporting
        anything."""
        ...

    @property
    def tensor(self) -> torch.Tensor:
        """The region as a flat, zero-filled uint8 tensor of exactly the requested bytes."""
        ...

    def handle(self) -> SharedHandle:
        """What a client needs to map the region (kind ``none`` if it cannot be shared).

        Called once per Attach: a CUDA IPC export is good for one importer, so each call
        makes a fresh one; call it only to hand the result to a client.
        """
        ...

    def close(self) -> None:
        """Release the region (unmap, unlink). Idempotent."""
        ...


class GroupBacking(Backing, Protocol):
    """An elastic pool's region (``plan.elastic``): the whole virtual range addressable, memory
    only behind the fixed part and the granted groups."""

    def grant(self, group: int) -> None:
        """Back group ``group`` (every view's chunks of it) with memory; all or nothing.
        Blocking (milliseconds a group): the daemon calls it off its event loop.

        Raises:
            ResourceExhausted: the device cannot provide the memory (nothing changed).
        """
        ...

    def release(self, group: int) -> None:
        """Free group ``group``'s memory; every process has unmapped it. Blocking."""
        ...

    def backed_bytes(self) -> int:
        """Memory behind the region now, as the kernel or driver counts it."""
        ...


@dataclass(frozen=True)
class FdGrant:
    """What to send for an ask of parts: ``fds[i]`` backs ``ranges[i]`` (offset, length) of
    a region of ``size`` bytes, in the order of :mod:`kvpool.contract.fd_channel`.

    Attributes:
        owned: the descriptors are fresh exports for this answer; the server closes them
            after sending (or failing to).
    """

    fds: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    size: int
    kind: str
    owned: bool = True

    def close(self) -> None:
        """Close the descriptors if owned. Idempotent only in effect: call once."""
        if self.owned:
            for fd in self.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


class BackingFactory(Protocol):
    """Creates backings on one device; owns crash cleanup for what it created."""

    @property
    def device(self) -> torch.device: ...

    def create(self, nbytes: int, pool_name: str) -> Backing:
        """A new zero-filled region of ``nbytes`` for pool ``pool_name``.

        Raises:
            ResourceExhausted: when the device cannot provide the bytes.
        """
        ...

    def close(self) -> None:
        """Release everything this factory created and its instance lock. Idempotent."""
        ...


class Region:
    """What a shared backing holds: ``nbytes`` of region as a flat tensor until it is closed.

    Subclasses say how the region is named in messages (:meth:`describe`) and how it is shared.
    """

    def __init__(self, tensor: torch.Tensor, nbytes: int) -> None:
        self._tensor: torch.Tensor | None = tensor
        self.nbytes = nbytes

    def describe(self) -> str:
        """The region in messages (``"shared-memory region kvpool-x"``)."""
        return "region"

    @property
    def tensor(self) -> torch.Tensor:
        """The region as a flat, zero-filled uint8 tensor of exactly ``nbytes``.

        Raises:
            FailedPrecondition: after close.
        """
        if self._tensor is None:
            raise FailedPrecondition(f"{self.describe()} is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None


@dataclass
class PlainBacking:
    """Unshared device memory (``torch.zeros``): for tests and ``--sharing none``."""

    _tensor: torch.Tensor

    @property
    def sharing(self) -> Sharing:
        return "none"

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    def handle(self) -> SharedHandle:
        return SharedHandle(sharing="none", size=self._tensor.numel())

    def close(self) -> None:
        self._tensor = torch.empty(0, dtype=torch.uint8)


@dataclass
class PlainBackingFactory:
    """Factory of :class:`PlainBacking` on ``device``."""

    _device: torch.device

    @property
    def device(self) -> torch.device:
        return self._device

    def create(self, nbytes: int, pool_name: str) -> PlainBacking:
        return PlainBacking(torch.zeros(nbytes, dtype=torch.uint8, device=self._device))

    def close(self) -> None:
        return None

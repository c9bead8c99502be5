"""Build a pool from a plan: one backing region, named typed views carved from it.

Only this package (and ``sharing/``) touches torch memory. A builder per architecture is
registered in :data:`BUILDERS`; most carve the plan's buffers and leave them zeroed, the ones with
special initial contents (DSV4 compress-state score rows) add their own step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpool.dtypes import torch_dtype
from kvpool.errors import InvalidArgument
from kvpool.plan import BufferSpec, PoolPlan

# (nbytes, device) -> a zero-filled, 1-D uint8 tensor of exactly nbytes on that device.
AllocateFn = Callable[[int, torch.device], torch.Tensor]
BuilderFn = Callable[[PoolPlan, torch.Tensor], dict[str, torch.Tensor]]


def allocate_zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    """The default backing: plain device memory, zero-filled."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def carve(plan: PoolPlan, backing: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of every buffer of ``plan`` over ``backing`` (no copies).

    Raises:
        InvalidArgument: when the backing is smaller than the plan's region or not flat uint8.
    """
    if backing.dtype != torch.uint8 or backing.dim() != 1:
        raise InvalidArgument(f"backing must be a flat uint8 tensor, got {backing.dtype} "
                              f"with shape {tuple(backing.shape)}")
    if backing.numel() < plan.backing_bytes:
        raise InvalidArgument(
            f"backing has {backing.numel():,} B, the plan needs {plan.backing_bytes:,} B"
        )
    return {b.name: view_of(backing, b) for b in plan.buffers}


def view_of(backing: torch.Tensor, spec: BufferSpec) -> torch.Tensor:
    """One typed view of ``backing`` at ``spec.offset_bytes``."""
    raw = backing[spec.offset_bytes : spec.offset_bytes + spec.nbytes]
    return raw.view(torch_dtype(spec.dtype)).view(spec.shape)


def _build_dsv4(plan: PoolPlan, backing: torch.Tensor) -> dict[str, torch.Tensor]:
    from kvpoold.pools.dsv4 import build_dsv4  # its own module; imports this one for carve

    return build_dsv4(plan, backing)


BUILDERS: dict[str, BuilderFn] = {
    "mha": carve,
    "mla": carve,
    "dsa": carve,
    "hybrid_swa": carve,
    "all_swa": carve,
    "hybrid_linear": carve,
    "dsv4": _build_dsv4,
}


@dataclass
class PoolBuffers:
    """A built pool: its plan, the backing region and the named views over it."""

    plan: PoolPlan
    device: torch.device
    backing: torch.Tensor
    views: dict[str, torch.Tensor] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return self.backing.numel()


def build_pool(
    plan: PoolPlan,
    device: str | torch.device = "cpu",
    allocate: AllocateFn = allocate_zeros,
) -> PoolBuffers:
    """Allocate one region of ``plan.backing_bytes`` on ``device`` and carve the views.

    Args:
        plan: from :func:`kvpool.plan`.
        device: ``cpu`` or ``cuda:N``; the same code serves both.
        allocate: where the region comes from (plain memory, shared memory, CUDA IPC-able).

    Raises:
        InvalidArgument: for an architecture with no registered builder (lists the known ones).
    """
    builder = BUILDERS.get(plan.architecture)
    if builder is None:
        raise InvalidArgument(
            f"no builder for architecture {plan.architecture!r} "
            f"(known: {', '.join(sorted(BUILDERS))})",
            field="architecture",
        )
    dev = torch.device(device)
    backing = allocate(plan.backing_bytes, dev)
    return PoolBuffers(plan=plan, device=dev, backing=backing, views=builder(plan, backing))

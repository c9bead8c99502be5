"""Build a pool from a plan: one backing region, named typed views carved from it, each buffer
filled as the plan's buffer list says.

Only this package (and ``sharing/``) touches torch memory. Nothing here knows an architecture:
the plan's ``buffers`` say where each view lies and what it holds before anyone writes it
(``BufferSpec.fill``), and :data:`FILLS` writes each fill over the zero-filled backing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpool.contract.dtypes import torch_dtype
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import BufferFill, BufferSpec, PoolPlan

# (nbytes, device) -> a zero-filled, 1-D uint8 tensor of exactly nbytes on that device.
AllocateFn = Callable[[int, torch.device], torch.Tensor]


def allocate_zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    """The default backing: plain device memory, zero-filled."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def carve(plan: PoolPlan, backing: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of every buffer of ``plan`` over ``backing`` (no copies, nothing written).

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


def _kv_score(view: torch.Tensor) -> None:
    # SGLang clears only the sentinel row of a DSV4 compress state (the last one, which
    # position -1 reads) and leaves the rest uninitialized; writing every score keeps a
    # never-written slot harmless too.
    view[..., view.shape[-1] // 2 :].fill_(float("-inf"))


# What each fill writes over a zero-filled view (zeros: nothing).
FILLS: dict[BufferFill, Callable[[torch.Tensor], None]] = {
    BufferFill.zeros: lambda view: None,
    BufferFill.kv_score: _kv_score,
}


def fill(plan: PoolPlan, views: dict[str, torch.Tensor]) -> None:
    """Write every buffer's initial contents (``BufferSpec.fill``) into its zero-filled view."""
    for spec in plan.buffers:
        FILLS[spec.fill](views[spec.name])


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
    """Allocate one region of ``plan.backing_bytes`` on ``device``, carve the plan's views and
    fill them.

    Args:
        plan: from :func:`kvpool.contract.plan`.
        device: ``cpu`` or ``cuda:N``; the same code serves both.
        allocate: where the region comes from (plain memory, shared memory, CUDA IPC-able);
            it must come zero-filled.

    Raises:
        InvalidArgument: a backing that does not hold the plan's region.
    """
    dev = torch.device(device)
    backing = allocate(plan.backing_bytes, dev)
    views = carve(plan, backing)
    fill(plan, views)
    return PoolBuffers(plan=plan, device=dev, backing=backing, views=views)

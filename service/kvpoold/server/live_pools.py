"""One built pool as the daemon keeps it: plan, backing region, views and allocator together.

:func:`build_entry` is the blocking part of Configure (allocating and zeroing the region); the
daemon runs it in a worker thread on objects no other call can see until it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from kvpool.errors import Internal
from kvpool.plan import FULL_TO_SWA, PoolPlan
from kvpoold.ids import Kind, PoolAllocator, PoolCounters
from kvpoold.pools import Pool, build_pool
from kvpoold.sharing.base import Backing, BackingFactory


def plan_json_text(plan: PoolPlan) -> str:
    """The plan exactly as ``kvpoold plan --json`` prints it."""
    return msgspec.json.format(plan.to_json(), indent=2).decode() + "\n"


@dataclass
class PoolEntry:
    """A built pool, as the daemon keeps it."""

    name: str
    plan: PoolPlan
    fingerprint: str
    plan_json: str
    backing: Backing
    pool: Pool
    allocator: PoolAllocator
    created_at: float

    @property
    def handle_kind(self) -> str:
        """shm, cuda_ipc or none; Attach exports a fresh handle each time (backing.handle())."""
        return self.backing.handle_kind

    def counters(self) -> dict[Kind, PoolCounters]:
        return self.allocator.stats()

    def close(self) -> None:
        """Release the backing region (idempotent)."""
        self.backing.close()


def device_mirror(device_view: torch.Tensor) -> tuple[np.ndarray, Callable[[np.ndarray], None]]:
    """A host copy of a 1-D device buffer, and the function that copies written entries over.

    The allocator writes ``host[idx]`` under its lock and calls ``sync(idx)``; the copy is
    O(len(idx)) and synchronous, so an engine that gets the ids back sees the entries.
    """
    host = torch.zeros(device_view.shape, dtype=device_view.dtype)
    host_np = host.numpy()

    def sync(idx: np.ndarray) -> None:
        index = torch.from_numpy(idx)
        device_view[index.to(device_view.device)] = host[index].to(device_view.device)

    return host_np, sync


def make_allocator(name: str, plan: PoolPlan, views: dict[str, torch.Tensor]) -> PoolAllocator:
    """The allocator of a pool: KV pages ``1..num_pages``, SWA pages (hybrid), request rows
    ``1..max_running_requests`` and mamba state slots ``1..mamba_cache_size``.

    Raises:
        Internal: a hybrid plan without its ``full_to_swa`` buffer.
    """
    full_to_swa: np.ndarray | None = None
    on_write: Callable[[np.ndarray], None] | None = None
    swa_pages = plan.swa_num_pages or 0
    if swa_pages:
        if FULL_TO_SWA not in views:
            raise Internal(f"pool {name}: a plan with SWA pages has no {FULL_TO_SWA} buffer")
        view = views[FULL_TO_SWA].reshape(-1)
        if view.device.type == "cpu":
            full_to_swa = view.numpy()
        else:
            # The allocator writes numpy: it gets a host copy and every write is mirrored.
            full_to_swa, on_write = device_mirror(view)
    return PoolAllocator(
        name,
        kv_pages=plan.num_pages,
        swa_pages=swa_pages,
        full_to_swa=full_to_swa,
        full_to_swa_on_write=on_write,
        req_rows=plan.max_running_requests,
        state_slots=plan.mamba_cache_size or 0,
    )


def build_entry(
    name: str,
    plan: PoolPlan,
    factory: BackingFactory,
    created_at: float,
) -> PoolEntry:
    """Create the backing region through ``factory``, carve the views, make the allocator.

    Blocking (the region is allocated and zero-filled): run it in a worker thread.

    Raises:
        ResourceExhausted: the device cannot provide the bytes (from the factory).
        InvalidArgument: an architecture without a builder.
    """
    backing = factory.create(plan.backing_bytes, name)
    try:
        pool = build_pool(plan, factory.device, allocate=lambda _n, _d: backing.tensor)
        allocator = make_allocator(name, plan, pool.views)
    except BaseException:
        backing.close()
        raise
    return PoolEntry(
        name=name,
        plan=plan,
        fingerprint=plan.fingerprint(),
        plan_json=plan_json_text(plan),
        backing=backing,
        pool=pool,
        allocator=allocator,
        created_at=created_at,
    )

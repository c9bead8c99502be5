"""One built pool as the daemon keeps it: plan, backing region, buffers and id spaces together.

:func:`build_live_pool` is the blocking part of Configure (allocating and zeroing the region);
the daemon runs it in a worker thread on objects no other call can see until it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvpool.contract.codec import plan_to_json
from kvpool.contract.errors import FailedPrecondition, Internal
from kvpool.contract.plan import PoolPlan
from kvpoold.ids import MappingBuffer, PoolIds
from kvpoold.ids.grouped import GroupedSpace
from kvpoold.pools import PoolBuffers, build_pool
from kvpoold.sharing.base import Backing, BackingFactory


@dataclass
class LivePool:
    """A built pool, as the daemon keeps it."""

    name: str
    plan: PoolPlan
    fingerprint: str
    plan_json: str
    backing: Backing
    buffers: PoolBuffers
    ids: PoolIds
    created_at: float

    @property
    def space_kv(self) -> GroupedSpace:
        """An elastic pool's page space (its groups)."""
        space = self.ids.space("kv", "space")
        assert isinstance(space, GroupedSpace)
        return space

    @property
    def sharing(self) -> str:
        """shm, cuda_ipc or none; Attach exports a fresh handle each time (backing.handle())."""
        return self.backing.sharing

    def close(self) -> None:
        """Release the backing region (idempotent)."""
        self.backing.close()


def device_mirror(device_view: torch.Tensor) -> tuple[np.ndarray, Callable[[np.ndarray], None]]:
    """A host copy of a 1-D device buffer, and the function that copies written entries over.

    The id spaces write ``host[idx]`` and call ``sync(idx)``, which copies those entries to the
    device and waits for the copy: engines in other processes read the device buffer as soon
    as the Allocate reply reaches them, so the write must be complete before the daemon
    answers (a cross-process reader is not ordered by this process's stream). O(len(idx)).
    """
    host = torch.zeros(device_view.shape, dtype=device_view.dtype)
    host_np = host.numpy()
    device = device_view.device

    def sync(idx: np.ndarray) -> None:
        index = torch.from_numpy(idx)
        device_view[index.to(device)] = host[index].to(device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    return host_np, sync


def make_pool_ids(name: str, plan: PoolPlan, views: dict[str, torch.Tensor]) -> PoolIds:
    """The id spaces of a pool, from the plan's table; each mapping buffer a following space
    writes is handed over as numpy (a device buffer through a host mirror, see
    :func:`device_mirror`).

    Raises:
        Internal: a following space whose mapping buffer the plan does not carve.
    """
    mappings: dict[str, MappingBuffer] = {}
    for space in plan.id_spaces:
        if space.mapping is None or space.mapping in mappings:
            continue
        if space.mapping not in views:
            raise Internal(f"pool {name}: id space {space.name} maps through buffer "
                           f"{space.mapping!r}, which the plan does not have")
        view = views[space.mapping].reshape(-1)
        if view.device.type == "cpu":
            mappings[space.mapping] = MappingBuffer(view.numpy())
        else:
            mappings[space.mapping] = MappingBuffer(*device_mirror(view))
    grouped = None if plan.elastic is None else {"kv": plan.elastic.pages_per_group}
    return PoolIds(name, plan.id_spaces, mappings, grouped)


def build_live_pool(
    name: str,
    plan: PoolPlan,
    factory: BackingFactory,
    created_at: float,
) -> LivePool:
    """Create the backing region through ``factory``, carve the buffers, make the id spaces.

    Blocking (the region is allocated and zero-filled): run it in a worker thread.

    Raises:
        ResourceExhausted: the device cannot provide the bytes (from the factory).
        InvalidArgument: an architecture without a builder.
    """
    if plan.elastic is None:
        backing: Backing = factory.create(plan.backing_bytes, name)
    else:
        create_elastic = getattr(factory, "create_elastic", None)
        if create_elastic is None:
            raise FailedPrecondition(
                f"pool {name!r}: this daemon's memory cannot back an elastic pool (its "
                f"sharing gives {type(factory).__name__}); elastic pools need shared memory "
                "on CPU (--sharing shm) or CUDA VMM on GPU (pip install kvpool[cuda]); "
                "Configure without --elastic", field="elastic")
        backing = create_elastic(plan, name)
    try:
        buffers = build_pool(plan, factory.device, allocate=lambda _n, _d: backing.tensor)
        ids = make_pool_ids(name, plan, buffers.views)
    except BaseException:
        backing.close()
        raise
    return LivePool(
        name=name,
        plan=plan,
        fingerprint=plan.fingerprint(),
        plan_json=plan_to_json(plan),
        backing=backing,
        buffers=buffers,
        ids=ids,
        created_at=created_at,
    )

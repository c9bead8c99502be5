"""One pool as the daemon keeps it: the aggregate that alone changes its state.

A :class:`Pool` owns its plan, its backing region and buffers, its page ledger (``ids``: each
page's state, pins and quarantine; an elastic pool's per-group state table lives in its ``kv``
space, :class:`~kvpoold.ids.grouped.GroupedSpace`) and its **lifecycle**::

    live -> dropping -> closed

Everything that works on the pool's memory outside one event-loop step (a transfer's pins, an
elastic group committed or freed in a worker thread, an attachment) holds a **use**
(:meth:`Pool.acquire`, released in ``finally``). A Drop moves the pool to ``dropping``: new work
is not started on it, and its owner (:class:`~kvpoold.pools.registry.PoolRegistry`) is told
when the last use ends, to release the region (off the loop) and the budget: "when is this
memory really free?" is answered here, once. :meth:`Pool.audit` checks every invariant of the
ledger, the groups and the lifecycle.

:func:`open_pool` is the blocking part of Configure (allocating and zeroing the region); the
daemon runs it in a worker thread on objects no other call can see until it returns.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from kvpool.contract.codec import plan_to_json
from kvpool.contract.errors import FailedPrecondition, Internal
from kvpool.contract.plan import PoolPlan
from kvpoold.ids import MappingBuffer, PoolIds
from kvpoold.ids.grouped import GroupedSpace
from kvpoold.pools.builder import PoolBuffers, build_pool
from kvpoold.sharing.base import Backing, BackingFactory

log = logging.getLogger("kvpoold.pools")

Lifecycle = Literal["live", "dropping", "closed"]


@dataclass
class Pool:
    """A built pool, as the daemon keeps it."""

    name: str
    plan: PoolPlan
    fingerprint: str
    plan_json: str
    backing: Backing
    buffers: PoolBuffers
    ids: PoolIds
    created_at: float
    state: Lifecycle = "live"
    # uses held now, by what holds them (transfer, elastic, ...): O(kinds) to read
    uses: Counter[str] = field(default_factory=Counter)
    # budget bytes the pool still takes while dropping (set by Drop)
    charged_bytes: int = 0
    _on_idle: Callable[[Pool], None] | None = None

    @property
    def live(self) -> bool:
        return self.state == "live"

    def acquire(self, holder: str) -> Callable[[], None]:
        """Take a use of the pool for ``holder`` (a transfer, an elastic worker); returns the
        function that gives it back, once (call it in ``finally``). A dropping pool still
        lends uses to work already started on it (an unpin, a release), never to new work:
        callers check :attr:`live` before starting.

        Raises:
            Internal: the pool is closed (its memory is gone).
        """
        if self.state == "closed":
            raise Internal(f"pool {self.name!r} is closed: {holder} cannot use its memory")
        self.uses[holder] += 1
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            self.uses[holder] -= 1
            if not self.uses[holder]:
                del self.uses[holder]
            if self.state == "dropping" and not self.uses:
                self._idle()

        return release

    @contextlib.contextmanager
    def use(self, holder: str) -> Iterator[None]:
        """:meth:`acquire` for the length of a block."""
        release = self.acquire(holder)
        try:
            yield
        finally:
            release()

    def drop(self, charged_bytes: int, on_idle: Callable[[Pool], None]) -> bool:
        """Start dropping: no new work; ``on_idle(pool)`` runs when nothing uses the pool any
        more (it then closes it, :meth:`close`): now, or when its last use ends. Returns
        whether it ran now.

        Raises:
            Internal: the pool is not live.
        """
        if self.state != "live":
            raise Internal(f"drop pool {self.name!r}: it is {self.state}")
        self.state = "dropping"
        self.charged_bytes = charged_bytes
        self._on_idle = on_idle
        if self.uses:
            log.warning("pool dropped while in use: its memory goes when the uses end",
                        extra={"fields": {"event": "drop_draining", "pool": self.name,
                                          "uses": dict(self.uses)}})
            return False
        self._idle()
        return True

    def _idle(self) -> None:
        then, self._on_idle = self._on_idle, None
        if then is not None:
            then(self)

    def audit(self) -> None:
        """Every invariant of the pool: its ledger's (ids, pins, quarantine, an elastic pool's
        groups) and its lifecycle's.

        Raises:
            Internal: naming the first broken one.
        """
        self.ids.audit()
        if any(n <= 0 for n in self.uses.values()):
            raise Internal(f"pool {self.name!r}: use counts {dict(self.uses)}")
        if self.state == "closed" and self.uses:
            raise Internal(f"pool {self.name!r} is closed with uses {dict(self.uses)}")
        if self.state == "dropping" and not self.uses and self._on_idle is not None:
            raise Internal(f"pool {self.name!r} is dropping, unused, and nobody was told")
        if self.state == "live" and self.charged_bytes:
            raise Internal(f"pool {self.name!r} is live with a drop charge")

    def check_movable(self) -> None:
        """Whether the pool's pages may move between daemons: neither elastic nor vLLM-layout.

        Raises:
            FailedPrecondition: naming which.
        """
        if self.plan.elastic is not None:
            raise FailedPrecondition(
                f"pool {self.name!r} is elastic: moving its pages between daemons is not "
                "supported yet; Configure the pools of a prefill/decode pair without --elastic",
                field="pool")
        if self.plan.vllm is not None:
            raise FailedPrecondition(
                f"pool {self.name!r} has vLLM's layout: moving its blocks between daemons is "
                "not supported yet (a block's bytes are strided over vLLM's KV-cache tensors)",
                field="pool")

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
        """Release the backing region now (blocking for a large region: its owner calls it in
        a worker thread), whatever uses it at shutdown or after a failed build; idempotent."""
        if self.state != "closed":
            self.state = "closed"
            self.uses.clear()
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


def open_pool(
    name: str,
    plan: PoolPlan,
    factory: BackingFactory,
    created_at: float,
) -> Pool:
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
    return Pool(
        name=name,
        plan=plan,
        fingerprint=plan.fingerprint(),
        plan_json=plan_to_json(plan),
        backing=backing,
        buffers=buffers,
        ids=ids,
        created_at=created_at,
    )

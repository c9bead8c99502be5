"""One pool as the daemon keeps it: the aggregate that alone changes its state.

A :class:`Pool` owns its plan, its backing region and buffers, its page ledger (``ids``: each
page's state, pins and quarantine; an elastic pool's per-group state table lives in its ``kv``
space, :class:`~kvpoold.ids.grouped.GroupedSpace`) and its **lifecycle**::

    live -> dropping -> closed

Everything that works on the pool's memory outside one event-loop step (a transfer's pins, an
elastic group committed or freed in a worker thread, an attachment) holds a **use**
(:meth:`Pool.acquire`, released in ``finally``). A Drop moves the pool to ``dropping``: new work
is not started on it, and its owner (:class:`~kvpoold.pools.pool_registry.PoolRegistry`) is told
when the last use ends, to release the region (off the loop) and the budget: "when is this
memory really free?" is answered here, once. :meth:`Pool.audit` checks every invariant of the
ledger, the groups and the lifecycle.

:func:`open_pool` is the blocking part of Configure (allocating and zeroing the region); the
daemon runs it in a worker thread on objects no other call can see until it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from kvpool.contract.codec import plan_to_json
from kvpool.contract.errors import FailedPrecondition, Internal, ResourceExhausted
from kvpool.contract.plan import PoolPlan
from kvpoold.ids import MappingBuffer, PoolIds
from kvpoold.ids.grouped import GroupedSpace
from kvpoold.ids.pool_ids import Grant
from kvpoold.ids.space import IdSpace
from kvpoold.pools.builder import PoolBuffers, build_pool
from kvpoold.pools.sealed import SealedDirectory, kv_extents
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
    # device copies of mapping buffers the id spaces write (a CUDA pool's full_to_swa)
    mirrors: list[DeviceMirror] = field(default_factory=list)
    # sealed pages kept for the next engine (kvpoold.pools.sealed): made at the first Seal
    sealed: SealedDirectory | None = None

    # -- pages: the ledger, with sealed pages kept past their lease -------------------------

    def directory(self, clock: Callable[[], float]) -> SealedDirectory:
        """The pool's sealed directory, made at the first use.

        Raises:
            FailedPrecondition: a pool whose pages other ids follow or index (hybrid SWA,
                DSA, compressed KV, a hybrid vLLM pool): not sealable yet.
        """
        if self.sealed is None:
            self.check_sealable()
            self.sealed = SealedDirectory(self.kv_space(), self.plan.page_size, clock)
        return self.sealed

    def check_sealable(self) -> None:
        """Refuse a pool whose pages cannot be sealed (see :meth:`directory`); changes nothing.
        An elastic pool is sealable: its kept pages hold their groups open until a reclaim
        asks for them (:meth:`give_back_sealed`, before any page cache)."""
        kv_extents(self.plan)  # refuses a pool whose pages are not sealable

    def kv_space(self) -> IdSpace:
        """The pool's KV page space."""
        return self.ids.space("kv", "space")

    def _lease_sealed(self) -> bool:
        """Whether any lease holds a sealed page now (O(1))."""
        d = self.sealed
        return d is not None and len(d.entries) > len(d.orphans)

    def allocate(self, owner: int, items: Sequence[tuple[IdSpace, int]], *,
                 evict: bool = True) -> list[Grant]:
        """``PoolIds.allocate``; when the kv space is short and the directory holds pages, as
        many as it lacks are given back first, chains from their end (sealed pages yield
        before any live page). ``evict=False``: refuse instead (an elastic pool asks for
        groups first, and evicts only when none can come).

        Raises:
            As ``PoolIds.allocate``.
        """
        try:
            return self.ids.allocate(owner, items)
        except ResourceExhausted:
            d = self.sealed
            if not evict or d is None or not d.orphans:
                raise
            want = sum(n for space, n in items if space is d.space)
            short = want - d.space.num_free
            if short <= 0 or short > len(d.orphans):  # even all of them would not do: keep them
                raise
            d.evict(short)
            return self.ids.allocate(owner, items)

    @property
    def kept_sealed(self) -> int:
        """Sealed pages the directory keeps (no lease holds them): evictable cache (O(1))."""
        return 0 if self.sealed is None else len(self.sealed.orphans)

    def give_back_sealed(self, count: int, min_id: int = 0) -> int:
        """Evict up to ``count`` kept sealed pages, only ids ``>= min_id`` when it is > 1 (an
        elastic reclaim's groups); returns how many were freed."""
        d = self.sealed
        if d is None or not d.orphans or count <= 0:
            return 0
        return int(d.evict_from(min_id, count).shape[0])

    def adoptable(self, d: SealedDirectory, layout: str) -> tuple[list[int], int, int]:
        """:meth:`SealedDirectory.candidates`; in an elastic pool only pages of open groups (a
        kept page of a group being drained is evicted for the pool it goes to, not handed to a
        lease that would hold the group back). O(kept)."""
        ids, unfenced, other = d.candidates(layout)
        if self.plan.elastic is None or not ids:
            return ids, unfenced, other
        space = self.space_kv
        per = space.pages_per_group
        is_open = {g: space.state(g) == "open" for g in {u // per for u in ids}}
        return [u for u in ids if is_open[u // per]], unfenced, other

    def free(self, owner: int, items: Sequence[tuple[IdSpace, np.ndarray]]) -> dict[str, int]:
        """``PoolIds.free``, all or none; a sealed page the lease frees passes to the directory
        instead of the free set.

        Raises:
            As ``PoolIds.free`` (nothing is changed).
        """
        d = self.sealed
        if not self._lease_sealed():
            return self.ids.free(owner, items)
        assert d is not None
        kept: list[np.ndarray] = []
        rest: list[tuple[IdSpace, np.ndarray]] = []
        for space, ids in items:
            if space is not d.space:
                rest.append((space, ids))
                continue
            idx = ids.astype(np.intp)
            inside = (idx >= 1) & (idx <= space.capacity)
            sealed = np.zeros(idx.shape[0], dtype=bool)
            sealed[inside] = d.sealed_mask(idx[inside])
            if sealed.any():
                if space.check(owner, idx[sealed]) is not None:
                    return self.ids.free(owner, items)  # raises, naming the first bad id
                kept.append(ids[sealed])
                ids = ids[~sealed]
            if ids.shape[0]:
                rest.append((space, ids))
        out = self.ids.free(owner, rest) if rest else {}
        for ids in kept:
            d.keep(owner, ids.astype(np.int32))
        if kept:
            out[d.space.name] = out.get(d.space.name, 0) + sum(k.shape[0] for k in kept)
        return out

    def reclaim(self, owner: int) -> dict[str, int]:
        """``PoolIds.reclaim`` of an ended lease: its sealed pages (not in a transfer) pass to
        the directory, the rest are freed."""
        d = self.sealed
        if self._lease_sealed():
            assert d is not None
            held = d.space.held_ids(owner)
            mine = held[d.sealed_mask(held.astype(np.intp))]
            if mine.shape[0]:
                pinned = d.space.pinned_of(mine.astype(np.intp))
                d.forget(mine[pinned])  # a transfer still moves them: quarantined, then freed
                d.keep(owner, mine[~pinned])
        return self.ids.reclaim(owner)

    async def device_written(self) -> None:
        """Return once every mapping entry the ledger wrote so far is on the device (at once
        for a pool with no device mirror): an Allocate's reply waits for it, the loop does
        not (:class:`DeviceMirror`)."""
        for mirror in self.mirrors:
            await mirror.flush()

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
        if self.sealed is not None:  # its KV events: every page gone (AllBlocksCleared)
            self.sealed.drop_sink()
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
        if self.sealed is not None and self.state != "closed":
            self.sealed.audit()
            if self.plan.elastic is not None and self.sealed.entries:
                self._audit_sealed_groups()
        if any(n <= 0 for n in self.uses.values()):
            raise Internal(f"pool {self.name!r}: use counts {dict(self.uses)}")
        if self.state == "closed" and self.uses:
            raise Internal(f"pool {self.name!r} is closed with uses {dict(self.uses)}")
        if self.state == "dropping" and not self.uses and self._on_idle is not None:
            raise Internal(f"pool {self.name!r} is dropping, unused, and nobody was told")
        if self.state == "live" and self.charged_bytes:
            raise Internal(f"pool {self.name!r} is live with a drop charge")

    def _audit_sealed_groups(self) -> None:
        """No sealed page (held or kept) lies in a group that is not open or draining: a
        group is unmapped and released only once every page of it is free."""
        assert self.sealed is not None
        space = self.space_kv
        groups = {u // space.pages_per_group for u in self.sealed.entries}
        bad = sorted(g for g in groups if space.state(g) not in ("open", "draining"))
        if bad:
            raise Internal(f"pool {self.name!r}: sealed pages lie in group(s) {bad} "
                           f"({', '.join(space.state(g) for g in bad)})")

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
            for mirror in self.mirrors:
                mirror.close()
            if self.sealed is not None:
                self.sealed.close()
            self.backing.close()
            # The region's last references are the views: dropped here, in the caller's
            # thread, so the mapping is gone when this returns even while a reference to this
            # object lingers (a worker thread's finished work item, a traceback).
            self.buffers = dataclasses.replace(
                self.buffers, backing=torch.empty(0, dtype=torch.uint8), views={})


class DeviceMirror:
    """A host copy of a 1-D device buffer (a CUDA pool's ``full_to_swa``), which the id spaces
    write, and the device copy of the entries written, made off the event loop.

    Engines in other processes read the device buffer as soon as an Allocate reply reaches
    them, so the entries it wrote must be on the device before the daemon answers (a reader
    in another process is not ordered by this process's stream). The copy and the wait for it
    run in one worker thread, in submission order (:meth:`flush`); the loop only records which
    entries were written (O(len(idx)) each) and awaits the copy that covers them.

    Args:
        device_view: the 1-D device buffer.
    """

    # Pending writes kept as separate arrays up to this many, then merged (bounded memory
    # between flushes: a sweep of many leases writes between two Allocates).
    MERGE_AT = 1024

    def __init__(self, device_view: torch.Tensor) -> None:
        self._view = device_view
        self._host = torch.zeros(device_view.shape, dtype=device_view.dtype)
        self.array: np.ndarray = self._host.numpy()
        self._pending: list[np.ndarray] = []
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpoold-mirror")
        self._last: asyncio.Future[None] | None = None

    def on_write(self, idx: np.ndarray) -> None:
        """Entries ``idx`` of the host copy were written (called by the id spaces)."""
        self._pending.append(np.array(idx, dtype=np.int64))
        if len(self._pending) > self.MERGE_AT:
            self._pending = [np.unique(np.concatenate(self._pending))]

    def _take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._pending:
            return None
        idx = np.unique(np.concatenate(self._pending))
        self._pending = []
        index = torch.from_numpy(idx)
        return index, self._host[index].clone()  # the values as of now, on the loop

    def _copy(self, index: torch.Tensor, values: torch.Tensor) -> None:
        device = self._view.device
        self._view[index.to(device)] = values.to(device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    async def flush(self) -> None:
        """Return once every entry written so far is on the device (the copies run in the
        mirror's thread, in order: awaiting the last one covers every earlier one)."""
        taken = self._take()
        if taken is not None:
            loop = asyncio.get_running_loop()
            self._last = asyncio.ensure_future(
                loop.run_in_executor(self._thread, self._copy, *taken))
        if self._last is not None:
            await asyncio.shield(self._last)

    def flush_now(self) -> None:
        """:meth:`flush`, blocking (a worker thread building the pool, or shutdown)."""
        taken = self._take()
        if taken is not None:
            self._thread.submit(self._copy, *taken).result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def make_pool_ids(name: str, plan: PoolPlan, views: dict[str, torch.Tensor]
                  ) -> tuple[PoolIds, list[DeviceMirror]]:
    """The id spaces of a pool, from the plan's table; each mapping buffer a following space
    writes is handed over as numpy (a device buffer through a host mirror, see
    :class:`DeviceMirror`).

    Raises:
        Internal: a following space whose mapping buffer the plan does not carve.
    """
    mappings: dict[str, MappingBuffer] = {}
    mirrors: list[DeviceMirror] = []
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
            mirror = DeviceMirror(view)
            mirrors.append(mirror)
            mappings[space.mapping] = MappingBuffer(mirror.array, mirror.on_write)
    grouped = None if plan.elastic is None else {"kv": plan.elastic.pages_per_group}
    ids = PoolIds(name, plan.id_spaces, mappings, grouped)
    for mirror in mirrors:  # the entries the spaces wrote as they were built
        mirror.flush_now()
    return ids, mirrors


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
        ids, mirrors = make_pool_ids(name, plan, buffers.views)
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
        mirrors=mirrors,
        created_at=created_at,
    )

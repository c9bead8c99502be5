"""The daemon's state: pools by name, the device budget, leases and attachments.

Authorization, the one story: every method a client reaches takes the :class:`Caller` of the
call (``kvpoold.server.auth``) first. A pool is checked against the caller's scope before it is
looked up (PERMISSION_DENIED says nothing about whether it exists); a lease is proven by its
secret and must be the caller's identity's (``LeaseTable.prove``: any failure is the NOT_FOUND of
an unknown lease); messages name only the caller's own leases and the pools it may see.

Concurrency, the one story: every method runs on the server's event loop thread, so the pools,
their id spaces, the budget, the lease table and the attachments need no lock (one owner: the
loop; nothing here awaits while it holds state half-changed). The only work off the loop is
:func:`build_live_pool` in a worker thread, on objects nobody else sees until it returns; a
name being built is in ``_building`` so a second Configure of it waits instead of racing.
Device writes other processes read (a CUDA pool's ``full_to_swa``) are complete before a
method returns (``live_pools.device_mirror``). Stats replies are read in slices with the loop
serving other calls between them (``kvpoold.server.stats_replies``); they only read.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, TypeVar

import numpy as np

from kvpool.contract.devices import DEFAULT_GPU, GpuName, profile_of_device
from kvpool.contract.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    echo,
)
from kvpool.contract.fd_channel import FdAsk
from kvpool.contract.limits import check_pool_name
from kvpool.contract.plan import PoolPlan
from kvpool.contract.records import AttachInfo, ConfigureResult, HeldMap, Released, Stats
from kvpoold import __version__
from kvpoold.elastic.fd_server import FdGrant
from kvpoold.elastic.manager import RECLAIM_DEADLINE_S, ElasticPools, Policy
from kvpoold.ids import Grant, IdSpace
from kvpoold.ids.grouped import GroupedSpace
from kvpoold.server.args import ConfigureArgs, LeaseRef
from kvpoold.server.attachments import MAX_ATTACHMENTS_PER_IDENTITY, AttachmentTable
from kvpoold.server.auth import DAEMON_CALLER, Caller
from kvpoold.server.leases import MAX_LEASES_PER_IDENTITY, CacheCounts, Lease, LeaseTable
from kvpoold.server.live_pools import LivePool, build_live_pool
from kvpoold.server.loop_clock import StallClock
from kvpoold.server.planning import plan_off_loop
from kvpoold.server.stats import (
    MAX_WATCH_STREAMS_PER_IDENTITY,
    WATCH_MIN_INTERVAL_S,
    gather_stats,
    take_stats,
    watch_interval,
)
from kvpoold.sharing.base import BackingFactory
from kvpoold.transfer import NIXL_MISSING, NixlAgent, Outgoing, Transfers
from kvpoold.transfer.grants import ReceiveGrant

log = logging.getLogger("kvpoold.daemon")


def device_gpu(device: str) -> GpuName:
    """The ``--gpu`` profile a daemon on ``device`` plans for when Configure names none:
    ``cpu`` on the CPU, else the profile nearest the CUDA device's memory and capability."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    index = int(device.partition(":")[2] or 0)
    try:
        props = torch.cuda.get_device_properties(index)
    except (AssertionError, RuntimeError) as exc:  # no CUDA here (a label only, in tests)
        log.warning("cannot read %s's properties (%s); Configure without --gpu plans for %s",
                    device, exc, DEFAULT_GPU)
        return DEFAULT_GPU
    return profile_of_device(props.total_memory, props.major, props.minor)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"

_T = TypeVar("_T")

# An Allocate short of free ids, while other leases' page caches report enough cached ones,
# asks them to give back and waits this long at most (less under a shorter gRPC deadline).
GIVE_BACK_WAIT_S = 1.0
# Under pressure: an Allocate that leaves a space fewer than capacity // PRESSURE_FRACTION free
# asks other leases' caches to give back the difference (without waiting).
PRESSURE_FRACTION = 16
# Configure plans in worker threads, this many at once.
PLANNING_SLOTS = 2



class Allocated(NamedTuple):
    """What an Allocate got: ``(space, grant)`` per item, and per item what the lease holds of
    that space after the call."""

    grants: list[tuple[str, Grant]]
    held: list[int]

class Daemon:
    """Pools, budget, leases and attachments of one device.

    Args:
        device: ``cpu`` or ``cuda:N`` (for Stats and Attach; memory comes from the factory).
        budget_bytes: the device bytes pools may take in all (each pool costs its
            ``plan.backing_bytes``).
        backing_factory: creates each pool's region (plain, shared memory, CUDA IPC).
        clock: monotonic seconds; injected so tests can move time.
        lease_clock: the clock of lease deadlines (default ``clock``); ``kvpoold serve`` gives
            a ``loop_clock.StallClock``, which stands still while the event loop is stalled,
            so a renewal the daemon was too busy to read never expires a lease.
        nixl_agent: the NIXL agent for transfers between daemons (``kvpoold.transfer``);
            None answers every transfer RPC with ``nixl_off``.
        nixl_off: why there is no agent, for those answers.
        peer_token: the bearer token this daemon sends to peer daemons.
        max_leases_per_identity: leases one caller identity may hold open at once.
        max_attachments_per_identity: attachments one caller identity may hold at once.
        max_watch_streams_per_identity: WatchStats streams one caller identity may hold open.
        watch_min_interval_s: the shortest interval a WatchStats stream is served at.
        reclaim_deadline_s: how long attached processes have to unmap an elastic pool's group
            asked back before their lease is ended.
        elastic_policy: how elastic pools share the budget (``kvpoold.elastic.manager``).
    """

    def __init__(
        self,
        device: str,
        budget_bytes: int,
        backing_factory: BackingFactory,
        clock: Callable[[], float] = time.monotonic,
        *,
        lease_clock: Callable[[], float] | None = None,
        nixl_agent: NixlAgent | None = None,
        nixl_off: str = NIXL_MISSING,
        peer_token: str | None = None,
        max_leases_per_identity: int = MAX_LEASES_PER_IDENTITY,
        max_attachments_per_identity: int = MAX_ATTACHMENTS_PER_IDENTITY,
        max_watch_streams_per_identity: int = MAX_WATCH_STREAMS_PER_IDENTITY,
        watch_min_interval_s: float = WATCH_MIN_INTERVAL_S,
        reclaim_deadline_s: float = RECLAIM_DEADLINE_S,
        elastic_policy: Policy = "arbiter",
    ) -> None:
        self.device = device
        self._gpu: GpuName | None = None  # what Configure plans for by default (lazily)
        self.budget_bytes = budget_bytes
        self.version = __version__
        self._factory = backing_factory
        self._clock = clock
        self.started_at = clock()
        self.leases = LeaseTable(lease_clock or clock, max_per_identity=max_leases_per_identity)
        # Stats and /metrics report its stalls (none without one: a daemon driven by hand).
        self.stall_clock = lease_clock if isinstance(lease_clock, StallClock) else None
        self.max_attachments_per_identity = max_attachments_per_identity
        self.max_watch_streams_per_identity = max_watch_streams_per_identity
        self.watch_min_interval_s = watch_min_interval_s
        self._watch_streams: dict[str, int] = {}  # identity -> WatchStats streams open
        # Configures planning at once (each in a worker thread); the rest wait their turn.
        self._planning = asyncio.Semaphore(PLANNING_SLOTS)
        self.pools: dict[str, LivePool] = {}
        self.attachments = AttachmentTable()
        self._building: dict[str, asyncio.Event] = {}
        self._reserved_bytes = 0
        # Set (and dropped) when ids come back, for Allocates waiting on give-backs; None
        # while nobody waits, so Free costs nothing extra then.
        self._freed: asyncio.Event | None = None
        self.transfers = Transfers(self.pool, self.leases, clock, nixl_agent, nixl_off,
                                   peer_token, on_freed=self._notify_freed)
        # Dropped pools whose memory waits for transfers still moving bytes in it: their
        # bytes stay charged to the budget until it is released.
        self._draining_bytes: dict[str, int] = {}
        # Elastic pools: their groups, the arbiter and the unmap handshakes.
        self.elastic = ElasticPools(budget_bytes, _ElasticHooks(self), clock,
                                    reclaim_deadline_s, elastic_policy)

    # -- budget ----------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Budget bytes taken: fixed pools whole, elastic pools' fixed parts and granted
        groups, dropped pools still draining."""
        return self._fixed_bytes() + self.elastic.granted_bytes

    def _fixed_bytes(self) -> int:
        return (sum(fixed_part(e.plan) for e in self.pools.values())
                + sum(self._draining_bytes.values()))

    @property
    def gpu(self) -> GpuName:
        """The ``--gpu`` profile of this daemon's device (read once, at the first Configure
        that names none)."""
        if self._gpu is None:
            self._gpu = device_gpu(self.device)
        return self._gpu

    def available_bytes(self) -> int:
        return max(0, self.budget_bytes - self.used_bytes - self._reserved_bytes)

    def now(self) -> float:
        return self._clock()

    # -- Configure ---------------------------------------------------------------------------

    async def configure(self, caller: Caller, args: ConfigureArgs) -> ConfigureResult:
        """Plan a pool and build it, or return the existing one with the same layout.

        Raises:
            InvalidArgument: bad name, model or options.
            PermissionDenied: the caller's scope does not cover the name.
            AlreadyExists: the name is taken by a pool with another fingerprint.
            ResourceExhausted: the pool does not fit in the device budget left.
        """
        name = caller.check_pool(check_pool_name(args.pool))
        # Off the loop (O(layers) of Python); nothing read before this await is trusted after
        # it: the name, the existing pools and the budget are all looked at below.
        if "gpu" not in args.options:  # plan for this daemon's own device
            args = dataclasses.replace(args, options={**args.options, "gpu": self.gpu})
        if args.options.get("elastic") and not {"budget_bytes", "max_total_tokens"} & set(
                args.options):  # an elastic pool's virtual range: the whole device budget
            args = dataclasses.replace(
                args, options={**args.options, "budget_bytes": self.budget_bytes})
        planned = await plan_off_loop(args, self.available_bytes(), self._planning)
        new_plan, fingerprint = planned.plan, planned.fingerprint
        while name in self._building:  # the same name is being built: wait, then look again
            await self._building[name].wait()
        if name in self._draining_bytes:
            raise FailedPrecondition(
                f"pool {name!r} was dropped while transfers were moving its pages; its memory "
                "is released when they end (at the latest their write deadline plus the fence "
                "margin); Configure it again then, or use another name", field="pool")
        existing = self.pools.get(name)
        if existing is not None:
            if existing.fingerprint != fingerprint:
                raise AlreadyExists(
                    f"pool {name!r} exists with layout {existing.fingerprint}, this request "
                    f"plans {fingerprint}; use the same model and options, another name, or "
                    "Drop it first",
                    field="pool",
                )
            return self._configure_result(existing.plan, existing.plan_json, fingerprint,
                                          created=False, dry_run=args.dry_run)
        needed, available = fixed_part(new_plan), self.available_bytes()
        if new_plan.elastic is not None:
            self.elastic.check(name, new_plan, self._reserved_bytes + needed)
        if needed > available:
            raise ResourceExhausted(
                f"pool {name!r} needs {needed:,} B of device memory, the daemon has "
                f"{available:,} B of its {self.budget_bytes:,} B budget left; "
                f"{budget_hint(new_plan)}",
                field="budget_bytes",
            )
        if args.dry_run:
            return self._configure_result(new_plan, planned.plan_json, fingerprint,
                                          created=False, dry_run=True, extra=needed)
        # Claim the name and the bytes now, before any await, so concurrent calls see them.
        done = asyncio.Event()
        self._building[name] = done
        self._reserved_bytes += needed
        # Building continues if the caller goes away: the pool is then there for its retry.
        task = asyncio.ensure_future(self._build(name, new_plan, done))
        entry = await asyncio.shield(task)
        return self._configure_result(entry.plan, entry.plan_json, fingerprint,
                                      created=True, dry_run=False)

    async def _build(self, name: str, new_plan: PoolPlan, done: asyncio.Event) -> LivePool:
        try:
            entry = await asyncio.to_thread(self._build_registered, name, new_plan)
            if new_plan.elastic is not None:
                try:
                    await self.elastic.admit(name, new_plan, entry.backing,  # type: ignore[arg-type]
                                             entry.space_kv)
                except BaseException:
                    entry.close()
                    raise
            self.pools[name] = entry
        finally:
            self._reserved_bytes -= fixed_part(new_plan)
            del self._building[name]
            done.set()
        log.info("pool configured", extra={"fields": {
            "event": "configure", "pool": name, "fingerprint": entry.fingerprint,
            "architecture": new_plan.architecture, "backing_bytes": new_plan.backing_bytes,
            "num_pages": new_plan.num_pages, "page_size": new_plan.page_size,
        }})
        return entry

    def _build_registered(self, name: str, new_plan: PoolPlan) -> LivePool:
        """Build the pool and register its backing with NIXL (worker thread)."""
        entry = build_live_pool(name, new_plan, self._factory, self._clock())
        if new_plan.elastic is not None:  # not moved over NIXL (yet): nothing to register
            return entry
        try:
            self.transfers.register_pool(entry)
        except BaseException as exc:
            entry.close()
            raise Internal(f"pool {name!r}: NIXL could not register its {new_plan.backing_bytes:,}"
                           f" B region: {type(exc).__name__}: {exc}") from exc
        return entry

    def _configure_result(self, p: PoolPlan, plan_json: str, fingerprint: str, *, created: bool,
                          dry_run: bool, extra: int = 0) -> ConfigureResult:
        return ConfigureResult(p, plan_json, fingerprint, created, dry_run,
                               max(0, self.available_bytes() - extra))

    # -- leases ------------------------------------------------------------------------------

    def open_lease(self, caller: Caller, name: str, ttl_s: float) -> Lease:
        """Open a lease of the caller's identity (see :class:`LeaseTable`).

        Raises:
            InvalidArgument: bad name or TTL.
            ResourceExhausted: the daemon's lease limit, or the identity's cap.
        """
        lease = self.leases.open(name, ttl_s, caller.identity)
        log.info("lease opened", extra={"fields": {
            "event": "lease_open", "lease_id": lease.lease_id, "owner": lease.owner,
            "name": lease.name, "ttl_s": lease.ttl_s, "identity": lease.identity,
        }})
        return lease

    def lease(self, caller: Caller, ref: LeaseRef) -> Lease:
        """The open lease ``ref`` names, proven by its secret, of the caller's identity.

        Raises:
            NotFound: unknown, closed or expired, or not proven (the same answer).
        """
        return self.leases.prove(ref.lease_id, ref.secret, caller.identity)

    def renew_lease(self, caller: Caller, ref: LeaseRef,
                    reports: dict[tuple[str, str], CacheCounts] | None = None,
                    unmapped: Sequence[int] = ()) -> Lease:
        """Renew a lease and keep its page caches' report (``(pool, space) -> CacheCounts``;
        it replaces the last one), as far as the lease's holdings back it
        (:meth:`_backed`); ``unmapped``: the elastic reclaims its process carried out.

        Raises:
            NotFound: unknown, closed or expired lease, or not proven.
        """
        lease = self.leases.renew(self.lease(caller, ref).lease_id)
        if reports is not None:
            self.leases.set_reports(lease, self._backed(lease, reports))
        if unmapped:
            self.elastic.unmapped(lease.lease_id, unmapped)
        return lease

    def _backed(self, lease: Lease, reports: dict[tuple[str, str], CacheCounts]
                ) -> dict[tuple[str, str], CacheCounts]:
        """The part of a cache report the lease's holdings back: a cache holds only ids its
        lease holds, so each count is capped at what the lease holds in that pool and space
        now, and a report of a pool or space that does not exist is not kept (what a lease may
        store stays O(pools x spaces)). O(reports)."""
        out: dict[tuple[str, str], CacheCounts] = {}
        for (pool, name), (cached, in_use, evictable) in reports.items():
            entry = self.pools.get(pool)
            if entry is None or name not in entry.ids.names:
                continue
            held = entry.ids.space(name, "caches").held(lease.owner)
            in_use = min(in_use, held)
            out[(pool, name)] = CacheCounts(min(cached, held), in_use, min(evictable, in_use))
        return out

    def close_lease(self, caller: Caller, ref: LeaseRef) -> Released:
        """End a lease; everything it holds comes back and its attachments end.

        Raises:
            NotFound: unknown, closed or expired lease, or not proven.
        """
        lease = self.leases.close(self.lease(caller, ref).lease_id)
        result = self._release(lease)
        log.info("lease closed", extra={"fields": {
            "event": "lease_close", "lease_id": lease.lease_id, "name": lease.name,
            "released": result.total, "detached": result.detached,
        }})
        return result

    def expire_leases(self, max_leases: int | None = None, max_ids: int | None = None, *,
                      timers: bool = True) -> list[tuple[Lease, Released]]:
        """Expire leases past their deadline and reclaim what they held; logs each.

        A sweep of thousands of leases is done in slices (``kvpoold.server.run.sweep_leases``
        yields to the event loop between them): this call stops after ``max_leases`` leases,
        or once the leases it reclaimed released ``max_ids`` ids in all, whichever comes first
        (a lease is never split: one holding more than ``max_ids`` is a slice of its own).
        What is left stays due (``leases.next_deadline()`` <= now) and, its deadline passed,
        can be neither renewed nor used meanwhile (``LeaseTable.get``).

        Args:
            max_leases: at most this many leases (None: no bound).
            max_ids: stop once this many ids are released (None: no bound).
            timers: also end receive grants and elastic unmaps whose deadline passed (the
                sweep's first slice; the slices that carry on a sweep pass False).

        Returns:
            The leases expired by this call, by deadline, with what each released.
        """
        if timers:
            self.transfers.expire()  # receive grants past their expiry end on the same sweep
            self.elastic.sweep()  # unmap deadlines: leases that did not unmap are ended here
        out: list[tuple[Lease, Released]] = []
        released = 0
        while ((max_leases is None or len(out) < max_leases)
               and (max_ids is None or released < max_ids)):
            room = None if max_leases is None else max_leases - len(out)
            # One lease at a time under max_ids: what a lease holds is known once it is reclaimed.
            popped = self.leases.pop_expired(limit=1 if max_ids is not None else room)
            if not popped:
                break
            for lease in popped:
                result = self._release(lease)
                released += result.total
                out.append((lease, result))
                log.warning("lease expired", extra={"fields": {
                    "event": "lease_expired", "lease_id": lease.lease_id, "name": lease.name,
                    "ttl_s": lease.ttl_s, "released": result.total,
                    "detached": result.detached,
                    "held": {f"{pool}/{space}": n for pool, spaces in result.held.items()
                             for space, n in spaces.items()},
                }})
        return out

    def _release(self, lease: Lease) -> Released:
        self.transfers.lease_gone(lease.owner, f"lease {lease.lease_id} ({lease.name}) ended")
        released: HeldMap = {}
        for name, entry in self.pools.items():
            counts = {s: n for s, n in entry.ids.reclaim(lease.owner).items() if n}
            if counts:
                released[name] = counts
        detached = self.attachments.remove_lease(lease.lease_id)
        if released:
            self._notify_freed()
        self.elastic.lease_gone(lease.lease_id)
        return Released(released, detached)

    # -- Allocate / Free ---------------------------------------------------------------------

    def allocate(self, caller: Caller, pool: str, ref: LeaseRef,
                 items: Sequence[tuple[str, int]]) -> Allocated:
        """Allocate every ``(space, count)`` item for the lease, all or none.

        Returns:
            ``(space, grant)`` per item, in order, and per item what the lease holds of its
            space after the call (O(1) each: a page cache compares it with its counts).

        Raises:
            InvalidArgument: bad pool name, no items, an unknown space or one that follows
                another.
            NotFound: unknown pool or lease.
            PermissionDenied: the caller's scope does not cover the pool.
            ResourceExhausted: not enough free ids for an item (nothing allocated).
        """
        entry, lease, typed = self._items(caller, pool, ref, items, "allocate", "count")
        ids = entry.ids
        spaces = [space for space, _ in typed]
        grants = ids.allocate(lease.owner, typed)
        for space in spaces:  # O(items): a comparison each unless the space runs low
            if isinstance(space, GroupedSpace):
                self._elastic_pressure(pool, space, lease.owner)
                continue
            low = max(1, space.capacity // PRESSURE_FRACTION)
            room = ids.room(space)
            if room < low:
                self._ask_give_back(pool, space, low - room, lease.owner, cover=False)
        return Allocated([(name, grant) for (name, _), grant in zip(items, grants, strict=True)],
                         [space.held(lease.owner) for space in spaces])

    def _elastic_pressure(self, pool: str, space: GroupedSpace, owner: int) -> None:
        """After an Allocate in an elastic pool: grow ahead of need (a group from free budget,
        when less than half a group's pages are left), and ask other leases' caches to give
        back when under 1/16 of the granted pages are free. O(1) unless it acts."""
        self.elastic.allocated(pool)
        room = space.num_free
        if room < space.pages_per_group // 2:
            self.elastic.grow(pool, space.pages_per_group, reclaim=False)
        low = max(1, space.granted_pages // PRESSURE_FRACTION)
        if room < low:
            self._ask_give_back(pool, space, low - room, owner, cover=False)

    def _items(self, caller: Caller, pool: str, ref: LeaseRef,
               items: Sequence[tuple[str, _T]], verb: str, what: str,
               ) -> tuple[LivePool, Lease, list[tuple[IdSpace, _T]]]:
        """The pool, the lease and each item's id space for ``verb`` on ``items`` (``what``:
        the item's other half, named when the list is empty).

        Raises:
            InvalidArgument: bad pool name, no items, an unknown space.
            NotFound / PermissionDenied: as :meth:`pool` and :meth:`lease`.
        """
        entry = self.pool(pool, caller)
        lease = self.lease(caller, ref)
        if not items:
            raise InvalidArgument(f"{verb} needs at least one (space, {what}) item",
                                  field="items")
        return entry, lease, [(entry.ids.space(name, f"items[{i}].space"), x)
                              for i, (name, x) in enumerate(items)]

    async def allocate_waiting(self, caller: Caller, pool: str, ref: LeaseRef,
                               items: Sequence[tuple[str, int]],
                               wait_s: float = GIVE_BACK_WAIT_S) -> Allocated:
        """:meth:`allocate`; when short of free ids while other leases' page caches report
        enough cached ids to cover every shortfall, ask them to give back (on their KeepAlive
        streams, now) and retry as ids come back, for ``wait_s`` at most.

        Raises:
            As :meth:`allocate`; ResourceExhausted also after the wait, saying how many ids
            were asked back and how many came.
        """
        try:
            return self.allocate(caller, pool, ref, items)
        except ResourceExhausted as err:
            first = err.with_traceback(None)  # no cycle: err -> traceback -> frame -> err
        entry = self.pool(pool, caller)
        lease = self.lease(caller, ref)
        shortfall: dict[str, int] = {}
        for name, count in items:
            shortfall[name] = shortfall.get(name, 0) + count
        wanted = dict(shortfall)
        free_before = {}
        spaces = {}
        growing: set[str] = set()
        for name in list(shortfall):
            space = spaces[name] = entry.ids.space(name, "items")
            free_before[name] = space.num_free
            short = shortfall[name] - entry.ids.room(space)
            if short <= 0:
                del shortfall[name]
                continue
            shortfall[name] = short
            if isinstance(space, GroupedSpace) and self.elastic.grow(pool, short):
                growing.add(name)  # groups are being granted or taken back for it
            elif self._cached_elsewhere(pool, space, lease.owner) < short:
                raise first  # even every cached id would not do: refuse at once
        if not shortfall or wait_s <= 0:
            raise first
        asked = sum(self._ask_give_back(pool, spaces[name], short, lease.owner, cover=True)
                    for name, short in shortfall.items() if name not in growing)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            if self._freed is None:
                self._freed = asyncio.Event()
            freed = self._freed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(freed.wait(), remaining)
            try:
                return self.allocate(caller, pool, ref, items)
            except ResourceExhausted as err:
                first = err.with_traceback(None)  # no cycle: err -> traceback -> frame -> err
            for name in growing:  # budget may have come free meanwhile (a shrink, a Drop)
                room = entry.ids.room(spaces[name])
                if room < wanted[name]:
                    self.elastic.grow(pool, wanted[name] - room)
        entry = self.pool(pool, caller)
        came = sum(max(0, entry.ids.space(name, "items").num_free - before)
                   for name, before in free_before.items())
        grew = (f"; the elastic pool asked the device budget for {', '.join(sorted(growing))} "
                f"and got too little within {wait_s:.2f} s") if growing else ""
        raise ResourceExhausted(
            f"{first.message}; asked other leases' page caches to give back {asked} cached "
            f"ids, {came} came back within {wait_s:.2f} s{grew}", field=first.field)

    def _cached_of(self, lease: Lease, pool: str, space: IdSpace) -> int:
        """What ``lease``'s caches reported cached in ``pool``/``space``, capped at what it
        holds there now (O(1)): only ids a lease really holds can come back, so a report it
        does not back (stale, or a lie) never makes an Allocate wait nor another cache be
        asked in vain."""
        return min(lease.cached(pool, space.name), space.held(lease.owner))

    def _cached_elsewhere(self, pool: str, space: IdSpace, owner: int) -> int:
        return sum(self._cached_of(x, pool, space) for x in self.leases.cachers(pool, space.name)
                   if x.owner != owner)

    def _ask_give_back(self, pool: str, space: IdSpace, count: int, owner: int, *,
                       cover: bool, min_id: int = 0) -> int:
        """Ask the leases other than ``owner`` whose caches hold cached ids of ``pool``/``space``
        (:meth:`_cached_of`) to give back ``count`` in all (at most what they hold cached):
        shares proportional to what each holds cached, at least 1 each. Returns the ids asked.

        ``cover=False`` (pressure after a successful Allocate) skips leases already asked.
        """
        name = space.name
        holders = [(x, c) for x in self.leases.cachers(pool, name)
                   if x.owner != owner and (cover or (pool, name) not in x.give_back)
                   and (c := self._cached_of(x, pool, space)) > 0]
        total = sum(c for _, c in holders)
        if not total:
            return 0
        count = min(count, total)
        shares = [min(c, max(1, count * c // total)) for _, c in holders]
        rest = count - sum(shares)
        for i, (_, c) in sorted(enumerate(holders), key=lambda t: -t[1][1]):
            if rest <= 0:
                break
            more = min(rest, c - shares[i])
            shares[i] += more
            rest -= more
        for (x, _), n in zip(holders, shares, strict=True):
            x.ask_give_back(pool, name, n, min_id)
        log.info("give-back asked", extra={"fields": {
            "event": "give_back", "pool": pool, "space": name, "asked": sum(shares),
            "leases": len(holders), "waiting": cover,
        }})
        return sum(shares)

    def _notify_freed(self) -> None:
        if self._freed is not None:
            self._freed.set()
            self._freed = None
        if self.elastic.cached_asks or self.elastic.busy_drains:  # groups asked back may be empty
            self.elastic.on_freed()

    def free(self, caller: Caller, pool: str, ref: LeaseRef,
             items: Sequence[tuple[str, np.ndarray]]) -> tuple[int, list[int]]:
        """Free every ``(space, ids)`` item of the lease; validated first, all or none.

        Returns:
            Ids returned over all items, and per item what the lease holds of its space after
            the call (O(1) each).

        Raises:
            As :meth:`allocate` for the pool, the lease and the items; InvalidArgument also for
            an id out of range or repeated, FailedPrecondition for one this lease does not hold
            (nothing freed).
        """
        entry, lease, typed = self._items(caller, pool, ref, items, "free", "ids")
        ids = entry.ids
        # The ledger refuses pinned ids itself (a transfer in flight moves them).
        freed = sum(ids.free(lease.owner, typed).values())
        self._notify_freed()
        return freed, [space.held(lease.owner) for space, _ in typed]

    def not_held(self, caller: Caller, pool: str, ref: LeaseRef,
                 items: Sequence[tuple[str, np.ndarray]]
                 ) -> tuple[list[np.ndarray], list[int]]:
        """Per ``(space, ids)`` item, its ids the lease does not hold (free, or another
        lease's), in order, and what the lease holds of the space; frees nothing (a Free with
        ``check``). O(ids).

        Raises:
            InvalidArgument: an unknown space, or an id out of its range.
            NotFound / PermissionDenied: as :meth:`free`.
        """
        entry = self.pool(pool, caller)
        owner = self.lease(caller, ref).owner
        out, held = [], []
        for i, (name, arr) in enumerate(items):
            space = entry.ids.space(name, f"items[{i}].space")
            idx = np.asarray(arr, dtype=np.intp)
            bad = (idx < 1) | (idx > space.capacity)
            if bad.any():
                pos = int(bad.argmax())
                raise InvalidArgument(
                    f"check {space.label} items[{i}].ids[{pos}]={idx[pos]}: out of range "
                    f"1..{space.capacity}", field=f"items[{i}].ids[{pos}]")
            out.append(np.ascontiguousarray(arr[space.owner_of(idx) != owner], dtype=np.int32))
            held.append(space.held(owner))
        return out, held

    # -- pools -------------------------------------------------------------------------------

    def pool(self, name: str, caller: Caller | None = None) -> LivePool:
        """The built pool ``name``, checked against the caller's scope first (None: the
        daemon's own lookup, whose NotFound lists no pools).

        Raises:
            InvalidArgument: a malformed name.
            PermissionDenied: the caller's scope does not cover ``name``.
            NotFound: no such pool (or it is still being built).
        """
        if caller is not None and not caller.admin:
            caller.check_pool(check_pool_name(name))
        entry = self.pools.get(name)
        if entry is None:
            check_pool_name(name)
            building = " (it is being configured; retry when Configure returns)" if (
                name in self._building) else ""
            known = "" if caller is None else "; pools: " + (
                ", ".join(sorted(p for p in self.pools if caller.sees(p))) or "none")
            raise NotFound(f"no pool {name!r}{building}{known}", field="pool")
        return entry

    def drop(self, caller: Caller, name: str, force: bool = False) -> Released:
        """Release a pool's memory and budget.

        Raises:
            NotFound: no such pool.
            PermissionDenied: the caller's scope does not cover it.
            FailedPrecondition: a lease holds ids in it or a client is attached, and not force.
        """
        entry = self.pool(name, caller)
        holders = entry.ids.held_by_owner()
        attached = self.attachments.count_pool(name)
        if (holders or attached) and not force:
            labels = [self._holder_label(o, sum(h.values())) for o, h in holders.items()
                      if self._shown_to(caller, o)][:5]
            rest = len(holders) - len(labels)
            if rest:  # another identity's leases are counted, never named
                labels.append(f"and {rest} more" if labels else f"{rest} not yours")
            who = ", ".join(labels)
            raise FailedPrecondition(
                f"pool {name!r} is in use: {_count(len(holders), 'lease')} "
                f"{'holds' if len(holders) == 1 else 'hold'} ids [{who}], "
                f"{_count(attached, 'client')} attached; free or close them, or Drop with "
                "force (kvpool drop --force)",
                field="force",
            )
        reclaimed: dict[str, int] = {}
        for owner in holders:
            for space, count in entry.ids.reclaim(owner).items():
                reclaimed[space] = reclaimed.get(space, 0) + count
        held = {name: {s: n for s, n in reclaimed.items() if n}} if holders else {}
        detached = self.attachments.remove_pool(name)
        del self.pools[name]
        # The memory goes now, or once no transfer can move bytes in it any more (its bytes
        # stay charged until then); an elastic pool's once no group of it is being backed or
        # freed in a worker thread.
        charged = self._charged(entry)
        self._draining_bytes[name] = charged
        self.elastic.remove(name, lambda: self.transfers.pool_gone(
            name, lambda: self._release_dropped(name, entry)))
        self._notify_freed()  # Allocates waiting on give-backs in it: NOT_FOUND now
        log.info("pool dropped", extra={"fields": {
            "event": "drop", "pool": name, "force": force, "reclaimed": sum(reclaimed.values()),
            "detached": detached, "released_bytes": charged,
        }})
        return Released(held, detached, charged)

    def _charged(self, entry: LivePool) -> int:
        """Budget bytes a pool takes now: a fixed pool's region, an elastic pool's fixed part
        and granted groups."""
        stats = self.elastic.stats(entry.name)
        return entry.plan.backing_bytes if stats is None else stats.granted_bytes

    def _release_dropped(self, name: str, entry: LivePool) -> None:
        entry.close()
        self._draining_bytes.pop(name, None)

    def _shown_to(self, caller: Caller, owner: int) -> bool:
        """Whether the caller may see the lease ``owner`` by name and id (admin, or its own)."""
        if caller.admin:
            return True
        lease = self.leases.of_owner(owner)
        return lease is not None and lease.identity == caller.identity

    def _holder_label(self, owner: int, count: int) -> str:
        """``name (lease <id>, N ids)``: a holder as users know it (never the owner number)."""
        lease = self.leases.of_owner(owner)
        if lease is None:
            return f"a lease that ended ({count} ids)"
        name = lease.name if len(lease.name) <= 40 else echo(lease.name, 40)
        return f"{name} (lease {lease.lease_id}, {count} ids)"

    # -- Attach / Detach ---------------------------------------------------------------------

    def attach(self, caller: Caller, pool: str, expected_fingerprint: str = "",
               ref: LeaseRef | None = None) -> AttachInfo:
        """Hand out what a client needs to map a pool, and count it as attached (under the
        lease ``ref`` if given, so it ends with the lease).

        Every call exports a fresh handle (``backing.handle()``): a CUDA IPC export serves
        one importer. The backing stays open while the attachment lasts (Drop refuses it).

        Raises:
            NotFound: unknown pool, or unknown (or unproven) lease when one is given.
            PermissionDenied: the caller's scope does not cover the pool.
            ResourceExhausted: the caller's identity holds its cap of attachments.
            FailedPrecondition: the pool's fingerprint is not ``expected_fingerprint``, or
                the memory cannot be exported (an expandable CUDA segment).
        """
        entry = self.pool(pool, caller)
        if expected_fingerprint and expected_fingerprint != entry.fingerprint:
            raise FailedPrecondition(
                f"pool {pool!r} has layout {entry.fingerprint}, the client expects "
                f"{echo(expected_fingerprint, 40)}; Configure the client with the pool's plan or "
                "attach to the pool that matches",
                field="expected_fingerprint",
            )
        lease_id = 0 if ref is None else self.lease(caller, ref).lease_id
        if entry.plan.elastic is not None and not lease_id:
            raise FailedPrecondition(
                f"pool {pool!r} is elastic: attach to it under a lease (its groups are taken "
                "back over the lease's KeepAlive stream, and a process that does not unmap "
                "them in time loses its lease)", field="lease_id")
        mine = self.attachments.count_identity(caller.identity)
        if mine >= self.max_attachments_per_identity:
            raise ResourceExhausted(
                f"identity {caller.identity!r} has {mine} attachments, the cap per identity is "
                f"{self.max_attachments_per_identity} (max_attachments_per_identity, "
                "--max-attachments-per-identity); Detach the ones no longer mapped")
        handle = entry.backing.handle()  # last: nothing after it can fail and strand an export
        att = self.attachments.add(pool, lease_id, caller.identity)
        log.info("attached", extra={"fields": {
            "event": "attach", "pool": pool, "attach_id": att.attach_id, "lease_id": lease_id,
            "sharing": handle.sharing, "attached": self.attachments.count_pool(pool),
        }})
        groups = self.elastic.open_groups(pool) if entry.plan.elastic is not None else ()
        return AttachInfo(entry.fingerprint, entry.plan, entry.plan_json, handle,
                          att.attach_id, self.device, groups)

    def fd_grant(self, ask: FdAsk, uid: int) -> FdGrant:
        """The descriptors of an elastic pool's memory a client asks for on the side socket
        (``kvpoold.elastic.fd_server``; the socket already checked the peer's uid): the lease
        is proven by its secret and must hold an attachment of the pool; only groups granted
        and not being taken back are handed out.

        Raises:
            NotFound: no such pool, or the lease is not proven.
            FailedPrecondition: the lease has no attachment of the pool, the pool's memory is
                not handed out as descriptors, or a group asked for is not granted now.
        """
        entry = self.pool(ask.pool)
        try:
            secret = bytes.fromhex(ask.secret)
        except ValueError:
            secret = b""
        # The socket's peer is a uid, not a gRPC caller: the lease is proven by its secret, as
        # of the identity that opened it (LeaseTable.prove: the same NotFound for any failure).
        opened = self.leases.find(ask.lease_id)
        self.leases.prove(ask.lease_id, secret, opened.identity if opened else "")
        if ask.lease_id not in self.attachments.leases_of_pool(ask.pool):
            raise FailedPrecondition(
                f"lease {ask.lease_id} has no attachment of pool {ask.pool!r}: Attach under "
                "the lease first", field="pool")
        export = getattr(entry.backing, "export", None)
        if export is None or entry.plan.elastic is None:
            raise FailedPrecondition(
                f"pool {ask.pool!r} is not handed out as descriptors (sharing "
                f"{entry.sharing}): map it from its Attach handle", field="pool")
        granted = set(self.elastic.open_groups(ask.pool))
        missing = [g for g in ask.groups if g not in granted]
        if missing:
            raise FailedPrecondition(
                f"groups {missing} of pool {ask.pool!r} are not granted now (granted: "
                f"{sorted(granted)}); map only the groups Attach or an Allocate gave",
                field="groups")
        grant: FdGrant = export(ask.groups, ask.fixed)
        return grant

    def detach(self, caller: Caller, attach_id: int) -> None:
        """End an attachment of the caller's identity.

        Raises:
            NotFound: unknown, already ended, or another identity's (the same answer).
        """
        att = self.attachments.get(check_id(attach_id, "attach_id"))
        if att is not None and att.identity == caller.identity:
            self.attachments.remove(attach_id)
            if att.lease_id and att.lease_id not in self.attachments.leases_of_pool(att.pool):
                self.elastic.lease_gone(att.lease_id, att.pool)  # it maps nothing of it now
        else:
            raise NotFound(
                f"no attachment {attach_id} (never made, detached, or ended with its lease or "
                "a forced Drop)",
                field="attach_id",
            )
        log.info("detached", extra={"fields": {
            "event": "detach", "pool": att.pool, "attach_id": attach_id,
            "attached": self.attachments.count_pool(att.pool),
        }})

    # -- Stats and shutdown ------------------------------------------------------------------

    def stats(self, caller: Caller, pool: str = "") -> Stats:
        """Stats of the daemon, its pools (or one) and its leases, taken now in one go, as the
        caller may see them (``kvpoold.server.stats.take_stats``: O(the leases it lists)). The
        servicer answers Stats and WatchStats in slices instead
        (``kvpoold.server.stats_replies``).

        Raises:
            NotFound: ``pool`` given and unknown.
            PermissionDenied: ``pool`` given and outside the caller's scope.
        """
        if pool:
            self.pool(pool, caller)
        return take_stats(self, caller, pool)

    @contextlib.contextmanager
    def watching(self, caller: Caller, pool: str, interval_s: float) -> Iterator[float]:
        """Admit a WatchStats stream of the caller for as long as the block runs; yields the
        interval it is served at (``stats.watch_interval``: 0 is the default, and anything
        shorter than ``watch_min_interval_s`` is served at it). O(1).

        Raises:
            InvalidArgument: a malformed pool name; an interval negative, NaN or over an hour.
            PermissionDenied: ``pool`` outside the caller's scope.
            NotFound: ``pool`` given and unknown.
            ResourceExhausted: the caller's identity holds its cap of streams.
        """
        if pool:
            self.pool(pool, caller)
        interval = watch_interval(interval_s, self.watch_min_interval_s)
        identity = caller.identity
        mine = self._watch_streams.get(identity, 0)
        if mine >= self.max_watch_streams_per_identity:
            raise ResourceExhausted(
                f"identity {identity!r} asks for a WatchStats stream and has {mine} open, the cap "
                f"per identity is {self.max_watch_streams_per_identity} "
                "(max_watch_streams_per_identity, --max-watch-streams-per-identity); end a "
                "stream it no longer reads (kvpool top holds one per daemon), or call Stats")
        self._watch_streams[identity] = mine + 1
        try:
            yield interval
        finally:
            left = self._watch_streams[identity] - 1
            if left:
                self._watch_streams[identity] = left
            else:
                del self._watch_streams[identity]

    def count_watch_streams(self, identity: str) -> int:
        """WatchStats streams ``identity`` holds open."""
        return self._watch_streams.get(identity, 0)

    async def snapshot(self) -> Stats:
        """Stats of everything, as the daemon itself sees them (``/metrics``), the lease
        entries read in slices (``stats.gather_stats``): a scrape never holds the loop for
        O(leases) at once."""
        return await gather_stats(self, DAEMON_CALLER)

    # -- transfers (kvpoold.transfer): the lease and pool checked here ----------------------

    def grant_receive(self, caller: Caller, ref: LeaseRef, pool: str, pages: bytes,
                      ttl_s: float) -> ReceiveGrant:
        """``Transfers.grant`` for a proven lease of the caller, in a pool of its scope."""
        _movable(self.pool(pool, caller))
        return self.transfers.grant(self.lease(caller, ref).lease_id, pool, pages, ttl_s)

    async def send(self, caller: Caller, ref: LeaseRef, pool: str, pages: bytes, peer: str,
                   token: bytes) -> Outgoing:
        """``Transfers.send`` for a proven lease of the caller, in a pool of its scope."""
        _movable(self.pool(pool, caller))
        return await self.transfers.send(self.lease(caller, ref).lease_id, pool, pages, peer,
                                         token)

    def close(self) -> None:
        """Release every pool and the factory (shutdown). Idempotent."""
        for name, entry in self.pools.items():
            self.transfers.pool_gone(name, entry.close)
        self.pools.clear()
        self.transfers.release_draining()  # shutdown: nothing waits for late writes now
        self.attachments.clear()
        self._factory.close()


def budget_hint(p: PoolPlan) -> str:
    """What to lower when a plan does not fit: the request->token table and page maps (aux,
    sized by context length x running requests) when they are most of the bytes, else the
    pool's KV budget."""
    if p.aux_bytes * 2 >= p.backing_bytes:
        return (f"{p.aux_bytes:,} B of it is the request->token table (about "
                f"max_running_requests {p.max_running_requests:,} x {p.req_to_token_columns:,} "
                "columns x 4 B) and "
                "page maps, outside budget_bytes: lower --context-length or "
                "--max-running-requests, Drop a pool, or start kvpoold with a larger --budget")
    return ("lower budget_bytes / max_total_tokens, Drop a pool, or start kvpoold with a larger "
            "--budget")


def check_id(value: int, field: str) -> int:
    """A lease or attachment id as sent: 0 means the caller did not set it.

    Raises:
        InvalidArgument: 0.
    """
    if value == 0:
        raise InvalidArgument(f"{field} is not set (0); pass the id OpenLease/Attach returned",
                              field=field)
    return value


def fixed_part(p: PoolPlan) -> int:
    """Budget bytes a pool takes whatever it is granted: a fixed pool's whole region, an
    elastic pool's fixed part (its groups are counted by the arbiter)."""
    return p.backing_bytes if p.elastic is None else p.elastic.fixed_bytes


def _movable(entry: LivePool) -> None:
    """A pool whose pages move between daemons: neither elastic nor vLLM-layout.

    Raises:
        FailedPrecondition: naming which.
    """
    _not_elastic(entry)
    if entry.plan.vllm is not None:
        raise FailedPrecondition(
            f"pool {entry.name!r} has vLLM's layout: moving its blocks between daemons is not "
            "supported yet (a block's bytes are strided over vLLM's KV-cache tensors)",
            field="pool")


def _not_elastic(entry: LivePool) -> None:
    if entry.plan.elastic is not None:
        raise FailedPrecondition(
            f"pool {entry.name!r} is elastic: moving its pages between daemons is not "
            "supported yet; Configure the pools of a prefill/decode pair without --elastic",
            field="pool")


class _ElasticHooks:
    """What the elastic pools ask of the daemon (``kvpoold.elastic.manager.Hooks``)."""

    def __init__(self, daemon: Daemon) -> None:
        self._d = daemon

    def attached_leases(self, pool: str) -> set[int]:
        return self._d.attachments.leases_of_pool(pool)

    def ask_unmap(self, lease_id: int, pool: str, groups: tuple[int, ...], reclaim: int,
                  deadline_s: float) -> bool:
        lease = self._d.leases.find(lease_id)
        if lease is None:
            return False
        lease.ask_unmap(pool, groups, reclaim, deadline_s)
        return True

    def revoke(self, lease_id: int, why: str) -> None:
        d = self._d
        if d.leases.find(lease_id) is None:
            return
        lease = d.leases.close(lease_id)
        result = d._release(lease)
        log.warning("lease ended", extra={"fields": {
            "event": "lease_revoked", "lease_id": lease.lease_id, "name": lease.name,
            "why": why, "released": result.total, "detached": result.detached}})

    def notify_freed(self) -> None:
        self._d._notify_freed()

    def ask_give_back(self, pool: str, count: int, min_id: int = 0) -> int:
        entry = self._d.pools.get(pool)
        if entry is None:
            return 0
        return self._d._ask_give_back(pool, entry.space_kv, count, 0, cover=True,
                                      min_id=min_id)

    def cached(self, pool: str) -> int:
        entry = self._d.pools.get(pool)
        if entry is None:
            return 0
        return self._d._cached_elsewhere(pool, entry.space_kv, 0)

    def other_bytes(self) -> int:
        return self._d._fixed_bytes() + self._d._reserved_bytes

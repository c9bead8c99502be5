"""Configure, lookup and Drop of pools: names checked against the caller's scope, plans made off
the loop, regions built in a worker thread, budget claimed before any await, and a Drop that
cancels what the pool was part of (grants, sends, elastic promises) before its region goes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from kvpool.contract.devices import DEFAULT_GPU, GpuName, profile_of_device
from kvpool.contract.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    NotFound,
    ResourceExhausted,
    echo,
)
from kvpool.contract.limits import check_pool_name
from kvpool.contract.plan import PoolPlan
from kvpool.contract.records import ConfigureResult, Released
from kvpoold.access import Caller
from kvpoold.elastic.manager import ElasticPools
from kvpoold.pools.pool import Pool, open_pool
from kvpoold.pools.pool_registry import PoolRegistry, fixed_part
from kvpoold.server.args import ConfigureArgs
from kvpoold.server.attachments import AttachmentTable
from kvpoold.server.give_back import CachePressure
from kvpoold.server.leases import LeaseTable
from kvpoold.server.planning import plan_off_loop
from kvpoold.sharing.base import BackingFactory
from kvpoold.transfer import Transfers

log = logging.getLogger("kvpoold.daemon")

# Configure plans in worker threads, this many at once.
PLANNING_SLOTS = 2


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


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


class PoolService:
    """The daemon's Configure, pool lookup and Drop.

    Args:
        registry: the pools by name and their lifecycles.
        budget_bytes: the device budget.
        available_bytes: what the budget has left now.
        device: the daemon's device: Configure plans for its ``--gpu`` profile when it names
            none (read once, at the first such Configure: ``device_gpu``).
        factory: makes each pool's region.
        clock: monotonic seconds (a pool's creation time).
        elastic: the elastic pools (admitted at Configure, removed at Drop).
        transfers: NIXL registration at Configure; grants and sends end at Drop.
        attachments: counted (and ended by a forced Drop).
        leases: who holds ids in a pool (named in Drop's refusal).
        pressure: woken at Drop (Allocates waiting in the pool get NOT_FOUND).
    """

    def __init__(self, registry: PoolRegistry, budget_bytes: int,
                 available_bytes: Callable[[], int], device: str,
                 factory: BackingFactory, clock: Callable[[], float], elastic: ElasticPools,
                 transfers: Transfers, attachments: AttachmentTable, leases: LeaseTable,
                 pressure: CachePressure) -> None:
        self.registry = registry
        self.budget_bytes = budget_bytes
        self._available = available_bytes
        self._device = device
        self._gpu: GpuName | None = None
        self._factory = factory
        self._clock = clock
        self._elastic = elastic
        self._transfers = transfers
        self._attachments = attachments
        self._leases = leases
        self._pressure = pressure
        # Configures planning at once (each in a worker thread); the rest wait their turn.
        self._planning = asyncio.Semaphore(PLANNING_SLOTS)

    @property
    def gpu(self) -> GpuName:
        """The ``--gpu`` profile of this daemon's device (read once, lazily)."""
        if self._gpu is None:
            self._gpu = device_gpu(self._device)
        return self._gpu

    # -- lookup ------------------------------------------------------------------------------

    def pool(self, name: str, caller: Caller | None = None) -> Pool:
        """The built pool ``name``, checked against the caller's scope first (None: the
        daemon's own lookup, whose NotFound lists no pools).

        Raises:
            InvalidArgument: a malformed name.
            PermissionDenied: the caller's scope does not cover ``name``.
            NotFound: no such pool (or it is still being built).
        """
        if caller is not None and not caller.admin:
            caller.check_pool(check_pool_name(name))
        entry = self.registry.get(name)
        if entry is None:
            check_pool_name(name)
            building = " (it is being configured; retry when Configure returns)" if (
                name in self.registry.building) else ""
            known = "" if caller is None else "; pools: " + (
                ", ".join(sorted(p for p in self.registry.pools if caller.sees(p))) or "none")
            raise NotFound(f"no pool {name!r}{building}{known}", field="pool")
        return entry

    # -- Configure ---------------------------------------------------------------------------

    async def configure(self, caller: Caller, args: ConfigureArgs) -> ConfigureResult:
        """Plan a pool and build it, or return the existing one with the same layout.

        Raises:
            InvalidArgument: bad name, model or options.
            PermissionDenied: the caller's scope does not cover the name.
            AlreadyExists: the name is taken by a pool with another fingerprint.
            ResourceExhausted: the pool does not fit in the device budget left.
            FailedPrecondition: the name's dropped pool still waits for its last use.
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
        planned = await plan_off_loop(args, self._available(), self._planning)
        new_plan, fingerprint = planned.plan, planned.fingerprint
        registry = self.registry
        while name in registry.building:  # the same name is being built: wait, look again
            await registry.building[name].wait()
        if name in registry.dropping:
            raise FailedPrecondition(
                f"pool {name!r} was dropped while transfers or elastic workers were using its "
                "memory; it is released when they end (a transfer at the latest at its write "
                "deadline plus the fence margin); Configure it again then, or use another name",
                field="pool")
        existing = registry.get(name)
        if existing is not None:
            if existing.fingerprint != fingerprint:
                raise AlreadyExists(
                    f"pool {name!r} exists with layout {existing.fingerprint}, this request "
                    f"plans {fingerprint}; use the same model and options, another name, or "
                    "Drop it first",
                    field="pool",
                )
            return self._result(existing.plan, existing.plan_json, fingerprint,
                                created=False, dry_run=args.dry_run)
        needed, available = fixed_part(new_plan), self._available()
        if new_plan.elastic is not None:
            self._elastic.check(name, new_plan, registry.reserved_bytes + needed)
        if needed > available:
            raise ResourceExhausted(
                f"pool {name!r} needs {needed:,} B of device memory, the daemon has "
                f"{available:,} B of its {self.budget_bytes:,} B budget left; "
                f"{budget_hint(new_plan)}",
                field="budget_bytes",
            )
        if args.dry_run:
            return self._result(new_plan, planned.plan_json, fingerprint,
                                created=False, dry_run=True, extra=needed)
        # Claim the name and the bytes now, before any await, so concurrent calls see them.
        registry.reserve(name, needed)
        # Building continues if the caller goes away: the pool is then there for its retry.
        task = asyncio.ensure_future(self._build(name, new_plan))
        entry = await asyncio.shield(task)
        return self._result(entry.plan, entry.plan_json, fingerprint, created=True,
                            dry_run=False)

    async def _build(self, name: str, new_plan: PoolPlan) -> Pool:
        entry: Pool | None = None
        try:
            entry = await asyncio.to_thread(self._build_registered, name, new_plan)
            if new_plan.elastic is not None:
                try:
                    await self._elastic.admit(entry)
                except BaseException:
                    entry.close()
                    entry = None
                    raise
        finally:
            self.registry.built(name, fixed_part(new_plan), entry)
        assert entry is not None  # set unless the build raised
        log.info("pool configured", extra={"fields": {
            "event": "configure", "pool": name, "fingerprint": entry.fingerprint,
            "architecture": new_plan.architecture, "backing_bytes": new_plan.backing_bytes,
            "num_pages": new_plan.num_pages, "page_size": new_plan.page_size,
        }})
        return entry

    def _build_registered(self, name: str, new_plan: PoolPlan) -> Pool:
        """Build the pool and register its backing with NIXL (worker thread)."""
        entry = open_pool(name, new_plan, self._factory, self._clock())
        if new_plan.elastic is not None:  # not moved over NIXL (yet): nothing to register
            return entry
        try:
            self._transfers.register_pool(entry)
        except BaseException as exc:
            entry.close()
            raise Internal(f"pool {name!r}: NIXL could not register its {new_plan.backing_bytes:,}"
                           f" B region: {type(exc).__name__}: {exc}") from exc
        return entry

    def _result(self, p: PoolPlan, plan_json: str, fingerprint: str, *, created: bool,
                dry_run: bool, extra: int = 0) -> ConfigureResult:
        return ConfigureResult(p, plan_json, fingerprint, created, dry_run,
                               max(0, self._available() - extra))

    # -- Drop --------------------------------------------------------------------------------

    async def drop(self, caller: Caller, name: str, force: bool = False) -> Released:
        """Release a pool's memory and budget: every promise made to or by it is cancelled,
        its grants end and its sends fail, its holders' ids and its attachments go; its region
        is released (in a worker thread) once nothing uses it any more.

        Raises:
            NotFound: no such pool.
            PermissionDenied: the caller's scope does not cover it.
            FailedPrecondition: a lease holds ids in it or a client is attached, and not force.
        """
        entry = self.pool(name, caller)
        holders = entry.ids.held_by_owner()
        attached = self._attachments.count_pool(name)
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
        detached = self._attachments.remove_pool(name)
        charged = self._charged(entry)
        self._elastic.remove(name)  # its handshakes and promises end
        self._transfers.pool_gone(name)  # grants end, sends fail; pins hold uses
        await self.registry.drop(name, charged)
        self._pressure.notify_freed()  # Allocates waiting on give-backs in it: NOT_FOUND now
        log.info("pool dropped", extra={"fields": {
            "event": "drop", "pool": name, "force": force, "reclaimed": sum(reclaimed.values()),
            "detached": detached, "released_bytes": charged,
        }})
        return Released(held, detached, charged)

    def _charged(self, entry: Pool) -> int:
        """Budget bytes a pool takes now: a fixed pool's region, an elastic pool's fixed part
        and granted groups."""
        stats = self._elastic.stats(entry.name)
        return entry.plan.backing_bytes if stats is None else stats.granted_bytes

    def _shown_to(self, caller: Caller, owner: int) -> bool:
        """Whether the caller may see the lease ``owner`` by name and id (admin, or its own)."""
        if caller.admin:
            return True
        lease = self._leases.of_owner(owner)
        return lease is not None and lease.identity == caller.identity

    def _holder_label(self, owner: int, count: int) -> str:
        """``name (lease <id>, N ids)``: a holder as users know it (never the owner number)."""
        lease = self._leases.of_owner(owner)
        if lease is None:
            return f"a lease that ended ({count} ids)"
        name = lease.name if len(lease.name) <= 40 else echo(lease.name, 40)
        return f"{name} (lease {lease.lease_id}, {count} ids)"

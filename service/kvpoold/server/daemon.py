"""The daemon: a facade over the collaborators that own its state, one job each.

- :class:`~kvpoold.pools.pool_registry.PoolRegistry`: pools by name, their lifecycles (building,
  live, dropping) and fixed charges; each :class:`~kvpoold.pools.pool.Pool` the one owner of its
  pages' and groups' state;
- :class:`~kvpoold.elastic.manager.ElasticPools`: the elastic pools' grants and reclaims (its
  :class:`~kvpoold.elastic.arbiter.Arbiter` decides, purely);
- :class:`~kvpoold.server.pool_service.PoolService`: Configure, lookup, Drop;
- :class:`~kvpoold.server.lease_service.LeaseService`: open, prove, renew, close, expire;
- :class:`~kvpoold.server.allocation.Allocations`: Allocate, Free, the Free check;
- :class:`~kvpoold.server.give_back.CachePressure`: give-backs of page caches, wake-ups;
- :class:`~kvpoold.server.attach_service.AttachService`: Attach, Detach, descriptors;
- :class:`~kvpoold.transfer.Transfers`: grants and sends between daemons;
- :class:`~kvpoold.server.watch.WatchStreams`: WatchStats streams per identity.

Authorization: every method a client reaches takes the :class:`Caller` of the call first; a
pool is checked against the caller's scope before it is looked up (PERMISSION_DENIED says nothing
about whether it exists); a lease is proven by its secret and must be the caller's identity's
(any failure is the NOT_FOUND of an unknown lease).

Concurrency: every method runs on the server's event loop thread, so no state needs a lock
(nothing awaits while it holds state half-changed). Work off the loop (building a region,
committing or freeing an elastic group, releasing a dropped region) runs in worker threads on
objects nobody else changes meanwhile: a name being built is in the registry's ``building``, a
group being moved is ``committing`` or ``releasing`` in its pool's ledger, and either holds a
use of the pool, so a Drop releases the region only after them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvpool.contract.fd_channel import FdAsk
from kvpool.contract.records import AttachInfo, ConfigureResult, Released, Stats
from kvpoold import __version__
from kvpoold.access import DAEMON_CALLER, Caller
from kvpoold.elastic.fd_server import FdGrant
from kvpoold.elastic.manager import RECLAIM_DEADLINE_S, ElasticPools, Policy
from kvpoold.pools.pool import Pool
from kvpoold.pools.pool_registry import PoolRegistry
from kvpoold.server.allocation import Allocated, Allocations
from kvpoold.server.args import ConfigureArgs, LeaseRef
from kvpoold.server.attach_service import AttachService
from kvpoold.server.attachments import MAX_ATTACHMENTS_PER_IDENTITY, AttachmentTable
from kvpoold.server.elastic_hooks import ElasticHooks
from kvpoold.server.give_back import ELASTIC_WAIT_S, GIVE_BACK_WAIT_S, CachePressure
from kvpoold.server.kv_stream import KvEvents
from kvpoold.server.lease_service import LeaseService
from kvpoold.server.leases import MAX_LEASES_PER_IDENTITY, CacheCounts, Lease, LeaseTable
from kvpoold.server.loop_clock import StallClock
from kvpoold.server.pool_service import PoolService
from kvpoold.server.seal_service import Sealing
from kvpoold.server.stats import (
    MAX_WATCH_STREAMS_PER_IDENTITY,
    WATCH_MIN_INTERVAL_S,
    gather_stats,
    take_stats,
)
from kvpoold.server.watch import WatchStreams
from kvpoold.sharing.base import BackingFactory
from kvpoold.transfer import NIXL_MISSING, NixlAgent, Outgoing, Transfers
from kvpoold.transfer.grants import ReceiveGrant
from kvpoold.transfer.messages import GrantArgs, PostArgs, SendArgs


class Daemon:
    """Pools, budget, leases and attachments of one device.

    Args:
        device: ``cpu`` or ``cuda:N`` (for Stats and Attach; memory comes from the factory).
        budget_bytes: the device bytes pools may take in all.
        backing_factory: creates each pool's region (plain, shared memory, CUDA IPC).
        clock: monotonic seconds; injected so tests can move time.
        lease_clock: the clock of lease deadlines (default ``clock``); ``kvpoold serve`` gives
            a ``loop_clock.StallClock``, which stands still while the event loop is stalled,
            so a renewal the daemon was too busy to read never expires a lease.
        nixl_agent: the NIXL agent for transfers (None: every transfer RPC gets ``nixl_off``).
        peer_token: the bearer token this daemon sends to peer daemons.
        max_leases_per_identity: leases one caller identity may hold open at once.
        max_attachments_per_identity: attachments one caller identity may hold at once.
        max_watch_streams_per_identity: WatchStats streams one caller identity may hold open.
        watch_min_interval_s: the shortest interval a WatchStats stream is served at.
        reclaim_deadline_s: how long attached processes have to unmap an elastic group.
        elastic_policy: how elastic pools share the budget (``kvpoold.elastic.manager``).
        kv_events: the KV events stream of the sealed-page directories (None: not published;
            ``kvpoold.server.kv_stream``).
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
        kv_events: KvEvents | None = None,
    ) -> None:
        self.device = device
        # The Unix socket held sends are posted on (the post channel, on the side socket), set
        # once it listens; "" while there is none (posts then come by gRPC).
        self.post_socket = ""
        self.budget_bytes = budget_bytes
        self.version = __version__
        self._factory = backing_factory
        self._clock = clock
        self.started_at = clock()
        self.leases = LeaseTable(lease_clock or clock, max_per_identity=max_leases_per_identity)
        # Stats and /metrics report its stalls (none without one: a daemon driven by hand).
        self.stall_clock = lease_clock if isinstance(lease_clock, StallClock) else None
        self.attachments = AttachmentTable()
        self.watch_streams = WatchStreams(max_watch_streams_per_identity, watch_min_interval_s)
        self.pressure = CachePressure(self.leases)
        self.transfers = Transfers(self.pool, self.leases, clock, nixl_agent, nixl_off,
                                   peer_token, on_freed=self.pressure.notify_freed)
        self.registry = PoolRegistry(on_released=self._released)
        hooks = ElasticHooks(self.leases, self.attachments, self._revoke, self.pressure,
                             self.registry)
        self.elastic = ElasticPools(budget_bytes, hooks, clock, reclaim_deadline_s,
                                    elastic_policy)
        self.pressure.also_on_freed = self.elastic.ids_freed
        self.lease_service = LeaseService(self.leases, self.registry, self.attachments,
                                          self.transfers, self.elastic, self.pressure)
        self.pool_service = PoolService(self.registry, budget_bytes, self.available_bytes,
                                        device, backing_factory, clock, self.elastic,
                                        self.transfers, self.attachments, self.leases,
                                        self.pressure)
        self.allocations = Allocations(self.pool, self.lease, self.pressure, self.elastic)
        self.attach_service = AttachService(device, self.pool, self.lease, self.leases,
                                            self.attachments, self.elastic,
                                            max_attachments_per_identity)
        self.kv_events = kv_events
        self.sealing = Sealing(self.pool, self.lease, clock, kv_events)  # Seal, Adopt, Sealed

    def _revoke(self, lease_id: int, why: str) -> None:
        self.lease_service.revoke(lease_id, why)

    def _released(self, pool: Pool) -> None:
        self.transfers.deregister(pool.name)
        self.pressure.notify_freed()

    # -- budget ----------------------------------------------------------------------------

    @property
    def pools(self) -> dict[str, Pool]:
        """The live pools by name (the registry's)."""
        return self.registry.pools

    @property
    def used_bytes(self) -> int:
        """Budget bytes taken: fixed pools whole, elastic pools' fixed parts and granted
        groups, dropped pools not yet released."""
        return self.registry.fixed_bytes() + self.elastic.granted_bytes

    def available_bytes(self) -> int:
        return max(0, self.budget_bytes - self.used_bytes - self.registry.reserved_bytes)

    def now(self) -> float:
        return self._clock()

    def audit(self) -> None:
        """Every invariant of every pool and of the registry (tests call it after each step).

        Raises:
            Internal: naming the first broken one.
        """
        self.registry.audit()

    # -- pools -------------------------------------------------------------------------------

    async def configure(self, caller: Caller, args: ConfigureArgs) -> ConfigureResult:
        """``PoolService.configure``."""
        return await self.pool_service.configure(caller, args)

    def pool(self, name: str, caller: Caller | None = None) -> Pool:
        """``PoolService.pool``: the live pool ``name``, checked against the caller's scope."""
        return self.pool_service.pool(name, caller)

    async def drop(self, caller: Caller, name: str, force: bool = False) -> Released:
        """``PoolService.drop``."""
        return await self.pool_service.drop(caller, name, force)

    # -- leases ------------------------------------------------------------------------------

    def open_lease(self, caller: Caller, name: str, ttl_s: float) -> Lease:
        """``LeaseService.open``."""
        return self.lease_service.open(caller, name, ttl_s)

    def lease(self, caller: Caller, ref: LeaseRef) -> Lease:
        """``LeaseService.prove``."""
        return self.lease_service.prove(caller, ref)

    def renew_lease(self, caller: Caller, ref: LeaseRef,
                    reports: dict[tuple[str, str], CacheCounts] | None = None,
                    unmapped: Sequence[int] = ()) -> Lease:
        """``LeaseService.renew``."""
        return self.lease_service.renew(caller, ref, reports, unmapped)

    def close_lease(self, caller: Caller, ref: LeaseRef) -> Released:
        """``LeaseService.close``."""
        return self.lease_service.close(caller, ref)

    def expire_leases(self, max_leases: int | None = None, max_ids: int | None = None, *,
                      timers: bool = True) -> list[tuple[Lease, Released]]:
        """``LeaseService.expire``: one slice of the lease sweep."""
        return self.lease_service.expire(max_leases, max_ids, timers=timers)

    # -- Allocate / Free ---------------------------------------------------------------------

    def allocate(self, caller: Caller, pool: str, ref: LeaseRef,
                 items: Sequence[tuple[str, int]]) -> Allocated:
        """``Allocations.allocate``."""
        return self.allocations.allocate(caller, pool, ref, items)

    async def allocate_waiting(self, caller: Caller, pool: str, ref: LeaseRef,
                               items: Sequence[tuple[str, int]],
                               wait_s: float = GIVE_BACK_WAIT_S,
                               grow_wait_s: float = ELASTIC_WAIT_S) -> Allocated:
        """``Allocations.allocate_waiting``."""
        return await self.allocations.allocate_waiting(caller, pool, ref, items, wait_s,
                                                       grow_wait_s)

    def free(self, caller: Caller, pool: str, ref: LeaseRef,
             items: Sequence[tuple[str, np.ndarray]]) -> int:
        """``Allocations.free``."""
        return self.allocations.free(caller, pool, ref, items)

    # -- Attach / Detach ---------------------------------------------------------------------

    def attach(self, caller: Caller, pool: str, expected_fingerprint: str = "",
               ref: LeaseRef | None = None) -> AttachInfo:
        """``AttachService.attach``."""
        return self.attach_service.attach(caller, pool, expected_fingerprint, ref)

    def fd_grant(self, ask: FdAsk, uid: int, pid: int) -> FdGrant:
        """``AttachService.fd_grant``."""
        return self.attach_service.fd_grant(ask, uid, pid)

    def detach(self, caller: Caller, attach_id: int) -> None:
        """``AttachService.detach``."""
        self.attach_service.detach(caller, attach_id)

    # -- Stats -------------------------------------------------------------------------------

    def stats(self, caller: Caller, pool: str = "") -> Stats:
        """Stats as the caller may see them, taken now in one go (``stats.take_stats``); for
        ``pool`` NotFound / PermissionDenied as :meth:`pool`."""
        if pool:
            self.pool(pool, caller)
        return take_stats(self, caller, pool)

    @contextlib.contextmanager
    def watching(self, caller: Caller, pool: str, interval_s: float) -> Iterator[float]:
        """Admit a WatchStats stream of the caller while the block runs (``WatchStreams``).

        Raises:
            As :meth:`pool` for ``pool``, and ``WatchStreams.admit``.
        """
        if pool:
            self.pool(pool, caller)
        with self.watch_streams.admit(caller.identity, interval_s) as interval:
            yield interval

    def count_watch_streams(self, identity: str) -> int:
        """WatchStats streams ``identity`` holds open."""
        return self.watch_streams.count(identity)

    async def snapshot(self) -> Stats:
        """Stats of everything as the daemon sees them (``/metrics``), leases read in slices."""
        return await gather_stats(self, DAEMON_CALLER)

    # -- transfers (kvpoold.transfer): the lease and pool checked here ----------------------

    def grant_receive(self, caller: Caller, ref: LeaseRef, args: GrantArgs) -> ReceiveGrant:
        """``Transfers.grant`` for a proven lease of the caller, in a pool of its scope."""
        self.pool(args.pool, caller).check_movable()
        return self.transfers.grant(self.lease(caller, ref).lease_id, args)

    async def send(self, caller: Caller, ref: LeaseRef, args: SendArgs | PostArgs
                   ) -> Outgoing:
        """``Transfers.send`` for a proven lease of the caller, in a pool of its scope, or
        ``Transfers.post`` of a send the lease holds."""
        if isinstance(args, PostArgs):
            return await self.transfers.post(self.lease(caller, ref).owner, args)
        self.pool(args.pool, caller).check_movable()
        return await self.transfers.send(self.lease(caller, ref).lease_id, args)

    def close(self) -> None:
        """Release every pool and the factory (shutdown). Idempotent."""
        names = [*self.registry.pools, *self.registry.dropping]
        self.registry.close()
        for name in names:
            self.transfers.deregister(name)
        self.attachments.clear()
        self._factory.close()

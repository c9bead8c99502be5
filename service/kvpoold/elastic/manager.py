"""The daemon's elastic pools: the arbiter's decisions carried out on real memory (issue 23).

One :class:`ElasticPools` per daemon, on its event loop: an executor. Each group's state lives
in the pool's ledger (:class:`~kvpoold.ids.grouped.GroupedSpace`: closed, committing, open,
draining, unmapping, releasing, failed), the pool's lifecycle in the pool aggregate
(:class:`~kvpoold.pools.pool.Pool`: work in a worker thread holds a use of it, so a Drop closes
its region only once that work is done), the budget's shares and promises in the pure
:class:`~kvpoold.elastic.arbiter.Arbiter`. The manager keeps the handshakes in flight (unmaps,
cache asks, busy drains) and the counters Stats shows, and drives:

- **grants**: the arbiter counts the groups at once (the budget is theirs); their memory is
  committed in a worker thread (milliseconds a group: never on the loop), then their pages
  open in the ledger and waiting Allocates are woken;
- **reclaims**: a group to take back is drained in the ledger (no page of it is handed out
  again), then every lease with an attachment of the pool is asked on its KeepAlive stream to
  unmap it; when all have acknowledged (or their leases ended), its memory is freed (off the
  loop) and the freed budget granted to the pool it was promised to. A lease that does not
  acknowledge within the deadline is ended: it loses its lease, never another pool's data.
  Groups whose pages page caches hold unused are asked back first (a give-back), then taken
  as they empty; groups whose pages are in use (the arbiter's ``busy`` source: a pool above
  its weighted share while another waits) are drained at once, so their pages are not handed
  out again, and their pool's caches are asked on every sweep for what they free there; each
  is taken as its last page comes back, and reopened if that takes longer than
  ``BUSY_DRAIN_S``;
- **shrinks**: when a lease ends, a pool's wholly free groups above its floor are taken back;
- **failures**: a group whose memory could not be freed is ``failed`` (charged, shown in
  Stats) and retried on every sweep until it is freed; its promise to the asker stands.

Budget: the arbiter's budget is the daemon's; what it may grant is what everything else (fixed
pools, elastic pools' fixed parts, builds in progress, dropped regions still draining) leaves,
asked for fresh at every decision (``Hooks.other_bytes``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Literal

from kvpool.contract.plan import PoolPlan
from kvpool.contract.records import ElasticStats
from kvpoold.elastic.arbiter import Arbiter, Decision, Reclaim, Share
from kvpoold.elastic.backing_audit import BackingAudit
from kvpoold.elastic.elastic_pool import BusyDrain, CachedAsk, ElasticPool, Hooks, Unmapping
from kvpoold.elastic.mover import GroupMover
from kvpoold.pools.pool import Pool

log = logging.getLogger("kvpoold.elastic")

# How long attached processes have to unmap a group asked back (``--reclaim-deadline``).
RECLAIM_DEADLINE_S = 2.0
# How long page caches have to give back pages of groups asked back from them.
CACHED_WAIT_S = 1.0
# How long groups with pages in use, drained for a pool that waits, may take to empty before
# they are handed out again (the asker asks anew if it still waits).
BUSY_DRAIN_S = 30.0
# How the pools share the budget. arbiter: the rules of kvpoold.elastic.arbiter (groups taken
# back from pools that do not use them, weighted fair shares). greedy: what an engine-side
# elastic cache does without a daemon (kvcached): each pool takes what is free while the budget
# keeps GREEDY_HEADROOM of it free, never takes from another, and on the sweep asks its page
# caches to give back what they hold beyond one group and gives back wholly free groups beyond
# one spare; a pool that comes second waits for the first to free memory.
Policy = Literal["arbiter", "greedy"]
POLICIES: tuple[Policy, ...] = ("arbiter", "greedy")
GREEDY_HEADROOM = 0.05


class ElasticPools:
    """Every elastic pool of a daemon and the arbiter between them.

    Args:
        budget_bytes: the daemon's device budget.
        hooks: the daemon's side (leases, attachments, caches, budget).
        clock: monotonic seconds (deadlines, latencies).
        deadline_s: how long attached processes have to unmap a group asked back.
        policy: ``arbiter`` or ``greedy`` (:data:`Policy`).
    """

    def __init__(self, budget_bytes: int, hooks: Hooks,
                 clock: Callable[[], float] = time.monotonic,
                 deadline_s: float = RECLAIM_DEADLINE_S, policy: Policy = "arbiter") -> None:
        self.arbiter = Arbiter(budget_bytes)
        self.policy = policy
        self.pools: dict[str, ElasticPool] = {}
        self.unmappings: dict[int, Unmapping] = {}
        self.cached_asks: list[CachedAsk] = []
        self.busy_drains: list[BusyDrain] = []
        self._hooks = hooks
        self._clock = clock
        self.deadline_s = deadline_s
        self._next_reclaim = 1
        self.mover = GroupMover(self.arbiter, hooks, clock, self._sync_budget, self.pools)
        self.audit = BackingAudit()  # memory in sparse files' holes (CPU)

    # -- budget ------------------------------------------------------------------------------

    @property
    def granted_bytes(self) -> int:
        """Budget bytes the elastic pools' groups take (granted, being committed or freed)."""
        return self.arbiter.granted_bytes

    def _sync_budget(self) -> None:
        self.arbiter.fixed_bytes = self._hooks.other_bytes()

    # -- Configure and Drop ------------------------------------------------------------------

    @staticmethod
    def share_of(name: str, plan: PoolPlan) -> Share:
        e = plan.elastic
        assert e is not None
        return Share(name, e.group_bytes, e.groups, e.floor_groups, e.cap_groups, e.weight)

    def check(self, name: str, plan: PoolPlan, extra_bytes: int = 0) -> None:
        """Whether the pool's floor fits beside the others' floors (before it is built, with
        ``extra_bytes``, its fixed part, not yet counted anywhere).

        Raises:
            ResourceExhausted: naming the floors and the budget; InvalidArgument: bad numbers.
        """
        self._sync_budget()
        self.arbiter.fixed_bytes += extra_bytes
        try:
            self.arbiter.check(self.share_of(name, plan))
        finally:
            self._sync_budget()

    async def admit(self, pool: Pool) -> None:
        """Add a built pool and back its floor: what the budget has free now before this
        returns, the rest as other pools give groups back.

        Raises:
            ResourceExhausted: the floors no longer fit (another Configure won the race), or
                the device cannot back the floor.
        """
        name, plan = pool.name, pool.plan
        self._sync_budget()
        decision = self.arbiter.admit(self.share_of(name, plan))
        ep = self.pools[name] = ElasticPool(pool)
        try:
            await self.mover.grant(ep, decision.grant, raise_errors=True)
        except BaseException:
            self.arbiter.drop(name)
            del self.pools[name]
            raise
        self._start_reclaims(decision, name)
        log.info("elastic pool admitted", extra={"fields": {
            "event": "elastic_admit", "pool": name, "floor_groups": plan.elastic.floor_groups
            if plan.elastic else 0, "granted": decision.grant, "reclaiming": decision.pending,
        }})

    def remove(self, name: str) -> None:
        """Forget a dropped pool: its handshakes end, every promise made to it or by it is
        cancelled (:meth:`Arbiter.drop`). Its region is closed by the pool aggregate once no
        grant or release of it runs in a worker thread (they hold a use of it)."""
        self.pools.pop(name, None)
        self.arbiter.drop(name)
        for rid in [r for r, u in self.unmappings.items() if u.pool == name]:
            del self.unmappings[rid]
        self.cached_asks = [a for a in self.cached_asks if a.pool != name]
        self.busy_drains = [b for b in self.busy_drains if b.pool != name]

    # -- grants ------------------------------------------------------------------------------

    def grow(self, name: str, pages: int, *, reclaim: bool = True) -> bool:
        """Pool ``name`` is ``pages`` kv pages short: ask the arbiter for the groups that
        cover them and start what it decides. Returns whether any pages are coming (a grant,
        a reclaim, or a grant already in flight)."""
        ep = self.pools.get(name)
        share = self.arbiter.pools.get(name)
        if ep is None or share is None:
            return False
        self._sync_budget()
        greedy = self.policy == "greedy"
        if greedy:  # never from another pool, and never into the headroom
            reclaim = False
            if self.arbiter.free_bytes - share.group_bytes < (
                    GREEDY_HEADROOM * self.arbiter.budget_bytes):
                return bool(ep.moving())
        if not reclaim and (ep.moving() or share.granted >= share.cap
                            or self.arbiter.free_bytes < share.group_bytes):
            return False  # growing ahead: only into free budget, one grant at a time (O(1))
        if reclaim:
            self._observe()
        # groups being committed for it now count: their pages are not open yet
        coming = ep.space.count("committing")
        groups = -(-pages // ep.pages_per_group) - coming
        decision = self.arbiter.want(name, groups, reclaim=reclaim)
        if decision.grant:
            self.mover.spawn(self.mover.grant(ep, decision.grant))
        self._start_reclaims(decision, name)
        return bool(decision.grant or decision.reclaims or ep.moving()
                    or self.arbiter.promised_to(name))

    def coming(self, name: str) -> bool:
        """Whether groups are on their way to pool ``name`` now: a group of it being
        committed, or free groups of another pool taken for it and waiting for their mappers
        to unmap. Each ends by a fact (the commit returns or fails; every mapper unmaps, or its
        lease is revoked at its unmap deadline), so an Allocate may wait on it. Not a drain
        of groups in use (that waits on another tenant's requests to end) nor a cache's
        give-back: those are waited for only as give-backs are. O(reclaims in flight)."""
        ep = self.pools.get(name)
        return ep is not None and bool(ep.space.count("committing") or any(
            u.asker == name for u in self.unmappings.values()))

    def holders(self, name: str) -> str:
        """Who holds the budget, for a refusal to pool ``name`` (``Arbiter.holders``)."""
        self._sync_budget()
        return self.arbiter.holders(name)

    def allocated(self, name: str) -> None:
        """An Allocate was served in ``name`` (the pool is busy, not idle)."""
        ep = self.pools.get(name)
        if ep is not None:
            ep.allocs += 1

    def _observe(self) -> None:
        for name, ep in self.pools.items():
            free = ep.space.num_releasable
            self.arbiter.observe(name, free_groups=free,
                                 cached_groups=self._hooks.cached(name) // ep.pages_per_group,
                                 idle=ep.allocs == 0)
            ep.allocs = 0

    # -- reclaims ----------------------------------------------------------------------------

    def _start_reclaims(self, decision: Decision, asker: str | None) -> None:
        for r in decision.reclaims:
            self._reclaim(r, asker)

    def _reclaim(self, r: Reclaim, asker: str | None) -> None:
        ep = self.pools.get(r.victim)
        if ep is None:
            return
        now = self._clock()
        if r.source == "cached":
            asked = self._hooks.ask_give_back(r.victim, r.groups * ep.pages_per_group)
            if not asked:
                self.arbiter.cancel(r.victim, r.groups, asker)
                return
            self.cached_asks.append(CachedAsk(r.victim, r.groups, asker, now + CACHED_WAIT_S,
                                              now))
            return
        if r.source == "busy":
            self._drain_busy(ep, r.groups, asker, now)
            return
        self._take(ep, r.groups, asker, now)

    def _drain_busy(self, ep: ElasticPool, n: int, asker: str | None, now: float) -> None:
        """Drain ``n`` of ``ep``'s highest open groups that hold pages (those the victim's
        first-fit allocation packs least into) and ask its caches for what they hold there."""
        space = ep.space
        picks = [g for g in reversed(space.in_state("open").tolist()) if space.used_in(g)][:n]
        if len(picks) < n:
            self.arbiter.cancel(ep.name, n - len(picks), asker)
        if not picks:
            return
        for g in picks:
            ep.space.drain(g)
        drain = BusyDrain(ep.name, picks, asker, now + BUSY_DRAIN_S, now)
        self.busy_drains.append(drain)
        log.info("elastic drain", extra={"fields": {
            "event": "elastic_drain", "pool": ep.name, "groups": len(picks), "for": asker or "",
            "pages_in_use": sum(ep.space.used_in(g) for g in picks)}})
        self._ask_drained(ep.name)

    def _ask_drained(self, pool: str) -> None:
        """Ask the drained pool's caches for the pages they cache in its drained groups (ids
        from the lowest drained group's first page up: the groups above it are drained,
        wholly free or closed), to stay free there; pages requests use come as they free."""
        ep = self.pools.get(pool)
        groups = [g for b in self.busy_drains if b.pool == pool for g in b.groups]
        if ep is None or not groups:
            return
        held = sum(ep.space.used_in(g) for g in groups)
        want = min(held, self._hooks.cached(pool))
        if want > 0:
            self._hooks.ask_give_back(pool, want, max(1, min(groups) * ep.pages_per_group))

    def _check_drains(self, now: float | None = None) -> None:
        """Take the drained groups that emptied; with ``now``, reopen those past their
        deadline (the asker no longer gets them)."""
        keep = []
        for b in self.busy_drains:
            ep = self.pools.get(b.pool)
            if ep is None:
                continue
            empty = [g for g in b.groups if ep.space.used_in(g) == 0]
            if empty:
                b.groups = [g for g in b.groups if g not in empty]
                self._unmap(ep, tuple(empty), b.asker, b.started)
            if b.groups and now is not None and b.deadline <= now:
                for g in b.groups:
                    ep.space.reopen(g)
                self.arbiter.cancel(b.pool, len(b.groups), b.asker)
                log.info("elastic drain expired", extra={"fields": {
                    "event": "elastic_drain_expired", "pool": b.pool,
                    "groups": len(b.groups), "for": b.asker or ""}})
                b.groups = []
            if b.groups:
                keep.append(b)
        self.busy_drains = keep
        if now is not None:
            for pool in {b.pool for b in self.busy_drains}:
                self._ask_drained(pool)

    def _take(self, ep: ElasticPool, n: int, asker: str | None, started: float) -> int:
        """Drain up to ``n`` wholly free groups of ``ep`` (highest first) and start their
        unmap handshake; what cannot be found is cancelled. Returns the groups taken."""
        picks = tuple(ep.space.releasable().tolist()[:n])
        if len(picks) < n:
            self.arbiter.cancel(ep.name, n - len(picks), asker)
        if not picks:
            return 0
        for g in picks:
            ep.space.drain(g)
        self._unmap(ep, picks, asker, started)
        return len(picks)

    def _unmap(self, ep: ElasticPool, picks: tuple[int, ...], asker: str | None,
               started: float) -> None:
        """Start the unmap handshake of drained, wholly free groups ``picks``."""
        for g in picks:
            ep.space.unmap(g)
        rid = self._next_reclaim
        self._next_reclaim += 1
        u = Unmapping(rid, ep.name, picks, set(), started + self.deadline_s, started, asker)
        for lease_id in self._hooks.attached_leases(ep.name):
            if self._hooks.ask_unmap(lease_id, ep.name, picks, rid, self.deadline_s):
                u.waiting.add(lease_id)
        log.info("elastic reclaim", extra={"fields": {
            "event": "elastic_reclaim", "pool": ep.name, "groups": len(picks),
            "reclaim": rid, "for": asker or "", "waiting_leases": len(u.waiting)}})
        if u.waiting:
            self.unmappings[rid] = u
        else:
            self.mover.spawn(self.mover.finish(u))

    def unmapped(self, lease_id: int, reclaims: Iterable[int]) -> None:
        """The lease's process unmapped these reclaims' groups (its KeepAlive said so)."""
        for rid in reclaims:
            u = self.unmappings.get(rid)
            if u is None or lease_id not in u.waiting:
                continue
            u.waiting.discard(lease_id)
            if not u.waiting:
                del self.unmappings[rid]
                self.mover.spawn(self.mover.finish(u))

    def lease_gone(self, lease_id: int, pool: str | None = None) -> None:
        """A lease ended (or, with ``pool``, detached its last attachment of it): it no
        longer maps anything, so nothing waits for it; then pools shrink to what they use."""
        self.unmapped(lease_id, [rid for rid, u in self.unmappings.items()
                                 if pool is None or u.pool == pool])
        if pool is None:
            for name in list(self.pools):
                self.shrink(name)

    def shrink(self, name: str) -> int:
        """Take back ``name``'s wholly free groups above its floor; returns how many."""
        ep = self.pools.get(name)
        if ep is None:
            return 0
        n = self.arbiter.take_back(name, ep.space.num_releasable)
        return self._take(ep, n, None, self._clock()) if n else 0

    def ids_freed(self) -> None:
        """Ids came back somewhere: groups asked back may have emptied (O(1) unless a drain or
        a cache ask waits)."""
        if self.cached_asks or self.busy_drains:
            self.on_freed()

    def on_freed(self, now: float | None = None) -> None:
        """Ids came back: page caches' give-backs may have emptied groups asked back (with
        ``now``, the sweep's: drains past their deadline are undone too)."""
        if self.busy_drains:
            self._check_drains(now)
        if not self.cached_asks:
            return
        keep = []
        for a in self.cached_asks:
            ep = self.pools.get(a.pool)
            if ep is None:
                continue
            n = min(ep.space.num_releasable, a.groups)
            if n:
                self._take(ep, n, a.asker, a.started)
                a.groups -= n
            if a.groups:
                keep.append(a)
        self.cached_asks = keep

    def sweep(self) -> None:
        """Deadlines: leases that did not unmap in time are ended; give-backs that did not
        empty their groups in time are given up."""
        now = self._clock()
        self.on_freed(now)
        for ep in self.pools.values():  # failed releases: retried (the promise stands)
            retry, ep.retry = ep.retry, []
            for u in retry:
                self.mover.spawn(self.mover.finish(u))
        self.audit.sweep(self.pools, self._hooks)  # memory outside the groups: freed, revoked
        if self.policy == "greedy":  # give back what is unused, beyond one spare group
            for name, ep in self.pools.items():
                cached = self._hooks.cached(name)  # caches keep one group's worth, as kvcached
                if cached > 2 * ep.pages_per_group:  # keeps a reserve of free pages
                    self._hooks.ask_give_back(name, cached - ep.pages_per_group)
                share = self.arbiter.pools[name]
                above = share.granted - share.reclaiming - share.floor
                free = ep.space.num_releasable
                if min(free, above) > 1:  # one spare group above the floor stays
                    n = self.arbiter.take_back(name, min(free, above) - 1)
                    if n:
                        self._take(ep, n, None, now)
        for a in [a for a in self.cached_asks if a.deadline <= now]:
            self.cached_asks.remove(a)
            if a.pool in self.pools:
                self.arbiter.cancel(a.pool, a.groups, a.asker)
        late = [u for u in self.unmappings.values() if u.deadline <= now]
        for u in late:
            # A revoke below ends its lease, which may finish another late reclaim first (the
            # lease was all it waited for): that one is gone, and finished once.
            if self.unmappings.pop(u.reclaim_id, None) is None:
                continue
            ep = self.pools.get(u.pool)
            for lease_id in sorted(u.waiting):
                if ep is not None:
                    ep.revoked += 1
                log.warning("lease did not unmap in time", extra={"fields": {
                    "event": "elastic_revoke", "pool": u.pool, "reclaim": u.reclaim_id,
                    "lease_id": lease_id, "deadline_s": self.deadline_s}})
                self._hooks.revoke(lease_id, (
                    f"it did not unmap groups {list(u.groups)} of elastic pool {u.pool!r} "
                    f"within {self.deadline_s:g} s of being asked (reclaim {u.reclaim_id})"))
            self.mover.spawn(self.mover.finish(u))

    # -- Attach and Stats ---------------------------------------------------------------------

    def open_groups(self, name: str) -> tuple[int, ...]:
        """Groups a process attaching now maps: granted and not being taken back."""
        return tuple(self.pools[name].space.in_state("open").tolist())

    def stats(self, name: str) -> ElasticStats | None:
        """The pool's :class:`ElasticStats` (None: not an elastic pool)."""
        ep = self.pools.get(name)
        share = self.arbiter.pools.get(name)
        if ep is None or share is None or ep.plan.elastic is None:
            return None
        e = ep.plan.elastic
        try:
            backed = ep.backing.backed_bytes()
        except OSError:
            backed = 0
        return ElasticStats(
            group_bytes=e.group_bytes, groups=e.groups, granted_groups=share.granted,
            reclaiming_groups=share.reclaiming, floor_groups=e.floor_groups,
            cap_groups=e.cap_groups, weight=e.weight, virtual_bytes=ep.plan.backing_bytes,
            granted_bytes=e.fixed_bytes + share.granted_bytes, backed_bytes=backed,
            grants=ep.grants, reclaims=ep.reclaims, reclaim_seconds_sum=ep.reclaim_sum,
            reclaim_seconds_max=ep.reclaim_max, revoked_leases=ep.revoked,
            failed_groups=ep.space.count("failed"), failed_releases=ep.failures)

    async def close(self) -> None:
        """Stop: cancel what is running in worker threads' wake (shutdown)."""
        await self.mover.close()

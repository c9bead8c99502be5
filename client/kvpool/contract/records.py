"""What the daemon answers, as one set of records both sides use (no proto, no grpc, no torch).

The daemon builds these (``Stats`` once per call, in this shape), ``kvpool.contract.codec`` turns
them into proto messages and back, and the clients hand them to callers. ``kvpool stats --json`` is
``msgspec.json.encode`` of :class:`Stats`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpool.contract.plan import BufferSpec, PoolPlan
from kvpool.contract.shared_handle import SharedHandle

# pool -> id space -> ids: what a lease holds, or what CloseLease / Drop gave back.
HeldMap = dict[str, dict[str, int]]


class SpaceStats(msgspec.Struct, frozen=True, kw_only=True):
    """One id space of a pool, counted now (what the wire carries; :attr:`free` and
    :attr:`allocs` follow from it).

    ``frees`` counts ids (not calls) returned since the pool was built, reclaim included;
    ``failed_allocs`` counts refused Allocate calls; ``high_water`` is the largest ``used``
    seen. ``pinned`` ids are being moved by a transfer between daemons (they cannot be freed);
    ``quarantined`` ids (counted in ``used``) belong to no lease: their lease ended while a
    transfer moved them, and they come back free when it ends.
    """

    capacity: int
    used: int
    high_water: int
    frees: int
    failed_allocs: int
    unit: str = "ids"
    bytes_per_unit: int = 0
    follows: str = ""
    pinned: int = 0
    quarantined: int = 0

    @property
    def free(self) -> int:
        """Ids an Allocate may take now."""
        return self.capacity - self.used

    @property
    def allocs(self) -> int:
        """Ids handed out since the pool was built (``used == allocs - frees``)."""
        return self.frees + self.used


class ElasticStats(msgspec.Struct, frozen=True, kw_only=True):
    """An elastic pool's share of the device budget (docs/elastic.md): its groups granted and
    being taken back, the bytes the budget pays for it (``granted_bytes``: granted groups plus
    the fixed part) and the memory the kernel counts behind it (``backed_bytes``), and its
    counters since Configure."""

    group_bytes: int
    groups: int
    granted_groups: int
    reclaiming_groups: int
    floor_groups: int
    cap_groups: int
    weight: float
    virtual_bytes: int
    granted_bytes: int
    backed_bytes: int
    grants: int = 0
    reclaims: int = 0
    reclaim_seconds_sum: float = 0.0
    reclaim_seconds_max: float = 0.0
    revoked_leases: int = 0
    failed_groups: int = 0
    failed_releases: int = 0


class PoolStats(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    fingerprint: str
    architecture: str
    kv_cache_dtype: str
    page_size: int
    max_total_num_tokens: int
    max_running_requests: int
    backing_bytes: int
    spaces: dict[str, SpaceStats]  # in the plan's order
    attached: int
    age_seconds: float
    sharing: str
    elastic: ElasticStats | None = None  # elastic pools only
    # the sealed-page directory (docs/restart.md) once a page was sealed; ``evicted`` 0 and
    # ``layouts`` empty here (the Sealed RPC lists them)
    sealed: SealedStats | None = None


class LeaseStats(msgspec.Struct, frozen=True, kw_only=True):
    """One lease. ``cached``: of ``held``, the ids its page caches hold unused, as they last
    reported on KeepAlive (``in_use`` = held - cached)."""

    lease_id: int
    name: str
    ttl_seconds: float
    expires_in_seconds: float
    held: HeldMap
    attached: int
    cached: HeldMap = msgspec.field(default_factory=dict)

    def in_use(self, pool: str, space: str = "kv") -> int:
        """Ids of ``pool``/``space`` held and not cached (in use by the engine)."""
        return (self.held.get(pool, {}).get(space, 0)
                - self.cached.get(pool, {}).get(space, 0))

    def held_text(self) -> str:
        """``pool: kv=120 (96 cached) req=1`` per pool (``kvpool top`` and ``kvpool leases``);
        ``-`` when it holds nothing."""
        def one(pool: str, space: str, n: int) -> str:
            cached = self.cached.get(pool, {}).get(space, 0)
            return f"{space}={n:,}" + (f" ({cached:,} cached)" if cached else "")

        return "  ".join(
            f"{pool}: " + " ".join(one(pool, space, n) for space, n in spaces.items())
            for pool, spaces in self.held.items()
        ) or "-"


class DaemonStats(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    device: str
    budget_bytes: int
    used_bytes: int
    uptime_seconds: float
    num_pools: int
    num_leases: int
    leases_opened: int
    leases_closed: int
    leases_expired: int
    nixl_agent: str = ""  # "" = this daemon cannot move pages to peers (kvpool[nixl] missing)
    # Open leases of other identities, in num_leases but not listed (a caller that is not admin
    # sees only its own identity's leases; docs/security.md).
    other_leases: int = 0
    # Event-loop stalls since start, their summed and longest length (lease deadlines stand
    # still during a stall; docs/operations.md, "Event-loop stalls").
    loop_stalls: int = 0
    loop_stalled_seconds: float = 0.0
    loop_longest_stall_seconds: float = 0.0
    # The KV events stream (docs/kv-events.md): endpoints as bound ("" = off / no replay), the
    # topic template, batches handed to the publisher and dropped (a full queue: each a gap),
    # the last batch's sequence number.
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    kv_events_published: int = 0
    kv_events_dropped: int = 0
    kv_events_last_seq: int = 0  # the last batch's number (sent or dropped)


class PeerStats(msgspec.Struct, frozen=True, kw_only=True):
    """Transfers with one peer daemon: sent to the address a Send named, received from the
    sending daemon's NIXL agent. ``sent``/``received`` count completed transfers."""

    peer: str
    sent: int = 0
    sent_bytes: int = 0
    send_failures: int = 0
    received: int = 0
    received_bytes: int = 0
    receive_failures: int = 0
    # Now: received writes whose grant ended before the writer was known to have ended; their
    # pages stay quarantined until it reports its end or its process exits.
    fenced_writes: int = 0
    fenced_pages: int = 0


class Stats(msgspec.Struct, frozen=True, kw_only=True):
    """The daemon, its pools and its leases at one instant of its event loop."""

    daemon: DaemonStats
    pools: list[PoolStats]
    leases: list[LeaseStats]
    peers: list[PeerStats] = msgspec.field(default_factory=list)

    def pool(self, name: str) -> PoolStats:
        """The pool called ``name``; KeyError if Stats has none."""
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


@dataclass(frozen=True)
class Released:
    """What CloseLease or Drop gave back: ids per pool and id space, attachments ended."""

    held: HeldMap
    detached: int
    released_bytes: int = 0

    @property
    def total(self) -> int:
        return sum(n for spaces in self.held.values() for n in spaces.values())


@dataclass(frozen=True)
class ConfigureResult:
    """What Configure returned: the plan, its fingerprint, and whether this call created the
    pool; ``budget_available_bytes`` is the daemon's device budget left after the call."""

    plan: PoolPlan
    plan_json: str
    fingerprint: str
    created: bool
    dry_run: bool
    budget_available_bytes: int

    @property
    def buffers(self) -> tuple[BufferSpec, ...]:
        return self.plan.buffers


@dataclass(frozen=True)
class AttachInfo:
    """What Attach returned: the layout and the handle to map it; Detach with ``attach_id``."""

    fingerprint: str
    plan: PoolPlan
    plan_json: str
    handle: SharedHandle
    attach_id: int
    device: str
    # Elastic pools: the groups granted when Attach answered (map them before reading).
    elastic_groups: tuple[int, ...] = ()


class TransferState(enum.StrEnum):
    """Where a transfer between daemons stands (``TransferStatus.state``)."""

    pending = "pending"  # granted and not yet written, or posted and not yet complete
    done = "done"  # every byte is in the receiving pages
    failed = "failed"  # see the message; pages stay owned as they were


class TransferStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A transfer as one side sees it (WaitTransfer): the sender by transfer id, the receiver
    by grant token. ``seconds`` runs from posting (sender) or accepting (receiver) to the end;
    ``peer`` is the other daemon's NIXL agent."""

    state: TransferState
    message: str = ""
    bytes: int = 0
    pages: int = 0
    seconds: float = 0.0
    peer: str = ""

    @property
    def ended(self) -> bool:
        return self.state != TransferState.pending


class CancelledGrant(msgspec.Struct, frozen=True, kw_only=True):
    """What CancelGrant did: the grant as it ended, the pages it unpinned, and the pages a
    sender's write may still land in (fenced until the writer has ended)."""

    status: TransferStatus
    freed_pages: int = 0
    fenced_pages: int = 0


@dataclass(frozen=True)
class Adopted:
    """What Adopt handed the lease: the pages (now the lease's; parents before their children),
    each page's 32-byte key and parent key, its token ids (``tokens[i]``: page_size int32),
    the pool's epoch after it, and what stayed behind: pages whose writers may still live
    (``unfenced``), pages whose bytes changed since sealed (``corrupt``, freed), pages of another
    layout."""

    ids: Any  # np.ndarray int32
    keys: list[bytes]
    parents: list[bytes]
    tokens: Any  # np.ndarray int32, (pages, page_size)
    epoch: int = 0
    unfenced: int = 0
    corrupt: int = 0
    other_layout: int = 0


class SealedStats(msgspec.Struct, frozen=True, kw_only=True):
    """A pool's sealed-page directory (the Sealed RPC): pages leases hold, pages it keeps with
    their bytes and ages, totals, and the pages a call evicted."""

    held: int = 0
    kept: int = 0
    kept_bytes: int = 0
    oldest_seconds: float = 0.0
    newest_seconds: float = 0.0
    sealed_total: int = 0
    adopted_total: int = 0
    evicted_total: int = 0
    corrupt_total: int = 0
    epoch: int = 0
    evicted: int = 0
    layouts: tuple[str, ...] = ()
    events_rank: int | None = None  # its KV events' data_parallel_rank (None: none published)


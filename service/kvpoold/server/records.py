"""Frozen records the daemon takes and returns; ``convert`` maps them to and from the wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool.plan import PoolPlan
from kvpoold.ids import Kind, PoolCounters
from kvpoold.sharing.base import SharedHandle


@dataclass(frozen=True)
class ConfigureArgs:
    """A Configure request: the model as HF config text or a spec mapping, plus plan options.

    ``options`` holds only the fields the caller set (keys of ``PlanOptions``).
    """

    pool: str
    hf_config_json: str | None = None
    spec: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False


@dataclass(frozen=True)
class ConfigureResult:
    plan: PoolPlan
    plan_json: str
    fingerprint: str
    created: bool
    dry_run: bool
    budget_available_bytes: int


@dataclass(frozen=True)
class IdBlock:
    """Ids handed out for one Allocate item; ``swa_ids`` for kv of a hybrid SWA pool."""

    kind: Kind
    ids: np.ndarray
    swa_ids: np.ndarray | None = None


@dataclass(frozen=True)
class HeldCount:
    pool: str
    kind: Kind
    count: int


@dataclass(frozen=True)
class CloseResult:
    released: tuple[HeldCount, ...]
    detached: int


@dataclass(frozen=True)
class DropResult:
    reclaimed: tuple[HeldCount, ...]
    detached: int
    released_bytes: int


@dataclass(frozen=True)
class AttachResult:
    fingerprint: str
    plan: PoolPlan
    plan_json: str
    handle: SharedHandle
    attach_id: int
    device: str


@dataclass(frozen=True)
class DaemonSnapshot:
    version: str
    device: str
    budget_bytes: int
    used_bytes: int
    uptime_s: float
    num_pools: int
    num_leases: int
    leases_opened: int
    leases_closed: int
    leases_expired: int


@dataclass(frozen=True)
class PoolSnapshot:
    name: str
    fingerprint: str
    plan: PoolPlan
    kinds: dict[Kind, PoolCounters]
    attached: int
    age_s: float
    handle_kind: str


@dataclass(frozen=True)
class LeaseSnapshot:
    lease_id: int
    name: str
    ttl_s: float
    expires_in_s: float
    held: tuple[HeldCount, ...]
    attached: int


@dataclass(frozen=True)
class Snapshot:
    """What Stats returns, taken at one instant of the event loop."""

    daemon: DaemonSnapshot
    pools: tuple[PoolSnapshot, ...]
    leases: tuple[LeaseSnapshot, ...]

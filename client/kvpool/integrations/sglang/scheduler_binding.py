"""How an SGLang worker finds its kvpool pool: one :class:`PoolBinding` per scheduler process
(the engine-neutral part is ``kvpool.integrations.pool_binding``).

The KV pool class (``kvpool.integrations.sglang.pools``) makes the binding when SGLang builds
the pool: it opens the scheduler's lease, configures the pool in the daemon from SGLang's own
model config and options, attaches it, and stores the binding on the pool as
``kvpool_binding``. The paged allocator (``kvpool.integrations.sglang.allocator``) takes the
binding of the KV pool it is given; given any other pool (SGLang's own classes, a test's), it
makes one from the environment.

Environment (read once, here):

- ``KVPOOL_TARGET``: the daemon (``kvpool.clients.targets.default_target``; default the per-user
socket).
  ``{gpu}`` in it becomes the scheduler's CUDA device index (one daemon per GPU:
  ``unix:///run/kvpool/gpu{gpu}.sock``); on CPU it becomes 0.
- ``KVPOOL_TOKEN_FILE``: a file holding the daemon's bearer token (TCP listeners).
- ``KVPOOL_POOL``: the pool's name. Required.
- ``KVPOOL_LEASE_TTL_S``: the scheduler's lease TTL in seconds (default 10): how long after a
  crash the daemon takes its pages back.
- ``KVPOOL_ELASTIC``: ``1`` configures the pool elastic (docs/elastic.md), with
  ``KVPOOL_ELASTIC_FLOOR_TOKENS``, ``KVPOOL_ELASTIC_CAP_TOKENS`` (tokens, the daemon's
  defaults when unset) and ``KVPOOL_ELASTIC_WEIGHT`` (default 1).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.contract.errors import InvalidArgument
from kvpool.integrations.pool_binding import (
    DEFAULT_TTL_S,
    POOL_ENV,
    TTL_ENV,
    client_from,
    current_gpu,
    lease_name_for,
    number_from,
    pool_from,
    target_for_this_gpu,
    ttl_from,
)
from kvpool.integrations.pool_binding import PoolBinding as EnginePoolBinding

__all__ = [
    "CAP_ENV",
    "DEFAULT_TTL_S",
    "ELASTIC_ENV",
    "FLOOR_ENV",
    "POOL_ENV",
    "TTL_ENV",
    "WEIGHT_ENV",
    "ElasticSettings",
    "PoolBinding",
    "binding_from_env",
    "binding_of",
    "current_gpu",
    "elastic_from",
    "target_for_this_gpu",
    "ttl_from",
]

ELASTIC_ENV = "KVPOOL_ELASTIC"
FLOOR_ENV = "KVPOOL_ELASTIC_FLOOR_TOKENS"
CAP_ENV = "KVPOOL_ELASTIC_CAP_TOKENS"
WEIGHT_ENV = "KVPOOL_ELASTIC_WEIGHT"


@dataclass(frozen=True)
class ElasticSettings:
    """How the scheduler's pool is configured elastic: floor and cap in tokens (None: the
    daemon's defaults) and the arbiter's weight."""

    floor_tokens: int | None = None
    cap_tokens: int | None = None
    weight: float | None = None

    def options(self) -> dict[str, Any]:
        """The Configure options (``elastic=True`` and those set)."""
        out: dict[str, Any] = {"elastic": True}
        for key, value in (("elastic_floor_tokens", self.floor_tokens),
                           ("elastic_cap_tokens", self.cap_tokens),
                           ("elastic_weight", self.weight)):
            if value is not None:
                out[key] = value
        return out


@dataclass
class PoolBinding(EnginePoolBinding):
    """A scheduler's connection to its pool: the client, the pool's name, and the one lease the
    scheduler holds its pages with (opened lazily, shared by the KV pool's attachment and the
    paged allocator, closed by :meth:`close`), named ``sglang@host:pid``."""

    lease_name: str = field(default_factory=lambda: lease_name_for("sglang"))
    # KVPOOL_ELASTIC=1: the pool is configured elastic with these; None: as it exists, else fixed.
    elastic: ElasticSettings | None = None


def elastic_from(env: Mapping[str, str]) -> ElasticSettings | None:
    """``KVPOOL_ELASTIC`` and its floor, cap and weight; None unless ``KVPOOL_ELASTIC`` is
    ``1`` or ``true``.

    Raises:
        InvalidArgument: a malformed value (the variable is named), or a floor above the cap.
    """
    flag = env.get(ELASTIC_ENV, "").strip().lower()
    if flag not in ("1", "true"):
        if flag not in ("", "0", "false"):
            raise InvalidArgument(f"{ELASTIC_ENV}={flag!r}: expected 1 or 0",
                                  field=ELASTIC_ENV)
        return None
    settings = ElasticSettings(floor_tokens=number_from(env, FLOOR_ENV, int),
                               cap_tokens=number_from(env, CAP_ENV, int),
                               weight=number_from(env, WEIGHT_ENV, float))
    if (settings.floor_tokens is not None and settings.cap_tokens is not None
            and settings.floor_tokens > settings.cap_tokens):
        raise InvalidArgument(
            f"{FLOOR_ENV}={settings.floor_tokens} is above {CAP_ENV}={settings.cap_tokens}",
            field=FLOOR_ENV)
    return settings


def binding_from_env(env: Mapping[str, str] | None = None) -> PoolBinding:
    """A binding from ``KVPOOL_TARGET``, ``KVPOOL_TOKEN_FILE``, ``KVPOOL_POOL``,
    ``KVPOOL_LEASE_TTL_S`` and ``KVPOOL_ELASTIC*``.

    Raises:
        FailedPrecondition: ``KVPOOL_POOL`` is not set.
        InvalidArgument: a malformed value (the variable is named).
    """
    env = os.environ if env is None else env
    pool = pool_from(env, "this SGLang worker")
    ttl_s, elastic = ttl_from(env), elastic_from(env)
    return PoolBinding(client=client_from(env), pool=pool, ttl_s=ttl_s, elastic=elastic)


def binding_of(kvcache: Any) -> PoolBinding | None:
    """The binding a kvpool KV pool carries (``kvpool_binding``; of a composite pool such as
    SGLang's ``HybridLinearKVPool``, its ``full_kv_pool``'s), else None."""
    for pool in (kvcache, getattr(kvcache, "full_kv_pool", None)):
        binding = getattr(pool, "kvpool_binding", None)
        if isinstance(binding, PoolBinding):
            return binding
    return None

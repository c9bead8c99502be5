"""How a vLLM engine core finds its kvpool pool: one :class:`VLLMBinding` per engine-core process.

The scheduler (``kvpool.integrations.vllm.scheduler``) makes the binding from the environment
when vLLM builds it, in the engine-core process: its block pool takes the binding's lease,
which is opened on first use, renewed by the client's keep-alive thread while the engine runs
and ended by :meth:`VLLMBinding.close` (the scheduler's shutdown, and interpreter exit); the
daemon then takes back every page the engine held, in use or cached. An engine that dies
without closing stops renewing, and the daemon takes the pages back ``KVPOOL_LEASE_TTL_S``
later. The engine-neutral part is ``kvpool.integrations.pool_binding``.

Environment (read once, here):

- ``KVPOOL_TARGET``: the daemon (``kvpool.clients.targets.default_target``; default the per-user
  socket). ``{gpu}`` in it becomes the ``gpu`` the caller names; the scheduler names 0, the
  engine's first (CUDA-visible) device, without asking torch (the engine core has no CUDA
  context of its own when its workers are other processes).
- ``KVPOOL_TOKEN_FILE``: a file holding the daemon's bearer token (TCP listeners).
- ``KVPOOL_POOL``: the pool's name. Required; the pool must exist in the daemon.
- ``KVPOOL_LEASE_TTL_S``: the engine's lease TTL in seconds (default 10).

Imports no vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpool.integrations.pool_binding import (
    DEFAULT_TTL_S,
    POOL_ENV,
    TTL_ENV,
    PoolBinding,
    client_from,
    lease_name_for,
    pool_from,
    target_for_this_gpu,
    ttl_from,
)

__all__ = [
    "DEFAULT_TTL_S",
    "POOL_ENV",
    "TTL_ENV",
    "VLLMBinding",
    "binding_from_env",
    "target_for_this_gpu",
    "ttl_from",
]


@dataclass
class VLLMBinding(PoolBinding):
    """An engine core's connection to its pool: the client, the pool's name and the one lease
    (``vllm@host:pid``) its blocks are held by (see
    :class:`kvpool.integrations.pool_binding.PoolBinding`)."""

    lease_name: str = field(default_factory=lambda: lease_name_for("vllm"))


def binding_from_env(env: Mapping[str, str] | None = None, *,
                     gpu: int | None = None) -> VLLMBinding:
    """A binding from ``KVPOOL_TARGET``, ``KVPOOL_TOKEN_FILE``, ``KVPOOL_POOL`` and
    ``KVPOOL_LEASE_TTL_S``; ``gpu`` fills ``{gpu}`` in the target (default the current CUDA
    device, 0 without CUDA). Opens no lease yet.

    Raises:
        FailedPrecondition: ``KVPOOL_POOL`` is not set.
        InvalidArgument: a malformed value (the variable is named).
    """
    env = os.environ if env is None else env
    pool = pool_from(env, "this vLLM engine")
    ttl_s = ttl_from(env)
    return VLLMBinding(client=client_from(env, gpu), pool=pool, ttl_s=ttl_s)

"""How an SGLang worker finds its kvpool pool: one :class:`PoolBinding` per scheduler process.

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
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.clients.client import KVPoolClient, Lease
from kvpool.clients.targets import TARGET_ENV, TOKEN_FILE_ENV, default_target, token_from
from kvpool.contract.errors import FailedPrecondition, InvalidArgument

POOL_ENV = "KVPOOL_POOL"
TTL_ENV = "KVPOOL_LEASE_TTL_S"
DEFAULT_TTL_S = 10.0
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
class PoolBinding:
    """A scheduler's connection to its pool: the client, the pool's name, and the one lease the
    scheduler holds its pages with (opened lazily, shared by the KV pool's attachment and the
    paged allocator, closed by :meth:`close`)."""

    client: KVPoolClient
    pool: str
    ttl_s: float = DEFAULT_TTL_S
    lease_name: str = field(default_factory=lambda: f"sglang@{socket.gethostname()}:{os.getpid()}")
    # KVPOOL_ELASTIC=1: the pool is configured elastic with these; None: as it exists, else fixed.
    elastic: ElasticSettings | None = None
    _lease: Lease | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # What keeps the binding's resources open (the attachment's context manager, caches, ...),
    # closed last-in first-out by ``close``.
    _closers: list[Any] = field(default_factory=list)

    @property
    def lease(self) -> Lease:
        with self._lock:
            if self._lease is None:
                self._lease = self.client.lease(self.lease_name, ttl_s=self.ttl_s)
            return self._lease

    def on_close(self, closer: Any) -> None:
        """Call ``closer()`` at :meth:`close` (before the lease ends)."""
        self._closers.append(closer)

    def close(self) -> None:
        """Run the closers, end the lease (its pages go back to the pool) and the channel.
        Idempotent."""
        while self._closers:
            self._closers.pop()()
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.close()
        self.client.close()


def ttl_from(env: Mapping[str, str]) -> float:
    ttl = _number(env, TTL_ENV, float, lo=0.1, hi=3600.0, example="10")
    return DEFAULT_TTL_S if ttl is None else ttl


def _number(env: Mapping[str, str], name: str, kind: type, *, lo: float | None = None,
            hi: float | None = None, example: str = "") -> Any:
    """The number variable ``name`` holds (None when unset): positive, or in ``lo..hi``.

    Raises:
        InvalidArgument: not a number of ``kind``, or out of range (the variable named).
    """
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        hint = f", e.g. {example}" if example else ""
        what = "seconds" if example else f"a {kind.__name__}"
        raise InvalidArgument(f"{name}={text!r}: expected {what}{hint}", field=name) from None
    if lo is None and value <= 0:
        raise InvalidArgument(f"{name}={text!r}: must be positive", field=name)
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise InvalidArgument(f"{name}={text!r}: must be between {lo:g} and {hi:g} seconds",
                              field=name)
    return value


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
    settings = ElasticSettings(floor_tokens=_number(env, FLOOR_ENV, int),
                               cap_tokens=_number(env, CAP_ENV, int),
                               weight=_number(env, WEIGHT_ENV, float))
    if (settings.floor_tokens is not None and settings.cap_tokens is not None
            and settings.floor_tokens > settings.cap_tokens):
        raise InvalidArgument(
            f"{FLOOR_ENV}={settings.floor_tokens} is above {CAP_ENV}={settings.cap_tokens}",
            field=FLOOR_ENV)
    return settings


def target_for_this_gpu(target: str, gpu: int | None = None) -> str:
    """``target`` with ``{gpu}`` replaced by ``gpu`` (default: the current CUDA device, 0
    without CUDA); a target without the placeholder is returned as it is."""
    if "{gpu}" not in target:
        return target
    if gpu is None:
        gpu = current_gpu()
    return target.replace("{gpu}", str(gpu))


def current_gpu() -> int:
    """The current CUDA device index of this process (SGLang sets it per scheduler), else 0."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.current_device()) if torch.cuda.is_available() else 0


def binding_from_env(env: Mapping[str, str] | None = None) -> PoolBinding:
    """A binding from ``KVPOOL_TARGET``, ``KVPOOL_TOKEN_FILE``, ``KVPOOL_POOL``,
    ``KVPOOL_LEASE_TTL_S`` and ``KVPOOL_ELASTIC*``.

    Raises:
        FailedPrecondition: ``KVPOOL_POOL`` is not set.
        InvalidArgument: a malformed value (the variable is named).
    """
    env = os.environ if env is None else env
    pool = env.get(POOL_ENV, "").strip()
    if not pool:
        raise FailedPrecondition(
            f"{POOL_ENV} is not set: name the kvpool pool this SGLang worker uses "
            f"(and {TARGET_ENV} its daemon, default {default_target(env)})", field=POOL_ENV)
    token_file = env.get(TOKEN_FILE_ENV, "").strip()
    token = token_from(None, Path(token_file)) if token_file else None
    client = KVPoolClient(target_for_this_gpu(default_target(env)), token=token)
    return PoolBinding(client=client, pool=pool, ttl_s=ttl_from(env),
                       elastic=elastic_from(env))


def binding_of(kvcache: Any) -> PoolBinding | None:
    """The binding a kvpool KV pool carries (``kvpool_binding``; of a composite pool such as
    SGLang's ``HybridLinearKVPool``, its ``full_kv_pool``'s), else None."""
    for pool in (kvcache, getattr(kvcache, "full_kv_pool", None)):
        binding = getattr(pool, "kvpool_binding", None)
        if isinstance(binding, PoolBinding):
            return binding
    return None

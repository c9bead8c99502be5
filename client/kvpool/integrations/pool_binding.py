"""How an engine process finds its kvpool pool: the engine-neutral part of the SGLang and vLLM
bindings (``kvpool.integrations.sglang.scheduler_binding``,
``kvpool.integrations.vllm.engine_core_binding``).

One :class:`PoolBinding` per engine process (SGLang's scheduler, vLLM's engine core): the
client of the daemon, the pool's name and the one lease the process holds its pages with. The
lease is opened lazily, on first use; from then on the client's keep-alive thread renews it
every ``ttl_s / 3`` for as long as the process runs (``kvpool.clients.client.Lease``), and
:meth:`PoolBinding.close` (run at interpreter exit once :meth:`PoolBinding.close_at_exit` is
asked) ends it, so the daemon takes back every page it held. A process that dies without
closing stops renewing, and the daemon takes the pages back ``ttl_s`` later.

Environment (read once, by the engine's ``binding_from_env``):

- ``KVPOOL_TARGET``: the daemon (``kvpool.clients.targets.default_target``; default the per-user
  socket). ``{gpu}`` in it becomes the process's CUDA device index (one daemon per GPU:
  ``unix:///run/kvpool/gpu{gpu}.sock``); on CPU it becomes 0.
- ``KVPOOL_TOKEN_FILE``: a file holding the daemon's bearer token (TCP listeners).
- ``KVPOOL_POOL``: the pool's name. Required.
- ``KVPOOL_LEASE_TTL_S``: the lease's TTL in seconds (default 10, 0.1..3600): how long after a
  crash the daemon takes the pages back.
"""

from __future__ import annotations

import atexit
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
TTL_RANGE_S = (0.1, 3600.0)


def lease_name_for(engine: str) -> str:
    """The lease name of this process for ``engine``: ``engine@host:pid``."""
    return f"{engine}@{socket.gethostname()}:{os.getpid()}"


@dataclass
class PoolBinding:
    """An engine process's connection to its pool: the client, the pool's name, and the one
    lease the process holds its pages with (opened lazily by :attr:`lease`, renewed by the
    client's keep-alive thread while the process runs, ended by :meth:`close`)."""

    client: KVPoolClient
    pool: str
    ttl_s: float = DEFAULT_TTL_S
    lease_name: str = field(default_factory=lambda: lease_name_for("kvpool"))
    _lease: Lease | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # What keeps the binding's resources open (attachments, page caches, ...), closed
    # last-in first-out by ``close``.
    _closers: list[Any] = field(default_factory=list)

    @property
    def lease(self) -> Lease:
        """The process's lease, opened on first use (its keep-alive thread starts then)."""
        with self._lock:
            if self._lease is None:
                self._lease = self.client.lease(self.lease_name, ttl_s=self.ttl_s)
            return self._lease

    @property
    def lease_open(self) -> bool:
        """Whether the lease has been opened and not closed."""
        with self._lock:
            return self._lease is not None and not self._lease.closed

    def on_close(self, closer: Any) -> None:
        """Call ``closer()`` at :meth:`close` (before the lease ends)."""
        self._closers.append(closer)

    def close_at_exit(self) -> None:
        """Run :meth:`close` at interpreter exit (unless it ran before)."""
        atexit.register(self.close)

    def close(self) -> None:
        """Run the closers, end the lease (its pages go back to the pool) and the channel.
        Idempotent."""
        atexit.unregister(self.close)
        while self._closers:
            self._closers.pop()()
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.close()
        self.client.close()


def number_from(env: Mapping[str, str], name: str, kind: type, *, lo: float | None = None,
                hi: float | None = None, example: str = "") -> Any:
    """The number variable ``name`` holds (None when unset): positive, or in ``lo..hi``
    (seconds, when ``example`` is given).

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


def ttl_from(env: Mapping[str, str]) -> float:
    """``KVPOOL_LEASE_TTL_S`` (default 10 s).

    Raises:
        InvalidArgument: not a number, or outside 0.1..3600 seconds.
    """
    lo, hi = TTL_RANGE_S
    ttl = number_from(env, TTL_ENV, float, lo=lo, hi=hi, example="10")
    return DEFAULT_TTL_S if ttl is None else ttl


def pool_from(env: Mapping[str, str], who: str) -> str:
    """``KVPOOL_POOL``; ``who`` names the process in the error (e.g. ``"this SGLang worker"``).

    Raises:
        FailedPrecondition: ``KVPOOL_POOL`` is not set.
    """
    pool = env.get(POOL_ENV, "").strip()
    if not pool:
        raise FailedPrecondition(
            f"{POOL_ENV} is not set: name the kvpool pool {who} uses "
            f"(and {TARGET_ENV} its daemon, default {default_target(env)})", field=POOL_ENV)
    return pool


def client_from(env: Mapping[str, str], gpu: int | None = None) -> KVPoolClient:
    """A client of the daemon ``KVPOOL_TARGET`` names (``{gpu}`` filled in), with the token of
    ``KVPOOL_TOKEN_FILE`` when set.

    Raises:
        InvalidArgument: the token file cannot be read, or the target is malformed.
    """
    token_file = env.get(TOKEN_FILE_ENV, "").strip()
    token = token_from(None, Path(token_file)) if token_file else None
    return KVPoolClient(target_for_this_gpu(default_target(env), gpu), token=token)


def target_for_this_gpu(target: str, gpu: int | None = None) -> str:
    """``target`` with ``{gpu}`` replaced by ``gpu`` (default: the current CUDA device, 0
    without CUDA); a target without the placeholder is returned as it is."""
    if "{gpu}" not in target:
        return target
    if gpu is None:
        gpu = current_gpu()
    return target.replace("{gpu}", str(gpu))


def current_gpu() -> int:
    """The current CUDA device index of this process (the engine sets it per worker), else 0."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.current_device()) if torch.cuda.is_available() else 0

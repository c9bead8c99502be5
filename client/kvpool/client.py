"""``KVPoolClient``: the blocking client; leases are context managers kept alive in a thread.

    with KVPoolClient("unix:///run/kvpool/kvpool.sock") as client:
        client.configure("llama", hf_config=Path("config.json"), budget_bytes=2 << 30,
                         page_size=16)
        with client.lease("engine-0", ttl_s=10) as lease:
            pages = lease.allocate("llama", "kv", 64)   # int32 page ids
            lease.free("llama", "kv", pages)

Every failed call raises the ``kvpool.errors`` class of its status code.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool import codec, wire
from kvpool.errors import KVPoolError, NotFound, Unavailable
from kvpool.limits import MESSAGE_SIZE_OPTIONS
from kvpool.page_cache import closed_error
from kvpool.records import AttachInfo, ConfigureResult, Released, Stats
from kvpool.targets import channel_target, default_target
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc

if TYPE_CHECKING:
    from kvpool.attach import LeaseArg
    from kvpool.mapping import MappedRegion
    from kvpool.page_cache import PageCache
    from kvpool.transfer import ReceiveGrant, SendHandle

log = logging.getLogger("kvpool.client")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_TTL_S = 10.0


def open_channel(grpc_module: Any, target: str, root_certificates: bytes | None) -> Any:
    """A channel of ``grpc`` or ``grpc.aio`` (same signatures): TLS when roots are given."""
    if root_certificates is not None:
        creds = grpc.ssl_channel_credentials(root_certificates)
        return grpc_module.secure_channel(target, creds, options=MESSAGE_SIZE_OPTIONS)
    return grpc_module.insecure_channel(target, options=MESSAGE_SIZE_OPTIONS)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The bearer-token metadata TCP listeners with ``--token`` require."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def default_lease_name() -> str:
    """``host:pid``, what Stats shows for a lease opened without a name."""
    return f"{socket.gethostname()}:{os.getpid()}"


def keepalive_interval(ttl_s: float) -> float:
    """Renew three times per TTL: one lost renewal does not expire the lease."""
    return max(0.03, ttl_s / 3)


def cache_reports(caches: Sequence[Any]) -> list[pb.CacheReport]:
    """The KeepAlive report of a lease's page caches: ``(cached, in_use)`` summed per (pool,
    space)."""
    sums: dict[tuple[str, str], list[int]] = {}
    for cache in caches:
        cached, in_use = cache._report()
        counts = sums.setdefault((cache.pool, cache.space), [0, 0])
        counts[0] += cached
        counts[1] += in_use
    return [pb.CacheReport(pool=pool, space=space, cached=c, in_use=u)
            for (pool, space), (c, u) in sums.items()]


def give_back(caches: Sequence[Any], resp: pb.KeepAliveResponse) -> bool:
    """Route a response's give-backs to the caches of their pool and space (each returns cached
    ids only, up to what is asked of it). Returns whether any was asked."""
    for item in resp.give_back:
        left = item.count
        for cache in caches:
            if left <= 0:
                break
            if cache.pool == item.pool and cache.space == item.space:
                left -= cache._give_back(left)
    return bool(resp.give_back)


def lease_gone(caches: Sequence[Any], err: KVPoolError) -> None:
    """The lease is closing or expired: its page caches stop handing out ids (``err``)."""
    for cache in caches:
        cache.lease_gone(err)


class KVPoolClient:
    """A connection to one kvpoold.

    Args:
        target: ``unix:///path.sock``, ``/path.sock``, ``host:port`` or ``tcp://host:port``
            (default: the daemon's default socket).
        token: the daemon's ``--token`` for TCP listeners.
        timeout_s: deadline of each call (Configure waits for the pool to be built: no
            deadline unless given).
        root_certificates: PEM roots for a TLS listener (a TLS channel when given).
    """

    def __init__(self, target: str | None = None, *, token: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 root_certificates: bytes | None = None) -> None:
        self.target = channel_target(target or default_target())
        self._channel = open_channel(grpc, self.target, root_certificates)
        self._stub = kvpool_pb2_grpc.KVPoolStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = auth_metadata(token)
        self.timeout_s = timeout_s

    # -- plumbing ----------------------------------------------------------------------------

    def call(self, method: str, request: Any, *, timeout_s: float | None = -1.0) -> Any:
        """Call ``method`` on the KVPool stub; a gRPC error becomes a ``KVPoolError``."""
        try:
            return getattr(self._stub, method)(
                request, timeout=self.timeout_s if timeout_s == -1.0 else timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, self.target) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KVPoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- RPCs --------------------------------------------------------------------------------

    def health(self, service: str = "") -> str:
        """The health status name (``SERVING``, ``NOT_SERVING``)."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                      timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, self.target) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        """Poll the health service until the daemon answers ``SERVING`` (a daemon just
        started imports torch first: a second or two).

        Raises:
            Unavailable: not serving after ``timeout_s``, with the last answer or error. Other
                errors (a refused token) are raised at once: waiting would not mend them.
        """
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            try:
                last = self.health()
                if last == "SERVING":
                    return
            except Unavailable as exc:  # not listening yet
                last = str(exc)
            if time.monotonic() >= deadline:
                raise Unavailable(f"kvpoold at {self.target} is not serving after "
                                  f"{timeout_s:g} s: {last}")
            time.sleep(0.05)

    def configure(self, pool: str, *, hf_config: Any = None, spec: Any = None,
                  dry_run: bool = False, timeout_s: float | None = None,
                  **options: Any) -> ConfigureResult:
        """Plan (and unless ``dry_run``, build) pool ``pool``.

        Args:
            pool: the name, ``[a-z0-9][a-z0-9._-]{0,62}``.
            hf_config: a HF config.json as text, a mapping, or a path.
            spec: a model spec mapping (kvpoold's ModelSpec JSON shape) instead.
            dry_run: plan and check only.
            timeout_s: deadline (default none: building a large pool takes a while).
            options: ``budget_bytes``, ``max_total_tokens``, ``page_size``, ``kv_cache_dtype``,
                ``tp_size``, ``pp_size``, ``pp_rank``, ``context_length``,
                ``max_running_requests``, ``speculative_algorithm``, ... (see docs/api.md).

        Returns:
            The plan, fingerprint and whether this call created the pool.

        Raises:
            InvalidArgument, AlreadyExists, ResourceExhausted: see docs/api.md.
        """
        req = wire.configure_request(pool, hf_config=hf_config, spec=spec, dry_run=dry_run,
                                        **options)
        return codec.configure_from_pb(self.call("Configure", req, timeout_s=timeout_s))

    def lease(self, name: str | None = None, ttl_s: float = DEFAULT_TTL_S) -> Lease:
        """Open a lease kept alive in a background thread; use it as a context manager."""
        resp = self.call("OpenLease", pb.OpenLeaseRequest(name=name or default_lease_name(),
                                                          ttl_seconds=ttl_s))
        return Lease(self, resp.lease_id, name or default_lease_name(), resp.ttl_seconds,
                     resp.lease_secret)

    def stats(self, pool: str = "") -> Stats:
        return codec.stats_from_pb(self.call("Stats", pb.StatsRequest(pool=pool)))

    def watch_stats(self, pool: str = "", interval_s: float = 1.0) -> Iterator[Stats]:
        """Stats every ``interval_s`` until the caller stops iterating."""
        stream = self._stub.WatchStats(
            pb.WatchStatsRequest(pool=pool, interval_seconds=interval_s), metadata=self._metadata
        )
        try:
            for resp in stream:
                yield codec.stats_from_pb(resp)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                raise wire.error_from_rpc(exc, self.target) from None
        finally:
            stream.cancel()

    def drop(self, pool: str, force: bool = False) -> Released:
        resp = self.call("Drop", pb.DropRequest(pool=pool, force=force))
        return codec.released_from_pb(resp)

    def attach_raw(self, pool: str, expected_fingerprint: str = "",
                   lease: LeaseArg = None) -> AttachInfo:
        """The pool's layout and shared handle; counts as attached until :meth:`detach`
        (or until ``lease``, a ``Lease``, ends)."""
        lease_id, secret = wire.lease_key(lease)
        req = pb.AttachRequest(pool=pool, expected_fingerprint=expected_fingerprint,
                               lease_id=lease_id, lease_secret=secret)
        return codec.attach_from_pb(self.call("Attach", req))

    def detach(self, attach_id: int) -> None:
        self.call("Detach", pb.DetachRequest(attach_id=attach_id))

    def attach(self, pool: str, expected_fingerprint: str | None = None,
               lease: LeaseArg = None) -> AbstractContextManager[MappedRegion]:
        """Map pool ``pool`` zero-copy for the ``with`` block; unmap and Detach after it.

            with client.attach("llama", expected_fingerprint=fp, lease=lease) as region:
                region["k.0"]                 # a tensor view of the daemon's memory
                region.page("v.3", page_id)   # the rows of one KV page

        Args:
            pool: the pool's name.
            expected_fingerprint: the layout the caller was built for (refused if the pool
                has another); None accepts any and ``region.fingerprint`` says which.
            lease: a ``Lease``: the attachment then also ends when the lease does, so a
                crashed process does not pin the pool.

        Returns:
            A context manager yielding a :class:`kvpool.mapping.MappedRegion` (name -> view on
            the pool's device, plus ``plan``, ``page_size``, ``page(name, id)``). On exit
            the region is closed, then detached; a failing Detach never hides an exception
            raised in the block, and an attachment already ended (forced Drop) is no error.

        Raises:
            NotFound: no such pool or lease. FailedPrecondition: another fingerprint, a
            pool that cannot be shared (``--sharing none``), or a GPU this process cannot
            see. PermissionDenied: the shm file belongs to another user.
        """
        from kvpool.attach import attach_sync  # imports torch when the region is mapped

        return attach_sync(self.attach_raw, self.detach, pool, expected_fingerprint, lease)

    def send(self, pool: str, pages: Any, *, peer: str, token: bytes,
             lease: Lease) -> SendHandle:
        """Write ``pages`` (held by ``lease``) into the pages a peer daemon granted with
        ``token`` (page i -> granted page i), with NIXL; see docs/pd-transfer.md.

        Returns once the peer accepted and the write is posted: ``handle.wait()`` for its end.

        Raises:
            FailedPrecondition: no NIXL in the daemon, a page not held, or the peer refused
                (grant ended or used, layouts differ; the peer's message). Unavailable: the
                peer cannot be reached. NotFound: pool, lease or grant unknown.
        """
        from kvpool.transfer import SendHandle

        resp = self.call("Send", wire.send_request(pool, lease, pages, peer, token))
        return SendHandle(self, resp)

    def keep_alive_stream(self, requests: Iterator[pb.KeepAliveRequest]) -> Any:
        return self._stub.KeepAlive(requests, metadata=self._metadata)


class Lease:
    """An open lease: the ids it allocates are its own until freed or the lease ends.

    A background thread renews it over the KeepAlive stream every ``ttl_s / 3``; ``close`` (or
    leaving the ``with`` block) stops the thread and returns everything the lease holds.

    Every request acting on the lease carries its ``secret`` (from OpenLease), which proves it
    to the daemon: the id alone is not enough (docs/security.md). The secret is kept here,
    never shown in ``repr`` or logs; hand it to no one you would not hand the lease to.

    The thread holds the lease only weakly (:func:`_keep_alive`): a ``Lease`` dropped without
    ``close()`` stops renewing once it is garbage (a ``weakref.finalize`` stops the thread, with
    a warning), and the daemon reclaims its ids when its TTL runs out. A page cache with a
    background worker keeps its lease alive while the cache is open.
    """

    def __init__(self, client: KVPoolClient, lease_id: int, name: str, ttl_s: float,
                 secret: bytes) -> None:
        self.client = client
        self.lease_id = lease_id
        self.name = name
        self.ttl_s = ttl_s
        self._secret = secret
        self.error: BaseException | None = None  # why keep-alive stopped, if it failed
        self._stop = threading.Event()
        self._kick = threading.Event()  # send a renewal (with the caches' report) now
        self._caches: list[PageCache] = []
        self._acked = threading.Condition()  # guards _seq, _acked_seq and _caches
        self._seq = 0
        self._acked_seq = 0
        self._thread = threading.Thread(
            target=_keep_alive, args=(weakref.ref(self), client, lease_id, ttl_s, self._stop,
                                      self._kick),
            daemon=True, name=f"kvpool-lease-{lease_id}")
        weakref.finalize(self, _dropped, lease_id, ttl_s, self._stop, self._kick)
        self._thread.start()

    @property
    def secret(self) -> bytes:
        """The lease's secret, which every request acting on it carries."""
        return self._secret

    def __repr__(self) -> str:
        return f"Lease(lease_id={self.lease_id}, name={self.name!r}, ttl_s={self.ttl_s})"

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def allocate(self, pool: str, kind: str, count: int) -> np.ndarray:
        """``count`` ids of ``kind`` (``kv``, ``req``, ``state``) as int32, all or none."""
        return self.allocate_batch(pool, [(kind, count)])[0]

    def allocate_batch(self, pool: str, items: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        """Several ``(kind, count)`` in one all-or-nothing call; one int32 array per item."""
        resp = self.client.call("Allocate", wire.allocate_request(pool, self, items))
        return [codec.ids_from_bytes(item.ids) for item in resp.items]

    def allocate_swa_pairs(self, pool: str, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Hybrid SWA pools: ``count`` full pages and the SWA page paired with each."""
        resp = self.client.call("Allocate", wire.allocate_request(pool, self, [("kv", count)]))
        item = resp.items[0]
        return codec.ids_from_bytes(item.ids), codec.ids_from_bytes(item.paired_ids)

    def free(self, pool: str, kind: str, ids: Any) -> int:
        """Return ``ids`` of ``kind`` (``swa``: only the SWA side of kv pages); all or none."""
        return self.free_batch(pool, [(kind, ids)])

    def free_batch(self, pool: str, items: Sequence[tuple[str, Any]]) -> int:
        """Several ``(kind, ids)`` in one validated call; returns the ids freed."""
        return self.client.call("Free", wire.free_request(pool, self, items)).freed

    # -- for page caches: one space, and what the lease holds of it after the call --------------

    def _allocate_held(self, pool: str, space: str, count: int) -> tuple[np.ndarray, int | None]:
        resp = self.client.call("Allocate", wire.allocate_request(pool, self, [(space, count)]))
        return codec.ids_from_bytes(resp.items[0].ids), wire.held_of(resp)

    def _free_held(self, pool: str, space: str, ids: Any) -> tuple[int, int | None]:
        resp = self.client.call("Free", wire.free_request(pool, self, [(space, ids)]))
        return resp.freed, wire.held_of(resp)

    def _check_held(self, pool: str, space: str, ids: Any) -> tuple[np.ndarray, int | None]:
        """The ids of ``ids`` this lease does not hold now, in order (frees nothing); only for
        a daemon that answered ``held`` before (see ``wire.free_request``)."""
        resp = self.client.call("Free", wire.free_request(pool, self, [(space, ids)],
                                                          check=True))
        return codec.ids_from_bytes(resp.not_held[0].ids), wire.held_of(resp)

    def grant_receive(self, pool: str, pages: Any, ttl_s: float | None = None) -> ReceiveGrant:
        """Let one transfer from a peer daemon write into ``pages`` (kv pages this lease
        holds, and their SWA pages in a hybrid SWA pool) within ``ttl_s`` (default 60 s).

        Returns:
            The grant: pass ``grant.token`` to the sending side; ``grant.wait()`` until the
            bytes are in. Freeing a granted page (or the lease ending) revokes it.

        Raises:
            FailedPrecondition: no NIXL in the daemon, a page this lease does not hold, or
                a page already in a live grant (wait for that grant to end first).
            ResourceExhausted: too many live grants.
        """
        from kvpool.transfer import ReceiveGrant

        req = wire.grant_receive_request(pool, self, pages, ttl_s)
        resp = self.client.call("GrantReceive", req)
        return ReceiveGrant(self.client, codec.ids_from_bytes(req.pages), resp)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (CloseLease took back every id the lease held)."""
        return self._stop.is_set()

    def page_cache(self, pool: str, space: str = "kv", *, low: int | None = None,
                   high: int | None = None, batch: int | None = None,
                   background: bool = True) -> PageCache:
        """A local cache of ``space`` ids held by this lease: ``alloc``/``free`` without gRPC.

        Watermarks in ids (defaults 64/512/128, less for small spaces); see
        ``kvpool.page_cache`` and docs/api.md, "Page cache". ``background=False``: no worker
        thread, the engine calls ``cache.maintain()`` once per step. One Stats call; paired
        spaces (``kv``
        of hybrid SWA and DeepSeek-V4 pools, ``swa``) are refused (InvalidArgument).
        """
        from kvpool.page_cache import PageCache

        return PageCache.open(self, pool, space, low=low, high=high, batch=batch,
                              background=background)

    def close(self) -> Released:
        """Stop renewing and end the lease; returns what it held. Idempotent."""
        if self._stop.is_set():
            return Released({}, 0)
        self._stop.set()
        self._kick.set()
        with self._acked:
            self._acked.notify_all()
            caches = list(self._caches)
        # Before CloseLease takes back every id: the caches' allocs stop handing them out.
        lease_gone(caches, closed_error(self.lease_id))
        self._thread.join(timeout=5.0)
        resp = self.client.call("CloseLease", pb.CloseLeaseRequest(lease_id=self.lease_id,
                                                                   lease_secret=self._secret))
        return codec.released_from_pb(resp)

    def report_now(self, timeout_s: float = 10.0) -> bool:
        """Renew now with the page caches' current counts, and wait until the daemon has the
        report (for tests and tools; the lease reports every TTL/3 anyway).

        Returns:
            False if ``timeout_s`` passed first or the lease stopped.
        """
        with self._acked:
            target = self._seq + 1
        self._kick.set()
        with self._acked:
            return self._acked.wait_for(
                lambda: self._acked_seq >= target or self._stop.is_set(),
                timeout_s) and self._acked_seq >= target

    def _register_cache(self, cache: PageCache) -> None:
        with self._acked:
            self._caches.append(cache)
        self._kick.set()

    def _unregister_cache(self, cache: PageCache) -> None:
        with self._acked:
            if cache in self._caches:
                self._caches.remove(cache)
        self._kick.set()

    def _report_soon(self) -> None:
        self._kick.set()

    def _request(self) -> pb.KeepAliveRequest:
        with self._acked:
            self._seq += 1
            seq = self._seq
            caches = list(self._caches)
        return pb.KeepAliveRequest(lease_id=self.lease_id, lease_secret=self._secret, seq=seq,
                                   caches=cache_reports(caches))

    def _on_response(self, resp: pb.KeepAliveResponse) -> None:
        with self._acked:
            caches = list(self._caches)
        if give_back(caches, resp):
            self._kick.set()  # the new counts go out now; again once the Free is done
        if resp.seq:
            with self._acked:
                self._acked_seq = max(self._acked_seq, resp.seq)
                self._acked.notify_all()

    def _failed(self, err: KVPoolError) -> None:
        """The keep-alive stream failed with ``err`` (the thread retries unless NotFound)."""
        self.error = err
        if isinstance(err, NotFound):  # the lease expired or was closed
            log.error("lease %d lost: %s", self.lease_id, err)
            with self._acked:
                caches = list(self._caches)
            lease_gone(caches, err)
        else:
            log.warning("keep-alive of lease %d failed, retrying: %s", self.lease_id, err)


# -- the keep-alive thread: it reaches its Lease through a weak reference only -------------------

def _requests(ref: weakref.ref[Lease], stop: threading.Event, kick: threading.Event,
              interval: float) -> Iterator[pb.KeepAliveRequest]:
    """The KeepAlive requests of the lease behind ``ref``, every ``interval`` or when kicked;
    ends when stopped or when the lease is garbage (never keeps it alive between requests)."""
    while not stop.is_set():
        lease = ref()
        if lease is None:
            return
        request = lease._request()
        del lease
        yield request
        kick.wait(interval)
        kick.clear()


def _keep_alive(ref: weakref.ref[Lease], client: KVPoolClient, lease_id: int, ttl_s: float,
                stop: threading.Event, kick: threading.Event) -> None:
    """Renew until stopped (close, or the Lease became garbage); reopen the stream after a
    transient failure. Holds the Lease only while handling one response."""
    interval = keepalive_interval(ttl_s)
    while not stop.is_set():
        stream = client.keep_alive_stream(_requests(ref, stop, kick, interval))
        try:
            for resp in stream:
                lease = ref()
                if lease is None:
                    return
                lease._on_response(resp)
                del lease
            return  # the daemon ended the stream (shutting down, or we stopped asking)
        except grpc.RpcError as exc:
            if stop.is_set():
                return
            err = wire.error_from_rpc(exc, client.target)
            lease = ref()
            if lease is None:
                return
            lease._failed(err)
            del lease
            if isinstance(err, NotFound):
                return
            stop.wait(interval / 2)
        finally:
            stream.cancel()


def _dropped(lease_id: int, ttl_s: float, stop: threading.Event, kick: threading.Event) -> None:
    """A Lease became garbage: stop its keep-alive thread (weakref.finalize; a no-op after
    close)."""
    if stop.is_set():
        return
    stop.set()
    kick.set()
    log.warning("lease %d was dropped without close(); it is no longer renewed and the daemon "
                "reclaims its ids within its TTL (%.1f s)", lease_id, ttl_s)

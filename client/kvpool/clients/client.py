"""``KVPoolClient``: the blocking client; leases are context managers kept alive in a thread.

    with KVPoolClient("unix:///run/kvpool/kvpool.sock") as client:
        client.configure("llama", hf_config=Path("config.json"), budget_bytes=2 << 30,
                         page_size=16)
        with client.lease("engine-0", ttl_s=10) as lease:
            pages = lease.allocate("llama", "kv", 64)   # int32 page ids
            lease.free("llama", "kv", pages)

Every failed call raises the ``kvpool.contract.errors`` class of its status code.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Generator, Iterator, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.clients.session import KeepAliveSession, keepalive_interval
from kvpool.clients.targets import channel_target, default_target
from kvpool.contract import codec, rpcs, wire
from kvpool.contract.errors import KVPoolError, Unavailable, lease_closed
from kvpool.contract.limits import MESSAGE_SIZE_OPTIONS
from kvpool.contract.records import (
    Adopted,
    AttachInfo,
    ConfigureResult,
    Released,
    SealedStats,
    Stats,
)
from kvpool.pd.post_connections import PostChannels
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc

if TYPE_CHECKING:
    from kvpool.cache.page_cache import PageCache
    from kvpool.mapping.attach import LeaseArg
    from kvpool.mapping.elastic_map import ElasticRegion
    from kvpool.mapping.regions import MappedRegion
    from kvpool.pd.transfer_handles import ReceiveGrant, SendHandle

R = TypeVar("R")
log = logging.getLogger("kvpool.clients.client")

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


def serving_polls(target: str, timeout_s: float
                  ) -> Generator[float | None, str | Unavailable | None, None]:
    """``wait_serving`` without I/O: sent each health answer (a status name, or the
    Unavailable of a daemon not listening yet; None first), yields how long to pause before
    the next check, or None once it is SERVING.

    Raises:
        Unavailable: not serving after ``timeout_s``, with the last answer.
    """
    deadline = time.monotonic() + timeout_s
    answer = yield 0.0
    while answer != "SERVING":
        if time.monotonic() >= deadline:
            raise Unavailable(f"kvpoold at {target} is not serving after {timeout_s:g} s: "
                              f"{answer if answer is not None else 'no answer'}")
        answer = yield 0.05
    yield None


class Connection:
    """What both clients hold: the channel to one daemon, its stubs, the token's metadata and
    the default deadline (``grpc_module``: ``grpc`` or ``grpc.aio``, same signatures)."""

    def __init__(self, grpc_module: Any, target: str | None, token: str | None,
                 timeout_s: float, root_certificates: bytes | None) -> None:
        self.target = channel_target(target or default_target())
        self._channel = open_channel(grpc_module, self.target, root_certificates)
        self._stub = kvpool_pb2_grpc.KVPoolStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = auth_metadata(token)
        self.timeout_s = timeout_s
        # Pool -> the elastic regions attached through this client's leases, which map the
        # groups of every page those leases allocate. Replaced whole under the lock, so the
        # allocate path reads it with one dict lookup and no lock.
        self._elastic: dict[str, tuple[Any, ...]] = {}
        self._elastic_lock = threading.Lock()  # a leaf

    def _add_region(self, region: Any) -> None:
        with self._elastic_lock:
            self._elastic[region.pool] = (*self._elastic.get(region.pool, ()), region)

    def _remove_region(self, region: Any) -> None:
        with self._elastic_lock:
            left = tuple(r for r in self._elastic.get(region.pool, ()) if r is not region)
            if left:
                self._elastic[region.pool] = left
            else:
                self._elastic.pop(region.pool, None)


def map_allocated(regions: tuple[Any, ...], spaces: Sequence[str],
                  arrays: Sequence[np.ndarray]) -> None:
    """Map, in every elastic region of the pool, the groups of the ids just allocated (of the
    space whose ids lie in groups) before the caller sees them.

    Raises:
        OSError: an mmap failed (the caller frees the ids and raises it).
    """
    for space, ids in zip(spaces, arrays, strict=True):
        for region in regions:
            if space == region.space:
                region.ensure_pages(ids)


class KVPoolClient(Connection):
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
        super().__init__(grpc, target, token, timeout_s, root_certificates)
        # Posts of held sends over the daemon's side socket (kvpool.pd.post_connections).
        self.post_channels = PostChannels(self._metadata)

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

    def run(self, call: rpcs.Call[R], *, timeout_s: float | None = -1.0) -> R:
        """Send one call of the RPC table (:mod:`kvpool.contract.rpcs`) and decode its reply."""
        return call.decode(self.call(call.method, call.request, timeout_s=timeout_s))

    def close(self) -> None:
        self.post_channels.close()
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
        polls = serving_polls(self.target, timeout_s)
        answer: str | Unavailable | None = None
        while (pause := polls.send(answer)) is not None:
            time.sleep(pause)
            try:
                answer = self.health()
            except Unavailable as exc:  # not listening yet
                answer = exc

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
        return self.run(rpcs.configure(pool, hf_config=hf_config, spec=spec, dry_run=dry_run,
                                       **options), timeout_s=timeout_s)

    def lease(self, name: str | None = None, ttl_s: float = DEFAULT_TTL_S) -> Lease:
        """Open a lease kept alive in a background thread; use it as a context manager."""
        name = name or default_lease_name()
        resp = self.run(rpcs.open_lease(name, ttl_s))
        return Lease(self, resp.lease_id, name, resp.ttl_seconds, resp.lease_secret)

    def stats(self, pool: str = "") -> Stats:
        return self.run(rpcs.stats(pool))

    def sealed(self, pool: str, evict: bool = False) -> SealedStats:
        """Pool ``pool``'s sealed-page directory; with ``evict`` (admin), emptied first."""
        return self.run(rpcs.sealed(pool, evict))

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
        return self.run(rpcs.drop(pool, force))

    def attach_raw(self, pool: str, expected_fingerprint: str = "",
                   lease: LeaseArg = None) -> AttachInfo:
        """The pool's layout and shared handle; counts as attached until :meth:`detach`
        (or until ``lease``, a ``Lease``, ends)."""
        return self.run(rpcs.attach(pool, expected_fingerprint, lease))

    def detach(self, attach_id: int) -> None:
        self.run(rpcs.detach(attach_id))

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
            A context manager yielding a :class:`kvpool.mapping.regions.MappedRegion` (name -> view
            on the pool's device, plus ``plan``, ``page_size``, ``page(name, id)``). On exit
            the region is closed, then detached; a failing Detach never hides an exception
            raised in the block, and an attachment already ended (forced Drop) is no error.

        Raises:
            NotFound: no such pool or lease. FailedPrecondition: another fingerprint, a
            pool that cannot be shared (``--sharing none``), or a GPU this process cannot
            see. PermissionDenied: the shm file belongs to another user.
        """
        from kvpool.mapping.attach import attachment  # imports torch when the region is mapped

        return attachment(self.attach_raw, self.detach, pool, expected_fingerprint, lease)

    def send(self, pool: str, pages: Any, *, peer: str, token: bytes,
             lease: Lease, hold: bool = False, wait_s: float = 0.0) -> SendHandle:
        """Write ``pages`` (held by ``lease``) into the pages a peer daemon granted with
        ``token`` (page i -> granted page i), with NIXL; see docs/pd-transfer.md.

        Returns once the peer accepted and the write is posted: ``handle.wait()`` for its end
        (with ``wait_s``, the daemon answers once the write ended, or that long after, and
        ``handle.wait()`` then makes no call). With ``hold``, returns once the peer accepted
        and the write is ready: ``handle.post()`` posts it (one call on the hot path; the
        peer's write deadline runs from now).

        Raises:
            FailedPrecondition: no NIXL in the daemon, a page not held, or the peer refused
                (grant ended or used, layouts differ; the peer's message). Unavailable: the
                peer cannot be reached. NotFound: pool, lease or grant unknown.
        """
        from kvpool.pd.transfer_handles import SendHandle, send_timeout

        resp = self.run(rpcs.send(pool, lease, pages, peer, token, hold, wait_s),
                        timeout_s=send_timeout(self.timeout_s, wait_s))
        return SendHandle(self, resp, lease)

    def keep_alive_stream(self, requests: Iterator[pb.KeepAliveRequest]) -> Any:
        return self._stub.KeepAlive(requests, metadata=self._metadata)


class LeaseView:
    """What both leases show (``Lease``, ``AsyncLease``): the secret, why keep-alive last
    failed, and a ``repr`` that never shows the secret."""

    lease_id: int
    name: str
    ttl_s: float
    _secret: bytes
    _session: KeepAliveSession

    @property
    def secret(self) -> bytes:
        """The lease's secret, which every request acting on it carries."""
        return self._secret

    @property
    def error(self) -> BaseException | None:
        """Why the keep-alive stream last failed (None: it has not)."""
        return self._session.error

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(lease_id={self.lease_id}, name={self.name!r}, "
                f"ttl_s={self.ttl_s})")


class Lease(LeaseView):
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
        self._stop = threading.Event()
        self._kick = threading.Event()  # send a renewal (with the caches' report) now
        self._session = KeepAliveSession(lease_id, secret, ttl_s)
        self._acked = threading.Condition()  # guards _session
        self._thread = threading.Thread(
            target=_keep_alive, args=(weakref.ref(self), client, lease_id, ttl_s, self._stop,
                                      self._kick),
            daemon=True, name=f"kvpool-lease-{lease_id}")
        weakref.finalize(self, _dropped, lease_id, ttl_s, self._stop, self._kick)
        self._thread.start()


    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def allocate(self, pool: str, space: str, count: int) -> np.ndarray:
        """``count`` ids of id space ``space`` (``kv``, ``req``, ``state``, ...) as int32, all
        or none."""
        return self.allocate_batch(pool, [(space, count)])[0]

    def allocate_batch(self, pool: str, items: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        """Several ``(space, count)`` in one all-or-nothing call; one int32 array per item.

        In an elastic pool the groups of the ``kv`` pages are mapped in every region of the
        pool attached through this client before this returns.

        Raises:
            FailedPrecondition: a space a page cache of this lease serves (allocate through
                the cache). Otherwise the daemon's errors.
        """
        if self._session.caches:
            with self._acked:
                self._session.refuse_cached(pool, [space for space, _ in items], "allocate")
        arrays = self.client.run(rpcs.allocate(pool, self, items))
        regions = self.client._elastic.get(pool)
        if regions:
            self._map_or_free(pool, regions, [space for space, _ in items], arrays)
        return arrays

    def allocate_swa_pairs(self, pool: str, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Hybrid SWA pools: ``count`` full pages and the SWA page paired with each."""
        if self._session.caches:
            with self._acked:
                self._session.refuse_cached(pool, ["kv"], "allocate")
        full, swa = self.client.run(rpcs.allocate_pairs(pool, self, count))
        regions = self.client._elastic.get(pool)
        if regions:
            self._map_or_free(pool, regions, ["kv"], [full])  # freeing kv frees its pair
        return full, swa

    def _map_or_free(self, pool: str, regions: tuple[Any, ...], spaces: list[str],
                     arrays: list[np.ndarray]) -> None:
        """:func:`map_allocated`; if it fails, the ids go back before the error is raised."""
        try:
            map_allocated(regions, spaces, arrays)
        except BaseException:
            self.client.run(rpcs.free(pool, self, list(zip(spaces, arrays, strict=True))))
            raise

    def free(self, pool: str, space: str, ids: Any) -> int:
        """Return ``ids`` of id space ``space`` (``swa``: only the SWA side of kv pages); all
        or none."""
        return self.free_batch(pool, [(space, ids)])

    def seal(self, pool: str, layout: str, pages: Any, keys: Sequence[bytes],
             parents: Sequence[bytes], tokens: Any) -> int:
        """Seal kv ``pages`` of this lease whose KV is complete and will not change (the lease
        must not write them again): once it frees them, or ends, the pool's directory keeps
        them for a later engine of the same ``layout`` (docs/restart.md). ``keys``/``parents``:
        32-byte hashes per page; ``tokens``: page_size token ids per page. Returns the pages
        sealed now."""
        return self.client.run(rpcs.seal(pool, self, layout, pages, keys, parents, tokens))

    def unseal(self, pool: str, pages: Any) -> int:
        """Unseal kv ``pages`` this lease sealed and holds, before writing them again (they
        leave the pool's directory; the lease keeps them). Returns the pages unsealed (a page
        not sealed is skipped)."""
        return self.client.run(rpcs.unseal(pool, self, pages))

    def adopt(self, pool: str, layout: str) -> Adopted:
        """Take the pool's sealed pages of ``layout`` whose writers are proven gone: they are
        this lease's now (sealed still), with their keys and tokens."""
        return self.client.run(rpcs.adopt(pool, self, layout))

    def free_batch(self, pool: str, items: Sequence[tuple[str, Any]]) -> int:
        """Several ``(space, ids)`` in one validated call; returns the ids freed.

        Raises:
            FailedPrecondition: a space a page cache of this lease serves (free through the
                cache). Otherwise the daemon's errors.
        """
        if self._session.caches:
            with self._acked:
                self._session.refuse_cached(pool, [space for space, _ in items], "free")
        return self.client.run(rpcs.free(pool, self, items))

    # -- the page caches' own path to their space (the lease's is refused while one is open) ---

    def _cache_allocate(self, pool: str, space: str, count: int) -> np.ndarray:
        ids = self.client.run(rpcs.allocate(pool, self, [(space, count)]))[0]
        regions = self.client._elastic.get(pool)
        if regions:  # a cache hands out only mapped pages
            self._map_or_free(pool, regions, [space], [ids])
        return ids

    def _cache_free(self, pool: str, space: str, ids: Any) -> int:
        return self.client.run(rpcs.free(pool, self, [(space, ids)]))

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
        from kvpool.pd.transfer_handles import ReceiveGrant

        granted, resp = self.client.run(rpcs.grant_receive(pool, self, pages, ttl_s))
        return ReceiveGrant(self.client, granted, resp, self)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (CloseLease took back every id the lease held)."""
        return self._stop.is_set()

    def page_cache(self, pool: str, space: str = "kv", *, low: int | None = None,
                   high: int | None = None, batch: int | None = None,
                   background: bool = True, fill: bool = True,
                   held: Any = None) -> PageCache:
        """A local cache of ``space`` ids held by this lease: ``alloc``/``free`` without gRPC.

        Watermarks in ids (defaults 64/512/128, less for small spaces); see
        ``kvpool.cache.page_cache`` and docs/api.md, "Page cache". ``background=False``: no
        worker thread, the engine calls ``cache.maintain()`` once per step. ``fill=False``: no
        first fill to ``high`` (the cache holds only what allocs fetched). One Stats call;
        paired spaces (``kv`` of hybrid SWA and DeepSeek-V4 pools, ``swa``) are refused
        (InvalidArgument), and so is a space of which the lease holds ids
        (FailedPrecondition): while the cache is open it is the only path to its space (the
        lease's own ``allocate``/``free`` of it are refused). ``held``: ids of the space the
        lease holds already (pages it adopted), handed to the cache as in use.
        """
        from kvpool.cache.page_cache import PageCache

        return PageCache.open(self, pool, space, low=low, high=high, batch=batch,
                              background=background, fill=fill, held=held)

    def close(self) -> Released:
        """Stop renewing and end the lease; returns what it held. Idempotent."""
        if self._stop.is_set():
            return Released({}, 0)
        self._stop.set()
        self._kick.set()
        with self._acked:
            self._acked.notify_all()
        # Before CloseLease takes back every id: the caches' allocs stop handing them out
        # (outside the lock: a cache takes its own lock, and may then take this one).
        self._session.end(lease_closed(self.lease_id))
        self._thread.join(timeout=5.0)
        return self.client.run(rpcs.close_lease(self))

    def report_now(self, timeout_s: float = 10.0) -> bool:
        """Renew now with the page caches' current counts, and wait until the daemon has the
        report (for tests and tools; the lease reports every TTL/3 anyway).

        Returns:
            False if ``timeout_s`` passed first or the lease stopped.
        """
        session = self._session
        with self._acked:
            target = session.seq + 1
        self._kick.set()
        with self._acked:
            return self._acked.wait_for(
                lambda: session.acked(target) or self._stop.is_set(),
                timeout_s) and session.acked(target)

    def _register_cache(self, cache: PageCache) -> None:
        with self._acked:
            self._session.add_cache(cache)
        self._kick.set()

    def _unregister_cache(self, cache: PageCache) -> None:
        with self._acked:
            self._session.remove_cache(cache)
        self._kick.set()

    def _register_region(self, region: ElasticRegion) -> None:
        """An elastic region attached under this lease: its groups are unmapped when the
        daemon asks on this lease's stream, and mapped as this client's leases allocate; until
        it closes (or the lease ends, which closes it)."""
        if self.closed:
            raise lease_closed(self.lease_id)
        with self._acked:
            self._session.add_region(region)
        self.client._add_region(region)
        region.on_close(self._unregister_region)

    def _unregister_region(self, region: ElasticRegion) -> None:
        with self._acked:
            self._session.remove_region(region)
        self.client._remove_region(region)

    def _report_soon(self) -> None:
        self._kick.set()

    # The thread's side of the session (a shell: each takes the lock and asks the session).

    def _request(self) -> pb.KeepAliveRequest:
        with self._acked:
            return self._session.next_request()

    def _on_response(self, resp: pb.KeepAliveResponse) -> None:
        with self._acked:
            again = self._session.on_response(resp)
            self._acked.notify_all()
        if again:
            self._kick.set()  # the new counts go out now; again once the Free is done

    def _failed(self, err: KVPoolError) -> bool:
        """The keep-alive stream failed with ``err``; returns whether to retry. Outside the
        lock, as ``close``'s ``end``."""
        return self._session.on_failure(err)


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
            retry = lease._failed(err)
            del lease
            if not retry:
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

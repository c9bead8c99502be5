"""``AsyncKVPoolClient``: the asyncio twin of ``KVPoolClient``; leases renew in a task.

    async with AsyncKVPoolClient(target) as client:
        async with await client.lease("engine-0", ttl_s=10) as lease:
            pages = await lease.allocate("llama", "kv", 64)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np
from grpc import aio
from grpc_health.v1 import health_pb2

from kvpool.clients.client import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_TTL_S,
    Connection,
    LeaseView,
    default_lease_name,
    map_allocated,
    serving_polls,
)
from kvpool.clients.session import KeepAliveSession
from kvpool.contract import codec, rpcs, wire
from kvpool.contract.errors import Unavailable, lease_closed
from kvpool.contract.records import (
    Adopted,
    AttachInfo,
    ConfigureResult,
    Released,
    SealedStats,
    Stats,
)
from kvpool.pd.post_connections import AsyncPostChannels
from kvpool.v1 import kvpool_pb2 as pb

if TYPE_CHECKING:
    from kvpool.cache.aio_page_cache import AsyncPageCache
    from kvpool.mapping.attach import LeaseArg
    from kvpool.mapping.elastic_map import ElasticRegion
    from kvpool.mapping.regions import MappedRegion
    from kvpool.pd.transfer_handles import AsyncReceiveGrant, AsyncSendHandle

R = TypeVar("R")
log = logging.getLogger("kvpool.clients.aio")


class AsyncKVPoolClient(Connection):
    """A connection to one kvpoold for asyncio code; arguments as ``KVPoolClient``."""

    def __init__(self, target: str | None = None, *, token: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 root_certificates: bytes | None = None) -> None:
        super().__init__(aio, target, token, timeout_s, root_certificates)
        self.post_channels = AsyncPostChannels(self._metadata)

    async def call(self, method: str, request: Any, *, timeout_s: float | None = -1.0) -> Any:
        """Call ``method``; a gRPC error becomes a ``KVPoolError``."""
        try:
            return await getattr(self._stub, method)(
                request, timeout=self.timeout_s if timeout_s == -1.0 else timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, self.target) from None

    async def run(self, call: rpcs.Call[R], *, timeout_s: float | None = -1.0) -> R:
        """Send one call of the RPC table (:mod:`kvpool.contract.rpcs`) and decode its reply."""
        return call.decode(await self.call(call.method, call.request, timeout_s=timeout_s))

    async def close(self) -> None:
        self.post_channels.close()
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVPoolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def health(self, service: str = "") -> str:
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                            timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, self.target) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def wait_serving(self, timeout_s: float = 60.0) -> None:
        """See ``KVPoolClient.wait_serving``."""
        polls = serving_polls(self.target, timeout_s)
        answer: str | Unavailable | None = None
        while (pause := polls.send(answer)) is not None:
            await asyncio.sleep(pause)
            try:
                answer = await self.health()
            except Unavailable as exc:  # not listening yet
                answer = exc

    async def configure(self, pool: str, *, hf_config: Any = None, spec: Any = None,
                        dry_run: bool = False, timeout_s: float | None = None,
                        **options: Any) -> ConfigureResult:
        """See ``KVPoolClient.configure``."""
        return await self.run(rpcs.configure(pool, hf_config=hf_config, spec=spec,
                                             dry_run=dry_run, **options), timeout_s=timeout_s)

    async def lease(self, name: str | None = None, ttl_s: float = DEFAULT_TTL_S) -> AsyncLease:
        """Open a lease renewed by a background task; ``async with`` closes it."""
        name = name or default_lease_name()
        resp = await self.run(rpcs.open_lease(name, ttl_s))
        return AsyncLease(self, resp.lease_id, name, resp.ttl_seconds, resp.lease_secret)

    async def stats(self, pool: str = "") -> Stats:
        return await self.run(rpcs.stats(pool))

    async def sealed(self, pool: str, evict: bool = False) -> SealedStats:
        """See ``KVPoolClient.sealed``."""
        return await self.run(rpcs.sealed(pool, evict))

    async def watch_stats(self, pool: str = "", interval_s: float = 1.0
                          ) -> AsyncIterator[Stats]:
        stream = self._stub.WatchStats(
            pb.WatchStatsRequest(pool=pool, interval_seconds=interval_s), metadata=self._metadata
        )
        try:
            async for resp in stream:
                yield codec.stats_from_pb(resp)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:  # as KVPoolClient.watch_stats
                raise wire.error_from_rpc(exc, self.target) from None
        finally:
            stream.cancel()

    async def drop(self, pool: str, force: bool = False) -> Released:
        return await self.run(rpcs.drop(pool, force))

    async def attach_raw(self, pool: str, expected_fingerprint: str = "",
                         lease: LeaseArg = None) -> AttachInfo:
        return await self.run(rpcs.attach(pool, expected_fingerprint, lease))

    async def detach(self, attach_id: int) -> None:
        await self.run(rpcs.detach(attach_id))

    def attach(self, pool: str, expected_fingerprint: str | None = None,
               lease: LeaseArg = None) -> contextlib.AbstractAsyncContextManager[MappedRegion]:
        """``async with client.attach(pool) as region:``; see ``KVPoolClient.attach``.

        Mapping happens on the event loop: an mmap for shm (microseconds), but the first
        mapping in a process imports torch.
        """
        from kvpool.mapping.attach import attachment

        return attachment(self.attach_raw, self.detach, pool, expected_fingerprint, lease)

    async def send(self, pool: str, pages: Any, *, peer: str, token: bytes,
                   lease: AsyncLease, hold: bool = False, wait_s: float = 0.0
                   ) -> AsyncSendHandle:
        """:meth:`KVPoolClient.send` for asyncio code."""
        from kvpool.pd.transfer_handles import AsyncSendHandle, send_timeout

        resp = await self.run(rpcs.send(pool, lease, pages, peer, token, hold, wait_s),
                              timeout_s=send_timeout(self.timeout_s, wait_s))
        return AsyncSendHandle(self, resp, lease)

    def keep_alive_stream(self) -> Any:
        return self._stub.KeepAlive(metadata=self._metadata)


class AsyncLease(LeaseView):
    """An open lease renewed by a task over the KeepAlive stream (see
    ``kvpool.clients.client.Lease``)."""

    def __init__(self, client: AsyncKVPoolClient, lease_id: int, name: str,
                 ttl_s: float, secret: bytes) -> None:
        self.client = client
        self.lease_id = lease_id
        self.name = name
        self.ttl_s = ttl_s
        self._secret = secret
        self._closed = False
        self._kick = asyncio.Event()  # send a renewal (with the caches' report) now
        self._acked = asyncio.Event()  # set at every answered renewal
        self._session = KeepAliveSession(lease_id, secret, ttl_s)
        # The task holds the lease weakly: one dropped without close() stops being renewed
        # (its ids come back by expiry), as a dropped Lease does.
        self._task = asyncio.create_task(
            _keep_alive(weakref.ref(self), client, lease_id, ttl_s),
            name=f"kvpool-lease-{lease_id}")


    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def allocate(self, pool: str, space: str, count: int) -> np.ndarray:
        return (await self.allocate_batch(pool, [(space, count)]))[0]

    async def allocate_batch(self, pool: str, items: Sequence[tuple[str, int]]
                             ) -> list[np.ndarray]:
        """See ``Lease.allocate_batch`` (an elastic pool's groups are mapped before it
        returns; a space a page cache of this lease serves is refused)."""
        self._session.refuse_cached(pool, [space for space, _ in items], "allocate")
        arrays = await self.client.run(rpcs.allocate(pool, self, items))
        regions = self.client._elastic.get(pool)
        if regions:
            await self._map_or_free(pool, regions, [space for space, _ in items], arrays)
        return arrays

    async def _map_or_free(self, pool: str, regions: tuple[Any, ...], spaces: list[str],
                           arrays: list[np.ndarray]) -> None:
        """See ``Lease._map_or_free`` (the mmaps run on the loop: microseconds each)."""
        try:
            map_allocated(regions, spaces, arrays)
        except BaseException:
            await self.client.run(rpcs.free(pool, self, list(zip(spaces, arrays, strict=True))))
            raise

    async def free(self, pool: str, space: str, ids: Any) -> int:
        return await self.free_batch(pool, [(space, ids)])

    async def seal(self, pool: str, layout: str, pages: Any, keys: Sequence[bytes],
                   parents: Sequence[bytes], tokens: Any) -> int:
        """See ``Lease.seal``."""
        return await self.client.run(rpcs.seal(pool, self, layout, pages, keys, parents,
                                               tokens))

    async def unseal(self, pool: str, pages: Any) -> int:
        """See ``Lease.unseal``."""
        return await self.client.run(rpcs.unseal(pool, self, pages))

    async def adopt(self, pool: str, layout: str) -> Adopted:
        """See ``Lease.adopt``."""
        return await self.client.run(rpcs.adopt(pool, self, layout))

    async def free_batch(self, pool: str, items: Sequence[tuple[str, Any]]) -> int:
        """See ``Lease.free_batch`` (a space a page cache of this lease serves is refused)."""
        self._session.refuse_cached(pool, [space for space, _ in items], "free")
        return await self.client.run(rpcs.free(pool, self, items))

    # -- the page caches' own path: see ``Lease._cache_allocate`` ----------------------------

    async def _cache_allocate(self, pool: str, space: str, count: int) -> np.ndarray:
        ids = (await self.client.run(rpcs.allocate(pool, self, [(space, count)])))[0]
        regions = self.client._elastic.get(pool)
        if regions:  # a cache hands out only mapped pages
            await self._map_or_free(pool, regions, [space], [ids])
        return ids

    async def _cache_free(self, pool: str, space: str, ids: Any) -> int:
        return await self.client.run(rpcs.free(pool, self, [(space, ids)]))

    async def grant_receive(self, pool: str, pages: Any, ttl_s: float | None = None
                            ) -> AsyncReceiveGrant:
        """:meth:`kvpool.clients.client.Lease.grant_receive` for asyncio code."""
        from kvpool.pd.transfer_handles import AsyncReceiveGrant

        granted, resp = await self.client.run(rpcs.grant_receive(pool, self, pages, ttl_s))
        return AsyncReceiveGrant(self.client, granted, resp, self)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (CloseLease took back every id the lease held)."""
        return self._closed

    async def page_cache(self, pool: str, space: str = "kv", *, low: int | None = None,
                         high: int | None = None, batch: int | None = None,
                         background: bool = True, fill: bool = True,
                         held: Any = None) -> AsyncPageCache:
        """See ``Lease.page_cache``: ``async with await lease.page_cache(pool) as cache``
        (``background=False``: no worker task, the engine awaits ``cache.maintain()`` once
        per step; ``held``: ids the lease adopted, in use from the start)."""
        from kvpool.cache.aio_page_cache import AsyncPageCache

        return await AsyncPageCache.open(self, pool, space, low=low, high=high, batch=batch,
                                         background=background, fill=fill, held=held)

    async def close(self) -> Released:
        """Stop renewing and end the lease; returns what it held. Idempotent."""
        if self._closed:
            return Released({}, 0)
        self._closed = True
        self._session.end(lease_closed(self.lease_id))  # see Lease.close
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        return await self.client.run(rpcs.close_lease(self))

    async def report_now(self, timeout_s: float = 10.0) -> bool:
        """See ``Lease.report_now``."""
        session = self._session
        target = session.seq + 1
        self._kick.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not session.acked(target) and not self._closed and not self._task.done():
            self._acked.clear()
            try:
                await asyncio.wait_for(self._acked.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return False
        return session.acked(target)

    def _register_cache(self, cache: AsyncPageCache) -> None:
        self._session.add_cache(cache)
        self._kick.set()

    def _unregister_cache(self, cache: AsyncPageCache) -> None:
        self._session.remove_cache(cache)
        self._kick.set()

    def _register_region(self, region: ElasticRegion) -> None:
        """See ``Lease._register_region``."""
        if self._closed:
            raise lease_closed(self.lease_id)
        self._session.add_region(region)
        self.client._add_region(region)
        region.on_close(self._unregister_region)

    def _unregister_region(self, region: ElasticRegion) -> None:
        self._session.remove_region(region)
        self.client._remove_region(region)

    def _report_soon(self) -> None:
        self._kick.set()


async def _read(ref: weakref.ref[AsyncLease], stream: Any) -> None:
    """Answers and give-backs, until the daemon ends the stream (EOF) or the lease is gone."""
    while True:
        resp = await stream.read()
        lease = ref()
        if resp is aio.EOF or lease is None:
            return
        if lease._session.on_response(resp):
            lease._kick.set()
        if resp.seq:
            lease._acked.set()
        del lease  # not held across the next read


async def _keep_alive(ref: weakref.ref[AsyncLease], client: AsyncKVPoolClient, lease_id: int,
                      ttl_s: float) -> None:
    """Renew the lease ``ref`` names until it closes, is lost, or is garbage (a reference held
    only between awaits: the task never keeps the lease alive)."""
    while True:
        stream = client.keep_alive_stream()
        reader = asyncio.ensure_future(_read(ref, stream))
        try:
            while not reader.done():
                lease = ref()
                if lease is None:
                    log.warning("lease %d was dropped without close(); it is no longer renewed "
                                "and the daemon reclaims its ids within its TTL (%.1f s)",
                                lease_id, ttl_s)
                    return
                lease._kick.clear()
                request, kick_event = lease._session.next_request(), lease._kick
                interval = lease._session.interval
                del lease
                await stream.write(request)
                kick = asyncio.ensure_future(kick_event.wait())
                try:
                    await asyncio.wait((reader, kick), timeout=interval,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    kick.cancel()
            reader.result()  # raises the stream's error
            return  # the daemon ended the stream (shutting down), or the lease is gone
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            # A write to a call that already failed (no daemon) raises InvalidStateError;
            # the call's own status says why.
            rpc_error = exc if isinstance(exc, grpc.RpcError) else aio.AioRpcError(
                await stream.code(), await stream.initial_metadata(),
                await stream.trailing_metadata(), await stream.details())
            err = wire.error_from_rpc(rpc_error, client.target)
            lease = ref()
            if lease is None:
                return
            retry, interval = lease._session.on_failure(err), lease._session.interval
            del lease
            if not retry:
                return
            await asyncio.sleep(interval / 2)
        finally:
            if reader.done() and not reader.cancelled():
                reader.exception()  # retrieved (it was raised above, or a write failed)
            reader.cancel()
            stream.cancel()

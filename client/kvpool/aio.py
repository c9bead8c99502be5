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
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool import codec, wire
from kvpool.client import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_TTL_S,
    auth_metadata,
    cache_reports,
    default_lease_name,
    give_back,
    keepalive_interval,
    lease_gone,
    open_channel,
)
from kvpool.errors import NotFound
from kvpool.page_cache import closed_error
from kvpool.records import AttachInfo, ConfigureResult, Released, Stats
from kvpool.targets import channel_target, default_target
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc

if TYPE_CHECKING:
    from kvpool.aio_page_cache import AsyncPageCache
    from kvpool.attach import LeaseArg
    from kvpool.mapping import MappedRegion
    from kvpool.transfer import AsyncReceiveGrant, AsyncSendHandle

log = logging.getLogger("kvpool.aio")


class AsyncKVPoolClient:
    """A connection to one kvpoold for asyncio code; arguments as ``KVPoolClient``."""

    def __init__(self, target: str | None = None, *, token: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 root_certificates: bytes | None = None) -> None:
        self.target = channel_target(target or default_target())
        self._channel = open_channel(aio, self.target, root_certificates)
        self._stub = kvpool_pb2_grpc.KVPoolStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = auth_metadata(token)
        self.timeout_s = timeout_s

    async def call(self, method: str, request: Any, *, timeout_s: float | None = -1.0) -> Any:
        """Call ``method``; a gRPC error becomes a ``KVPoolError``."""
        try:
            return await getattr(self._stub, method)(
                request, timeout=self.timeout_s if timeout_s == -1.0 else timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, self.target) from None

    async def close(self) -> None:
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

    async def configure(self, pool: str, *, hf_config: Any = None, spec: Any = None,
                        dry_run: bool = False, timeout_s: float | None = None,
                        **options: Any) -> ConfigureResult:
        """See ``KVPoolClient.configure``."""
        req = wire.configure_request(pool, hf_config=hf_config, spec=spec, dry_run=dry_run,
                                        **options)
        return codec.configure_from_pb(await self.call("Configure", req, timeout_s=timeout_s))

    async def lease(self, name: str | None = None, ttl_s: float = DEFAULT_TTL_S) -> AsyncLease:
        """Open a lease renewed by a background task; ``async with`` closes it."""
        name = name or default_lease_name()
        resp = await self.call("OpenLease", pb.OpenLeaseRequest(name=name, ttl_seconds=ttl_s))
        return AsyncLease(self, resp.lease_id, name, resp.ttl_seconds, resp.lease_secret)

    async def stats(self, pool: str = "") -> Stats:
        return codec.stats_from_pb(await self.call("Stats", pb.StatsRequest(pool=pool)))

    async def watch_stats(self, pool: str = "", interval_s: float = 1.0
                          ) -> AsyncIterator[Stats]:
        stream = self._stub.WatchStats(
            pb.WatchStatsRequest(pool=pool, interval_seconds=interval_s), metadata=self._metadata
        )
        try:
            async for resp in stream:
                yield codec.stats_from_pb(resp)
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, self.target) from None
        finally:
            stream.cancel()

    async def drop(self, pool: str, force: bool = False) -> Released:
        resp = await self.call("Drop", pb.DropRequest(pool=pool, force=force))
        return codec.released_from_pb(resp)

    async def attach_raw(self, pool: str, expected_fingerprint: str = "",
                         lease: LeaseArg = None) -> AttachInfo:
        lease_id, secret = wire.lease_key(lease)
        req = pb.AttachRequest(pool=pool, expected_fingerprint=expected_fingerprint,
                               lease_id=lease_id, lease_secret=secret)
        return codec.attach_from_pb(await self.call("Attach", req))

    async def detach(self, attach_id: int) -> None:
        await self.call("Detach", pb.DetachRequest(attach_id=attach_id))

    def attach(self, pool: str, expected_fingerprint: str | None = None,
               lease: LeaseArg = None) -> contextlib.AbstractAsyncContextManager[MappedRegion]:
        """``async with client.attach(pool) as region:``; see ``KVPoolClient.attach``.

        Mapping happens on the event loop: an mmap for shm (microseconds), but the first
        mapping in a process imports torch.
        """
        from kvpool.attach import attach_async

        return attach_async(self.attach_raw, self.detach, pool, expected_fingerprint, lease)

    async def send(self, pool: str, pages: Any, *, peer: str, token: bytes,
                   lease: AsyncLease) -> AsyncSendHandle:
        """:meth:`KVPoolClient.send` for asyncio code."""
        from kvpool.transfer import AsyncSendHandle

        resp = await self.call("Send", wire.send_request(pool, lease, pages, peer, token))
        return AsyncSendHandle(self, resp)

    def keep_alive_stream(self) -> Any:
        return self._stub.KeepAlive(metadata=self._metadata)


class AsyncLease:
    """An open lease renewed by a task over the KeepAlive stream (see ``kvpool.client.Lease``)."""

    def __init__(self, client: AsyncKVPoolClient, lease_id: int, name: str,
                 ttl_s: float, secret: bytes) -> None:
        self.client = client
        self.lease_id = lease_id
        self.name = name
        self.ttl_s = ttl_s
        self._secret = secret
        self.error: BaseException | None = None
        self._closed = False
        self._kick = asyncio.Event()  # send a renewal (with the caches' report) now
        self._acked = asyncio.Event()  # set at every answered renewal
        self._caches: list[AsyncPageCache] = []
        self._seq = 0
        self._acked_seq = 0
        # The task holds the lease weakly: one dropped without close() stops being renewed
        # (its ids come back by expiry), as a dropped Lease does.
        self._task = asyncio.create_task(
            _keep_alive(weakref.ref(self), client, lease_id, ttl_s),
            name=f"kvpool-lease-{lease_id}")

    @property
    def secret(self) -> bytes:
        """The lease's secret, which every request acting on it carries (see ``Lease``)."""
        return self._secret

    def __repr__(self) -> str:
        return f"AsyncLease(lease_id={self.lease_id}, name={self.name!r}, ttl_s={self.ttl_s})"

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def allocate(self, pool: str, kind: str, count: int) -> np.ndarray:
        return (await self.allocate_batch(pool, [(kind, count)]))[0]

    async def allocate_batch(self, pool: str, items: Sequence[tuple[str, int]]
                             ) -> list[np.ndarray]:
        req = wire.allocate_request(pool, self, items)
        resp = await self.client.call("Allocate", req)
        return [codec.ids_from_bytes(item.ids) for item in resp.items]

    async def free(self, pool: str, kind: str, ids: Any) -> int:
        return await self.free_batch(pool, [(kind, ids)])

    async def free_batch(self, pool: str, items: Sequence[tuple[str, Any]]) -> int:
        req = wire.free_request(pool, self, items)
        return (await self.client.call("Free", req)).freed

    # -- for page caches: see ``Lease._allocate_held`` and the two after it -----------------

    async def _allocate_held(self, pool: str, space: str, count: int
                             ) -> tuple[np.ndarray, int | None]:
        req = wire.allocate_request(pool, self, [(space, count)])
        resp = await self.client.call("Allocate", req)
        return codec.ids_from_bytes(resp.items[0].ids), wire.held_of(resp)

    async def _free_held(self, pool: str, space: str, ids: Any) -> tuple[int, int | None]:
        resp = await self.client.call("Free", wire.free_request(pool, self, [(space, ids)]))
        return resp.freed, wire.held_of(resp)

    async def _check_held(self, pool: str, space: str, ids: Any
                          ) -> tuple[np.ndarray, int | None]:
        req = wire.free_request(pool, self, [(space, ids)], check=True)
        resp = await self.client.call("Free", req)
        return codec.ids_from_bytes(resp.not_held[0].ids), wire.held_of(resp)

    async def grant_receive(self, pool: str, pages: Any, ttl_s: float | None = None
                            ) -> AsyncReceiveGrant:
        """:meth:`kvpool.client.Lease.grant_receive` for asyncio code."""
        from kvpool.transfer import AsyncReceiveGrant

        req = wire.grant_receive_request(pool, self, pages, ttl_s)
        resp = await self.client.call("GrantReceive", req)
        return AsyncReceiveGrant(self.client, codec.ids_from_bytes(req.pages), resp)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (CloseLease took back every id the lease held)."""
        return self._closed

    async def page_cache(self, pool: str, space: str = "kv", *, low: int | None = None,
                         high: int | None = None, batch: int | None = None
                         ) -> AsyncPageCache:
        """See ``Lease.page_cache``: ``async with await lease.page_cache(pool) as cache``."""
        from kvpool.aio_page_cache import AsyncPageCache

        return await AsyncPageCache.open(self, pool, space, low=low, high=high, batch=batch)

    async def close(self) -> Released:
        """Stop renewing and end the lease; returns what it held. Idempotent."""
        if self._closed:
            return Released({}, 0)
        self._closed = True
        lease_gone(self._caches, closed_error(self.lease_id))  # see Lease.close
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        resp = await self.client.call("CloseLease", pb.CloseLeaseRequest(
            lease_id=self.lease_id, lease_secret=self._secret))
        return codec.released_from_pb(resp)

    async def report_now(self, timeout_s: float = 10.0) -> bool:
        """See ``Lease.report_now``."""
        target = self._seq + 1
        self._kick.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._acked_seq < target and not self._closed and not self._task.done():
            self._acked.clear()
            try:
                await asyncio.wait_for(self._acked.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return False
        return self._acked_seq >= target

    def _register_cache(self, cache: AsyncPageCache) -> None:
        self._caches.append(cache)
        self._kick.set()

    def _unregister_cache(self, cache: AsyncPageCache) -> None:
        if cache in self._caches:
            self._caches.remove(cache)
        self._kick.set()

    def _report_soon(self) -> None:
        self._kick.set()

    def _request(self) -> pb.KeepAliveRequest:
        self._seq += 1
        return pb.KeepAliveRequest(lease_id=self.lease_id, lease_secret=self._secret,
                                   seq=self._seq, caches=cache_reports(self._caches))


async def _read(ref: weakref.ref[AsyncLease], stream: Any) -> None:
    """Answers and give-backs, until the daemon ends the stream (EOF) or the lease is gone."""
    while True:
        resp = await stream.read()
        lease = ref()
        if resp is aio.EOF or lease is None:
            return
        if give_back(lease._caches, resp):
            lease._kick.set()
        if resp.seq:
            lease._acked_seq = max(lease._acked_seq, resp.seq)
            lease._acked.set()
        del lease  # not held across the next read


async def _keep_alive(ref: weakref.ref[AsyncLease], client: AsyncKVPoolClient, lease_id: int,
                      ttl_s: float) -> None:
    """Renew the lease ``ref`` names until it closes, is lost, or is garbage (a reference held
    only between awaits: the task never keeps the lease alive)."""
    interval = keepalive_interval(ttl_s)
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
                request, kick_event = lease._request(), lease._kick
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
            lease.error = err
            if isinstance(err, NotFound):  # the lease expired or was closed
                log.error("lease %d lost: %s", lease_id, err)
                lease_gone(lease._caches, err)
                return
            del lease
            log.warning("keep-alive of lease %d failed, retrying: %s", lease_id, err)
            await asyncio.sleep(interval / 2)
        finally:
            if reader.done() and not reader.cancelled():
                reader.exception()  # retrieved (it was raised above, or a write failed)
            reader.cancel()
            stream.cancel()

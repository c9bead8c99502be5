"""Build the gRPC servers (:func:`create_server`) and run them until a signal (:func:`run`).

Unix-socket listeners share one ``grpc.aio`` server; TCP listeners get a second one with the
token interceptor and optional TLS (``kvpoold.server.listeners``). Each server has its own
servicer over the one daemon, knowing its transport: who a call is depends on it
(``kvpoold.server.auth``). Both serve the same
servicer, health and reflection. Shutdown: health NOT_SERVING -> long streams end -> stop
accepting and drain (grace) -> release the pools -> remove the socket files. With
``metrics_port`` a Prometheus ``/metrics`` server (``kvpoold.metrics``) runs beside them and
stops before the pools are released. Arguments are parsed in ``kvpoold.server.serve_cli``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from grpc import aio
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.fd_channel import fd_socket_path
from kvpool.contract.limits import SERVER_MESSAGE_OPTIONS
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.access import Authority, NamedToken, UnixAuth, all_tokens
from kvpoold.elastic.fd_server import FdServer
from kvpoold.metrics import DaemonMetrics, MetricsServer, loop_snapshot, start_metrics_server
from kvpoold.server.backing_select import make_backing_factory
from kvpoold.server.daemon import Daemon
from kvpoold.server.intake import Bound, IntakeInterceptor, free_bound
from kvpoold.server.kv_stream import KvEvents
from kvpoold.server.listener_health import (
    ListenerHealth,
    fit_connection_cap,
    raise_descriptor_limit,
    watch_descriptors,
)
from kvpoold.server.listeners import (
    Listener,
    auth_interceptors,
    bind_tcp,
    bind_unix,
    group_id,
    read_tls,
    remove_sockets,
    secure_sockets,
)
from kvpoold.server.logs import adopt
from kvpoold.server.loop_clock import StallClock
from kvpoold.server.post_service import PostChannel
from kvpoold.server.servicer import KVPoolServicer
from kvpoold.server.stats_replies import StatsReplies
from kvpoold.server.status import RpcObserver
from kvpoold.settings import (
    KV_EVENTS_NEED_PYZMQ,
    MAX_CONNECTIONS,
    ServeSettings,
)
from kvpoold.sharing.base import BackingFactory
from kvpoold.transfer import NIXL_MISSING, make_agent, nixl_installed

if TYPE_CHECKING:
    from kvpoold.server.kv_process import PublisherProcess

log = logging.getLogger("kvpoold.server")

SERVICE_NAME = "kvpool.v1.KVPool"
# The sweeper's longest sleep: a lease opened meanwhile (TTL >= 0.1 s) is seen within it.
SWEEP_INTERVAL_S = 0.2
# One slice of a sweep: at most this many leases, or leases that released this many ids,
# whichever comes first; the loop serves everyone else between slices. Reclaiming a lease costs
# ~50-160 us (its log line, its grants, attachments and elastic hooks) and an id ~5 ns, so a
# slice holds the loop a few ms at most (4,000 leases at once used to hold it 0.64 s).
SWEEP_SLICE_LEASES = 32
SWEEP_SLICE_IDS = 1 << 18
# The pause between two slices. Not 0: grpc.aio hands calls to the loop from a poller thread,
# and with a pause of 0 (a loop that never blocks in select) other clients' calls waited for the
# whole sweep: Allocate p99 143 ms, against 9 ms with 1 ms (bench/lease_expiry.py, 4,000 leases).
SWEEP_PAUSE_S = 0.001
# Replies up to 64 MiB (Stats of thousands of leases); requests up to the largest method bound,
# so gRPC refuses a larger one before it reaches the event loop (kvpool.contract.limits).
_OPTIONS = (*SERVER_MESSAGE_OPTIONS, ("grpc.so_reuseport", 0))


@dataclass
class KVPoolServer:
    """The running pieces: servers, health, the closing flag and the sockets to remove."""

    servers: list[aio.Server]
    health: health.aio.HealthServicer
    closing: asyncio.Event
    addresses: list[str] = field(default_factory=list)
    sockets: list[Path] = field(default_factory=list)
    socket_gid: int | None = None
    listeners: ListenerHealth = field(init=False)
    # The token check of the Unix servers (the side socket's post channel uses it too).
    authority: Authority | None = None
    rpc_observer: RpcObserver | None = None

    def __post_init__(self) -> None:
        self.listeners = ListenerHealth(self.health, ("", SERVICE_NAME))

    async def start(self) -> None:
        """Start accepting calls, fix the socket files' modes, and report SERVING (unless a
        listener is down already)."""
        for server in self.servers:
            await server.start()
        secure_sockets(self.sockets, self.socket_gid)
        await self.listeners.start()

    async def shutdown(self, grace_s: float) -> None:
        """Health NOT_SERVING, end long streams, stop accepting, drain up to ``grace_s``.

        Args:
            grace_s: seconds in-flight calls get to finish.
        """
        await self.health.enter_graceful_shutdown()
        self.closing.set()
        await asyncio.gather(*(server.stop(grace_s) for server in self.servers))

    def remove_sockets(self) -> None:
        """Remove the Unix socket files (after :meth:`shutdown`)."""
        remove_sockets(self.sockets)


def create_server(
    daemon: Daemon,
    listeners: Sequence[Listener],
    *,
    token: str | None = None,
    tokens: Sequence[NamedToken] = (),
    unix_auth: UnixAuth = "trust",
    tls: tuple[bytes, bytes] | None = None,
    socket_group: str | None = None,
    rpc_observer: RpcObserver | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> KVPoolServer:
    """Build (not start) the servers for ``listeners``; call inside the event loop.

    Args:
        daemon: the state the servicer works on.
        listeners: Unix sockets and TCP addresses (TCP port 0 picks a free port).
        token: shared secret required on TCP listeners (``authorization: Bearer <token>``):
            one admin token, the identity ``admin`` (``kvpoold.server.auth``).
        tokens: named, scoped tokens (``--tokens-file``), beside ``token``.
        unix_auth: ``trust`` (Unix callers without a token are the local admin) or ``token``.
        tls: ``(private_key_pem, certificate_chain_pem)`` for TCP listeners.
        socket_group: group allowed on the Unix sockets (mode 0660 instead of 0600).
        rpc_observer: told each RPC's time and failures (``kvpoold.metrics.RpcMetrics``).
        max_connections: connections each server (the Unix sockets', the TCP one) accepts at
            once; gRPC closes one more as soon as it is accepted.

    Returns:
        The server set; ``addresses`` lists what is bound (real ports for port 0).

    Raises:
        InvalidArgument: no listeners, or an unknown group.
        FailedPrecondition: a socket path served by another daemon, or an address in use.
    """
    if not listeners:
        raise InvalidArgument("give at least one --listen address", field="listen")
    gid = group_id(socket_group) if socket_group else None
    closing = asyncio.Event()
    authority = Authority(all_tokens(token, tokens), unix_auth)
    built = KVPoolServer([], health.aio.HealthServicer(), closing, socket_gid=gid,
                         authority=authority, rpc_observer=rpc_observer)
    replies = StatsReplies(daemon)  # one for both servicers: their Stats callers share builds
    unix = [x for x in listeners if x.transport == "unix"]
    tcp = [x for x in listeners if x.transport == "tcp"]
    registry = daemon.registry
    bounds = {"Free": free_bound(lambda: registry.most_ids)}
    options = (*_OPTIONS, ("grpc.max_allowed_incoming_connections", max_connections))
    try:
        if unix:
            servicer = KVPoolServicer(daemon, closing, rpc_observer, authority=authority,
                                      transport="unix", replies=replies)
            server = _new_server(servicer, built.health, auth_interceptors(authority, "unix"),
                                 bounds, options)
            built.sockets += bind_unix(server, unix, gid)
            built.addresses += [x.grpc_address for x in unix]
            built.servers.append(server)
        if tcp:
            servicer = KVPoolServicer(daemon, closing, rpc_observer, authority=authority,
                                      transport="tcp", replies=replies)
            server = _new_server(servicer, built.health, auth_interceptors(authority, "tcp"),
                                 bounds, options)
            built.addresses += bind_tcp(server, tcp, tls)
            built.servers.append(server)
    except BaseException:
        built.remove_sockets()
        raise
    return built


def _new_server(servicer: KVPoolServicer, health_servicer: health.aio.HealthServicer,
                interceptors: Sequence[aio.ServerInterceptor],
                bounds: dict[str, Bound], options: Sequence[tuple[str, int]]) -> aio.Server:
    # The intake check runs last: a TCP call's token is checked before its message is read.
    server = aio.server(interceptors=(*interceptors, IntakeInterceptor(bounds)),
                        options=options)
    kvpool_pb2_grpc.add_KVPoolServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return server


async def sweep_leases(daemon: Daemon, interval_s: float = SWEEP_INTERVAL_S, *,
                       slice_leases: int = SWEEP_SLICE_LEASES,
                       slice_ids: int = SWEEP_SLICE_IDS) -> None:
    """Expire leases as their deadlines pass, until cancelled.

    Sleeps until the next deadline (``LeaseTable.next_deadline``), at most ``interval_s`` so
    that a lease opened meanwhile with a shorter TTL is seen: a lease is reclaimed within
    TTL + ``interval_s`` of its last renewal, and each sweep touches only expired leases.
    A sweep reclaims in slices (``Daemon.expire_leases``) and yields to the event loop between
    them, so thousands of leases expiring at once do not hold up other clients' calls; a lease
    waiting for its slice is already refused as expired.

    Args:
        daemon: whose leases to expire.
        interval_s: the longest sleep between sweeps.
        slice_leases: the most leases one slice reclaims.
        slice_ids: a slice ends once its leases released this many ids.
    """
    leases = daemon.leases
    while True:
        deadline = leases.next_deadline()
        now = leases.now()
        wait = interval_s if deadline is None else min(interval_s, deadline - now)
        await asyncio.sleep(max(0.0, wait))
        try:
            daemon.expire_leases(slice_leases, slice_ids)
            while (due := leases.next_deadline()) is not None and due <= leases.now():
                await asyncio.sleep(SWEEP_PAUSE_S)  # everyone else's calls run in between
                daemon.expire_leases(slice_leases, slice_ids, timers=False)
        except Exception:
            log.exception("lease sweep failed", extra={"fields": {"event": "sweep_error"}})
            await asyncio.sleep(interval_s)  # a past deadline must not make a failing sweep spin


async def start_fd_server(daemon: Daemon, factory: BackingFactory, settings: ServeSettings,
                          server: KVPoolServer) -> FdServer | None:
    """The descriptor side socket (``<first Unix socket>.fd``) of a factory that hands elastic
    pools out as descriptors (CUDA VMM's allocations; a CPU pool's sparse file, so the daemon
    knows which process maps it under which lease); None for the others, or with no Unix
    listener. It has the gRPC sockets' group and connection cap, reports its accept loop to
    the server's listener health, and carries the post channel (``daemon.post_socket``).
    """
    if not hasattr(factory, "fd_socket"):
        return None
    unix = [x.address for x in settings.listeners if x.transport == "unix"]
    if not unix:
        log.warning("no Unix listener, so no descriptor socket: elastic CUDA pools cannot be "
                    "mapped, elastic CPU pools are mapped by their file's path",
                    extra={"fields": {"event": "fd_socket_off"}})
        return None
    path = fd_socket_path(unix[0])
    factory.fd_socket = path  # type: ignore[attr-defined]
    assert server.authority is not None
    channel = PostChannel(daemon, server.authority, server.rpc_observer)
    fd_server = FdServer(Path(path), daemon.fd_grant,
                         gid=group_id(settings.socket_group) if settings.socket_group else None,
                         max_connections=settings.max_connections,
                         max_connections_per_uid=settings.max_connections_per_uid,
                         on_state=server.listeners.report(f"descriptor socket {path}"),
                         post_channel=channel.serve)
    await fd_server.start()
    daemon.post_socket = path
    log.info("descriptor socket", extra={"fields": {"event": "fd_socket", "path": path}})
    return fd_server


async def open_kv_events(settings: ServeSettings) -> tuple[PublisherProcess, KvEvents]:
    """The KV events publisher process, started with its endpoints bound, and the loop's side.

    Raises:
        FailedPrecondition: pyzmq is missing, or an endpoint cannot be bound.
    """
    assert settings.kv_events is not None
    try:
        from kvpoold.server.kv_process import PublisherProcess
    except ModuleNotFoundError as exc:
        if exc.name != "zmq":
            raise
        raise FailedPrecondition(KV_EVENTS_NEED_PYZMQ, field="kv_events_config") from None
    publisher = PublisherProcess(settings.kv_events, settings.log_level, settings.log_format)
    events = KvEvents(settings.kv_events, publisher)
    try:
        await publisher.start(events.snapshot, lambda: events.numbered)
    except BaseException:
        await publisher.close()
        raise
    return publisher, events


async def run(
    settings: ServeSettings,
    *,
    factory: BackingFactory | None = None,
    ready: Callable[[KVPoolServer], None] | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or ``stop``), then shut down cleanly.

    Args:
        settings: checked settings (``kvpoold.settings.resolve``).
        factory: backing factory (default ``kvpoold.server.backing_select.make_backing_factory``).
        ready: called once the servers accept calls.
        stop: set it to stop (tests); signals set it too.

    Returns:
        The exit status, 0.

    Raises:
        InvalidArgument: an unreadable TLS file, or a bad device or shm directory (see
            ``make_backing_factory``).
        FailedPrecondition: a listen address, the metrics port or a KV events endpoint cannot
            be served; KV events without pyzmq.
    """
    tls = read_tls(settings.tls_cert, settings.tls_key)  # first: a bad file must not strand
    publisher, events = (await open_kv_events(settings) if settings.kv_events is not None
                         else (None, None))
    try:
        factory = factory or make_backing_factory(settings)  # the factory's files
        return await _serve(settings, factory, tls, events, ready, stop)
    finally:
        if publisher is not None:  # after the pools: their AllBlocksCleared are sent
            await publisher.close()


async def _serve(settings: ServeSettings, factory: BackingFactory,
                 tls: tuple[bytes, bytes] | None, events: KvEvents | None,
                 ready: Callable[[KVPoolServer], None] | None,
                 stop: asyncio.Event | None) -> int:
    """:func:`run` once its factory and KV events publisher are made."""
    nofile, _hard = raise_descriptor_limit()
    unix_listeners = any(x.transport == "unix" for x in settings.listeners)
    tcp_listeners = any(x.transport == "tcp" for x in settings.listeners)
    settings = msgspec.structs.replace(settings, max_connections=fit_connection_cap(
        nofile, settings.max_connections, 2 * unix_listeners + tcp_listeners))  # Unix: + fd
    # With kvpool[nixl] installed the daemon owns a NIXL agent and can move pages to peers.
    agent = make_agent(adopt)
    nixl_off = NIXL_MISSING if not nixl_installed() else (
        "NIXL is installed but its agent did not start (see kvpoold's log); transfers are off")
    # Lease deadlines run on a clock that stands still while the loop is stalled (loop_clock).
    lease_clock = StallClock()
    daemon = Daemon(settings.device, settings.budget_bytes, factory, nixl_agent=agent,
                    nixl_off=nixl_off, peer_token=settings.peer_token, lease_clock=lease_clock,
                    max_leases_per_identity=settings.max_leases_per_identity,
                    max_attachments_per_identity=settings.max_attachments_per_identity,
                    max_watch_streams_per_identity=settings.max_watch_streams_per_identity,
                    watch_min_interval_s=settings.watch_min_interval,
                    reclaim_deadline_s=settings.reclaim_deadline,
                    elastic_policy=settings.elastic_policy, kv_events=events)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    server: KVPoolServer | None = None
    sweeper: asyncio.Task[None] | None = None
    watch: asyncio.Task[None] | None = None
    ticker = asyncio.create_task(lease_clock.run())
    metrics = None if settings.metrics_port is None else DaemonMetrics(
        loop_snapshot(daemon.snapshot, loop), settings.device)
    metrics_server: MetricsServer | None = None
    fd_server: FdServer | None = None
    try:
        server = create_server(daemon, settings.listeners, token=settings.token,
                               tokens=settings.tokens, unix_auth=settings.unix_auth, tls=tls,
                               socket_group=settings.socket_group,
                               rpc_observer=metrics.rpc if metrics else None,
                               max_connections=settings.max_connections)
        if metrics is not None and settings.metrics_port is not None:
            metrics_server = start_metrics_server(metrics.registry, settings.metrics_host,
                                                  settings.metrics_port)
        await server.start()
        fd_server = await start_fd_server(daemon, factory, settings, server)
        watch = asyncio.create_task(watch_descriptors(server.listeners.report("descriptors")))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        sweeper = asyncio.create_task(sweep_leases(daemon))
        log.info("serving", extra={"fields": {
            "event": "serving", "pid": os.getpid(), "listen": ",".join(server.addresses),
            "device": settings.device, "budget_bytes": settings.budget_bytes,
            "nixl_agent": agent.name if agent is not None else None,
            **({"kv_events": events.stats_fields()["kv_events_endpoint"],
                "kv_events_replay": events.stats_fields()["kv_events_replay_endpoint"]}
               if events is not None else {}),
        }})
        if ready is not None:
            ready(server)
        await stop.wait()
        log.info("shutting down", extra={"fields": {"event": "shutdown",
                                                    "grace_s": settings.grace_seconds}})
        await server.shutdown(settings.grace_seconds)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        for task in (sweeper, watch):
            if task is not None:
                task.cancel()
        ticker.cancel()
        if server is not None:
            if not server.closing.is_set():  # an error before the normal shutdown
                await server.shutdown(0)
            server.remove_sockets()
        if fd_server is not None:
            await fd_server.close()
        if metrics_server is not None:  # before the pools go: a scrape must not see them half
            await asyncio.to_thread(metrics_server.close)
        await daemon.transfers.close()
        daemon.close()
    log.info("stopped", extra={"fields": {"event": "stopped"}})
    return 0

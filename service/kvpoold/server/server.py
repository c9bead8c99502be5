"""Build the gRPC servers (build), run them until a signal (run); arguments live in serve_cli.

Unix-socket listeners share one ``grpc.aio`` server; TCP listeners get a second one with the
token interceptor and optional TLS. Both serve the same servicer, health and reflection.
Shutdown: health NOT_SERVING -> long streams end -> stop accepting and drain (grace) -> release
the pools -> remove the socket files. With ``--metrics-port`` a Prometheus ``/metrics`` server
(``kvpoold.metrics``) runs beside them and stops before the pools are released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool.errors import FailedPrecondition, InvalidArgument
from kvpool.limits import MESSAGE_SIZE_OPTIONS
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.config import Listener, ServeSettings, check_shm_dir, group_id, read_tls
from kvpoold.ids.ledger import default_backend
from kvpoold.metrics import DaemonMetrics, MetricsServer, loop_snapshot, start_metrics_server
from kvpoold.server.auth import TokenAuthInterceptor
from kvpoold.server.daemon import Daemon
from kvpoold.server.servicer import KVPoolServicer
from kvpoold.server.status import RpcObserver
from kvpoold.sharing.base import BackingFactory

log = logging.getLogger("kvpoold.server")

SERVICE_NAME = "kvpool.v1.KVPool"
SWEEP_INTERVAL_S = 0.2
# Stats with thousands of leases and big id batches are larger than gRPC's 4 MiB default.
_OPTIONS = (*MESSAGE_SIZE_OPTIONS, ("grpc.so_reuseport", 0))


@dataclass
class KVPoolServer:
    """The running pieces: servers, health, the closing flag and the sockets to remove."""

    servers: list[aio.Server]
    health: health.aio.HealthServicer
    closing: asyncio.Event
    addresses: list[str] = field(default_factory=list)
    sockets: list[Path] = field(default_factory=list)
    socket_gid: int | None = None

    async def start(self) -> None:
        for server in self.servers:
            await server.start()
        for path in self.sockets:  # umask made them 0600/0660 already; be explicit anyway
            os.chmod(path, 0o660 if self.socket_gid is not None else 0o600)
            if self.socket_gid is not None:
                os.chown(path, -1, self.socket_gid)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def shutdown(self, grace_s: float) -> None:
        """Health NOT_SERVING, end long streams, stop accepting, drain up to ``grace_s``."""
        await self.health.enter_graceful_shutdown()
        self.closing.set()
        await asyncio.gather(*(server.stop(grace_s) for server in self.servers))

    def remove_sockets(self) -> None:
        for path in self.sockets:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def create_server(
    daemon: Daemon,
    listeners: Sequence[Listener],
    *,
    token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
    socket_group: str | None = None,
    rpc_observer: RpcObserver | None = None,
) -> KVPoolServer:
    """Build (not start) the servers for ``listeners``; call inside the event loop.

    Args:
        daemon: the state the servicer works on.
        listeners: Unix sockets and TCP addresses (TCP port 0 picks a free port).
        token: shared secret required on TCP listeners (``authorization: Bearer <token>``).
        tls: ``(private_key_pem, certificate_chain_pem)`` for TCP listeners.
        socket_group: group allowed on the Unix sockets (mode 0660 instead of 0600).
        rpc_observer: told each RPC's time and failures (``kvpoold.metrics.RpcMetrics``).

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
    servicer = KVPoolServicer(daemon, closing, rpc_observer)
    health_servicer = health.aio.HealthServicer()
    unix = [x for x in listeners if x.kind == "unix"]
    tcp = [x for x in listeners if x.kind == "tcp"]
    built = KVPoolServer([], health_servicer, closing, socket_gid=gid)
    try:
        _add_listeners(built, servicer, unix, tcp, token, tls)
    except BaseException:
        built.remove_sockets()
        raise
    return built


def _add_listeners(built: KVPoolServer, servicer: KVPoolServicer, unix: Sequence[Listener],
                   tcp: Sequence[Listener], token: str | None,
                   tls: tuple[bytes, bytes] | None) -> None:
    gid, health_servicer = built.socket_gid, built.health
    if unix:
        server = _new_server(servicer, health_servicer, ())
        for x in unix:
            _prepare_socket_path(Path(x.address), gid)
        # The socket file is created at bind with the umask's mode: no window where it is open.
        umask = os.umask(0o117 if gid is not None else 0o177)
        try:
            for x in unix:
                path = Path(x.address)
                _bind(server.add_insecure_port, x)
                built.sockets.append(path)
                built.addresses.append(x.grpc_address)
        finally:
            os.umask(umask)
        built.servers.append(server)
    if tcp:
        interceptors = (TokenAuthInterceptor(token),) if token else ()
        server = _new_server(servicer, health_servicer, interceptors)
        creds = grpc.ssl_server_credentials([tls]) if tls else None
        for x in tcp:
            if creds is None:
                port = _bind(server.add_insecure_port, x)
            else:
                port = _bind(lambda a: server.add_secure_port(a, creds), x)
            host = x.address.rpartition(":")[0]
            built.addresses.append(f"{host}:{port}")
        if not token:
            log.warning("tcp listeners without --token: anyone who can reach them may call",
                        extra={"fields": {"event": "insecure_tcp"}})
        built.servers.append(server)


def _new_server(servicer: KVPoolServicer, health_servicer: health.aio.HealthServicer,
                interceptors: Sequence[aio.ServerInterceptor]) -> aio.Server:
    server = aio.server(interceptors=interceptors, options=_OPTIONS)
    kvpool_pb2_grpc.add_KVPoolServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return server


def _bind(add_port: Callable[[str], int], listener: Listener) -> int:
    try:
        return add_port(listener.grpc_address)
    except RuntimeError as exc:
        raise FailedPrecondition(
            f"cannot listen on {listener.grpc_address}: {exc} (in use, or not permitted)",
            field="listen",
        ) from exc


def _prepare_socket_path(path: Path, gid: int | None) -> None:
    """Create the socket's directory (0700, or 0750 for a group) and clear a stale socket.

    Raises:
        FailedPrecondition: another daemon answers on the socket, or the path is not a socket.
    """
    parent = path.parent
    if not parent.exists():
        parent.mkdir(parents=True, mode=0o750 if gid is not None else 0o700)
        os.chmod(parent, 0o750 if gid is not None else 0o700)  # mkdir's mode obeys the umask
        if gid is not None:
            os.chown(parent, -1, gid)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FailedPrecondition(f"{path} exists and is not a socket; remove it or choose "
                                 "another --listen path", field="listen")
    if _socket_alive(path):
        raise FailedPrecondition(f"another daemon is serving on {path}; stop it or choose "
                                 "another --listen path", field="listen")
    path.unlink()  # stale: left by a daemon that died


def _socket_alive(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


async def sweep_leases(daemon: Daemon, interval_s: float = SWEEP_INTERVAL_S) -> None:
    """Expire leases past their TTL every ``interval_s`` (reclaim within TTL + interval)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            daemon.expire_leases()
        except Exception:
            log.exception("lease sweep failed", extra={"fields": {"event": "sweep_error"}})


def make_backing_factory(settings: ServeSettings) -> BackingFactory:
    """The backing factory for the device: shared memory on cpu, CUDA IPC on cuda.

    On cpu the shared-memory factory first removes the files of dead daemons from
    ``settings.shm_dir`` (logged as ``event=shm_orphans_removed``) and takes this daemon's
    instance lock; on cuda the allocator settings are checked before CUDA is touched.
    ``settings.sharing == "none"`` gives unshared memory (tests and benchmarks).

    Raises:
        InvalidArgument: a CUDA device this process cannot see, ``expandable_segments`` or
            ``cudaMallocAsync`` in the allocator settings, or a missing shm directory (all
            exit 2: fix the flags or the environment).
        FailedPrecondition: the shm directory is not writable.
    """
    import torch

    from kvpoold.sharing import (
        CudaIpcBackingFactory,
        PlainBackingFactory,
        ShmBackingFactory,
        check_allocator_conf,
    )

    device = torch.device(settings.device)
    if device.type == "cuda":
        if settings.sharing != "none":
            try:
                check_allocator_conf(os.environ)
            except FailedPrecondition as exc:  # a setting to change, like a bad flag: exit 2
                raise InvalidArgument(str(exc), field=exc.field) from None
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise InvalidArgument(
                f"device {settings.device}: this process sees {count} CUDA devices; check "
                "--device and CUDA_VISIBLE_DEVICES",
                field="device",
            )
    if settings.sharing == "none":
        log.warning("sharing is off: clients cannot map pools (--sharing none)",
                    extra={"fields": {"event": "sharing_none", "device": settings.device}})
        return PlainBackingFactory(device)
    if device.type == "cuda":
        factory = CudaIpcBackingFactory(device)
        log.info("cuda ipc ready", extra={"fields": {
            "event": "cuda_ipc_ready", "device": settings.device,
            "device_uuid": factory.device_uuid,
        }})
        return factory
    check_shm_dir(settings.shm_dir)
    shm = ShmBackingFactory(settings.shm_dir, preallocate=settings.shm_preallocate)
    if shm.swept:
        log.warning("removed files of dead daemons", extra={"fields": {
            "event": "shm_orphans_removed", "shm_dir": str(settings.shm_dir),
            "count": len(shm.swept), "files": ",".join(p.name for p in shm.swept),
        }})
    log.info("shared memory ready", extra={"fields": {
        "event": "shm_ready", "shm_dir": str(settings.shm_dir), "instance": shm.instance,
        "lock": str(shm.lock_path), "preallocate": settings.shm_preallocate,
    }})
    return shm


async def run(
    settings: ServeSettings,
    *,
    factory: BackingFactory | None = None,
    ready: Callable[[KVPoolServer], None] | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or ``stop``), then shut down cleanly.

    Args:
        settings: checked settings (``kvpoold.config.resolve``).
        factory: backing factory (default :func:`make_backing_factory`).
        ready: called once the servers accept calls.
        stop: set it to stop (tests); signals set it too.

    Returns:
        The exit status, 0.

    Raises:
        InvalidArgument: an unreadable TLS file, a bad device or shm directory (see
            :func:`make_backing_factory`), or a bad ``$KVPOOL_LEDGER``.
    """
    ledger = default_backend()  # a bad $KVPOOL_LEDGER fails here, not at the first Configure
    tls = read_tls(settings)  # before the factory: a bad file must not strand its files
    factory = factory or make_backing_factory(settings)
    daemon = Daemon(settings.device, settings.budget_bytes, factory)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    server: KVPoolServer | None = None
    sweeper: asyncio.Task[None] | None = None
    metrics = None if settings.metrics_port is None else DaemonMetrics(
        loop_snapshot(daemon.snapshot, loop), settings.device)
    metrics_server: MetricsServer | None = None
    try:
        server = create_server(daemon, settings.listeners, token=settings.token, tls=tls,
                               socket_group=settings.socket_group,
                               rpc_observer=metrics.rpc if metrics else None)
        if metrics is not None and settings.metrics_port is not None:
            metrics_server = start_metrics_server(metrics.registry, settings.metrics_host,
                                                  settings.metrics_port)
        await server.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        sweeper = asyncio.create_task(sweep_leases(daemon))
        log.info("serving", extra={"fields": {
            "event": "serving", "pid": os.getpid(), "listen": ",".join(server.addresses),
            "device": settings.device, "budget_bytes": settings.budget_bytes,
            "allocator_ledger": ledger,
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
        if sweeper is not None:
            sweeper.cancel()
        if server is not None:
            if not server.closing.is_set():  # an error before the normal shutdown
                await server.shutdown(0)
            server.remove_sockets()
        if metrics_server is not None:  # before the pools go: a scrape must not see them half
            await asyncio.to_thread(metrics_server.close)
        daemon.close()
    log.info("stopped", extra={"fields": {"event": "stopped"}})
    return 0

"""Build the gRPC servers (build), run them until a signal (run); arguments live in serve_cli.

Unix-socket listeners share one ``grpc.aio`` server; TCP listeners get a second one with the
token interceptor and optional TLS. Both serve the same servicer, health and reflection.
Shutdown: health NOT_SERVING -> long streams end -> stop accepting and drain (grace) -> release
the pools -> remove the socket files.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
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
from kvpool.v1 import kvpool_pb2_grpc
from kvpoold.config import Listener, ServeSettings
from kvpoold.service.auth import TokenAuthInterceptor
from kvpoold.service.daemon import Daemon
from kvpoold.service.servicer import KVPoolServicer
from kvpoold.sharing.base import BackingFactory

log = logging.getLogger("kvpoold.server")

SERVICE_NAME = "kvpool.v1.KVPool"
SWEEP_INTERVAL_S = 0.2
# Stats with thousands of leases and big id batches are larger than gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 << 20
_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
)


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
) -> KVPoolServer:
    """Build (not start) the servers for ``listeners``; call inside the event loop.

    Args:
        daemon: the state the servicer works on.
        listeners: Unix sockets and TCP addresses (TCP port 0 picks a free port).
        token: shared secret required on TCP listeners (``authorization: Bearer <token>``).
        tls: ``(private_key_pem, certificate_chain_pem)`` for TCP listeners.
        socket_group: group allowed on the Unix sockets (mode 0660 instead of 0600).

    Returns:
        The server set; ``addresses`` lists what is bound (real ports for port 0).

    Raises:
        InvalidArgument: no listeners, or an unknown group.
        FailedPrecondition: a socket path served by another daemon, or an address in use.
    """
    if not listeners:
        raise InvalidArgument("give at least one --listen address", field="listen")
    gid = _group_id(socket_group) if socket_group else None
    closing = asyncio.Event()
    servicer = KVPoolServicer(daemon, closing)
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


def _group_id(group: str) -> int:
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidArgument(f"unknown group {group!r} for --socket-group",
                              field="socket_group") from None


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
    """The backing factory for the device (plain memory until shm/CUDA IPC factories land)."""
    import torch

    from kvpoold.sharing.base import PlainBackingFactory

    device = torch.device(settings.device)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise InvalidArgument(
                f"device {settings.device}: this process sees {count} CUDA devices; check "
                "--device and CUDA_VISIBLE_DEVICES",
                field="device",
            )
    return PlainBackingFactory(device)


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
    """
    factory = factory or make_backing_factory(settings)
    daemon = Daemon(settings.device, settings.budget_bytes, factory)
    tls = None
    if settings.tls_cert and settings.tls_key:
        tls = (settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    server: KVPoolServer | None = None
    sweeper: asyncio.Task[None] | None = None
    try:
        server = create_server(daemon, settings.listeners, token=settings.token, tls=tls,
                               socket_group=settings.socket_group)
        await server.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        sweeper = asyncio.create_task(sweep_leases(daemon))
        log.info("serving", extra={"fields": {
            "event": "serving", "pid": os.getpid(), "listen": ",".join(server.addresses),
            "device": settings.device, "budget_bytes": settings.budget_bytes,
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
        daemon.close()
    log.info("stopped", extra={"fields": {"event": "stopped"}})
    return 0

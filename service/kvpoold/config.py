"""``kvpoold serve`` settings: a TOML file decoded with msgspec, then command-line flags on top.

The file holds the same keys as the flags (underscores for dashes; no ``token``: a secret
belongs in ``token_file``), all optional::

    listen = ["unix:///run/kvpool/kvpool.sock", "tcp://127.0.0.1:50051"]
    device = "cuda:0"
    budget = "60GiB"          # or a number of bytes, or a fraction of free memory on cuda: 0.9
    socket_group = "kvpool"
    log_level = "info"
    log_format = "json"
    token_file = "/etc/kvpool/token"
    tls_cert = "/etc/kvpool/tls.crt"
    tls_key = "/etc/kvpool/tls.key"
    shm_dir = "/dev/shm"
    shm_preallocate = false   # reserve every tmpfs page of a cpu pool when it is built
    sharing = "auto"          # shm on cpu, CUDA IPC on cuda; "none": unshared (tests only)
    metrics_port = 9400       # serve Prometheus /metrics (omit it: no metrics server)
    metrics_host = "127.0.0.1"  # the default; 0.0.0.0 in a container so Prometheus can reach it
    grace_seconds = 5.0       # how long shutdown waits for in-flight calls, 0..600

:func:`resolve` merges file and flags and checks every value, giving :class:`ServeSettings`;
:func:`check_host` then checks what depends on this machine (the group, the TLS files, the
shared-memory directory), so ``kvpoold serve`` reports either before it imports torch.
"""

from __future__ import annotations

import grp
import ipaddress
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvpool.errors import InvalidArgument
from kvpool.sizes import parse_size
from kvpool.spec import Base
from kvpool.targets import default_socket_path

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormatName = Literal["text", "json"]
# auto: shared memory on cpu, CUDA IPC on cuda. none: plain unshared memory (tests, benchmarks).
SharingMode = Literal["auto", "none"]
DEFAULT_BUDGET_BYTES = 1 << 30
# Loopback unless asked: /metrics has no authentication. Containers pass --metrics-host 0.0.0.0.
DEFAULT_METRICS_HOST = "127.0.0.1"
MAX_GRACE_SECONDS = 600.0
LISTEN_FORMS = "unix:///abs/path.sock or tcp://host:port"
_DEVICE = re.compile(r"cpu|cuda:(?P<index>[0-9]{1,3})")


class ServeConfig(Base):
    """The ``--config`` file; every key is optional and flags override it."""

    listen: tuple[str, ...] = ()
    device: str | None = None
    budget: str | Annotated[int, Meta(ge=0)] | Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    socket_group: str | None = None
    log_level: LogLevel | None = None
    log_format: LogFormatName | None = None
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    shm_dir: str | None = None
    shm_preallocate: bool | None = None
    sharing: SharingMode | None = None
    grace_seconds: Annotated[float, Meta(ge=0.0, le=MAX_GRACE_SECONDS)] | None = None
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    metrics_host: str | None = None
    allow_insecure_tcp: bool | None = None


@dataclass(frozen=True)
class Listener:
    """One address to serve on: a Unix socket path or a TCP ``host:port``."""

    kind: Literal["unix", "tcp"]
    address: str  # the socket path, or host:port

    @property
    def grpc_address(self) -> str:
        return f"unix://{self.address}" if self.kind == "unix" else self.address


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``kvpoold serve`` needs, checked. ``budget_bytes`` is resolved to bytes."""

    listeners: tuple[Listener, ...]
    device: str
    budget_bytes: int
    socket_group: str | None
    log_level: LogLevel
    log_format: LogFormatName
    token: str | None
    tls_cert: Path | None
    tls_key: Path | None
    shm_dir: Path
    grace_seconds: float
    sharing: SharingMode = "auto"
    shm_preallocate: bool = False
    # Prometheus /metrics: None serves none; 0 picks a free port (logged as metrics_serving).
    metrics_port: int | None = None
    metrics_host: str = DEFAULT_METRICS_HOST


def load_config(path: Path) -> ServeConfig:
    """Read a ``kvpoold.toml``.

    Raises:
        InvalidArgument: unreadable file, bad TOML, an unknown key or a mistyped value (with
            its path, ``$.budget``).
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read config {path}: {exc.strerror or exc}",
                              field="config") from exc
    try:
        return msgspec.toml.decode(raw, type=ServeConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidArgument(f"invalid config {path}: {exc}", field="config") from exc


def parse_listen(text: str) -> Listener:
    """``unix:///abs/path.sock`` or ``tcp://host:port`` (``tcp://[::1]:50051`` for IPv6).

    Raises:
        InvalidArgument: anything else, naming the accepted forms.
    """
    if text.startswith("unix://"):
        path = text[len("unix://"):]
        if not path.startswith("/") or path.endswith("/"):
            raise InvalidArgument(
                f"listen {text!r}: give an absolute socket path ({LISTEN_FORMS})", field="listen"
            )
        return Listener("unix", path)
    if text.startswith("tcp://"):
        address = text[len("tcp://"):]
        host, sep, port = address.rpartition(":")
        if sep and host and port.isdigit() and int(port) <= 65535:
            return Listener("tcp", address)
    raise InvalidArgument(f"cannot read listen address {text!r}; give {LISTEN_FORMS}",
                          field="listen")


def parse_device(text: str) -> str:
    """``cpu`` or ``cuda:N``.

    Raises:
        InvalidArgument: anything else.
    """
    match = _DEVICE.fullmatch(text.strip())
    if match is None:
        raise InvalidArgument(f"device {text!r}: give cpu or cuda:N (cuda:0, cuda:1 ...)",
                              field="device")
    return match.group(0)


def parse_budget(value: str | int | float, device: str,
                 free_bytes: Callable[[str], int]) -> int:
    """The device budget in bytes.

    Args:
        value: bytes (``2147483648``), a size (``2GiB``), or on cuda a fraction of the device's
            free memory (``0.9``).
        device: ``cpu`` or ``cuda:N``.
        free_bytes: device -> free bytes now (``torch.cuda.mem_get_info``), asked only for a
            fraction.

    Raises:
        InvalidArgument: malformed, or a fraction on cpu.
    """
    fraction: float | None = None
    if isinstance(value, float):
        fraction = value
    elif isinstance(value, str) and re.fullmatch(r"0?\.[0-9]+|1\.0*|0", value.strip()):
        fraction = float(value)
    if fraction is None:
        return value if isinstance(value, int) else parse_size(str(value), field="budget")
    if not (0.0 < fraction <= 1.0 and math.isfinite(fraction)):
        raise InvalidArgument(f"budget fraction {value!r} must be in (0, 1]", field="budget")
    if device == "cpu":
        raise InvalidArgument(
            f"budget {value!r}: a fraction of free memory applies to cuda devices only; on cpu "
            "give a size (2GiB)",
            field="budget",
        )
    return int(free_bytes(device) * fraction)


def resolve(flags: Mapping[str, Any], config: ServeConfig | None,
            env: Mapping[str, str] | None = None,
            free_bytes: Callable[[str], int] | None = None) -> ServeSettings:
    """Merge the config file and flags (flags win) into checked settings.

    Args:
        flags: argparse values by key (``listen``, ``device``, ``budget``, ``token`` ...);
            ``None`` or an empty list means "not given".
        config: the ``--config`` file, if any.
        env: environment for the default socket path.
        free_bytes: device -> free bytes, for a fractional cuda budget.

    Raises:
        InvalidArgument: naming the first bad setting.
    """
    cfg = config or ServeConfig()

    def pick(key: str) -> Any:
        value = flags.get(key)
        return getattr(cfg, key, None) if value in (None, [], ()) else value

    listen = pick("listen") or (f"unix://{default_socket_path(env)}",)
    device = parse_device(pick("device") or "cpu")
    budget = pick("budget")
    budget_bytes = DEFAULT_BUDGET_BYTES if budget is None else parse_budget(
        budget, device, free_bytes or _cuda_free_bytes
    )
    token = flags.get("token")
    token_file = pick("token_file")
    if token and token_file:
        raise InvalidArgument("give --token or --token-file, not both", field="token")
    if token_file:
        token = _read_token(Path(token_file))
    tls_cert, tls_key = pick("tls_cert"), pick("tls_key")
    if bool(tls_cert) != bool(tls_key):
        raise InvalidArgument("TLS needs both --tls-cert and --tls-key", field="tls_cert")
    grace = pick("grace_seconds")
    if grace is not None and not 0.0 <= float(grace) <= MAX_GRACE_SECONDS:
        raise InvalidArgument(
            f"grace_seconds {grace!r}: give 0 to {MAX_GRACE_SECONDS:g} seconds (how long "
            "shutdown waits for in-flight calls)",
            field="grace_seconds",
        )
    metrics_port = pick("metrics_port")
    metrics_host = pick("metrics_host")
    listeners = tuple(parse_listen(x) for x in listen)
    if not token and not pick("allow_insecure_tcp"):
        check_tcp_is_local(listeners)
    return ServeSettings(
        listeners=listeners,
        device=device,
        budget_bytes=budget_bytes,
        socket_group=pick("socket_group"),
        log_level=pick("log_level") or "info",
        log_format=pick("log_format") or "text",
        token=token or None,
        tls_cert=Path(tls_cert) if tls_cert else None,
        tls_key=Path(tls_key) if tls_key else None,
        shm_dir=Path(pick("shm_dir") or "/dev/shm"),
        sharing=parse_sharing(pick("sharing") or "auto"),
        shm_preallocate=bool(pick("shm_preallocate")),
        grace_seconds=5.0 if grace is None else float(grace),
        metrics_port=None if metrics_port is None else parse_port(metrics_port, "metrics_port"),
        metrics_host=parse_host(metrics_host, "metrics_host") if metrics_host
        else DEFAULT_METRICS_HOST,
    )


def check_tcp_is_local(listeners: Sequence[Listener]) -> None:
    """Without a token, TCP is served on loopback only: anyone who reaches a listener can
    allocate pages and map pools.

    Raises:
        InvalidArgument: a non-loopback TCP listener, naming the ways out.
    """
    for x in listeners:
        if x.kind != "tcp":
            continue
        host = x.address.rpartition(":")[0].strip("[]")
        if host == "localhost":
            continue
        try:
            if ipaddress.ip_address(host).is_loopback:
                continue
        except ValueError:
            pass
        raise InvalidArgument(
            f"refusing to serve tcp://{x.address} without a token: anyone who can reach it "
            "could allocate pages and map pools; give --token-file (or --token), listen on "
            "127.0.0.1, or pass --allow-insecure-tcp if the network is trusted",
            field="listen",
        )


def check_host(settings: ServeSettings) -> None:
    """Check the settings that depend on this machine, before anything is started.

    Raises:
        InvalidArgument: an unknown ``socket_group``, an unreadable TLS file, or, for shared
            memory on cpu, an ``shm_dir`` that is not a directory.
    """
    if settings.socket_group:
        group_id(settings.socket_group)
    read_tls(settings)
    if settings.device == "cpu" and settings.sharing == "auto":
        check_shm_dir(settings.shm_dir)


def group_id(group: str) -> int:
    """The id of a group given by name or number.

    Raises:
        InvalidArgument: no such group on this machine.
    """
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidArgument(f"unknown group {group!r} for --socket-group",
                              field="socket_group") from None


def read_tls(settings: ServeSettings) -> tuple[bytes, bytes] | None:
    """``(private_key_pem, certificate_chain_pem)`` for TCP listeners, or None without TLS.

    Raises:
        InvalidArgument: a TLS file cannot be read (names it and its flag).
    """
    if not (settings.tls_cert and settings.tls_key):
        return None
    pems = []
    for field, path in (("tls_key", settings.tls_key), ("tls_cert", settings.tls_cert)):
        try:
            pems.append(path.read_bytes())
        except OSError as exc:
            flag = "--" + field.replace("_", "-")
            raise InvalidArgument(f"cannot read {flag} {path}: {exc.strerror or exc}",
                                  field=field) from exc
    return pems[0], pems[1]


def check_shm_dir(path: Path) -> None:
    """Shared-memory backings need ``path`` to be an existing directory.

    Raises:
        InvalidArgument: it is not.
    """
    if not path.is_dir():
        raise InvalidArgument(
            f"shared-memory directory {path} does not exist; create it (a tmpfs) or pass "
            "another --shm-dir",
            field="shm_dir",
        )


def parse_port(value: str | int, field: str) -> int:
    """A TCP port ``0..65535`` (0: any free port), as a number or its text.

    Raises:
        InvalidArgument: not an integer, or out of range.
    """
    text = str(value).strip()
    if not text.isdigit() or int(text) > 65535:
        raise InvalidArgument(f"{field} {value!r}: give a TCP port 0..65535 (0 picks a free one)",
                              field=field)
    return int(text)


def parse_host(value: str, field: str) -> str:
    """A host to bind: an IPv4/IPv6 address or a name, without brackets or a port.

    Raises:
        InvalidArgument: empty, bracketed, or with whitespace or a scheme.
    """
    host = value.strip()
    if not host or host.startswith("[") or "/" in host or any(c.isspace() for c in host):
        raise InvalidArgument(
            f"{field} {value!r}: give an address or host name to bind, 127.0.0.1 (this host "
            "only, the default), 0.0.0.0 or :: (every interface)",
            field=field,
        )
    return host


def parse_sharing(text: str) -> SharingMode:
    """``auto`` or ``none``.

    Raises:
        InvalidArgument: anything else.
    """
    if text == "auto":
        return "auto"
    if text == "none":
        return "none"
    raise InvalidArgument(
        f"sharing {text!r}: give auto (shared memory on cpu, CUDA IPC on cuda) or none "
        "(unshared memory: clients cannot map pools; for tests and benchmarks)",
        field="sharing",
    )


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise InvalidArgument(f"cannot read token file {path}: {exc.strerror or exc}",
                              field="token_file") from exc
    if not token:
        raise InvalidArgument(f"token file {path} is empty", field="token_file")
    if path.stat().st_mode & 0o077:
        # A token others can read is no secret; refuse rather than serve with it.
        raise InvalidArgument(f"token file {path} is readable by group/others; chmod 600 it",
                              field="token_file")
    return token


def _cuda_free_bytes(device: str) -> int:
    import torch  # only for a fractional cuda budget

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)

"""``kvpoold serve`` settings, declared once in :class:`ServeConfig`: file, flags, defaults, bounds.

Each setting is one field of :class:`ServeConfig`, with its default, its bounds and a one-line
description. The ``--config`` TOML file decodes into it (every key optional, unknown keys
refused); ``kvpoold serve``'s flags are built from its fields (``kvpoold.server.serve_cli``);
:func:`resolve` merges file and flags (flags win), validates the result once with
``msgspec.convert`` and derives what the daemon uses (listeners, the budget in bytes, the
token) into :class:`ServeSettings`. :func:`check_host` then checks what depends on this machine
(the group, the TLS files, the shared-memory directory), so ``kvpoold serve`` reports a bad
setting before it imports torch. Two flags are command-line only: ``--config`` (the file
itself) and ``--token`` (a secret belongs in ``token_file``).

The list of settings: ``kvpoold serve --help`` and docs/operations.md; an example file:
docker/kvpoold.toml.
"""

import importlib.util
import math
import re
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvpool.clients.targets import default_socket_path
from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.sizes import parse_size
from kvpool.contract.spec import Base
from kvpoold.access import (
    SINGLE_TOKEN_IDENTITY,
    Authority,
    NamedToken,
    Scope,
    UnixAuth,
    all_tokens,
    check_pool_patterns,
    check_token_name,
)
from kvpoold.listen import (
    LISTEN_FORMS,
    Listener,
    check_tcp_is_local,
    group_id,
    is_loopback,
    parse_listen,
    read_tls,
)

__all__ = [
    "DEFAULT_BUDGET_BYTES",
    "KvEventsConfig",
    "Listener",
    "ServeConfig",
    "ServeSettings",
    "check_host",
    "check_shm_dir",
    "describe",
    "load_config",
    "parse_budget",
    "parse_listen",
    "resolve",
]

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]
# auto: shared memory on cpu, CUDA IPC on cuda. none: plain unshared memory (tests, benchmarks).
SharingMode = Literal["auto", "none"]
# How elastic pools share the budget (kvpoold.elastic.manager.POLICIES).
ElasticPolicy = Literal["arbiter", "greedy"]
MAX_GRACE_SECONDS = 600.0
MAX_WATCH_STREAMS = 1024
MIN_WATCH_INTERVAL_FLOOR_S = 0.05
MAX_WATCH_MIN_INTERVAL_S = 60.0
MAX_PORT = 65535
# The daemon's defaults and bounds that its tables and streams share with these settings: the
# leases open at once (and per identity, ``--max-leases-per-identity``), the attachments one
# identity may hold (``--max-attachments-per-identity``), and WatchStats' shortest interval
# served (``--watch-min-interval``: a shorter one is served at it) and streams one identity may
# hold open at once (``--max-watch-streams-per-identity``).
MAX_LEASES = 65_536
MAX_LEASES_PER_IDENTITY = 1024
MAX_ATTACHMENTS_PER_IDENTITY = 256
WATCH_MIN_INTERVAL_S = 0.5
MAX_WATCH_STREAMS_PER_IDENTITY = 4
# Connections one listener serves at once (the Unix sockets' gRPC server, the TCP server, the
# descriptor socket), and one peer uid on the descriptor socket: held connections cannot take
# every descriptor of the daemon (docs/security.md, "Exhaustion").
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_UID = 256
MAX_CONNECTIONS_CAP = 1 << 20


def _setting(description: str, *, metavar: str | None = None, hint: str | None = None,
             **bounds: Any) -> Meta:
    """A field's ``Meta``: its bounds, its description (the ``--help`` line) and, in ``extra``,
    the flag's metavar and the advice given with a bad value (default: its bounds or choices).
    """
    extra = {k: v for k, v in (("metavar", metavar), ("hint", hint)) if v is not None}
    return Meta(description=description, extra=extra, **bounds)


KV_EVENTS_ENDPOINT_FORMS = "tcp://*:PORT, tcp://HOST:PORT or ipc:///abs/path"
KV_EVENTS_NEED_PYZMQ = (
    "--kv-events-config asks for a ZMQ publisher, and pyzmq is not installed: install the events "
    "extra (from the repository root: pip install -e '.[server,events]'; from a built wheel: "
    "pip install 'kvpool-VERSION-py3-none-any.whl[server,events]'), or leave "
    "enable_kv_cache_events false")


class KvEventsConfig(Base):
    """``--kv-events-config``: vLLM 0.32's ``KVEventsConfig`` keys, the same meanings, for the
    daemon's stream of its sealed-page directories (docs/kv-events.md)."""

    enable_kv_cache_events: bool = False
    # None: "zmq" when enable_kv_cache_events, else "null" (as vLLM resolves it)
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: Annotated[int, Meta(ge=1, le=10_000_000)] = 10_000
    hwm: Annotated[int, Meta(ge=0, le=100_000_000)] = 100_000
    max_queue_size: Annotated[int, Meta(ge=1, le=100_000_000)] = 100_000
    topic: str = ""

    @property
    def publishing(self) -> bool:
        """Whether a ZMQ publisher runs (enabled, and the publisher is not "null")."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


class ServeConfig(Base):
    """Every ``kvpoold serve`` setting (frozen, keyword-only, unknown fields refused).

    The ``--config`` file has these keys, all optional; each is also the flag ``--key-name``.
    """

    listen: Annotated[tuple[str, ...], _setting(
        f"where to serve: {LISTEN_FORMS}; repeat for several (default: the per-user socket, "
        "$XDG_RUNTIME_DIR/kvpool/kvpool.sock, else /tmp/kvpool-$UID/kvpool.sock)",
        metavar="ADDR",
    )] = ()
    device: Annotated[str, _setting(
        "the device whose memory the pools take: cpu or cuda:N",
        metavar="DEV", hint="give cpu or cuda:N (cuda:0, cuda:1 ...)",
        pattern=r"^(cpu|cuda:[0-9]{1,3})$",
    )] = "cpu"
    budget: Annotated[
        str | Annotated[int, Meta(ge=0)] | Annotated[float, Meta(gt=0.0, le=1.0)],
        _setting("the most device bytes all pools together may use: a size (2GiB), a byte "
                 "count, or on cuda a fraction of the free memory at start (0.9)",
                 metavar="SIZE"),
    ] = "1GiB"
    socket_group: Annotated[str | None, _setting(
        "make every Unix socket the daemon creates (its gRPC sockets and the descriptor "
        "socket beside them) 0660 for this group, a name or gid (without it: 0600, the "
        "daemon's user only)",
        metavar="GROUP",
    )] = None
    log_level: Annotated[LogLevel, _setting("the least severe log lines written")] = "info"
    log_format: Annotated[LogFormat, _setting(
        "text (key=value) or json (one object per line)")] = "text"
    token_file: Annotated[str | None, _setting(
        "a file (mode 0600) with the secret every TCP call must carry as 'authorization: "
        "Bearer SECRET'",
        metavar="PATH",
    )] = None
    tokens_file: Annotated[str | None, _setting(
        "a TOML file of named, scoped tokens: [tokens.NAME] with secret_file = \"PATH\" (a "
        "0600 file) and admin = true, pools = [\"llama\", \"llama-tp*\"] or peer = true (a "
        "peer daemon: transfers only); a caller's identity is its token's name "
        "(docs/security.md)",
        metavar="PATH",
    )] = None
    peer_token_file: Annotated[str | None, _setting(
        "a file (mode 0600) with the secret this daemon presents to peer daemons when it sends "
        "them pages (default: the --token-file secret); a peer accepts it as an admin or "
        "peer = true token",
        metavar="PATH",
    )] = None
    unix_auth: Annotated[UnixAuth, _setting(
        "trust: Unix-socket callers without a token are the identity 'local', admin (the "
        "socket's mode guards it); token: they must present a token like TCP callers")] = "trust"
    max_leases_per_identity: Annotated[int, _setting(
        "the most leases one caller identity (a token, or 'local') may hold open at once",
        metavar="N", ge=1, le=MAX_LEASES)] = MAX_LEASES_PER_IDENTITY
    max_attachments_per_identity: Annotated[int, _setting(
        "the most attachments (Attach without Detach) one caller identity may hold at once",
        metavar="N", ge=1, le=MAX_LEASES)] = MAX_ATTACHMENTS_PER_IDENTITY
    max_watch_streams_per_identity: Annotated[int, _setting(
        "the most WatchStats streams one caller identity may hold open at once",
        metavar="N", ge=1, le=MAX_WATCH_STREAMS)] = MAX_WATCH_STREAMS_PER_IDENTITY
    watch_min_interval: Annotated[float, _setting(
        "the shortest interval a WatchStats stream is served at, in seconds (a stream asking "
        "for less gets this)",
        metavar="S", ge=MIN_WATCH_INTERVAL_FLOOR_S, le=MAX_WATCH_MIN_INTERVAL_S,
    )] = WATCH_MIN_INTERVAL_S
    max_connections: Annotated[int, _setting(
        "the most connections one listener serves at once (the Unix sockets, the TCP "
        "listeners, the descriptor socket: each); one more is closed at once",
        metavar="N", ge=1, le=MAX_CONNECTIONS_CAP)] = MAX_CONNECTIONS
    max_connections_per_uid: Annotated[int, _setting(
        "the most connections one peer uid holds open on the descriptor socket at once; one "
        "more is answered RESOURCE_EXHAUSTED",
        metavar="N", ge=1, le=MAX_CONNECTIONS_CAP)] = MAX_CONNECTIONS_PER_UID
    allow_insecure_tcp: Annotated[bool, _setting(
        "serve TCP on a non-loopback address without a token (refused otherwise: anyone who "
        "reaches it could allocate and map pools)")] = False
    tls_cert: Annotated[str | None, _setting(
        "TLS certificate chain (PEM) for TCP listeners; give both TLS files or neither",
        metavar="PEM")] = None
    tls_key: Annotated[str | None, _setting(
        "TLS private key (PEM) for TCP listeners; give both TLS files or neither",
        metavar="PEM")] = None
    reclaim_deadline: Annotated[float, _setting(
        "elastic pools: seconds an attached process has to unmap a group the daemon takes "
        "back before its lease is ended", metavar="S", ge=0.05, le=600.0)] = 2.0
    elastic_policy: Annotated[ElasticPolicy, _setting(
        "elastic pools: arbiter (groups taken back from pools that do not use them, weighted "
        "fair shares; see docs/elastic.md) or greedy (each pool takes what is free, keeps a "
        "headroom free, never takes from another: kvcached's policy, for comparison)")
    ] = "arbiter"
    shm_dir: Annotated[str, _setting(
        "where cpu pools' shared-memory files and the instance lock live; it must exist",
        metavar="DIR")] = "/dev/shm"
    shm_preallocate: Annotated[bool, _setting(
        "reserve every shared-memory page of a cpu pool when it is built: a full directory "
        "then fails Configure instead of a SIGBUS on first write")] = False
    sharing: Annotated[SharingMode, _setting(
        "auto: shared memory on cpu, CUDA IPC on cuda; none: unshared memory that clients "
        "cannot map (tests and benchmarks only)")] = "auto"
    grace_seconds: Annotated[float, _setting(
        "how long shutdown waits for in-flight calls, in seconds",
        metavar="S", ge=0.0, le=MAX_GRACE_SECONDS)] = 5.0
    metrics_port: Annotated[Annotated[int, Meta(ge=0, le=MAX_PORT)] | None, _setting(
        "serve Prometheus metrics at http://HOST:N/metrics (0: a free port, logged; without "
        "it: no metrics server)",
        metavar="N", hint=f"give a TCP port 0..{MAX_PORT} (0 picks a free one)")] = None
    metrics_host: Annotated[str, _setting(
        "the address the metrics server binds (/metrics has no authentication; 0.0.0.0 in a "
        "container so Prometheus can reach it)",
        metavar="HOST", pattern=r"^[^\s/\[\]]+$",
        hint="give an address or host name to bind: 127.0.0.1 (this host only), 0.0.0.0 or "
             ":: (every interface)")] = "127.0.0.1"
    kv_events_config: Annotated[str | KvEventsConfig | None, _setting(
        "publish the sealed-page directories' KV events (BlockStored, BlockRemoved, "
        "AllBlocksCleared) in vLLM's ZMQ format: a JSON object of vLLM's KVEventsConfig keys, "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558"}\' (in the config file, a table); needs pyzmq (kvpool[events]); '
        "docs/kv-events.md",
        metavar="JSON")] = None


class ServeSettings(ServeConfig, kw_only=True):
    """The checked settings: every :class:`ServeConfig` value, plus what is derived from them."""

    listeners: tuple[Listener, ...]  # ``listen`` parsed, or the per-user socket
    budget_bytes: int  # ``budget`` in bytes (a cuda fraction resolved against free memory)
    token: str | None  # ``--token``, or the contents of ``token_file`` (the admin token)
    tokens: tuple[NamedToken, ...] = ()  # ``tokens_file``, read
    peer_token: str | None = None  # ``peer_token_file`` read, else ``token``: sent to peers
    kv_events: KvEventsConfig | None = None  # ``kv_events_config`` read; None: no publisher


DEFAULT_BUDGET_BYTES = parse_size(str(ServeConfig().budget), field="budget")
_FIELDS = {f.name: f for f in msgspec.structs.fields(ServeConfig)}


def describe(name: str) -> tuple[str, dict[str, Any]]:
    """A setting's description and ``extra`` (metavar, hint), read from its ``Meta``.

    Args:
        name: a :class:`ServeConfig` field.

    Returns:
        ``(description, extra)``.
    """
    meta = _outer_meta(_FIELDS[name].type)
    return meta.description or "", dict(meta.extra or {})


def load_config(path: Path) -> ServeConfig:
    """Read a ``kvpoold.toml``.

    Args:
        path: the ``--config`` file.

    Returns:
        The file's settings; keys it leaves out have their defaults.

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


def resolve(flags: Mapping[str, Any], config: ServeConfig | None,
            env: Mapping[str, str] | None = None,
            free_bytes: Callable[[str], int] | None = None) -> ServeSettings:
    """Merge the config file and flags (flags win) into checked settings.

    Args:
        flags: flag values by setting name (``listen``, ``device``, ``budget`` ...) plus
            ``token``, as text or typed; ``None`` or an empty list means "not given", and keys
            that are not settings are ignored.
        config: the ``--config`` file, if any.
        env: environment for the default socket path.
        free_bytes: device -> free bytes, for a fractional cuda budget.

    Returns:
        The settings, with listeners parsed, the budget in bytes and the token read.

    Raises:
        InvalidArgument: naming the first bad setting.
    """
    merged: dict[str, Any] = msgspec.structs.asdict(config) if config is not None else {}
    merged.update({k: v for k, v in flags.items() if k in _FIELDS and v not in (None, [], ())})
    try:
        cfg = msgspec.convert(merged, ServeConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise _invalid(exc, merged) from None
    listeners = tuple(parse_listen(x) for x in cfg.listen or (
        f"unix://{default_socket_path(env)}",))
    budget_bytes = parse_budget(cfg.budget, cfg.device, free_bytes or _cuda_free_bytes)
    token = flags.get("token")
    if token and cfg.token_file:
        raise InvalidArgument("give --token or --token-file, not both", field="token")
    if cfg.token_file:
        token = _read_token(Path(cfg.token_file))
    tokens = load_tokens(Path(cfg.tokens_file)) if cfg.tokens_file else ()
    if token and any(t.name == SINGLE_TOKEN_IDENTITY for t in tokens):
        raise InvalidArgument(f"--tokens-file names a token {SINGLE_TOKEN_IDENTITY!r}, the name "
                              "of the --token / --token-file token; rename it",
                              field="tokens_file")
    Authority(all_tokens(token, tokens))  # refuses two tokens with one secret, now
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise InvalidArgument("TLS needs both --tls-cert and --tls-key", field="tls_cert")
    if not (token or tokens) and not cfg.allow_insecure_tcp:
        check_tcp_is_local(listeners)
    if cfg.unix_auth == "token" and not (token or tokens):
        raise InvalidArgument("unix_auth token needs tokens: give --tokens-file or --token-file",
                              field="unix_auth")
    events = parse_kv_events(cfg.kv_events_config)
    return ServeSettings(**msgspec.structs.asdict(cfg), listeners=listeners,
                         budget_bytes=budget_bytes, token=token or None, tokens=tokens,
                         kv_events=events if events is not None and events.publishing else None,
                         peer_token=(_read_token(Path(cfg.peer_token_file),
                                                 field="peer_token_file")
                                     if cfg.peer_token_file else token or None))


def parse_kv_events(value: str | KvEventsConfig | None) -> KvEventsConfig | None:
    """``kv_events_config`` read: JSON text (the flag) or a table (the config file), checked.

    Raises:
        InvalidArgument: not JSON, an unknown key, a mistyped or out-of-range value, or an
            endpoint the daemon cannot serve (naming it and the forms accepted).
    """
    if value is None or isinstance(value, KvEventsConfig):
        config = value
    else:
        try:
            config = msgspec.json.decode(value.strip() or "{}", type=KvEventsConfig)
        except msgspec.ValidationError as exc:
            raise InvalidArgument(f"kv_events_config: {exc} (the keys of vLLM's KVEventsConfig: "
                                  f"{', '.join(KvEventsConfig.__struct_fields__)})",
                                  field="kv_events_config") from None
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"kv_events_config {value!r} is not a JSON object ({exc}); "
                                  'give \'{"enable_kv_cache_events": true, ...}\'',
                                  field="kv_events_config") from None
    if config is None or not config.publishing:
        return config
    for key in ("endpoint", "replay_endpoint"):
        endpoint = getattr(config, key)
        if endpoint is None:
            continue
        if not re.fullmatch(r"(tcp://[^\s/]+:[0-9]{1,5}|ipc:///\S+)", endpoint):
            raise InvalidArgument(
                f"kv_events_config {key} {endpoint!r}: give {KV_EVENTS_ENDPOINT_FORMS} (a "
                "router in another process must reach it: inproc:// cannot)",
                field="kv_events_config")
    if config.replay_endpoint == config.endpoint and not config.endpoint.endswith(":0"):
        raise InvalidArgument(f"kv_events_config: endpoint and replay_endpoint are both "
                              f"{config.endpoint!r}; give the replay socket its own port or path",
                              field="kv_events_config")
    return config


class TokenEntry(Base):
    """One ``[tokens.NAME]`` table of a tokens file."""

    secret_file: str
    admin: bool = False
    pools: tuple[str, ...] = ()
    peer: bool = False


class TokensFile(Base):
    tokens: dict[str, TokenEntry]


def load_tokens(path: Path) -> tuple[NamedToken, ...]:
    """Read a ``--tokens-file``: each ``[tokens.NAME]`` has ``secret_file`` (mode 0600, as
    ``--token-file``) and one of ``admin = true``, ``pools`` (pool names, ``*``/``?``
    patterns) or ``peer = true`` (a peer daemon: PeerReceive and PeerDone only).

    Raises:
        InvalidArgument: unreadable or malformed, a bad name or pattern, a token both admin
            and pool-scoped (or neither), an unreadable or open secret file.
    """
    try:
        decoded = msgspec.toml.decode(path.read_bytes(), type=TokensFile)
    except OSError as exc:
        raise InvalidArgument(f"cannot read tokens file {path}: {exc.strerror or exc}",
                              field="tokens_file") from exc
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidArgument(f"invalid tokens file {path}: {exc}", field="tokens_file") from exc
    out = []
    for name, entry in decoded.tokens.items():
        where = f"tokens file {path}, [tokens.{name}]"
        check_token_name(name)
        if entry.admin + bool(entry.pools) + entry.peer != 1:
            raise InvalidArgument(f"{where}: give admin = true, pools = [...] or peer = true, "
                                  "one of them", field="tokens_file")
        secret = _read_token(Path(entry.secret_file), field="tokens_file")
        out.append(NamedToken(name, secret, Scope(entry.admin,
                                                  check_pool_patterns(entry.pools, where),
                                                  entry.peer)))
    if not out:
        raise InvalidArgument(f"tokens file {path} has no [tokens.NAME] table",
                              field="tokens_file")
    return tuple(out)


def security_warnings(settings: ServeSettings, token_inline: bool) -> list[str]:
    """What ``kvpoold serve`` warns about at start (it serves anyway):

    - a token given inline (``--token``): every local user can read it in
      ``/proc/<pid>/cmdline`` and ``ps``;
    - a token on a TCP listener off loopback without TLS: it crosses the network in clear.
    """
    out = []
    if token_inline and settings.token:
        out.append("the token was given with --token: every local user can read it in "
                   "/proc/<pid>/cmdline and ps; put it in a 0600 file and pass --token-file")
    if (settings.token or settings.tokens) and not settings.tls_cert:
        for x in settings.listeners:
            if not is_loopback(x):
                out.append(f"tcp://{x.address} has no TLS: the bearer token and every message "
                           "cross the network in clear; give --tls-cert and --tls-key")
    return out


def parse_budget(value: str | int | float, device: str,
                 free_bytes: Callable[[str], int]) -> int:
    """The device budget in bytes.

    Args:
        value: bytes (``2147483648``), a size (``2GiB``), or on cuda a fraction of the device's
            free memory (``0.9``).
        device: ``cpu`` or ``cuda:N``.
        free_bytes: device -> free bytes now (``torch.cuda.mem_get_info``), asked only for a
            fraction.

    Returns:
        The budget in bytes.

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


def check_host(settings: ServeSettings) -> None:
    """Check the settings that depend on this machine, before anything is started.

    Args:
        settings: resolved settings.

    Raises:
        InvalidArgument: an unknown ``socket_group``, an unreadable TLS file, or, for shared
            memory on cpu, an ``shm_dir`` that is not a directory.
        FailedPrecondition: KV events asked for without pyzmq (``kvpool[events]``).
    """
    if settings.socket_group:
        group_id(settings.socket_group)
    read_tls(settings.tls_cert, settings.tls_key)
    if settings.kv_events is not None and importlib.util.find_spec("zmq") is None:
        raise FailedPrecondition(KV_EVENTS_NEED_PYZMQ, field="kv_events_config")
    if settings.device == "cpu" and settings.sharing == "auto":
        check_shm_dir(settings.shm_dir)


def check_shm_dir(path: str | Path) -> None:
    """Shared-memory backings need ``path`` to be an existing directory.

    Args:
        path: the ``shm_dir`` setting.

    Raises:
        InvalidArgument: it is not.
    """
    if not Path(path).is_dir():
        raise InvalidArgument(
            f"shared-memory directory {path} does not exist; create it (a tmpfs) or pass "
            "another --shm-dir",
            field="shm_dir",
        )


def _invalid(exc: msgspec.ValidationError, values: Mapping[str, Any]) -> InvalidArgument:
    """The error for a value ``msgspec.convert`` refused: ``name value: advice``."""
    match = re.search(r"at `\$\.([a-z_]+)", str(exc))
    if match is None or match.group(1) not in _FIELDS:
        return InvalidArgument(f"invalid settings: {exc}")
    name = match.group(1)
    return InvalidArgument(f"{name} {values.get(name)!r}: {_advice(name, exc)}", field=name)


def _advice(name: str, exc: msgspec.ValidationError) -> str:
    """What to give instead: the field's hint, else its choices or bounds, with its meaning."""
    description, extra = describe(name)
    if "hint" in extra:
        return str(extra["hint"])
    info = typing.get_args(_FIELDS[name].type)[0]  # inside the outer Annotated
    choices = typing.get_args(info) if typing.get_origin(info) is Literal else ()
    bounds = _outer_meta(_FIELDS[name].type)
    if choices:
        *rest, last = [str(c) for c in choices]
        advice = f"give {', '.join(rest)} or {last}" if rest else f"give {last}"
    elif bounds.ge is not None and bounds.le is not None:
        advice = f"give {bounds.ge:g} to {bounds.le:g}"
    else:
        advice = str(exc).split(" - at ", 1)[0]
    return f"{advice} ({description})"


def _outer_meta(annotation: Any) -> Meta:
    """The ``Meta`` of a field's outer ``Annotated`` (description, bounds, extra)."""
    for item in getattr(annotation, "__metadata__", ()):
        if isinstance(item, Meta):
            return item
    return Meta()


def _read_token(path: Path, field: str = "token_file") -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise InvalidArgument(f"cannot read token file {path}: {exc.strerror or exc}",
                              field=field) from exc
    if not token:
        raise InvalidArgument(f"token file {path} is empty", field=field)
    if path.stat().st_mode & 0o077:
        # A token others can read is no secret; refuse rather than serve with it.
        raise InvalidArgument(f"token file {path} is readable by group/others; chmod 600 it",
                              field=field)
    return token


def _cuda_free_bytes(device: str) -> int:
    import torch  # only for a fractional cuda budget

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)

"""``kvpoold serve``: parse flags (and ``--config``), then run the daemon until a signal."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from kvpool.targets import default_socket_path
from kvpoold.config import ServeSettings, check_host, load_config, resolve
from kvpoold.server.logs import LOG_FORMATS, configure_logging


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    """Register ``serve`` with the ``kvpoold`` subcommand parser and return its parser."""
    p = subparsers.add_parser(
        "serve",
        help="run the daemon: own the pools of one device and serve them over gRPC",
        description="Serve the KVPool gRPC API on Unix sockets and/or TCP. Flags override the "
                    "--config file; with no flags: cpu, a 1GiB budget, and the socket "
                    f"{default_socket_path()}.",
    )
    p.add_argument("--listen", action="append", metavar="ADDR",
                   help="unix:///abs/path.sock or tcp://host:port; repeat for several "
                        "(default: the per-user socket above)")
    p.add_argument("--device", metavar="DEV", help="cpu (default) or cuda:N")
    p.add_argument("--budget", metavar="SIZE",
                   help="device bytes all pools may use: 2GiB, 2147483648; on cuda also a "
                        "fraction of free memory, 0.9 (default 1GiB)")
    p.add_argument("--config", type=Path, metavar="PATH",
                   help="a TOML file with the same keys, underscores for dashes (example: "
                        "docker/kvpoold.toml)")
    p.add_argument("--socket-group", metavar="GROUP",
                   help="make Unix sockets 0660 for this group, a name or gid (default 0600: "
                        "owner only)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   help="default info")
    p.add_argument("--log-format", choices=LOG_FORMATS, help="text (default) or json lines")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token", metavar="SECRET",
                       help="require 'authorization: Bearer SECRET' on TCP listeners")
    token.add_argument("--token-file", metavar="PATH",
                       help="read the TCP token from a file (mode 0600)")
    p.add_argument("--allow-insecure-tcp", action="store_true", default=None,
                   help="serve TCP on a non-loopback address without a token (refused "
                        "otherwise: anyone who reaches it could allocate and map pools)")
    p.add_argument("--tls-cert", metavar="PEM", help="TLS certificate chain for TCP listeners")
    p.add_argument("--tls-key", metavar="PEM", help="TLS private key for TCP listeners")
    p.add_argument("--shm-dir", metavar="DIR",
                   help="where shared-memory backings live on cpu (default /dev/shm)")
    p.add_argument("--shm-preallocate", action="store_true", default=None,
                   help="reserve every shared-memory page of a cpu pool when it is built: a "
                        "full /dev/shm then fails Configure instead of a SIGBUS on first write")
    p.add_argument("--sharing", choices=("auto", "none"),
                   help="auto (default): shared memory on cpu, CUDA IPC on cuda; none: "
                        "unshared memory that clients cannot map (tests and benchmarks only)")
    p.add_argument("--grace-seconds", type=float, metavar="S",
                   help="how long shutdown waits for in-flight calls, 0 to 600 (default 5)")
    p.add_argument("--metrics-port", metavar="N",
                   help="serve Prometheus metrics at http://HOST:N/metrics (0: a free port, "
                        "logged; default: no metrics server)")
    p.add_argument("--metrics-host", metavar="HOST",
                   help="address the metrics server binds (default 127.0.0.1; 0.0.0.0 in a "
                        "container so Prometheus can reach it)")
    p.set_defaults(func=run)
    return p


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """Merge ``--config`` and the flags into checked settings.

    Raises:
        InvalidArgument: naming the first bad flag or config key.
    """
    config = load_config(args.config) if args.config else None
    return resolve(vars(args), config)


def run(args: argparse.Namespace) -> int:
    """Entry of ``kvpoold serve``: returns the exit status.

    Raises:
        InvalidArgument: a bad flag or config value, reported before torch is imported.
    """
    settings = settings_from_args(args)
    check_host(settings)
    configure_logging(settings.log_level, settings.log_format)
    # The server imports torch (seconds): only once the settings are known to be good.
    from kvpoold.server.server import run as serve

    return asyncio.run(serve(settings))

"""``kvpoold serve``: flags built from the settings Struct, merged with ``--config``, then run."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec

from kvpool.clients.targets import default_socket_path
from kvpool.contract.errors import FailedPrecondition
from kvpoold.server.logs import configure_logging
from kvpoold.settings import (
    ServeConfig,
    ServeSettings,
    check_host,
    describe,
    load_config,
    resolve,
    security_warnings,
)

log = logging.getLogger("kvpoold.server")


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    """Register ``serve`` with the ``kvpoold`` subcommand parser.

    Every field of :class:`~kvpoold.settings.ServeConfig` becomes a flag (``shm_dir`` ->
    ``--shm-dir``) with its description, choices and default; ``--config`` and ``--token``
    are the command-line-only extras.

    Args:
        subparsers: the ``kvpoold`` parser's subcommands.

    Returns:
        The ``serve`` parser.
    """
    defaults = ServeConfig()
    p = subparsers.add_parser(
        "serve",
        help="run the daemon: own the pools of one device and serve them over gRPC",
        description="Serve the KVPool gRPC API on Unix sockets and/or TCP. Each setting is a "
                    "flag and a key of the --config file (underscores for dashes); flags "
                    f"override the file. With neither: {defaults.device}, a {defaults.budget} "
                    f"budget, and the socket {default_socket_path()}.",
    )
    group = p.add_argument_group("settings", "also keys of the --config file")
    for field in msgspec.structs.fields(ServeConfig):
        group.add_argument("--" + field.name.replace("_", "-"), **_flag(field))
    extras = p.add_argument_group("command line only")
    extras.add_argument("--config", type=Path, metavar="PATH",
                        help="a TOML file of the settings above, underscores for dashes "
                             "(example: docker/kvpoold.toml)")
    extras.add_argument("--token", metavar="SECRET",
                        help="the TCP token given inline (it shows in ps: prefer --token-file); "
                             "not allowed in the config file")
    p.set_defaults(func=run)
    return p


def _flag(field: msgspec.structs.FieldInfo) -> dict[str, Any]:
    """``add_argument`` keywords for one setting; an absent flag is None ("not given")."""
    description, extra = describe(field.name)
    help_text = description
    if field.default not in (None, False, ()):
        help_text += f" (default {field.default})"
    kwargs: dict[str, Any] = {"dest": field.name, "default": None,
                              "help": help_text.replace("%", "%%")}
    value_type = typing.get_args(field.type)[0]  # inside the outer Annotated
    if value_type is bool:
        kwargs["action"] = "store_true"
    elif typing.get_origin(value_type) is tuple:
        kwargs.update(action="append", metavar=extra.get("metavar"))
    elif typing.get_origin(value_type) is Literal:
        kwargs["choices"] = typing.get_args(value_type)
    else:  # text here; msgspec converts it to the field's type in resolve()
        kwargs["metavar"] = extra.get("metavar")
    return kwargs


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """Merge ``--config`` and the flags into checked settings.

    Args:
        args: the parsed ``kvpoold serve`` arguments.

    Returns:
        The settings.

    Raises:
        InvalidArgument: naming the first bad flag or config key.
    """
    config = load_config(args.config) if args.config else None
    return resolve(vars(args), config)

# What `kvpool[server]` adds to the client's dependencies (pyproject.toml).
SERVER_EXTRA = ("torch", "prometheus_client", "grpc_reflection", "xxhash")


def run(args: argparse.Namespace) -> int:
    """Entry of ``kvpoold serve``.

    Args:
        args: the parsed ``kvpoold serve`` arguments.

    Returns:
        The exit status.

    Raises:
        InvalidArgument: a bad flag or config value, reported before torch is imported.
    """
    settings = settings_from_args(args)
    check_host(settings)
    configure_logging(settings.log_level, settings.log_format)
    for warning in security_warnings(settings, token_inline=bool(args.token)):
        log.warning(warning, extra={"fields": {"event": "insecure_setting"}})
    # The server imports torch (seconds): only once the settings are known to be good.
    try:
        from kvpoold.server.run import run as serve
    except ModuleNotFoundError as exc:
        if exc.name not in SERVER_EXTRA:
            raise
        from kvpool import __version__

        missing = [name for name in SERVER_EXTRA if importlib.util.find_spec(name) is None]
        raise FailedPrecondition(
            f"kvpoold serve needs the server extra (not installed: "
            f"{', '.join(missing or [str(exc.name)])}): from the repository root, pip install -e "
            f"'.[server]' (from a built wheel: pip install "
            f"'kvpool-{__version__}-py3-none-any.whl[server]'); kvpool is not on a package "
            "index, and a plain install is the client, its CLI and `kvpoold plan` only"
        ) from None

    return asyncio.run(serve(settings))

"""What every ``kvpool`` subcommand shares: the common options (where the daemon is, how to
authenticate, the deadline), the client they make, and reading a spec file. The subcommand
modules (``cli``, ``demo``, ``top``) import this; it imports none of them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

from kvpool.clients.targets import TOKEN_FILE_ENV, default_target, token_from
from kvpool.contract.errors import InvalidArgument


def common_options(target_help: str | None = None) -> argparse.ArgumentParser:
    """Options every subcommand takes: where the daemon is and how to authenticate.

    Args:
        target_help: ``--target``'s help when its default is not the per-user socket.

    Returns:
        A parser to pass as ``parents=[...]``.
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default=None, metavar="ADDR",
                        help=target_help or
                        f"unix:///path.sock or host:port (default {default_target()})")
    token = common.add_mutually_exclusive_group()
    token.add_argument("--token", metavar="SECRET",
                       help="bearer token for a TCP listener (visible in ps: prefer --token-file)")
    env_file = os.environ.get(TOKEN_FILE_ENV, "").strip()
    token.add_argument("--token-file", type=Path, metavar="PATH",
                       default=Path(env_file) if env_file else None,
                       help=f"read the token here (default ${TOKEN_FILE_ENV}"
                            + (f", now {env_file})" if env_file else ", unset now)"))
    common.add_argument("--timeout", type=float, default=30.0, metavar="S",
                        help="deadline per call in seconds (default 30)")
    return common


def client_from(args: argparse.Namespace) -> Any:
    """A ``KVPoolClient`` for the common options."""
    from kvpool.clients.client import KVPoolClient

    if args.token:
        print("kvpool: warning: --token "
              "shows the secret to every local user (ps, /proc/<pid>/cmdline); use --token-file",
              file=sys.stderr)
    token = token_from(args.token, args.token_file)
    return KVPoolClient(args.target, token=token, timeout_s=args.timeout)


def load_spec_mapping(path: Path) -> dict[str, Any]:
    """A spec file as a mapping (``.toml`` or JSON), checked here so that an error names the
    file (``invalid model spec in examples/specs/x.toml: ...``), not the request's field.

    Raises:
        InvalidArgument: the file cannot be read or is not a valid spec (field ``spec``).
    """
    from kvpool.contract.spec import decode_spec
    from kvpool.contract.wire import HF_CONFIG_KEYS

    try:
        raw = path.read_bytes()
        data = msgspec.toml.decode(raw) if path.suffix == ".toml" else msgspec.json.decode(raw)
    except (OSError, msgspec.DecodeError) as exc:
        raise InvalidArgument(f"cannot read spec {path}: {exc}", field="spec") from exc
    if isinstance(data, dict) and not any(k in data for k in HF_CONFIG_KEYS):
        decode_spec(data, source=str(path), field="spec")  # a HF config: Configure says so
    return data  # type: ignore[no-any-return]


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one: ``count(1, "pool")`` -> ``"1 pool"``,
    ``count(1200, "lease")`` -> ``"1,200 leases"``."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"

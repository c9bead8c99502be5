"""Where the daemon listens by default, how a ``--target`` becomes a gRPC channel address, and
how a client reads its ``--token-file``.

Shared by the daemon (``kvpoold serve``) and the client so both agree on the default socket:
``$XDG_RUNTIME_DIR/kvpool/kvpool.sock`` when that variable is set, else
``/tmp/kvpool-$UID/kvpool.sock``. Clients given no target use ``$KVPOOL_TARGET`` first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kvpool.contract.errors import InvalidArgument

SOCKET_NAME = "kvpool.sock"
TARGET_FORMS = "unix:///abs/path.sock, /abs/path.sock, host:port or tcp://host:port"


def default_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """The default Unix socket of the daemon.

    Args:
        env: the environment to read ``XDG_RUNTIME_DIR`` from (default ``os.environ``).
    """
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime:
        return Path(runtime) / "kvpool" / SOCKET_NAME
    return Path(f"/tmp/kvpool-{os.getuid()}") / SOCKET_NAME


# Where clients find the daemon when given no target: the CLI, ``KVPoolClient()``,
# ``AsyncKVPoolClient()`` and the SGLang integration.
TARGET_ENV = "KVPOOL_TARGET"


def default_target(env: Mapping[str, str] | None = None) -> str:
    """The client's target when none is given: ``$KVPOOL_TARGET`` when set (any form
    ``channel_target`` takes), else ``unix://`` + the default socket path."""
    env = os.environ if env is None else env
    chosen = env.get(TARGET_ENV, "").strip()
    if chosen:
        return chosen
    return f"unix://{default_socket_path(env)}"


def channel_target(target: str) -> str:
    """The gRPC address for a target as users write it.

    ``unix:///run/kvpool/kvpool.sock`` and ``/run/kvpool/kvpool.sock`` name a Unix socket;
    ``host:port`` and ``tcp://host:port`` a TCP address.

    Raises:
        InvalidArgument: an empty target, a relative socket path or an unknown scheme.
    """
    text = target.strip()
    if not text:
        raise InvalidArgument(f"empty target; give {TARGET_FORMS}", field="target")
    if text.startswith("unix://"):
        path = text[len("unix://"):]
        if not path.startswith("/"):
            raise InvalidArgument(
                f"target {target!r}: the socket path must be absolute (unix:///abs/path)",
                field="target",
            )
        return f"unix://{path}"
    if text.startswith("/"):
        return f"unix://{text}"
    if text.startswith("tcp://"):
        text = text[len("tcp://"):]
    if "://" in text or ":" not in text:
        raise InvalidArgument(f"cannot read target {target!r}; give {TARGET_FORMS}",
                              field="target")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidArgument(
            f"target {target!r}: the port must be a number 1..65535 after the host "
            f"(host:port); give {TARGET_FORMS}", field="target")
    return text


def is_unix(target: str) -> bool:
    """Whether a channel address (from :func:`channel_target`) is a Unix socket."""
    return target.startswith("unix:")


# A file holding the bearer token: the CLI's --token-file default and the SGLang plugin's.
TOKEN_FILE_ENV = "KVPOOL_TOKEN_FILE"


def token_from(token: str | None, token_file: Path | None) -> str | None:
    """The bearer token a client sends: ``--token``, else ``--token-file``'s first line.

    Args:
        token: the token given inline, if any.
        token_file: a file holding it, if any (surrounding whitespace is dropped).

    Raises:
        InvalidArgument: the file cannot be read or holds only whitespace.
    """
    if token is not None or token_file is None:
        return token
    try:
        text = Path(token_file).read_text().strip()
    except OSError as exc:
        raise InvalidArgument(f"cannot read token file {token_file}: {exc.strerror or exc}",
                              field="token_file") from exc
    if not text:
        raise InvalidArgument(f"token file {token_file} is empty", field="token_file")
    return text

"""``kvpool demo``: a daemon, a writer and a reader process sharing one real model's pool, checked.

Without ``--target`` the demo starts its own ``kvpoold serve`` on a temporary Unix socket with a
temporary shared-memory directory. It configures a pool for a real model config (Qwen3-8B,
shipped in ``kvpool/data``) scaled to a small CPU budget, then runs two other processes:

* the **writer** opens a lease, allocates N KV pages, attaches the pool and writes a
  deterministic byte pattern into those pages of every K/V buffer of every layer;
* the **reader** attaches the same pool by fingerprint, checks every byte of those pages and
  that every other page is still zero.

It prints Stats as a table, lets both detach, frees, drops the pool, stops the daemon (SIGTERM)
and checks that no ``kvpool-*`` file of it is left. Any failed step exits 1 with what went wrong.
Both workers start right away and import torch while the daemon starts; the whole run takes a
few seconds. The workers are ``kvpool.tools.demo_worker`` (``python -m kvpool.tools.demo_worker
ROLE``), talking JSON lines on stdin/stdout; starting and stopping the children is
:mod:`kvpool.tools.demo_procs`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.clients.targets import token_from
from kvpool.contract.errors import InvalidArgument, KVPoolError
from kvpool.tools.demo_procs import (
    OwnDaemon,
    child_env,
    own_daemon,
    start_workers,
    wait_listening,
    wait_serving,
)
from kvpool.tools.demo_worker import DemoFailed
from kvpool.tools.hf_hub_cache import local_model_config

if TYPE_CHECKING:
    from kvpool.clients.client import KVPoolClient
    from kvpool.contract.records import Stats

MiB = 1 << 20
DEFAULT_MODEL = "qwen3-8b.json"
DEFAULT_BUDGET = 32 * MiB
DEFAULT_PAGES = 8
PAGE_SIZE = 16
CONTEXT_LENGTH = 4096


def model_arg(path: Path | None) -> dict[str, Any]:
    """Configure's model argument: the shipped Qwen3-8B config, a HF config, or a spec file."""
    if path is None:
        return {"hf_config": (resources.files("kvpool") / "data" / DEFAULT_MODEL).read_text()}
    path = local_model_config(path, "model_config")
    if not path.exists():
        raise InvalidArgument(f"model config {path} does not exist", field="model_config")
    if path.suffix == ".toml":
        from kvpool.tools.cli_common import load_spec_mapping

        return {"spec": load_spec_mapping(path)}
    if path.is_file():
        data = json.loads(path.read_text())
        if "num_layers" in data and "attention" in data:  # a kvpool spec, not a HF config
            return {"spec": data}
    return {"hf_config": path}


def stats_tables(stats: Stats, pool: str) -> list[Any]:
    """The daemon, the demo pool's counters and the leases as rich tables."""
    from rich.table import Table

    from kvpool.contract.sizes import format_size

    d = stats.daemon
    daemon = Table(title=f"kvpoold {d.version} on {d.device}", title_justify="left")
    for col in ("budget", "used", "pools", "leases", "uptime"):
        daemon.add_column(col, justify="right")
    daemon.add_row(format_size(d.budget_bytes), format_size(d.used_bytes), str(d.num_pools),
                   str(d.num_leases), f"{d.uptime_seconds:.1f}s")
    p = stats.pool(pool)
    spaces = Table(title=f"pool {p.name}: {format_size(p.backing_bytes)} {p.sharing}, "
                        f"attached {p.attached}", title_justify="left")
    for col in ("space", "capacity", "used", "free", "high water", "allocs", "frees"):
        spaces.add_column(col, justify="left" if col == "space" else "right")
    for space, k in p.spaces.items():
        spaces.add_row(space, f"{k.capacity:,}", f"{k.used:,}", f"{k.free:,}",
                      f"{k.high_water:,}", f"{k.allocs:,}", f"{k.frees:,}")
    leases = Table(title="leases", title_justify="left")
    for col in ("lease", "name", "expires in", "attached", "held"):
        leases.add_column(col)
    for x in stats.leases:
        held = " ".join(f"{k}={n}" for spaces_ in x.held.values() for k, n in spaces_.items())
        leases.add_row(str(x.lease_id), x.name, f"{x.expires_in_seconds:.1f}s",
                       str(x.attached), held or "-")
    return [daemon, spaces, leases]


def run_demo(args: argparse.Namespace) -> int:
    """Entry of ``kvpool demo``: 0 when every check passed, 1 (with the reason) otherwise."""
    from kvpool.tools.cli_run import console as console_for

    console = console_for(highlight=False)
    started = time.monotonic()

    def say(text: str) -> None:
        console.print(f"[{time.monotonic() - started:5.1f}s] {text}", markup=False,
                      soft_wrap=True)

    try:
        _run(args, say, console)
    except DemoFailed as exc:
        console.print(f"kvpool demo: FAILED: {exc}", markup=False, style="bold red",
                      soft_wrap=True)
        return 1
    say("demo passed: the reader saw exactly the writer's bytes, and everything was cleaned up")
    return 0


def _run(args: argparse.Namespace, say: Any, console: Any) -> None:
    from kvpool.contract.sizes import format_size
    from kvpool.tools.cli_common import client_from

    if args.pages < 1:
        raise InvalidArgument(f"--pages must be >= 1, got {args.pages}", field="pages")
    model = model_arg(args.model_config)
    env = child_env()
    with contextlib.ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="kvpooldemo-logs-", dir="/tmp"))
        stack.callback(shutil.rmtree, work, True)
        daemon = None
        if args.target is None:
            # Workers start first and import torch while the daemon does.
            workers = start_workers(stack, env, work)
            daemon = stack.enter_context(own_daemon(2 * args.budget + 64 * MiB, env, say))
            args.target = daemon.target
            for w in workers.values():  # on failure: workers go before the daemon stops
                stack.callback(w.kill)
            wait_listening(daemon, 30.0)
        client = stack.enter_context(client_from(args))
        wait_serving(client, daemon, 30.0)
        say(f"kvpoold serving at {client.target}")
        if daemon is None:
            workers = start_workers(stack, env, work)

        pool = "demo" if daemon is not None else f"demo-{os.getpid()}-{secrets.token_hex(2)}"
        result = client.configure(pool, **model, budget_bytes=args.budget, page_size=PAGE_SIZE,
                                  context_length=CONTEXT_LENGTH)
        if not result.created:
            raise DemoFailed(f"pool {pool!r} already existed; the demo needs a fresh one")
        undropped = [pool]  # a failed run leaves no pool behind in a daemon it did not start
        if not args.keep:
            stack.callback(_drop_quietly, client, undropped)
        plan = result.plan
        say(f"configured pool {pool}: {plan.model_architecture} ({plan.architecture}), "
            f"{plan.num_pages} pages of {plan.page_size} tokens, backing "
            f"{format_size(plan.backing_bytes)}, fingerprint {result.fingerprint}")
        if args.pages > plan.num_pages:
            raise DemoFailed(f"--pages {args.pages} exceeds the pool's {plan.num_pages} pages; "
                             "lower --pages or raise --budget")

        token = token_from(args.token, args.token_file)
        # Over the workers' stdin, not their command line: ps would show it there.
        go = {"target": args.target, "pool": pool, "fingerprint": result.fingerprint,
              "pages": args.pages, "token": token}
        for w in workers.values():
            w.recv()  # ready: torch imported
        workers["writer"].send(go)
        wrote = workers["writer"].recv()
        say(f"writer (pid {workers['writer'].proc.pid}): lease {wrote['lease_id']}, pages "
            f"{wrote['pages']}, wrote {wrote['bytes']:,} B into {wrote['buffers']} K/V buffers "
            f"({wrote['sharing']} {wrote['path'] or ''})")
        workers["reader"].send({**go, "pages": wrote["pages"]})
        read = workers["reader"].recv()
        say(f"reader (pid {workers['reader'].proc.pid}): verified {read['verified']:,} B "
            f"byte for byte, {read['zeros']:,} B of untouched pages are zero")

        stats = client.stats(pool)
        p = stats.pool(pool)
        if p.attached != 2 or p.spaces["kv"].used != len(wrote["pages"]):
            raise DemoFailed(f"Stats show {p.attached} attached and {p.spaces['kv'].used} pages "
                             f"used; expected 2 and {len(wrote['pages'])}")
        for table in stats_tables(stats, pool):
            console.print(table)

        for w in workers.values():
            w.send("done")
        freed = workers["writer"].recv()["freed"]
        workers["reader"].recv()
        # Both have detached and the lease is closed; their exit is waited for at the end.
        p = client.stats(pool).pool(pool)
        if (p.attached, p.spaces["kv"].used) != (0, 0):
            raise DemoFailed(f"after the workers left: {p.attached} attached, "
                             f"{p.spaces['kv'].used} pages used; expected 0 and 0")
        say(f"workers detached; the writer freed {freed} pages and closed its lease")

        if not args.keep:
            dropped = client.drop(pool)
            undropped.clear()
            say(f"dropped pool {pool}: released {format_size(dropped.released_bytes)}")
            if wrote["sharing"] == "shm" and os.path.exists(wrote["path"]):
                raise DemoFailed(f"{wrote['path']} still exists after the pool was dropped")
        for w in workers.values():
            if (code := w.finish()) != 0:
                raise DemoFailed(f"the {w.role} exited with {code}:\n{w.stderr_tail()}")
        if args.keep:
            _keep(client, daemon, pool, say)
            return
        if daemon is not None:
            client.close()
            daemon.proc.send_signal(signal.SIGTERM)
            code = daemon.proc.wait(30)
            if code != 0:
                raise DemoFailed(f"kvpoold exited with {code}:\n{daemon.log_tail()}")
            left = daemon.leftovers()
            if left:
                raise DemoFailed(f"kvpoold left {left} in {daemon.shm_dir}")
            say(f"kvpoold stopped (exit 0); no kvpool-* file left in {daemon.shm_dir}")


def _drop_quietly(client: KVPoolClient, pools: list[str]) -> None:
    """Force-drop the pools still listed (cleanup after a failure; the daemon may be gone)."""
    for pool in pools:
        with contextlib.suppress(KVPoolError):
            client.drop(pool, force=True)


def _keep(client: KVPoolClient, daemon: OwnDaemon | None, pool: str, say: Any) -> None:
    """--keep: leave the pool; with the demo's own daemon, serve until Ctrl-C."""
    if daemon is None:
        say(f"kept pool {pool} at {client.target} (kvpool drop {pool} --target "
            f"{client.target} removes it)")
        return
    say(f"kept pool {pool}; kvpoold serves at {daemon.target} until Ctrl-C (try: kvpool stats "
        f"--target {daemon.target})")
    try:
        daemon.proc.wait()
    except KeyboardInterrupt:
        say("stopping kvpoold")


def _size(text: str) -> int:
    from kvpool.contract.sizes import parse_size  # pure: no torch

    try:
        return parse_size(text, field="budget")
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_demo(sub: Any, _common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``kvpool demo`` (torch is imported only when it runs).

    Its options are the common ones but for ``--target``: without it the demo starts its own
    daemon rather than using the per-user socket.
    """
    from kvpool.tools.cli_common import common_options

    common = common_options(target_help="a running daemon to use, unix:///path.sock or "
                                        "host:port (default: start kvpoold on a temporary "
                                        "socket, and stop it at the end)")
    p = sub.add_parser(
        "demo", parents=[common], help="daemon + writer + reader on one pool, checked",
        description="Start a daemon (or use --target), configure a real model's pool on a small "
                    "CPU budget, have a writer process fill KV pages and a reader process check "
                    "every byte through its own mapping, print Stats, and clean up. Exits 1 if "
                    "any check fails.",
    )
    p.add_argument("--model-config", type=Path, metavar="PATH",
                   help="a HF config.json (or its directory) or a kvpool spec (default: the "
                        "Qwen3-8B config shipped with kvpool)")
    p.add_argument("--budget", type=_size, default=DEFAULT_BUDGET, metavar="SIZE",
                   help="the pool's KV budget (default 32MiB; context length 4096, page 16)")
    p.add_argument("--pages", type=int, default=DEFAULT_PAGES, metavar="N",
                   help="KV pages the writer fills (default 8)")
    p.add_argument("--keep", action="store_true",
                   help="keep the pool (and the demo's own daemon, until Ctrl-C)")
    p.set_defaults(func=run_demo)
    return p

"""The client installs and runs without torch: ``pip install kvpool`` (no extras) into a fresh
venv, then that venv's ``kvpool`` CLI (stats, leases, top, configure, drop) against a real
daemon started from the test environment.

The venv is made once per session (about 10 s with a warm pip cache). The test skips only when
a venv cannot be created or pip cannot reach a package index; any other install failure fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import REPO, TINY_OPTIONS, TINY_SPEC, DaemonProcess, run_daemon, temp_dir

POOL = "notorch"
INSTALL_TIMEOUT_S = 540.0

# What pip prints when it cannot reach an index (no network, no proxy, no mirror); "(from
# versions: none)" is a requirement no index offered at all (a bad pin lists the versions seen).
UNREACHABLE = (
    "(from versions: none)",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "NewConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
)


@dataclass(frozen=True)
class ClientVenv:
    """A venv holding ``kvpool`` installed from this checkout with its base dependencies."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def kvpool(self) -> Path:
        return self.root / "bin" / "kvpool"

    def env(self) -> dict[str, str]:
        """This environment without anything pointing at the checkout or the test venv."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.root)
        return env

    def run(self, *args: str | Path, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``args`` with this venv's environment from its own directory (not the repo, so
        nothing is imported from the checkout by accident)."""
        return subprocess.run([str(a) for a in args], cwd=self.root, env=self.env(),
                              capture_output=True, text=True, timeout=timeout_s)


def source_copy(dest: Path) -> Path:
    """What ``pip install <repo>`` builds, copied out of the checkout: pip builds a local
    directory in place, and a ``build/`` left in the checkout (or shared with a concurrent run)
    could put stale modules into the wheel."""
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.so", "*.pyc")
    for name in ("client", "service"):
        shutil.copytree(REPO / name, dest / name, ignore=skip)
    for path in REPO.iterdir():
        if path.is_file() and (path.name in ("pyproject.toml", "README.md")
                               or path.name.startswith(("LICENSE", "NOTICE"))):
            shutil.copy2(path, dest / path.name)
    return dest


@pytest.fixture(scope="session")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> ClientVenv:
    """A fresh venv with ``pip install <checkout>`` (non-editable, no extras)."""
    base = tmp_path_factory.mktemp("client-venv")
    venv = ClientVenv(base / "venv")
    made = subprocess.run([sys.executable, "-m", "venv", str(venv.root)], capture_output=True,
                          text=True, timeout=120)
    if made.returncode != 0 or not venv.python.exists():
        pytest.skip(f"cannot create a venv with {sys.executable} -m venv: "
                    f"{(made.stderr or made.stdout).strip()[-500:]}")
    src = source_copy(base / "src")
    pip = venv.run(venv.python, "-m", "pip", "install", "--quiet",
                   "--disable-pip-version-check", src, timeout_s=INSTALL_TIMEOUT_S)
    if pip.returncode != 0:
        output = pip.stdout + pip.stderr
        unreachable = [line.strip() for line in output.splitlines()
                       if any(marker in line for marker in UNREACHABLE)]
        if unreachable:
            pytest.skip(f"pip cannot reach a package index: {unreachable[0][:400]}")
        pytest.fail(f"pip install {src} failed ({pip.returncode}):\n{output[-4000:]}")
    return venv


@pytest.fixture(scope="module")
def daemon_with_pool() -> Iterator[DaemonProcess]:
    """A daemon from the test environment (which has torch) with pool ``notorch`` and a lease
    holding 5 of its pages."""
    with (temp_dir() as path, run_daemon(path, budget="8MiB") as daemon,
          KVPoolClient(daemon.target) as client):
        client.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS)
        with client.lease("no-torch-engine", ttl_s=30.0) as lease:
            lease.allocate(POOL, "kv", 5)
            yield daemon


@pytest.mark.timeout(600)
def test_the_client_venv_has_no_torch_and_its_own_kvpool(client_venv: ClientVenv) -> None:
    no_torch = client_venv.run(client_venv.python, "-c", "import torch")
    assert no_torch.returncode != 0
    assert "No module named 'torch'" in no_torch.stderr
    where = client_venv.run(client_venv.python, "-c",
                            "import kvpool, kvpool.tools.cli, kvpool.clients.client, sys; "
                            "print(kvpool.__file__); "
                            "print(sorted(m for m in ('torch', 'prometheus_client', 'kvpoold') "
                            "if m in sys.modules))")
    assert where.returncode == 0, where.stderr
    path, loaded = where.stdout.splitlines()
    assert Path(path).is_relative_to(client_venv.root), path
    assert loaded == "[]"


@pytest.mark.timeout(600)
def test_the_client_cli_runs_without_torch(client_venv: ClientVenv,
                                           daemon_with_pool: DaemonProcess) -> None:
    target = daemon_with_pool.target
    kvpool = client_venv.kvpool

    stats = client_venv.run(kvpool, "stats", "--json", "--target", target)
    assert stats.returncode == 0, stats.stderr
    pools = json.loads(stats.stdout)["pools"]
    assert [p["name"] for p in pools] == [POOL]

    leases = client_venv.run(kvpool, "leases", "--json", "--target", target)
    assert leases.returncode == 0, leases.stderr
    (lease,) = json.loads(leases.stdout)
    assert lease["name"] == "no-torch-engine"
    assert POOL in lease["held"]

    top = client_venv.run(kvpool, "top", "--once", "--target", target)
    assert top.returncode == 0, top.stderr
    assert POOL in top.stdout

    spec = client_venv.root / "tiny.json"
    spec.write_text(json.dumps(TINY_SPEC))
    configured = client_venv.run(kvpool, "configure", "cli-pool", "--spec", spec, "--budget",
                                 "1MiB", "--page-size", "16", "--max-running-requests", "8",
                                 "--target", target)
    assert configured.returncode == 0, configured.stderr
    assert "cli-pool: created" in configured.stdout
    dropped = client_venv.run(kvpool, "drop", "cli-pool", "--target", target)
    assert dropped.returncode == 0, dropped.stderr
    assert dropped.stdout.startswith("dropped cli-pool")

    # the classes of the one error table reach the CLI here too
    missing = client_venv.run(kvpool, "stats", "--target",
                              f"unix://{client_venv.root}/none.sock")
    assert missing.returncode == 1
    assert "error (UNAVAILABLE)" in missing.stderr


@pytest.mark.timeout(600)
def test_kvpoold_serve_without_the_server_extra_says_what_to_install(
        client_venv: ClientVenv) -> None:
    """The base install carries the kvpoold command too; without torch it refuses to serve
    with one line naming the extra, after checking its flags, not with a traceback."""
    kvpoold = client_venv.kvpool.with_name("kvpoold")
    out = client_venv.run(kvpoold, "serve", "--listen",
                          f"unix://{client_venv.root}/serve.sock", "--shm-dir",
                          str(client_venv.root))
    assert out.returncode == 1, out.stderr
    assert "pip install -e '.[server]'" in out.stderr and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("kvpoold serve: error (FAILED_PRECONDITION): kvpoold serve needs the "
                           "server extra (not installed: torch, prometheus_client, "
                           "grpc_reflection, xxhash): from the repository root, pip install -e "
                           "'.[server]'"), line
    assert "whl[server]" in line and "`kvpoold plan` only" in line


@pytest.mark.timeout(600)
def test_kvpoold_plan_works_without_the_server_extra(client_venv: ClientVenv) -> None:
    """Planning is pure (no torch): the client-only install plans a pool as the daemon would,
    so the one line ``kvpoold serve`` prints there can say ``kvpoold plan`` works."""
    # Qwen3-8B: 147,456 B per token; 64 MiB holds 455 tokens -> 28 pages of 16 (448 tokens)
    out = client_venv.run(client_venv.kvpool.with_name("kvpoold"), "plan", "--model-config",
                          REPO / "client" / "kvpool" / "data" / "qwen3-8b.json", "--budget",
                          "64MiB", "--page-size", "16", "--context-length", "256", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert (plan["model_architecture"], plan["cell_size_bytes"]) == ("Qwen3ForCausalLM", 147_456)
    assert (plan["num_pages"], plan["max_total_num_tokens"]) == (28, 448)

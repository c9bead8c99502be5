"""The wheel, as README.md ("Installing from source") builds it: ``pip wheel --no-deps -w dist .``
from a copy of the checkout, then ``pip install "dist/kvpool-1.0.0-py3-none-any.whl[server]"``
into a fresh venv (torch first, as the README says), and the daemon's commands from there.

About a minute with torch's wheel in pip's cache. Skips only when a venv cannot be made or pip
cannot reach a package index.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvpool import WIRE_CONTRACT, __version__
from tests.e2e.test_client_without_torch import UNREACHABLE, ClientVenv, source_copy

WHEEL = f"kvpool-{__version__}-py3-none-any.whl"
TORCH = "torch==2.13.0"
MODEL = "kvpool/data/qwen3-8b.json"


def pip(venv: ClientVenv, *args: str | Path) -> None:
    out = venv.run(venv.python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                   *args, timeout_s=540)
    if out.returncode != 0:
        text = out.stdout + out.stderr
        if any(marker in text for marker in UNREACHABLE):
            pytest.skip("pip cannot reach a package index")
        pytest.fail(f"pip install {' '.join(map(str, args))} failed:\n{text[-4000:]}")


def packaged_sources(src: Path) -> set[str]:
    """What the wheel must hold: every file of the two packages in the source tree (modules,
    generated stubs and their .pyi, py.typed, data files), by its path inside the wheel."""
    files = set()
    for root in (src / "client", src / "service"):
        for path in root.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.add(path.relative_to(root).as_posix())
    return files


@pytest.mark.timeout(900)
def test_the_wheel_builds_installs_with_its_extra_and_serves_the_commands(
        tmp_path: Path) -> None:
    src = source_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                            "--disable-pip-version-check", "-w", str(dist), "."], cwd=src,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    assert [p.name for p in dist.iterdir()] == [WHEEL]

    with zipfile.ZipFile(dist / WHEEL) as whl:
        names = set(whl.namelist())
        metadata = whl.read(f"kvpool-{__version__}.dist-info/METADATA").decode()
        entry_points = whl.read(f"kvpool-{__version__}.dist-info/entry_points.txt").decode()
    expected = packaged_sources(src)
    assert {"kvpool/v1/kvpool_pb2.py", "kvpool/v1/kvpool_pb2.pyi", "kvpool/v1/kvpool_pb2_grpc.py",
            "kvpool/py.typed", "kvpoold/py.typed", MODEL} <= expected
    assert expected - names == set(), "files of the packages missing from the wheel"
    # README.md quotes the count (tests/unit/test_doc_numbers.py checks it without a build).
    readme = (src / "README.md").read_text()
    assert f"makes the same {len(names)} files" in readme, len(names)
    assert not {n for n in names if n.startswith(("tests/", "examples/", "bench/"))}
    assert "Provides-Extra: server" in metadata and "Provides-Extra: nixl" in metadata
    assert "kvpoold = kvpoold.main:main" in entry_points
    assert "kvpool = kvpool.tools.cli:main" in entry_points

    venv = ClientVenv(tmp_path / "venv")
    made = subprocess.run([sys.executable, "-m", "venv", str(venv.root)], capture_output=True,
                          text=True, timeout=120)
    if made.returncode != 0:
        pytest.skip(f"cannot create a venv: {(made.stderr or made.stdout)[-500:]}")
    pip(venv, TORCH)
    pip(venv, f"{dist / WHEEL}[server]")

    for command in ("kvpoold", "kvpool"):
        out = venv.run(venv.root / "bin" / command, "--version")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"{command} {__version__} (wire contract {WIRE_CONTRACT})"
    where = venv.run(venv.python, "-c",
                     "import kvpool, kvpoold.server.run, torch, prometheus_client, "
                     "grpc_reflection, xxhash; print(kvpool.__file__); print(torch.__version__)")
    assert where.returncode == 0, where.stderr
    path, torch_version = where.stdout.split()
    assert Path(path).is_relative_to(venv.root) and torch_version.startswith("2.13.0")

    # kvpoold plan on the config the wheel carries, as the checkout plans it
    model = venv.root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
        / "site-packages" / MODEL
    assert model.is_file()
    flags = ["plan", "--model-config", str(model), "--budget", "1GiB", "--page-size", "16",
             "--context-length", "4096", "--json"]
    planned = venv.run(venv.root / "bin" / "kvpoold", *flags)
    assert planned.returncode == 0, planned.stderr
    here = subprocess.run([sys.executable, "-m", "kvpoold.main", *flags], capture_output=True,
                          text=True, timeout=120, cwd=src.parent,
                          env={"PYTHONPATH": f"{src / 'client'}:{src / 'service'}",
                               "PATH": "/usr/bin:/bin"})
    assert here.returncode == 0, here.stderr
    plan = json.loads(planned.stdout)
    assert plan == json.loads(here.stdout)
    assert "Qwen3ForCausalLM" in planned.stdout

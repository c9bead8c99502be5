"""The side venvs' setup scripts and the scripts that reuse them, run for real on fake venvs:
the ready marker decides, an unfinished venv is made again, ``--reuse`` keeps a finished one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

SETUPS = {"sglang": ("tests/sglang/setup_venv.sh", "KVPOOL_SGLANG_VENV", ".kvpool-sglang-ready"),
          "vllm": ("tests/vllm/setup_venv.sh", "KVPOOL_VLLM_VENV", ".kvpool-vllm-ready")}


def unfinished_venv(path: Path) -> Path:
    """What a Ctrl-C during the first setup leaves: a virtualenv with a python, no marker."""
    (path / "bin").mkdir(parents=True)
    (path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (path / "bin" / "python").symlink_to("/bin/true")
    return path


def want_line(engine: str, checkout: Path) -> str:
    """The marker line the setup script writes, as if made from ``checkout``."""
    setup = SETUPS[engine][0]
    text = (REPO / setup).read_text()
    # The package list is whatever the script's `want=` line expands to: run the script's own
    # lines up to its first step under bash, with its path where it asks for its own.
    head = text[:text.index("\nvenv_begin")].replace("${BASH_SOURCE[0]}", str(REPO / setup))
    out = subprocess.run(["bash", "-c", head + '\nprintf %s "$want"'], capture_output=True,
                         text=True, check=True).stdout
    assert out.endswith(f" kvpool-editable:{REPO}"), out[-200:]
    return out[: -len(str(REPO))] + str(checkout)


@pytest.mark.parametrize("engine", sorted(SETUPS))
def test_unfinished_venv_is_removed_and_made_again(engine: str, tmp_path: Path) -> None:
    setup, var, marker = SETUPS[engine]
    venv = unfinished_venv(tmp_path / "side")
    # PYTHON=false: the script gets as far as making the new venv, and stops there (no network).
    out = subprocess.run(["bash", str(REPO / setup)], env={**os.environ, var: str(venv),
                         "PYTHON": "false"}, capture_output=True, text=True)
    assert f"removing the unfinished or outdated venv {venv}" in out.stdout
    assert not (venv / "bin" / "python").exists()
    assert out.returncode != 0


@pytest.mark.parametrize("engine", sorted(SETUPS))
def test_reuse_takes_a_finished_venv_from_another_checkout(engine: str, tmp_path: Path) -> None:
    setup, var, marker = SETUPS[engine]
    venv = unfinished_venv(tmp_path / "side")
    (venv / marker).write_text(want_line(engine, Path("/elsewhere/kvpool")))
    env = {**os.environ, var: str(venv), "PYTHON": "false"}
    out = subprocess.run(["bash", str(REPO / setup), "--reuse"], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert "made from the checkout at /elsewhere/kvpool); used as it is" in out.stdout
    assert (venv / "bin" / "python").exists()
    # Without --reuse (CI's call) another checkout's venv is made again for this one.
    out = subprocess.run(["bash", str(REPO / setup)], env=env, capture_output=True, text=True)
    assert "removing the unfinished or outdated venv" in out.stdout
    # An outdated package list is made again even with --reuse.
    venv = unfinished_venv(tmp_path / "old")
    (venv / marker).write_text("torch==2.0.0 kvpool-editable:/elsewhere/kvpool")
    out = subprocess.run(["bash", str(REPO / setup), "--reuse"], env={**env, var: str(venv)},
                         capture_output=True, text=True)
    assert "removing the unfinished or outdated venv" in out.stdout


def test_unknown_argument_is_refused(tmp_path: Path) -> None:
    setup, var, _ = SETUPS["sglang"]
    out = subprocess.run(["bash", str(REPO / setup), "--resue"],
                         env={**os.environ, var: str(tmp_path / "none")},
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "unknown argument --resue (the only one is --reuse)" in out.stderr
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("example", ["examples/two_models/run.sh", "examples/sglang_cpu/run.sh"])
def test_examples_repair_an_unfinished_side_venv(example: str, tmp_path: Path) -> None:
    """The examples trust the marker, not bin/python: an interrupted first run's venv goes
    through setup_venv.sh again (which here stops at making the venv: PYTHON=false)."""
    main = Path(os.environ.get("KVPOOL_VENV", REPO / ".venv"))
    if not (main / "bin" / "kvpoold").exists():
        pytest.skip(f"no daemon venv at {main}")
    venv = unfinished_venv(tmp_path / "side")
    out = subprocess.run(["bash", str(REPO / example)], capture_output=True, text=True,
                         env={**os.environ, "KVPOOL_VENV": str(main),
                              "KVPOOL_SGLANG_VENV": str(venv), "PYTHON": "false"})
    assert f"removing the unfinished or outdated venv {venv}" in out.stdout
    assert out.returncode != 0
    assert "kvpoold serve" not in out.stdout and "a daemon, two engines" not in out.stdout

"""The side venvs' setup, run for real without the network: the ready marker decides (an
unfinished venv is made again, ``--reuse`` keeps a finished one) and where the CPU torch comes
from (tests/torch_wheel.py: a local wheel, PyTorch's CPU index, or a one-line stop)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.torch_wheel import Target

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
    setup, var, _ = SETUPS[engine]
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


# -- where the CPU torch comes from (tests/torch_wheel.py) --------------------------------------

TARGET = Target.this_interpreter()
TAGS = f"{TARGET.python_tag}-{TARGET.python_tag}-manylinux_2_28_{TARGET.machine}.whl"
CPU, CUDA, PYPI = f"torch-2.13.0+cpu-{TAGS}", f"torch-2.13.0+cu128-{TAGS}", f"torch-2.13.0-{TAGS}"
OTHER_PY = f"torch-2.13.0+cpu-cp39-cp39-manylinux_2_28_{TARGET.machine}.whl"


def chooser(tmp: Path, index: str, **env: str) -> subprocess.CompletedProcess[str]:
    """tests/torch_wheel.py as side_venv_lib.sh runs it, with pip's configuration hidden
    (PIP_CONFIG_FILE=/dev/null: no config file is read) unless ``env`` sets its own."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("PIP_") and k != "KVPOOL_TORCH_WHEEL"}
    full = {**base, "PIP_CONFIG_FILE": os.devnull, "KVPOOL_TORCH_INDEX": index, **env}
    return subprocess.run([sys.executable, str(REPO / "tests" / "torch_wheel.py"),
                           "torch==2.13.0"], env=full, capture_output=True, text=True,
                          cwd=tmp)


def wheels(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


@pytest.fixture
def cpu_index(tmp_path: Path) -> Iterator[str]:
    """A real HTTP server on port 0 serving a PEP 503 folder ``torch/``: the index answers."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<a>torch-2.13.0+cpu</a>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


def closed_port_url() -> str:
    """An index that does not answer: a port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/whl/cpu"


def test_a_local_cpu_wheel_in_pips_find_links_comes_first(tmp_path: Path, cpu_index: str) -> None:
    folder = wheels(tmp_path / "wheels", CUDA, PYPI, OTHER_PY, CPU)
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = /nowhere\n    file://{folder}\n")
    out = chooser(tmp_path, cpu_index, PIP_CONFIG_FILE=str(conf))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"the CPU wheel in pip's find-links {folder}: {CPU}"
    assert lines[1:] == ["--no-deps", str(folder / CPU)]
    # The same folder through the environment (PIP_FIND_LINKS), as on this project's machines.
    out = chooser(tmp_path, cpu_index, PIP_FIND_LINKS=str(folder))
    assert out.stdout.splitlines()[1:] == ["--no-deps", str(folder / CPU)]


def test_kvpool_torch_wheel_names_the_wheel(tmp_path: Path) -> None:
    folder = wheels(tmp_path / "mine", CPU)
    other = wheels(tmp_path / "found", CPU)
    out = chooser(tmp_path, closed_port_url(), KVPOOL_TORCH_WHEEL=str(folder / CPU),
                  PIP_FIND_LINKS=str(other))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"the CPU wheel KVPOOL_TORCH_WHEEL names: {folder / CPU}",
                                       "--no-deps", str(folder / CPU)]
    # Its folder will do too; a CUDA wheel it names is refused, never installed.
    assert chooser(tmp_path, closed_port_url(),
                   KVPOOL_TORCH_WHEEL=str(folder)).stdout.splitlines()[2] == str(folder / CPU)
    cuda = wheels(tmp_path / "cuda", CUDA)
    out = chooser(tmp_path, closed_port_url(), KVPOOL_TORCH_WHEEL=str(cuda / CUDA))
    assert out.returncode == 1 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1
    assert f"KVPOOL_TORCH_WHEEL={cuda / CUDA} holds no CPU wheel of torch 2.13.0" in out.stderr
    assert "a CUDA build (+cu128)" in out.stderr


def test_no_local_wheel_takes_the_cpu_index_with_the_cpu_build_pinned(
        tmp_path: Path, cpu_index: str) -> None:
    folder = wheels(tmp_path / "wheels", CUDA, PYPI)  # only CUDA builds on disk
    out = chooser(tmp_path, cpu_index, PIP_FIND_LINKS=str(folder))
    assert out.returncode == 0, out.stderr
    pin = "torch==2.13.0" if TARGET.system == "macosx" else "torch==2.13.0+cpu"
    assert out.stdout.splitlines() == [f"{pin} from PyTorch's CPU wheel index {cpu_index}",
                                       "--no-deps", "--index-url", cpu_index, pin]


def test_neither_source_stops_with_one_line(tmp_path: Path) -> None:
    folder = wheels(tmp_path / "wheels", PYPI)
    index = closed_port_url()
    out = chooser(tmp_path, index, PIP_FIND_LINKS=str(folder))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    line = out.stderr.strip()
    assert line.startswith(f"no CPU wheel of torch 2.13.0 for {TARGET.describe()}: "
                           f"none in pip's find-links ({folder}); skipped {folder / PYPI} "
                           "(a CUDA build (PyPI's, no +cpu)), and " + index + " did not answer")
    assert line.endswith(f"download torch-2.13.0+cpu-{TARGET.python_tag}-*.whl from "
                         "https://download.pytorch.org/whl/cpu/torch/ onto this machine and run "
                         "again with KVPOOL_TORCH_WHEEL=<its path>")
    # pip with no find-links at all (a fresh machine) says so.
    assert "pip has no local find-links folder, and" in chooser(tmp_path, index).stderr


def test_setup_venv_stops_at_once_without_a_cpu_wheel(tmp_path: Path) -> None:
    """The whole script on a machine like a fresh one (pip knows no local folder, the CPU
    index does not answer): the one line, the fresh venv not marked ready, nothing else run."""
    venv = tmp_path / "side"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, KVPOOL_TORCH_INDEX=closed_port_url(),
               KVPOOL_SGLANG_VENV=str(venv), PYTHON=sys.executable)
    out = subprocess.run(["bash", str(REPO / "tests/sglang/setup_venv.sh")], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"setup_venv: no CPU wheel of torch 2.13.0 for {TARGET.describe()}: pip has no local "
        f"find-links folder, and {env['KVPOOL_TORCH_INDEX']} did not answer ([Errno 111] "
        f"Connection refused); download torch-2.13.0+cpu-{TARGET.python_tag}-*.whl from "
        "https://download.pytorch.org/whl/cpu/torch/ onto this machine and run again with "
        "KVPOOL_TORCH_WHEEL=<its path>"]
    assert "installing" not in out.stdout
    assert not (venv / ".kvpool-sglang-ready").exists()


def test_ctrl_c_during_a_pip_step_is_one_line_with_the_logs_path(tmp_path: Path) -> None:
    """An index that answers the chooser's probe and then never answers pip: pip waits, the
    script has said which step it is on (the fact waited for), Ctrl-C goes to its process group.
    One line names the log; nothing of pip's log is dumped; no marker is written."""
    release = threading.Event()
    answered: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if answered:
                release.wait()  # pip's request: never answered while the test runs
                return
            answered.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html></html>")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    venv = tmp_path / "side"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, KVPOOL_SGLANG_VENV=str(venv), PYTHON=sys.executable,
               KVPOOL_TORCH_INDEX=f"http://127.0.0.1:{server.server_address[1]}")
    proc = subprocess.Popen(["bash", str(REPO / "tests/sglang/setup_venv.sh")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "from PyTorch's CPU wheel index" in line:
                break
        else:
            raise AssertionError(f"setup_venv.sh ended before its pip step: {proc.stderr.read()}")
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        release.set()
        server.shutdown()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [
        f"setup_venv: interrupted; {venv} is unfinished (the next run makes it again); pip's "
        f"log: {venv}/pip.log"], err
    assert not (venv / ".kvpool-sglang-ready").exists()

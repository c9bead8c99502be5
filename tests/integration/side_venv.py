"""The SGLang side virtualenv (``tests/sglang/setup_venv.sh`` makes it; ``.ci/run`` runs it
first): where it is, how a test finds its python, and the environment of its children. Shared
by the parity test and the tests in ``tests/integration/sglang/``."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from tests.conftest import REPO
from tests.procs import with_default_sigint

SGLANG_DIR = REPO / "tests" / "sglang"
VENV = Path(os.environ.get("KVPOOL_SGLANG_VENV", REPO / ".venv-sglang"))


def python_or_skip(venv: Path, setup: str, require_env: str, marker: str) -> Path:
    """``venv``'s python, or skip naming ``setup`` (the script that makes it); fail instead
    under ``require_env=1`` (``.ci/run`` sets it: there the side venv must exist). A venv
    without ``marker`` (the file ``setup`` writes last) is an unfinished one and counts as
    missing: its python is there, its packages may not be."""
    python = venv / "bin" / "python"
    missing = ""
    if not python.exists():
        missing = f"no side venv at {venv}: run {setup} (.ci/run does)"
    elif not (venv / marker).is_file():
        missing = (f"the side venv at {venv} is unfinished (no {marker}; an interrupted "
                   f"setup): run {setup}, which makes it again")
    if missing:
        if os.environ.get(require_env) == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    return python


def sglang_python_or_skip() -> Path:
    """The SGLang side venv's python, or skip (fail under ``KVPOOL_REQUIRE_SGLANG=1``)."""
    return python_or_skip(VENV, "tests/sglang/setup_venv.sh", "KVPOOL_REQUIRE_SGLANG",
                          ".kvpool-sglang-ready")


def sglang_env(**extra: str) -> dict[str, str]:
    """The environment of a side-venv child: the GPU-package import stubs and this checkout's
    ``client/`` on PYTHONPATH (the side venv's editable kvpool may point at another checkout),
    no network for Hugging Face, the main venv's VIRTUAL_ENV removed; ``extra`` on top (e.g.
    ``KVPOOL_TARGET``, ``KVPOOL_POOL``, ``SGLANG_PLATFORM``)."""
    path = os.pathsep.join((str(SGLANG_DIR / "stubs"), str(REPO / "client")))
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env


def wait_until(what: str, check: Callable[[], Any], timeout_s: float,
               interval_s: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after timeout."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not so after {timeout_s} s (last: {last!r})")


def interrupted_when(script: Path, env: dict[str, str], what: str,
                     ready: Callable[[str], Any], timeout_s: float
                     ) -> tuple[int, str, str, Any]:
    """Run ``script`` as a terminal's foreground job would (its own process group, SIGINT at
    its default), wait until ``ready(stdout so far)`` returns something truthy (it failing
    with the output if the script ends first), then send SIGINT to the group as Ctrl-C does.

    Returns:
        ``(exit status, stdout, stderr, what ready returned)``.
    """
    proc = subprocess.Popen(with_default_sigint([str(script)]), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout),  # type: ignore[arg-type]
                              daemon=True)
    reader.start()

    def check() -> Any:
        assert proc.poll() is None, "the script ended first:\n" + "".join(lines)[-4000:]
        return ready("".join(lines))

    try:
        got = wait_until(what, check, timeout_s, interval_s=0.2)
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=30)
    return rc, "".join(lines), proc.stderr.read(), got  # type: ignore[union-attr]



class _HasId(Protocol):
    @property
    def id(self) -> str: ...


_CaseT = TypeVar("_CaseT", bound=_HasId)


def selected_cases(request: pytest.FixtureRequest, cases: Sequence[_CaseT]) -> list[_CaseT]:
    """The cases among ``cases`` that this session runs from the requesting module (after
    ``-k`` and node ids): a module fixture that runs an engine once for its whole matrix asks
    for these only, so a subset of the cases costs the engine a subset of the work."""
    chosen = {item.callspec.params["case"].id for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")
              and "case" in item.callspec.params}
    return [c for c in cases if c.id in chosen]

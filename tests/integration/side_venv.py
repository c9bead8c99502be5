"""The SGLang side virtualenv (``tests/sglang/setup_venv.sh`` makes it; ``.ci/run`` runs it
first): where it is, how a test finds its python, and the environment of its children. Shared
by the parity test and the tests in ``tests/integration/sglang/``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import REPO

SGLANG_DIR = REPO / "tests" / "sglang"
VENV = Path(os.environ.get("KVPOOL_SGLANG_VENV", REPO / ".venv-sglang"))


def sglang_python_or_skip() -> Path:
    """The side venv's python, or skip (fail under ``KVPOOL_REQUIRE_SGLANG=1``)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        missing = f"no SGLang side venv at {VENV}: run tests/sglang/setup_venv.sh (.ci/run does)"
        if os.environ.get("KVPOOL_REQUIRE_SGLANG") == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    return python


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

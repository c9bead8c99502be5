"""The vLLM side virtualenv (``tests/vllm/setup_venv.sh`` makes it; ``.ci/run`` runs it after
the SGLang one): where it is, how a test finds its python, and the environment of its
children. Shared by the vLLM parity test and, later, the vLLM engine tests."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import REPO
from tests.integration.side_venv import python_or_skip

VLLM_DIR = REPO / "tests" / "vllm"
VENV = Path(os.environ.get("KVPOOL_VLLM_VENV", REPO / ".venv-vllm"))


def vllm_python_or_skip() -> Path:
    """The vLLM side venv's python, or skip (fail under ``KVPOOL_REQUIRE_VLLM=1``)."""
    return python_or_skip(VENV, "tests/vllm/setup_venv.sh", "KVPOOL_REQUIRE_VLLM",
                          ".kvpool-vllm-ready")


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment of a side-venv child: vLLM on its CPU platform, this checkout's
    ``client/`` on PYTHONPATH (the side venv's editable kvpool may point at another checkout),
    no network for Hugging Face, the main venv's VIRTUAL_ENV removed; ``extra`` on top."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "client"), "HF_HUB_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env

"""Whether a side venv is finished: its python, and the ready marker its setup writes last."""

from __future__ import annotations

from pathlib import Path

SGLANG_MARKER = ".kvpool-sglang-ready"  # what tests/sglang/setup_venv.sh writes last
VLLM_MARKER = ".kvpool-vllm-ready"  # what tests/vllm/setup_venv.sh writes last


def venv_problem(venv: Path, marker: str, setup: str) -> str | None:
    """Why ``venv`` cannot run a bench's engine, or None when it can.

    Args:
        venv: the side venv's directory.
        marker: the file ``setup`` writes in it once every package is in.
        setup: the script that makes (or repairs) it, as the user runs it.

    Returns:
        One line naming the venv and ``setup``, or None when its python and marker are there.
        A python without the marker is an interrupted setup: its packages may be missing.
    """
    if not (venv / "bin" / "python").exists():
        return f"no side venv at {venv}: run {setup}"
    if not (venv / marker).is_file():
        return (f"the side venv at {venv} is unfinished (no {marker}; an interrupted setup): "
                f"run {setup}, which makes it again")
    return None

"""Fixtures for the tests that run SGLang 0.5.23 itself, with the kvpool plugin, in the side
virtualenv (``tests/sglang/setup_venv.sh`` makes it; ``.ci/run`` runs it first).

Without the side venv these tests skip, saying why; with ``KVPOOL_REQUIRE_SGLANG=1`` (as
``.ci/run`` sets) its absence fails them instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess, run_daemon, temp_dir
from tests.integration.side_venv import sglang_python_or_skip


@pytest.fixture(scope="module")
def sglang_python() -> Path:
    return sglang_python_or_skip()


@pytest.fixture(scope="module")
def sglang_daemon() -> Iterator[DaemonProcess]:
    """A kvpoold (this checkout, the main venv) on a fresh socket, for one test module."""
    with temp_dir("kvp-sgl-") as d, run_daemon(d, budget="512MiB") as daemon:
        yield daemon


@pytest.fixture(scope="module", autouse=True)
def sweep_semaphores() -> Iterator[None]:
    """SGLang's processes make named POSIX semaphores (``/dev/shm/sem.mp-*``, Python's
    multiprocessing); the ones SIGKILLed here (SGLang's own shutdown SIGKILLs its scheduler)
    never unlink theirs. Remove those this module's engines left: a process that still has one
    open keeps it (unlink only drops the name)."""
    shm = Path("/dev/shm")
    before = set(shm.glob("sem.mp-*"))
    yield
    for path in set(shm.glob("sem.mp-*")) - before:
        path.unlink(missing_ok=True)

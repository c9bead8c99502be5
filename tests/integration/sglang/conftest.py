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


# What SGLang's processes leave in /dev/shm when they are SIGKILLed (SGLang's own shutdown
# SIGKILLs its scheduler): named POSIX semaphores of Python's multiprocessing, and the load
# snapshot files of SGLang's scheduler (managers/load_snapshot.py), 16 KiB each.
SGLANG_SHM_LEFTOVERS = ("sem.mp-*", "sglang_loads_*")


@pytest.fixture(scope="module", autouse=True)
def sweep_shm_leftovers() -> Iterator[None]:
    """Remove the /dev/shm files this module's engines left (SGLANG_SHM_LEFTOVERS); files that
    were there before stay. A process that still has one open keeps it (unlink only drops the
    name)."""
    shm = Path("/dev/shm")

    def leftovers() -> set[Path]:
        return {p for pattern in SGLANG_SHM_LEFTOVERS for p in shm.glob(pattern)}

    before = leftovers()
    yield
    for path in leftovers() - before:
        path.unlink(missing_ok=True)

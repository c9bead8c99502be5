"""SGLang's own allocator unit tests (their ``test_allocator_cpu.py``, unchanged) on kvpool's
paged allocator, held against the same file on SGLang's own allocator.

``tests/sglang/own_allocator_tests.py`` runs their file in the side venv twice: once with
SGLang's platform as SGLang resolves it alone (its own ``PagedTokenToKVPoolAllocator``), once
with kvpool's plugin active (``KVPOOL_POOL`` names a pool in a real daemon started here), where
the paged allocator SGLang's platform gives, and so the class their tests build, is kvpool's
``PagedAllocator`` taking its pages from daemon leases. Their file is read from where it is
found (:func:`their_file`), never copied into this tree.

The file's cases that exercise a paged allocator are ``TestPagedAllocatorCPU`` and
``TestPagedAllocatorDebugModeCPU`` (19); the rest run SGLang's token allocator and helpers in
both runs. Six cases call APIs SGLang 0.5.23 lacks (:data:`NOT_IN_SGLANG_0_5_23`) and fail on
its own allocator; every other case must pass on both, with the same outcome per case.

Skipped, saying why, without the side venv (required under ``KVPOOL_REQUIRE_SGLANG=1``, as
``.ci/run`` sets) or without their file (required under ``KVPOOL_REQUIRE_SGLANG_SOURCE=1``:
the sglang wheel ships no tests and PyPI has no 0.5.23 sdist, so CI, which reaches only the
package index, cannot have it; run it where a source tree of SGLang is, with
``KVPOOL_SGLANG_SOURCE``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import REPO, TINY_SPEC, DaemonProcess
from tests.integration.side_venv import VENV, sglang_env

RUNNER = REPO / "tests" / "sglang" / "own_allocator_tests.py"
# Where their file sits in SGLang's source tree (a checkout, or an unpacked sdist, of 0.5.23).
THEIR_PATH = Path("test") / "registered" / "unit" / "mem_cache" / "test_allocator_cpu.py"
SOURCE_ENV = "KVPOOL_SGLANG_SOURCE"
# Their file is not on any index CI reaches (the wheel ships no tests, PyPI has no 0.5.23
# sdist): it is required only where this is set (a machine with a source tree of SGLang).
REQUIRE_SOURCE_ENV = "KVPOOL_REQUIRE_SGLANG_SOURCE"
# Page size 4 as their tests use; 2 MiB of TINY_SPEC pages (1 KiB each) is ~2,000 pages: every
# paged allocator their tests build (a quota of at most 16 pages each) keeps its lease, and
# its pages, until the runner exits.
POOL = "own4"
PAGE_SIZE = 4
POOL_BYTES = 2 << 20
PAGED_CLASSES = ("TestPagedAllocatorCPU.", "TestPagedAllocatorDebugModeCPU.")
# Their cases that call what SGLang 0.5.23 does not have (the file is newer than the wheel):
# they fail on SGLang's own allocator with this exception, and on kvpool's alike.
NOT_IN_SGLANG_0_5_23 = {
    "TestBaseAllocatorNotImplemented.test_get_cpu_copy_raises": "TypeError",
    "TestBaseAllocatorNotImplemented.test_load_cpu_copy_raises": "TypeError",
    "TestTokenAllocatorBackupRestore.test_backup_is_snapshot_not_reference": "AttributeError",
    "TestTokenAllocatorBackupRestore.test_restore_reverts_alloc": "AttributeError",
    "TestTokenAllocatorBackupRestore.test_restore_reverts_free": "AttributeError",
    "TestPagedAllocatorCPU.test_restore_after_alloc": "AttributeError",
}


def their_file_candidates() -> list[Path]:
    """Where their file may be, first found wins: under ``KVPOOL_SGLANG_SOURCE`` (SGLang's
    source tree), in the side venv's installed ``sglang`` package (should a wheel ship its
    tests), under ``shared/sglang`` beside the checkout (the project's shared files)."""
    out = []
    if os.environ.get(SOURCE_ENV):
        out.append(Path(os.environ[SOURCE_ENV]) / THEIR_PATH)
    for package in sorted(VENV.glob("lib/python3*/site-packages/sglang")):
        out.extend(sorted(package.rglob(THEIR_PATH.name)))
    out.append(REPO.parent / "shared" / "sglang" / THEIR_PATH)
    return out


@pytest.fixture(scope="module")
def their_file(sglang_python: Path) -> Path:
    """SGLang's ``test_allocator_cpu.py``, or skip (fail under ``KVPOOL_REQUIRE_SGLANG=1``)."""
    candidates = their_file_candidates()
    for path in candidates:
        if path.is_file():
            return path
    missing = (f"SGLang's {THEIR_PATH} not found (looked at: "
               f"{', '.join(map(str, candidates))}): the sglang wheel does not ship its "
               f"tests; set {SOURCE_ENV} to a source tree of SGLang 0.5.23")
    if os.environ.get(REQUIRE_SOURCE_ENV) == "1":
        pytest.fail(missing)
    pytest.skip(missing)


def run_their_tests(python: Path, path: Path, allocator: str, **env: str) -> dict[str, Any]:
    """The runner's report of their file on ``allocator`` (``sglang`` or ``kvpool``)."""
    child = sglang_env(**env)
    child.pop("SGLANG_DEBUG_MEMORY_POOL", None)  # their debug cases set it themselves
    proc = subprocess.run([str(python), str(RUNNER), "--tests", str(path),
                           "--allocator", allocator],
                          env=child, cwd=REPO, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"their tests on {allocator}'s allocator: the runner exited "
                    f"{proc.returncode}:\n{proc.stderr[-6000:]}")
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


@pytest.fixture(scope="module")
def runs(sglang_python: Path, their_file: Path,
         sglang_daemon: DaemonProcess) -> dict[str, dict[str, Any]]:
    """Their file on SGLang's allocator, then on kvpool's (a pool in the daemon)."""
    with KVPoolClient(sglang_daemon.target) as client:
        client.configure(POOL, spec=TINY_SPEC, budget_bytes=POOL_BYTES, page_size=PAGE_SIZE,
                         max_running_requests=8)
    return {
        "sglang": run_their_tests(sglang_python, their_file, "sglang",
                                  KVPOOL_POOL="", SGLANG_PLATFORM=""),
        "kvpool": run_their_tests(sglang_python, their_file, "kvpool",
                                  KVPOOL_TARGET=sglang_daemon.target, KVPOOL_POOL=POOL,
                                  SGLANG_PLATFORM="kvpool"),
    }


def outcomes(report: dict[str, Any]) -> dict[str, str]:
    return {case: c["outcome"] for case, c in report["cases"].items()}


def exception_name(case: dict[str, Any]) -> str:
    """The cause's exception class, without its module (``TypeError``, ``InvalidArgument``)."""
    return (case["error"] or "").split(":")[0].rsplit(".", 1)[-1]


def failures(report: dict[str, Any]) -> dict[str, str]:
    """Each case that did not pass, with its exception (or outcome) and where it failed."""
    return {case: f"{c['outcome']}: {c['error']}" for case, c in report["cases"].items()
            if c["outcome"] != "passed"}


def test_their_tests_build_each_allocator(runs: dict[str, dict[str, Any]]) -> None:
    """SGLang's platform gave their tests SGLang's own class in one run and kvpool's (through
    the plugin) in the other; on kvpool's, every paged case's allocator held pages in the
    daemon on a lease of its own."""
    sglang, kvpool = runs["sglang"], runs["kvpool"]
    assert sglang["allocator_class"] == ("sglang.srt.mem_cache.allocator.paged."
                                         "PagedTokenToKVPoolAllocator"), sglang
    assert kvpool["platform"] == "kvpool.integrations.sglang.platform.KVPoolCpuPlatform"
    assert kvpool["allocator_class"] == "kvpool.integrations.sglang.allocator.PagedAllocator"
    paged = [case for case in kvpool["cases"] if case.startswith(PAGED_CLASSES)]
    assert len(paged) == 19, paged
    assert kvpool["daemon"]["leases"] == len(paged), kvpool["daemon"]
    assert kvpool["daemon"]["held_kv"] > 0, kvpool["daemon"]


def test_sglangs_own_allocator_passes_all_but_what_0_5_23_lacks(
        runs: dict[str, dict[str, Any]]) -> None:
    """The baseline: on SGLang's own allocator every case passes but the six that call APIs
    SGLang 0.5.23 does not have, which fail with their known exception (so a broken run,
    where everything fails alike on both allocators, is caught here)."""
    report = runs["sglang"]
    assert report["ran"] == len(report["cases"]) == 60, report["ran"]
    failed = {case: exception_name(c) for case, c in report["cases"].items()
              if c["outcome"] != "passed"}
    assert failed == NOT_IN_SGLANG_0_5_23, failures(report)


def test_kvpools_allocator_passes_every_case_sglangs_passes(
        runs: dict[str, dict[str, Any]]) -> None:
    """The same cases, the same outcome for each, on kvpool's allocator as on SGLang's: every
    case that passes on SGLang's own passes on kvpool's (the 19 paged cases included, but
    the one calling ``backup_state``), the same pass count, and the cases 0.5.23 cannot pass
    fail the same way."""
    sglang, kvpool = runs["sglang"], runs["kvpool"]
    assert kvpool["ran"] == sglang["ran"]
    assert outcomes(kvpool) == outcomes(sglang), failures(kvpool)
    passed = sum(o == "passed" for o in outcomes(kvpool).values())
    assert passed == sum(o == "passed" for o in outcomes(sglang).values()) == 54
    for case in NOT_IN_SGLANG_0_5_23:
        assert exception_name(kvpool["cases"][case]) == NOT_IN_SGLANG_0_5_23[case], (
            case, kvpool["cases"][case]["error"])

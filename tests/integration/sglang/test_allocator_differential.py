"""kvpool's ``PagedAllocator`` against SGLang 0.5.23's ``PagedTokenToKVPoolAllocator``.

``tests/sglang/allocator_harness.py`` runs in the side venv (real SGLang, CPU torch) against a
real kvpoold started here, with pools configured here: it builds both allocators with the same
size and page size, drives them with the same random calls and reports every difference (the
success/None pattern, ``available_size``), every index invariant broken, the daemon's view of
the allocator's lease, and the outcome of the other scenarios (page-size mismatch,
``KVPOOL_POOL`` missing, quota, a shared pool running short, double frees in and out of
SGLang's debug mode, the KV pool's binding, pages back when the lease closes). This module
asserts on that report, one test per part, from one harness run.

Skipped (with the reason) without the side venv (``tests/sglang/setup_venv.sh``).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import REPO, TINY_SPEC, DaemonProcess
from tests.integration.side_venv import sglang_env

HARNESS = REPO / "tests" / "sglang" / "allocator_harness.py"
PS = 4
POOL = "alloc4"  # page size 4, 256 kv pages (a TINY_SPEC token is 256 B, a page 1 KiB)
POOL16 = "alloc16"  # page size 16
SMALL = "small4"  # page size 4, 16 kv pages
QUOTA_PAGES = 48
SEEDS = (0, 1, 2)
STEPS = 300


@pytest.fixture(scope="module")
def report(sglang_python: Path, sglang_daemon: DaemonProcess) -> dict[str, Any]:
    """Configure the pools, run the harness once, return its JSON report."""
    with KVPoolClient(sglang_daemon.target) as client:
        for name, page_size, budget in ((POOL, PS, 256 << 10), (POOL16, 16, 256 << 10),
                                        (SMALL, PS, 16 << 10)):
            client.configure(name, spec=TINY_SPEC, budget_bytes=budget, page_size=page_size,
                             max_running_requests=8)
    cmd = [str(sglang_python), str(HARNESS), "--pool16", POOL16, "--small", SMALL,
           "--seeds", *map(str, SEEDS), "--steps", str(STEPS),
           "--quota-pages", str(QUOTA_PAGES)]
    env = sglang_env(KVPOOL_TARGET=sglang_daemon.target, KVPOOL_POOL=POOL, SGLANG_PLATFORM="")
    env.pop("SGLANG_DEBUG_MEMORY_POOL", None)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        pytest.fail(f"allocator harness exited {proc.returncode} after {elapsed:.1f} s:\n"
                    f"{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    result["wall_s"] = round(elapsed, 2)
    return result


def test_sglang_runs_its_torch_fallbacks(report: dict[str, Any]) -> None:
    """SGLang resolved a platform without triton, so its reference allocator ran the torch
    paths (alloc_extend_naive / alloc_decode_naive) this module compares against."""
    assert report["supports_triton"] is False, report["platform"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("need_sort", [False, True])
def test_same_results_as_sglang(report: dict[str, Any], seed: int, need_sort: bool) -> None:
    """The same calls give the same success/None pattern and the same available_size after
    every one; indices stay page-aligned, unique per owner, never in page 0."""
    run = next(r for r in report["differential"]
               if r["seed"] == seed and r["need_sort"] == need_sort)
    assert run["error"] is None, run["error"]
    assert run["mismatches"] == []
    assert run["invariant_errors"] == []
    # The run exercised what it claims: every kind of call, and allocations refused.
    for op in ("alloc", "free", "alloc_extend", "alloc_decode", "free_group", "clear",
               "free_req(free)", "free_req(segments)", "free_req(page_ids)",
               "free_req(truncate)"):
        assert run["ops"].get(op, 0) > 0, (op, run["ops"])
    assert run["nones"] > 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("need_sort", [False, True])
def test_daemon_sees_the_pages_in_use(report: dict[str, Any], seed: int,
                                      need_sort: bool) -> None:
    """At each checkpoint the allocator's lease holds at least its pages in use, and (after
    the page cache reported) the daemon counts exactly those as in use."""
    run = next(r for r in report["differential"]
               if r["seed"] == seed and r["need_sort"] == need_sort)
    assert run["checkpoints"]
    for cp in run["checkpoints"]:
        assert cp["held"] >= cp["pages_in_use"], cp
        assert cp["reported_in_use"] == cp["pages_in_use"], cp


def scenario(report: dict[str, Any], name: str) -> dict[str, Any]:
    result = report["scenarios"][name]
    assert "error" not in result, result["error"]
    return result


def test_page_size_mismatch_names_both(report: dict[str, Any]) -> None:
    r = scenario(report, "page_size_mismatch")
    assert r["ok"] and r["type"] == "InvalidArgument", r
    assert "page size 4" in r["message"] and "page size 16" in r["message"], r["message"]
    assert POOL16 in r["message"] and "--page-size" in r["message"], r["message"]


def test_kvpool_pool_unset(report: dict[str, Any]) -> None:
    r = scenario(report, "env_missing")
    assert r["ok"] and r["type"] == "FailedPrecondition", r
    assert "KVPOOL_POOL is not set" in r["message"], r["message"]


def test_quota_above_capacity(report: dict[str, Any]) -> None:
    r = scenario(report, "quota_too_big")
    cap = r["capacity"]
    assert r["ok"] and r["type"] == "InvalidArgument", r
    assert f"{cap + 1} pages" in r["message"] and f"{cap} kv pages" in r["message"], r
    assert "--max-total-tokens" in r["message"], r["message"]


def test_quota_is_respected(report: dict[str, Any]) -> None:
    """At most size // page_size pages, though the pool has free pages."""
    r = scenario(report, "quota")
    assert r["ok"], r


def test_pool_running_short_returns_none(report: dict[str, Any]) -> None:
    r = scenario(report, "pool_short")
    assert r["ok"], r


def test_pages_return_when_the_lease_closes(report: dict[str, Any]) -> None:
    r = scenario(report, "lease_close")
    assert r["ok"], r
    assert r["alloc_after_close"] != "no error", r


def test_kvcache_binding_is_used_and_left_open(report: dict[str, Any]) -> None:
    r = scenario(report, "kvcache_binding")
    assert r["ok"], r


def test_debug_mode_double_free_raises(report: dict[str, Any]) -> None:
    r = scenario(report, "debug_double_free")
    assert r["ok"], r


def test_double_free_does_not_corrupt(report: dict[str, Any]) -> None:
    r = scenario(report, "double_free")
    assert r["ok"], r


def test_resize_and_nested_free_groups(report: dict[str, Any]) -> None:
    r = scenario(report, "resize")
    assert r["ok"], r


def test_fast(report: dict[str, Any]) -> None:
    """The whole harness (SGLang's import included) well inside a minute."""
    assert report["wall_s"] < 60, report["wall_s"]

"""vLLM 0.32's ``BlockPool`` with kvpool's free-block queue against the same ``BlockPool`` with
its own, and ``KVPoolScheduler`` in vLLM's own scheduler construction.

``block_pool_harness.py`` (next to this file) runs in the vLLM side venv (the real vllm
package) against a real kvpoold started here; it configures its pools, drives both block
pools with the same random scheduler calls and reports every difference, every broken
invariant, the daemon's view of the engine's lease, and the scenarios (a pool of the wrong
size, a shared pool running short, vLLM's Scheduler with ``scheduler_cls`` set to
``KVPoolScheduler``). This module asserts on that report, one test per part, from one run.

Skipped (with the reason) without the side venv (``tests/vllm/setup_venv.sh``); fails instead
under ``KVPOOL_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, DaemonProcess, run_daemon, temp_dir
from tests.integration.vllm_venv import vllm_env, vllm_python_or_skip

HARNESS = REPO / "tests" / "integration" / "vllm" / "block_pool_harness.py"
SEEDS = (0, 1, 2)
STEPS = 400
NUM_BLOCKS = 48  # the harness's vLLM block count (block 0 is the null block)
SCHEDULER_BLOCKS = 40
OPS = ("admit", "grow", "raw", "free", "evict", "reset")
RUNS = [(seed, True) for seed in SEEDS] + [(SEEDS[0], False)]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with temp_dir("kvp-vbp-") as d, run_daemon(d, budget="256MiB") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def report(daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = vllm_python_or_skip()
    out = tmp_path_factory.mktemp("vblocks") / "report.json"
    cmd = [str(python), str(HARNESS), "--target", daemon.target, "--out", str(out),
           "--seeds", *map(str, SEEDS), "--steps", str(STEPS),
           "--scheduler-blocks", str(SCHEDULER_BLOCKS)]
    proc = subprocess.run(cmd, env=vllm_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"block pool harness exited {proc.returncode}:\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


def run_of(report: dict[str, Any], seed: int, caching: bool) -> dict[str, Any]:
    run = next(r for r in report["differential"]
               if r["seed"] == seed and r["caching"] == caching)
    assert run["error"] is None, run["error"]
    return run


@pytest.mark.parametrize(("seed", "caching"), RUNS)
def test_same_results_as_vllm(report: dict[str, Any], seed: int, caching: bool) -> None:
    """The same calls succeed and fail alike, prefix hits have the same length, and
    ``get_num_free_blocks`` agrees after every call; no block 0 or id out of range is handed
    out, no id twice, and the lease's count of blocks in use is the blocks referenced."""
    run = run_of(report, seed, caching)
    assert run["mismatches"] == []
    assert run["invariant_errors"] == []
    for op in OPS:  # the run exercised every call
        assert run["ops"].get(op, 0) > 0, (op, run["ops"])
    assert run["refusals"] > 0  # allocations were refused, on both sides
    if caching:
        assert run["hits"] > 0  # and prefix hits reached blocks held in the queue


@pytest.mark.parametrize(("seed", "caching"), RUNS)
def test_lease_holds_the_blocks(report: dict[str, Any], seed: int, caching: bool) -> None:
    """At each checkpoint the daemon's Stats of the engine's lease: it holds the blocks in
    use, the prefix-cached free blocks (the queue) and the page cache's spare pages, nothing
    else; the page cache reports the first two as in use."""
    run = run_of(report, seed, caching)
    assert len(run["checkpoints"]) >= STEPS // 50
    for cp in run["checkpoints"]:
        assert cp["held"] == cp["blocks_in_use"] + cp["queue"] + cp["spare"], cp
        assert cp["reported_in_use"] == cp["blocks_in_use"] + cp["queue"], cp
    if caching:
        assert any(cp["queue"] > 0 for cp in run["checkpoints"])
    else:
        assert all(cp["queue"] == 0 for cp in run["checkpoints"])


@pytest.mark.parametrize("seed", SEEDS)
def test_reset_returns_the_queue(report: dict[str, Any], seed: int) -> None:
    """After a successful ``reset_prefix_cache`` the blocks that held a prefix hold nothing:
    at the next step they are back in the page cache (none in use by the lease), none kept
    by the queue."""
    resets = run_of(report, seed, True)["resets"]
    assert any(r["held_before"] > 0 for r in resets), resets
    assert all(r["held_after"] == 0 and r["in_use"] == 0 for r in resets), resets


@pytest.mark.parametrize(("seed", "caching"), RUNS)
def test_every_page_back_after_close(report: dict[str, Any], seed: int, caching: bool) -> None:
    assert run_of(report, seed, caching)["used_after_close"] == 0


def scenario(report: dict[str, Any], name: str) -> dict[str, Any]:
    result: dict[str, Any] = report["scenarios"][name]
    assert "error" not in result, result["error"]
    return result


def test_wrong_block_count_names_both(report: dict[str, Any]) -> None:
    r = scenario(report, "mismatch")
    assert r["ok"] and r["type"] == "InvalidArgument", r
    assert f"{NUM_BLOCKS} blocks" in r["message"] and "39 kv pages" in r["message"], r
    assert "vblocks-small" in r["message"] and "num_gpu_blocks_override=40" in r["message"]


def test_shared_pool_running_short(report: dict[str, Any]) -> None:
    """Another lease took pages the engine's quota counted: the allocation vLLM was promised
    is refused with vLLM's ValueError naming the pool; until the next step the pool counts
    only the pages its cache holds, and those it hands out; after the step (the other lease
    gave them back) the quota again."""
    r = scenario(report, "shared")
    assert r["free_before"] == NUM_BLOCKS - 1 == r["free_promised"]
    assert r["refused"] is not None and "vblocks-shared" in r["refused"], r
    assert r["short"] is True
    assert r["free_while_short"] == r["spare"] == r["got_while_short"] > 0, r
    assert r["ids_ok"]
    assert r["free_after_new_step"] == NUM_BLOCKS - 1


def test_kvpool_scheduler_in_vllm(report: dict[str, Any]) -> None:
    """vLLM resolves the dotted ``scheduler_cls``; the scheduler it builds keeps vLLM's own
    block pool everywhere (coordinator, managers, their null block) with kvpool's free-block
    queue in it, refuses a pool of the
    wrong size naming both counts, serves a request's blocks from pages its lease holds, and
    its shutdown ends the lease with every page back."""
    r = scenario(report, "scheduler")
    assert r["scheduler_cls"] == "kvpool.integrations.vllm.scheduler.KVPoolScheduler"
    assert r["wrong_size"]["ok"] and r["wrong_size"]["type"] == "InvalidArgument"
    assert f"{SCHEDULER_BLOCKS} blocks" in r["wrong_size"]["message"]
    assert f"{SCHEDULER_BLOCKS + 3} kv pages" in r["wrong_size"]["message"]
    assert r["block_pool"] == "BlockPool" and r["free_queue"] == "KVPoolFreeBlockQueue"
    assert r["managers_use_it"]
    assert r["free_blocks"] == SCHEDULER_BLOCKS - 1
    assert r["lease_name"].startswith("vllm@")
    ids = r["block_ids"]
    assert ids and 0 not in ids and all(0 < i < SCHEDULER_BLOCKS for i in ids), ids
    assert r["free_after_schedule"] == SCHEDULER_BLOCKS - 1 - len(ids)
    assert r["lease_in_use"] == len(ids) and r["lease_holds_ids"]
    assert r["lease_gone"] and r["used_after_shutdown"] == 0


def test_kvpool_async_scheduler_as_a_class(report: dict[str, Any]) -> None:
    """``scheduler_cls`` given the class itself (vLLM takes a class or a dotted name), the
    async flavour: the same free-block queue, a request's blocks from the lease, shutdown ends it;
    and the dotted ``KVPoolScheduler`` under async scheduling builds the async flavour."""
    r = scenario(report, "scheduler")["async"]
    assert r["cls"] == "KVPoolAsyncScheduler" and r["free_queue"] == "KVPoolFreeBlockQueue"
    # the dotted KVPoolScheduler under async scheduling: vLLM's choice, the async one
    assert scenario(report, "scheduler")["async_follows"] == {
        "cls": "KVPoolAsyncScheduler", "free_queue": "KVPoolFreeBlockQueue", "reset": True}
    assert r["block_ids"] and all(0 < i < SCHEDULER_BLOCKS for i in r["block_ids"]), r
    assert r["lease_gone"] and r["used_after_shutdown"] == 0

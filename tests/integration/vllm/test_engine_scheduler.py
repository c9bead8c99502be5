"""vLLM 0.32's engine (CPU, a tiny Llama with dummy weights) with ``scheduler_cls`` =
``KVPoolScheduler`` against the same engine with vLLM's own scheduler.

``engine_harness.py`` (next to this file) runs each engine in its own side-venv process (the
real vllm package, its engine core in-process) against a real kvpoold started here: the same
prompts (two share a two-block prefix) must give the same greedy tokens and the same
prefix-cache hits; the kvpool engine's blocks come from its lease (``vllm@host:pid``), which
holds exactly the prefix-cached blocks and the page cache's spare once the prompts are done,
and which the engine's shutdown ends with every page back.

Skipped (with the reason) without the side venv; fails instead under ``KVPOOL_REQUIRE_VLLM=1``.
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

HARNESS = REPO / "tests" / "integration" / "vllm" / "engine_harness.py"


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with temp_dir("kvp-veng-") as d, run_daemon(d, budget="128MiB") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def runs(daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, dict[str, Any]]:
    python = vllm_python_or_skip()
    out_dir = tmp_path_factory.mktemp("vengine")
    results: dict[str, dict[str, Any]] = {}
    for scheduler in ("kvpool", "vllm"):
        out = out_dir / f"{scheduler}.json"
        proc = subprocess.run(
            [str(python), str(HARNESS), "--scheduler", scheduler, "--target", daemon.target,
             "--out", str(out)],
            env=vllm_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"engine harness ({scheduler}) exited {proc.returncode}:\n"
                        f"{proc.stderr[-6000:]}")
        results[scheduler] = json.loads(Path(out).read_text())
    return results


def test_same_tokens_and_prefix_hits(runs: dict[str, dict[str, Any]]) -> None:
    kv, ref = runs["kvpool"], runs["vllm"]
    # vLLM's own block pool in both; kvpool's free-block queue in it with KVPoolScheduler
    assert kv["scheduler_class"] == "KVPoolScheduler" and kv["block_pool"] == "BlockPool"
    assert kv["free_queue"] == "KVPoolFreeBlockQueue"
    assert ref["scheduler_class"] == "Scheduler" and ref["block_pool"] == "BlockPool"
    assert ref["free_queue"] == "FreeKVCacheBlockQueue"
    assert kv["tokens"] == ref["tokens"]
    assert all(len(t) == 8 for t in kv["tokens"])
    assert kv["cached_tokens"] == ref["cached_tokens"]
    assert kv["cached_tokens"][1] == 2 * kv["block_size"]  # the shared prefix hit


def test_lease_holds_the_prefix_cache(runs: dict[str, dict[str, Any]]) -> None:
    lease = runs["kvpool"]["lease"]
    assert lease["name"].startswith("vllm@")
    assert lease["blocks_in_use"] == 0 and lease["queue"] == 2  # the two cached prefix blocks
    assert lease["in_use"] == lease["queue"]
    assert lease["held"] == lease["queue"] + lease["spare"]


def test_shutdown_ends_the_lease(runs: dict[str, dict[str, Any]]) -> None:
    kv = runs["kvpool"]
    assert kv["lease_gone"] and kv["used_after_shutdown"] == 0

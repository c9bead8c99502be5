"""SGLang 0.5.23's real engine on kvpool memory, end to end, on CPU.

Each engine runs in the side venv (``tests/sglang/engine_run.py``) against a daemon of this
checkout (``sglang_daemon``), on a tiny random Llama the module writes once (hidden 64, 2
layers, 4 heads, 2 KV heads, vocab 256, float32, safetensors; no tokenizer: requests are
``input_ids``), page size 4, greedy:

- ``test_engine_on_kvpool_memory``: generates with the plugin (selected by ``KVPOOL_POOL``
  alone), one prompt repeated so the radix cache hits; while the engine is up the daemon's
  Stats show its lease holding the pages its radix cache holds and the pool attached, and
  this process, attached to the same pool, sees non-zero K/V rows exactly where SGLang wrote
  (byte-equal to the scheduler's own view at the cached tokens) and zero rows everywhere else;
  the tokens equal those of the same engine without kvpool (SGLang's own pool and allocator);
  after shutdown the lease ends and every page is back.
- ``test_http_server``: ``python -m sglang.launch_server`` with ``SGLANG_PLATFORM=kvpool``,
  one ``POST /generate``.
- ``test_engine_restart``: SIGKILL of an engine's process group; the daemon takes its pages
  and attachment back within the lease TTL + 1 s; a new engine reuses the pool
  (``created=False``) and generates the same tokens.
- ``test_platform_selection``: without ``SGLANG_PLATFORM=kvpool`` or ``KVPOOL_POOL`` the
  installed plugin leaves SGLang's own platform choice alone.
- ``test_mla_dsa_pools``: the MLA and DSA classes built with SGLang's arguments (the CPU engine
  cannot run DeepSeek models) map the daemon's buffers; a plan that differs is refused.

SGLang's ``Engine.shutdown`` (and the HTTP server's) SIGKILLs the scheduler, so its lease
ends by expiry, not by the plugin's exit handler: the module uses a 2 s TTL.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvpool.clients.client import KVPoolClient
from kvpool.contract.records import Stats
from tests.conftest import REPO, DaemonProcess, temp_dir
from tests.integration.side_venv import SGLANG_DIR, sglang_env, wait_until

HARNESS = SGLANG_DIR / "engine_run.py"
MODELS = REPO / "tests" / "data" / "models"
PAGE_SIZE = 4
MAX_TOTAL_TOKENS = 512
TTL_S = 2.0
ENGINE_START_S = 240.0  # 23 s warm, 60-75 s cold on a busy 2-core machine
# Distinct prompts in one batch, then the first again: its first two pages come from the cache.
FIRST = list(range(5, 16))  # 11 tokens
BATCHES = [[FIRST, list(range(20, 25)), list(range(30, 43))], [FIRST]]
MAX_NEW_TOKENS = 8

pytestmark = pytest.mark.timeout(600)


# -- running the harness --------------------------------------------------------------------------

class Harness:
    """One ``engine_run.py`` process in its own process group (SGLang's children with it):
    events from its stdout, SGLang's log in a file shown on failure."""

    def __init__(self, python: Path, args: list[str], env: dict[str, str], log: Path,
                 stdin_line: str | None = None) -> None:
        self.log = log
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [str(python), str(HARNESS), *args], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, env=env, cwd=REPO, text=True,
                start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        if stdin_line is not None:
            self.send(stdin_line)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("HARNESS "):
                event = json.loads(line[len("HARNESS "):])
                print(f"  [{time.strftime('%X')}] harness: {event['event']}"
                      f"{' ' + str(event.get('seconds')) + ' s' if 'seconds' in event else ''}")
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
            left = deadline - time.monotonic()
            try:
                got = self._events.get(timeout=max(0.01, left))
            except queue.Empty:
                raise AssertionError(f"no {event!r} from the harness in {timeout_s:.0f} s"
                                     ) from None
            if got is None:
                code = self.proc.wait()
                raise AssertionError(f"the harness exited ({code}) before {event!r}")
            if got["event"] == event:
                return got

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def close(self) -> int:
        """Wait briefly for a normal exit, then SIGKILL whatever is left of the group."""
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = -9
        self.kill_group()
        self.proc.wait()
        return code

    def log_tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def harness(python: Path, args: list[str], env: dict[str, str], log: Path,
            stdin_line: str | None = None) -> Iterator[Harness]:
    """A running harness; on failure its log's tail is printed; always killed at the end."""
    h = Harness(python, args, env, log, stdin_line)
    try:
        yield h
    except BaseException:
        print(f"--- {log.name} (last lines) ---\n{h.log_tail()}")
        raise
    finally:
        h.close()


def engine_job(model: Path, work: Path, name: str, **extra: Any) -> str:
    job = {"model": str(model), "page_size": PAGE_SIZE, "max_total_tokens": MAX_TOTAL_TOKENS,
           "max_new_tokens": MAX_NEW_TOKENS, "batches": BATCHES,
           "dump": str(work / f"{name}.dump.json"), **extra}
    return json.dumps(job)


def kvpool_env(daemon: DaemonProcess, pool: str, **extra: str) -> dict[str, str]:
    return sglang_env(KVPOOL_TARGET=daemon.target, KVPOOL_POOL=pool,
                      KVPOOL_LEASE_TTL_S=str(TTL_S), **extra)


def without_kvpool_env() -> dict[str, str]:
    env = sglang_env()
    for name in ("KVPOOL_POOL", "KVPOOL_TARGET", "SGLANG_PLATFORM", "KVPOOL_LEASE_TTL_S"):
        env.pop(name, None)
    return env


def lease_of(stats: Stats, lease_id: int) -> Any:
    return next((lease for lease in stats.leases if lease.lease_id == lease_id), None)


def assert_all_back(client: KVPoolClient, pool: str, lease_id: int, since: float) -> float:
    """Wait for the lease to end and the pool to be idle (nothing attached, nothing used but
    the sealed pages its directory keeps for the next engine: docs/restart.md); returns the
    seconds from ``since`` until the last of these happened."""
    seen: dict[str, float] = {}

    def idle() -> bool:
        stats = client.stats()
        p = stats.pool(pool)
        kept = client.sealed(pool).kept
        now = time.monotonic() - since
        for what, done in (("lease ended", lease_of(stats, lease_id) is None),
                           ("detached", p.attached == 0),
                           ("pages back", all(s.used == (kept if name == "kv" else 0)
                                              for name, s in p.spaces.items()))):
            if done:
                seen.setdefault(what, now)
        return len(seen) == 3

    wait_until(f"lease {lease_id} gone and pool {pool!r} idle", idle, TTL_S + 10)
    print(f"  pool {pool!r} after the engine went: "
          + ", ".join(f"{what} at {t:.2f} s" for what, t in seen.items()))
    return max(seen.values())


# -- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    with temp_dir("kvp-sgl-e2e-") as d:
        yield d


@pytest.fixture(scope="module")
def tiny_model(sglang_python: Path, work: Path) -> Path:
    """The tiny random Llama (config.json, model.safetensors), seeded."""
    model = work / "tiny-llama"
    env = {**sglang_env(), "PYTHONPATH": ""}  # transformers only: no stubs needed
    out = subprocess.run([str(sglang_python), str(HARNESS), "make-model", str(model)],
                         env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (model / "model.safetensors").is_file()
    return model


@pytest.fixture(scope="module")
def baseline(sglang_python: Path, tiny_model: Path, work: Path) -> list[dict[str, Any]]:
    """The outputs of the same engine with SGLang's own KV pool and allocator."""
    print("\nbaseline engine (kvpool's platform, SGLang's own pool and allocator)")
    env = {**without_kvpool_env(), "SGLANG_PLATFORM": "kvpool"}
    job = engine_job(tiny_model, work, "baseline", baseline=True)
    with harness(sglang_python, ["engine"], env, work / "baseline.log", job) as h:
        h.wait_for("started", ENGINE_START_S)
        outputs = h.wait_for("generated", 120)["outputs"]
        dump = json.loads(Path(h.wait_for("dumped", 60)["path"]).read_text())
        h.wait_for("shutdown", 120)
    assert dump["pool_class"].startswith("sglang."), dump["pool_class"]
    assert dump["allocator_class"].startswith("sglang."), dump["allocator_class"]
    return outputs


# -- the engine on kvpool memory ------------------------------------------------------------------

def nonzero_rows(tensor: torch.Tensor) -> set[int]:
    return set(np.flatnonzero(tensor.reshape(tensor.shape[0], -1).ne(0).any(1).numpy()).tolist())


def sha256_rows(tensor: torch.Tensor, rows: list[int]) -> str:
    import hashlib

    return hashlib.sha256(tensor[rows].contiguous().numpy().tobytes()).hexdigest()


def check_outputs(outputs: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert [o["output_ids"] for o in outputs] == [e["output_ids"] for e in expected]
    repeated = outputs[-1]
    assert repeated["input_ids"] == FIRST
    assert repeated["cached_tokens"] > 0, repeated  # the radix cache served its prefix
    assert all(len(o["output_ids"]) == MAX_NEW_TOKENS for o in outputs)


def test_engine_on_kvpool_memory(sglang_python: Path, sglang_daemon: DaemonProcess,
                                 tiny_model: Path, baseline: list[dict[str, Any]],
                                 work: Path) -> None:
    pool = "sgl-engine"
    print("\nengine on kvpool memory (selected by KVPOOL_POOL alone)")
    env = kvpool_env(sglang_daemon, pool)
    env.pop("SGLANG_PLATFORM", None)
    job = engine_job(tiny_model, work, "engine", hold=True)
    with KVPoolClient(sglang_daemon.target) as client, \
            harness(sglang_python, ["engine"], env, work / "engine.log", job) as h:
        h.wait_for("started", ENGINE_START_S)
        outputs = h.wait_for("generated", 120)["outputs"]
        dump = json.loads(Path(h.wait_for("dumped", 60)["path"]).read_text())
        h.wait_for("holding", 30)

        check_outputs(outputs, baseline)
        assert dump["pool_class"].endswith("pools.KVPoolMHATokenToKVPool")
        assert dump["platform_class"] == "KVPoolCpuPlatform"
        info = dump["kvpool"]
        assert info["pool"] == pool and info["created"] is True
        # The daemon planned what SGLang resolved (its request count too).
        assert info["plan_max_running_requests"] == dump["max_running_requests"]
        lease_id = info["lease_id"]
        held = dump["held_locs"]
        written = set(dump["written_locs"])
        held_pages = {loc // PAGE_SIZE for loc in held}
        assert held and set(held) <= written
        kvpool_allocator = dump["allocator_class"].endswith("allocator.PagedAllocator")

        # Stats while the engine is up: the pool attached with the engine's lease, and (with
        # kvpool's allocator) the lease holding in use exactly the radix cache's pages.
        def lease_in_use() -> Any:
            stats = client.stats()
            lease = lease_of(stats, lease_id)
            if lease is None or stats.pool(pool).attached != 1 or lease.attached != 1:
                return None
            in_use = lease.held.get(pool, {}).get("kv", 0) - lease.cached.get(pool, {}).get(
                "kv", 0)
            return (stats, lease) if not kvpool_allocator or in_use == len(held_pages) else None

        stats, lease = wait_until(f"lease {lease_id} attached, holding the cache's pages",
                                  lease_in_use, 10)
        print(f"  lease {lease.name}: held {lease.held}, cached {lease.cached}; "
              f"radix cache holds {len(held)} tokens in {len(held_pages)} pages")
        assert lease.name == info["lease_name"]
        assert stats.pool(pool).spaces["kv"].used == lease.held[pool]["kv"]
        if not kvpool_allocator:
            print(f"  note: SGLang's own allocator ({dump['allocator_class']}): the lease "
                  "holds no pages")

        # A second process (this one) attached to the same pool reads what SGLang wrote.
        with client.attach(pool, info["fingerprint"]) as region:
            for layer in dump["layers"]:
                k, v = region[f"k.{layer['layer']}"], region[f"v.{layer['layer']}"]
                assert list(k.shape) == layer["shape"] and str(k.dtype) == "torch.float32"
                assert nonzero_rows(k) == written, layer["layer"]
                assert nonzero_rows(v) == written, layer["layer"]
                assert sha256_rows(k, held) == layer["k_sha256"]
                assert sha256_rows(v, held) == layer["v_sha256"]
                not_held = [p for p in range(k.shape[0] // PAGE_SIZE)
                            if p not in held_pages and all(
                                r not in written for r in range(p * PAGE_SIZE,
                                                                (p + 1) * PAGE_SIZE))]
                assert not k.reshape(-1, PAGE_SIZE, *k.shape[1:])[not_held].any()
        print(f"  attached from the test: {len(written)} rows written, {len(held)} held by "
              f"the radix cache ({len(written) - len(held)} written then freed), the rest 0")

        h.send("")  # shut the engine down: SGLang SIGKILLs the scheduler
        h.wait_for("shutdown", 120)
        took = assert_all_back(client, pool, lease_id, time.monotonic())
        print(f"  the lease ended {took:.2f} s after the shutdown"
              f" (TTL {TTL_S} s: waited on the fact, not timed)")
        assert h.close() == 0


# -- SGLang's HTTP server -------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 60) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"null")


def test_http_server(sglang_python: Path, sglang_daemon: DaemonProcess, tiny_model: Path,
                     baseline: list[dict[str, Any]], work: Path) -> None:
    pool = "sgl-http"
    port = free_port()
    print(f"\nHTTP server on port {port} (SGLANG_PLATFORM=kvpool)")
    args = ["serve", "--model-path", str(tiny_model), "--host", "127.0.0.1", "--port",
            str(port), "--device", "cpu", "--attention-backend", "torch_native",
            "--skip-tokenizer-init", "--disable-cuda-graph", "--dtype", "float32",
            "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--disable-overlap-schedule", "--page-size", str(PAGE_SIZE), "--max-total-tokens",
            str(MAX_TOTAL_TOKENS), "--mem-fraction-static", "0.05", "--random-seed", "0",
            "--log-level", "warning"]
    env = kvpool_env(sglang_daemon, pool, SGLANG_PLATFORM="kvpool")
    base = f"http://127.0.0.1:{port}"
    with KVPoolClient(sglang_daemon.target) as client, \
            harness(sglang_python, args, env, work / "server.log") as h:
        def ready() -> bool:
            if h.proc.poll() is not None:
                raise AssertionError(f"the server exited ({h.proc.returncode})")
            try:
                http_json(f"{base}/health", timeout_s=2)
            except OSError:
                return False
            return True

        start = time.monotonic()
        wait_until("the server answers /health", ready, ENGINE_START_S, interval_s=0.5)
        print(f"  server up in {time.monotonic() - start:.1f} s")
        out = http_json(f"{base}/generate", {
            "input_ids": FIRST, "sampling_params": {
                "temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}})
        assert out["output_ids"] == baseline[0]["output_ids"]
        stats = client.stats()
        assert stats.pool(pool).attached == 1
        (lease,) = [lease for lease in stats.leases if lease.attached]
        assert lease.name.startswith("sglang@")
        h.proc.send_signal(signal.SIGTERM)
        gone = time.monotonic()
        h.proc.wait(timeout=60)
        assert_all_back(client, pool, lease.lease_id, gone)


# -- an engine killed, and a new one on the same pool ---------------------------------------------

def test_engine_restart(sglang_python: Path, sglang_daemon: DaemonProcess, tiny_model: Path,
                        baseline: list[dict[str, Any]], work: Path) -> None:
    pool = "sgl-restart"
    env = kvpool_env(sglang_daemon, pool)
    print("\nfirst engine, to be SIGKILLed")
    with KVPoolClient(sglang_daemon.target) as client:
        job = engine_job(tiny_model, work, "killed", hold=True)
        with harness(sglang_python, ["engine"], env, work / "killed.log", job) as h:
            h.wait_for("started", ENGINE_START_S)
            check_outputs(h.wait_for("generated", 120)["outputs"], baseline)
            first = json.loads(Path(h.wait_for("dumped", 60)["path"]).read_text())["kvpool"]
            h.wait_for("holding", 30)
            assert first["created"] is True
            lease = lease_of(client.stats(), first["lease_id"])
            assert lease is not None and lease.attached == 1
            h.kill_group()
            killed = time.monotonic()
        took = assert_all_back(client, pool, first["lease_id"], killed)
        print(f"  pages and attachment back after {took:.2f} s"
              f" (TTL {TTL_S} s: waited on the fact, not timed)")

        print("second engine, same pool")
        job = engine_job(tiny_model, work, "restarted")
        with harness(sglang_python, ["engine"], env, work / "restarted.log", job) as h:
            h.wait_for("started", ENGINE_START_S)
            check_outputs(h.wait_for("generated", 120)["outputs"], baseline)
            second = json.loads(Path(h.wait_for("dumped", 60)["path"]).read_text())["kvpool"]
            h.wait_for("shutdown", 120)
            gone = time.monotonic()
        assert second["created"] is False
        assert second["fingerprint"] == first["fingerprint"]
        assert second["lease_id"] != first["lease_id"]
        assert_all_back(client, pool, second["lease_id"], gone)


# -- selection, and the MLA / DSA classes ---------------------------------------------------------

SELECTION = """
import json, os
from sglang.srt import platforms
from kvpool.integrations.sglang.platform import activate
out = {{}}
for name, env in {cases!r}.items():
    for key in ("SGLANG_PLATFORM", "KVPOOL_POOL"):
        os.environ.pop(key, None)
    os.environ.update(env)
    out[name] = [activate(), type(platforms._resolve_platform()).__qualname__]
print(json.dumps(out))
"""


def test_platform_selection(sglang_python: Path) -> None:
    """The plugin is active only when asked for; otherwise SGLang chooses as without it."""
    cases = {"neither": {}, "pool": {"KVPOOL_POOL": "p"},
             "platform": {"SGLANG_PLATFORM": "kvpool"}}
    code = SELECTION.format(cases=cases)
    out = subprocess.run([str(sglang_python), "-c", code], env=without_kvpool_env(),
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    cpu = "kvpool.integrations.sglang.platform:KVPoolCpuPlatform"
    # No GPU, no SGLANG_USE_CPU_ENGINE: SGLang's own fallback is its base platform.
    assert got["neither"] == [None, "SRTPlatform"]
    assert got["pool"] == [cpu, "KVPoolCpuPlatform"]
    assert got["platform"] == [cpu, "KVPoolCpuPlatform"]


def model_dir(work: Path, name: str) -> Path:
    directory = work / name
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text((MODELS / f"{name}.json").read_text())
    return directory


def test_mla_dsa_pools(sglang_python: Path, sglang_daemon: DaemonProcess, tiny_model: Path,
                       work: Path) -> None:
    """SGLang's MLA and DSA pool classes (DeepSeek-V3, -V3.2) built with the arguments SGLang's
    configurator passes, outside an engine: the CPU engine cannot run these models (MLA and
    DSA attention need CUDA kernels). Their buffers are the daemon's (a marker written through
    SGLang's tensors is read here); a plan that differs from SGLang's pool is refused."""
    v3, v32 = model_dir(work, "deepseek-v3"), model_dir(work, "deepseek-v3.2-exp")
    mla = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "layer_num": 61, "start_layer": 0,
           "end_layer": 61}
    settings = {"context_length": 4096}

    def tiny_mha(case: str, pool: str, settings: dict[str, Any] | None = None,
                 **args: int) -> dict[str, Any]:
        """An MHA pool case of the tiny Llama (2 layers, 2 KV heads of 16, page 4)."""
        return {"id": case, "kind": "mha", "pool": pool, "model": str(tiny_model),
                "dtype": "float32", **({"settings": settings} if settings else {}),
                "args": {"size": 64, "page_size": 4, "head_num": 2, "head_dim": 16,
                         "layer_num": 2, "start_layer": 0, "end_layer": 2, **args}}

    cases = [
        {"id": "mla", "kind": "mla", "pool": "sgl-mla", "model": str(v3), "dtype": "bfloat16",
         "args": {"size": 128, "page_size": 64, **mla}, "settings": settings},
        {"id": "dsa", "kind": "dsa", "pool": "sgl-dsa", "model": str(v32),
         "dtype": "bfloat16", "settings": settings,
         "args": {"size": 128, "page_size": 64, "index_head_dim": 128, "kv_cache_dim": 576,
                  **mla}},
        {"id": "dsa-fp8", "kind": "dsa", "pool": "sgl-dsa-fp8", "model": str(v32),
         "dtype": "fp8_e4m3", "settings": settings,
         "args": {"size": 128, "page_size": 64, "index_head_dim": 128, "kv_cache_dim": 656,
                  **mla}},
        # PP stage 1 of 2 of the tiny Llama: layer 1 only.
        tiny_mha("mha-pp", "sgl-mha-pp", settings={"pp_size": 2, "pp_rank": 1}, layer_num=1,
                 start_layer=1),
        # SGLang expecting 3 KV heads of the tiny Llama's 2: refused, naming both shapes.
        tiny_mha("mha-heads", "sgl-mha-bad", head_num=3),
        # The same pool, now planned by SGLang at twice the tokens: the daemon keeps its layout.
        tiny_mha("mha-size", "sgl-mha-bad", size=128),
        # The plugin selected (SGLANG_PLATFORM=kvpool) but no pool named.
        tiny_mha("no-pool", ""),
    ]
    env = sglang_env(KVPOOL_TARGET=sglang_daemon.target, KVPOOL_LEASE_TTL_S=str(TTL_S))
    results: dict[str, dict[str, Any]] = {}
    with harness(sglang_python, ["pools"], env, work / "pools.log",
                 json.dumps({"cases": cases})) as h:
        for _ in cases:
            event = h.wait_for("pool", 300)
            results[event["id"]] = event
        assert h.close() == 0

    for name in ("mla", "dsa", "dsa-fp8", "mha-pp"):
        assert results[name]["ok"], results[name]
        assert results[name]["created"] is True
    rows = 128 + 64
    assert results["mla"]["buffers"]["kv.60"] == {"shape": [rows, 1, 576], "dtype": "bfloat16"}
    assert results["dsa"]["buffers"]["index_k.0"] == {"shape": [3, 64 * 132],
                                                      "dtype": "uint8"}
    # fp8_e4m3 DSA: 512 fp8 + 4 fp32 scales + 64 bf16 rope = 656 bytes per token, as uint8.
    assert results["dsa-fp8"]["buffers"]["kv.0"] == {"shape": [rows, 1, 656], "dtype": "uint8"}
    assert list(results["mha-pp"]["buffers"]) == ["k.1", "v.1"]
    assert "(68, 3, 16)" in results["mha-heads"]["error"]
    assert "(68, 2, 16)" in results["mha-heads"]["error"]
    assert results["mha-size"]["error"].startswith(
        "PoolMismatch: max_total_tokens: SGLang needs kvpool pool 'sgl-mha-bad' with 128 tokens, "
        "page 4, float32 (tp 1, pp 0/1) but it exists with 64 tokens, page 4, float32")
    assert results["no-pool"]["error"].startswith("FailedPrecondition: KVPOOL_POOL is not set")
    print("  " + "\n  ".join(f"{k}: {'ok' if v['ok'] else v['error']}"
                             for k, v in results.items()))

    with KVPoolClient(sglang_daemon.target) as client:
        for name, buffer, marker_row in (("sgl-mla", "kv.0", 64), ("sgl-dsa", "kv.0", 64),
                                         ("sgl-dsa", "index_k.0", 1),
                                         ("sgl-dsa-fp8", "kv.0", 64), ("sgl-mha-pp", "k.1", 4)):
            with client.attach(name) as region:
                t = region[buffer]
                assert set(t[marker_row].reshape(-1).float().unique().tolist()) == {7.0}, name
                assert nonzero_rows(t) == {marker_row}, (name, buffer)
            stats = client.stats()
            assert stats.pool(name).attached == 0
            assert not [lease for lease in stats.leases if lease.held.get(name)]

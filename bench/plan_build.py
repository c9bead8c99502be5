"""Benchmark: ``plan()`` time per architecture and CPU pool build time against ``torch.zeros``.

What it measures, in one process on CPU:

1. Plan time: the median of ``--runs`` calls of :func:`kvpool.contract.plan` (spec already
   loaded, options already built) for one model per sizing module: mha (Llama-3.1-8B, page 16),
   mla (DeepSeek-V3), dsa (DeepSeek-V3.2, page 64), hybrid_swa (gpt-oss-20b, page 16),
   hybrid_linear (Qwen3-Next-80B-A3B), fp4 (Llama-3.1-8B, fp4_e2m1, page 16) and dsv4 (a
   synthetic 61-layer DeepSeek-V4 spec, page 256); 40 GiB budget each. A module that is not
   ready (raises, or the table picks another module) is reported, not fatal.
2. Build time: :func:`kvpoold.pools.build_pool` of a Llama plan whose backing region is about
   1 GiB, against ``torch.zeros`` of exactly ``plan.backing_bytes`` bytes in the same run
   (alternated, ``--build-runs`` rounds after a warm-up; median and min), and the ratio
   build / zeros. The builder's only extra work over the zero-fill is carving the named views,
   so the ratio should be ~1; on a shared VM the zero-fill itself varies a lot between runs,
   so trust the min ratio more than the median one.

Run from the repository root (takes well under 60 s):

    PYTHONPATH=client:service python bench/plan_build.py [--runs 200] [--build-runs 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELS = Path(__file__).resolve().parents[1] / "tests" / "data" / "models"
BUDGET = 40 << 30
POOL_BYTES = 1 << 30


@dataclass(frozen=True)
class Case:
    """One plan to time: the sizing module it should reach, the model and the options."""

    name: str  # what the row is called
    expect: str  # the sizing module the plan must come from
    label: str
    load: Callable[[], Any]  # -> ModelSpec
    options: dict[str, Any]


def _hf(name: str) -> Callable[[], Any]:
    def load() -> Any:
        from kvpoold.hf import load_model

        return load_model(MODELS / name)[0]

    return load


def _dsv4_spec() -> Any:
    """61 layers: ratios 0, 0, then 4 / 128 alternating (30 c4 layers, 29 c128 layers)."""
    from kvpool.contract.spec import decode_spec

    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(59)]
    return decode_spec({
        "architecture": "DeepseekV4ForCausalLM",
        "num_layers": 61,
        "attention": {"type": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64},
        "context_length": 1 << 20,
        "dsv4": {"compress_ratios": ratios},
        "kv_cache_quant_fp8": True,  # DSV4 pools store packed fp8 KV
    })


CASES = (
    Case("mha", "mha", "Llama-3.1-8B bf16 p16", _hf("llama-3.1-8b-instruct.json"),
         {"page_size": 16}),
    Case("mla", "mla", "DeepSeek-V3 bf16 p1", _hf("deepseek-v3.json"), {}),
    Case("dsa", "dsa", "DeepSeek-V3.2 bf16 p64", _hf("deepseek-v3.2-exp.json"),
         {"page_size": 64}),
    Case("hybrid_swa", "hybrid_swa", "gpt-oss-20b bf16 p16", _hf("gpt-oss-20b.json"),
         {"page_size": 16}),
    Case("hybrid_linear", "hybrid_linear", "Qwen3-Next-80B bf16 p1",
         _hf("qwen3-next-80b-a3b-instruct.json"), {}),
    Case("fp4", "mha", "Llama-3.1-8B fp4 p16", _hf("llama-3.1-8b-instruct.json"),
         {"page_size": 16, "kv_cache_dtype": "fp4_e2m1"}),
    Case("dsv4", "dsv4", "DeepSeek-V4 synthetic p256", _dsv4_spec,
         {"page_size": 256, "max_running_requests": 256}),
)


def median_us(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def bench_plans(runs: int) -> None:
    from kvpoold.sizing import make_options, plan

    print(f"plan() median of {runs} runs, 40 GiB budget")
    print(f"  {'module':<14} {'model':<28} {'median':>10}  {'buffers':>7}  result")
    for case in CASES:
        try:
            spec = case.load()
            options = make_options(budget_bytes=BUDGET, **case.options)
            result = plan(spec, options)
            if result.architecture != case.expect:
                print(f"  {case.name:<14} {case.label:<28} {'-':>10}  {'-':>7}  "
                      f"not ready: the table picked {result.architecture!r}")
                continue
            us = median_us(lambda spec=spec, options=options: plan(spec, options), runs)
        except Exception as exc:  # report an unfinished module, keep benchmarking the rest
            print(f"  {case.name:<14} {case.label:<28} {'-':>10}  {'-':>7}  "
                  f"not ready: {type(exc).__name__}: {exc}")
            continue
        print(f"  {case.name:<14} {case.label:<28} {us:>8.1f}us  {len(result.buffers):>7}  "
              f"{result.max_total_num_tokens:,} tokens")


def bench_build(runs: int) -> None:
    import torch

    from kvpoold.hf import load_model
    from kvpoold.pools import build_pool
    from kvpoold.sizing import make_options, plan

    spec, source = load_model(MODELS / "llama-3.1-8b-instruct.json")
    # a short context keeps the req_to_token table (outside the budget) small next to 1 GiB
    p = plan(spec, make_options(budget_bytes=POOL_BYTES, page_size=16, context_length=4096),
             source=source)
    nbytes = p.backing_bytes
    timings: dict[str, list[float]] = {"zeros": [], "build": []}
    makers: dict[str, Callable[[], object]] = {
        "zeros": lambda: torch.zeros(nbytes, dtype=torch.uint8),
        "build": lambda: build_pool(p, "cpu"),
    }
    for i in range(runs + 1):  # round 0 is a warm-up (first touch of fresh memory)
        for label, make in makers.items():
            gc.collect()
            start = time.perf_counter()
            obj = make()
            elapsed = time.perf_counter() - start
            del obj
            if i:
                timings[label].append(elapsed)
    print(f"\nbuild_pool on CPU: Llama-3.1-8B, {len(p.buffers)} buffers, "
          f"{nbytes:,} B backing; {runs} alternated rounds after a warm-up")
    print(f"  {'':<28} {'median':>10} {'min':>10}")
    for label, name in (("zeros", f"torch.zeros({nbytes:,} B)"), ("build", "build_pool")):
        t = timings[label]
        print(f"  {name:<28} {statistics.median(t) * 1e3:>8.1f}ms {min(t) * 1e3:>8.1f}ms")
    ratio_median = statistics.median(timings["build"]) / statistics.median(timings["zeros"])
    ratio_min = min(timings["build"]) / min(timings["zeros"])
    print(f"  {'ratio build / zeros':<28} {ratio_median:>10.3f} {ratio_min:>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="plan() calls per module")
    parser.add_argument("--build-runs", type=int, default=7, help="builds (and zeros) each")
    args = parser.parse_args()
    started = time.perf_counter()
    bench_plans(args.runs)
    bench_build(args.build_runs)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()

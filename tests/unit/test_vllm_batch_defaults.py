"""vLLM's default ``max_num_batched_tokens`` by entry point and platform (vLLM 0.32's
``EngineArgs.get_batch_defaults``), and what it does to a sliding-window plan.

By hand, vLLM's table (``tests/integration/test_vllm_batch_defaults.py`` checks it against
vLLM's own function): CPU 4,096 (``LLM(...)``) / 2,048 (``vllm serve``) times TP x PP; a GPU
under 70 GiB or an A100 8,192 / 2,048; 70 GiB and up (H100, H200) 16,384 / 8,192; 160 GiB and
up (B200) 16,384 / 16,384; capped at ``max_num_seqs x max_model_len`` (CPU 256 / 128 x world,
GPU 256 / 256, 1,024 from 70 GiB).

gpt-oss-20b at ``max_model_len`` 8,192, block 128 (CPU backend), window 128: a full-attention
group holds 8,192 / 128 = 64 blocks per request; a sliding group ``ceil(min(127 + in-flight,
8,192) / 128) + 1``: LLM(...) on CPU (4,096) 34, vllm serve on CPU (2,048) 18, LLM(...) on an
H100 (16,384) 65. The GPU numbers are computed here, not run: the side venv is vLLM's CPU
build (the parity test runs the CPU ones against vLLM itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.contract.vllm_plan import VllmSpecType, make_vllm_options
from kvpoold.sizing.vllm_profile import batched_tokens, plan_vllm

ROOT = Path(__file__).resolve().parents[2]
GPT_OSS = json.loads((ROOT / "tests" / "data" / "models" / "gpt-oss-20b.json").read_text())


@pytest.mark.parametrize(("platform", "entrypoint", "world", "expected"), [
    ("cpu", "llm", 1, 4096), ("cpu", "serve", 1, 2048), ("cpu", "llm", 4, 16384),
    ("cpu", "serve", 4, 8192), ("gpu", "llm", 4, 8192), ("gpu", "serve", 1, 2048),
    ("gpu-70gib", "llm", 1, 16384), ("gpu-70gib", "serve", 4, 8192),
    ("gpu-160gib", "llm", 1, 16384), ("gpu-160gib", "serve", 1, 16384),
])
def test_default_by_entrypoint_platform_and_world(platform: str, entrypoint: str, world: int,
                                                  expected: int) -> None:
    options = make_vllm_options(kv_cache_memory_bytes=1 << 30, platform=platform,
                                entrypoint=entrypoint, tp_size=world)
    assert batched_tokens(options, 131072) == expected


def test_the_cap_is_max_num_seqs_times_max_model_len_and_a_given_value_wins() -> None:
    serve = make_vllm_options(kv_cache_memory_bytes=1 << 30, entrypoint="serve")
    assert batched_tokens(serve, 8) == 128 * 8  # CPU serve: 128 sequences of 8 tokens
    given = make_vllm_options(kv_cache_memory_bytes=1 << 30, max_num_batched_tokens=300)
    assert batched_tokens(given, 8) == 300


@pytest.mark.parametrize(("platform", "entrypoint", "sliding_blocks"), [
    ("cpu", "llm", 34), ("cpu", "serve", 18), ("gpu-70gib", "llm", 65),
    ("gpu-70gib", "serve", 65), ("gpu", "serve", 18),
])
def test_sliding_groups_hold_the_default_batch(platform: str, entrypoint: str,
                                              sliding_blocks: int) -> None:
    p = plan_vllm(GPT_OSS, make_vllm_options(kv_cache_memory_bytes=8 << 30,
                                             max_model_len=8192, platform=platform,
                                             entrypoint=entrypoint))
    full = sum(g.type is VllmSpecType.full_attention for g in p.groups)
    sliding = sum(g.type is VllmSpecType.sliding_window for g in p.groups)
    assert full and sliding
    assert p.num_blocks / p.max_concurrency == pytest.approx(full * 64 + sliding * sliding_blocks)
    assert any("vLLM's default" in n for n in p.notes)


def test_plan_help_names_entrypoint_and_platform() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "client"),
                                                        str(ROOT / "service")])}
    proc = subprocess.run([sys.executable, "-m", "kvpoold.main", "plan", "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for flag in ("--entrypoint {llm,serve}", "--platform {cpu,gpu,gpu-70gib,gpu-160gib}",
                 "4096 x TP x PP for llm on cpu"):
        assert flag in text, flag

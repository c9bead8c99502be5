"""``kvpoold plan --engine vllm``: the real command line prints vLLM's KV cache (JSON and
table), keeps SGLang the default, and refuses the other engine's knobs with exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvpool.contract.vllm_plan import decode_vllm_plan

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "data" / "models"
LLAMA = MODELS / "llama-3.1-8b-instruct.json"
GEMMA3 = MODELS / "gemma-3-1b-it.json"


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "client"),
                                                        str(ROOT / "service")])}
    return subprocess.run([sys.executable, "-m", "kvpoold.main", "plan", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60, check=False)


def test_help_names_the_engine_and_vllm_knobs() -> None:
    proc = plan("--help")
    assert proc.returncode == 0
    for flag in ("--engine {sglang,vllm}", "--block-size", "--kv-cache-memory-bytes",
                 "--max-model-len", "--num-gpu-blocks-override",
                 "--disable-hybrid-kv-cache-manager", "vLLM (--engine vllm)"):
        assert flag in proc.stdout, flag


def test_json_is_vllms_kv_cache() -> None:
    """Llama-3.1-8B, 1 GiB (``--budget`` is kv_cache_memory_bytes), 4,096 tokens: 64 blocks of
    16 MiB (see tests/unit/test_sizing_vllm.py)."""
    proc = plan("--engine", "vllm", "--model-config", str(LLAMA), "--budget", "1GiB",
                "--max-model-len", "4096", "--json")
    assert proc.returncode == 0, proc.stderr
    p = decode_vllm_plan(proc.stdout)
    assert (p.num_blocks, p.bytes_per_block, p.max_concurrency) == (64, 16 << 20, 2.0)
    same = plan("--engine", "vllm", "--model-config", str(LLAMA), "--kv-cache-memory-bytes",
                "1073741824", "--max-model-len", "4096", "--json")
    assert decode_vllm_plan(same.stdout) == p


def test_table_shows_groups_and_tensors() -> None:
    proc = plan("--engine", "vllm", "--model-config", str(GEMMA3), "--budget", "1GiB",
                "--max-model-len", "4096")
    assert proc.returncode == 0, proc.stderr
    assert "kv cache groups (7)" in proc.stdout
    assert "kv cache tensors (7, one backing region)" in proc.stdout
    assert "2,048 (block 0 is vLLM's null block)" in proc.stdout


def test_each_engine_refuses_the_others_knobs() -> None:
    for args, flag in ((("--engine", "vllm", "--budget", "1GiB", "--page-size", "16"),
                        "--page-size"),
                       (("--budget", "1GiB", "--block-size", "16"), "--block-size")):
        proc = plan("--model-config", str(LLAMA), *args)
        assert proc.returncode == 2 and proc.stdout == ""
        # The message opens with the flag (once: "--page-size is SGLang's ...").
        assert proc.stderr.startswith(f"kvpoold plan: error: {flag} "), proc.stderr
    proc = plan("--engine", "vllm", "--model-config", str(LLAMA))
    assert proc.returncode == 2 and "--kv-cache-memory-bytes" in proc.stderr


def test_refusal_names_needed_and_available() -> None:
    proc = plan("--engine", "vllm", "--model-config", str(LLAMA), "--budget", "1GiB")
    assert proc.returncode == 2
    assert "131,072 tokens needs 17,179,869,184 B" in proc.stderr
    assert "at most 8,064 tokens fit" in proc.stderr


def test_an_attention_free_model_plans_its_states() -> None:
    """Mamba-130M (SYNTHETIC, attention-free; tests/unit/test_vllm_attention_free.py): one
    Mamba group of 24 layers in vLLM's LBNHC layout, states kept per 16 tokens, no KV."""
    mamba = ROOT / "tests" / "integration" / "synthetic_configs" / "mamba-130m.json"
    proc = plan("--engine", "vllm", "--model-config", str(mamba), "--budget", "4GiB",
                "--max-model-len", "2048", "--cpu-avx512-bf16", "no")
    assert proc.returncode == 0, proc.stderr
    assert "kv cache groups (1)" in proc.stdout and "LBNHC" in proc.stdout
    assert "3,066 (block 0 is vLLM's null block)" in proc.stdout
    assert "1533.00 requests" in proc.stdout
    assert "vLLM plans the model attention-free" in " ".join(proc.stdout.split())

"""``kvpool configure --engine vllm`` and ``kvpool stats`` against a real daemon: a vLLM-layout
pool (TinyLlama-1.1B's config: 2.75 MiB blocks of 128 tokens, 12 MiB make 4 blocks)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, DaemonProcess, subprocess_env

MODEL = REPO / "tests/data/models/tinyllama-1.1b-chat-v0.4.json"


def kvpool_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.tools.cli", *args], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)


def test_cli_configures_and_shows_a_vllm_pool(kvpoold: DaemonProcess) -> None:
    target = ["--target", kvpoold.target]
    vllm = ["--hf-config", str(MODEL), "--engine", "vllm", "--budget", "12MiB",
            "--max-model-len", "256"]
    out = kvpool_cli("configure", "tl", *vllm, *target)
    assert out.returncode == 0, out.stderr
    assert "pool tl: created" in out.stdout
    assert "vllm: 4 blocks of 128 tokens (2.75 MiB each), 1 group(s), 1 KV-cache tensor(s), " \
           "layout LBHNC, max_model_len 256" in out.stdout
    assert "block ids 1..3 are the kv pages" in out.stdout
    out = kvpool_cli("configure", "tl", *vllm, "--json", *target)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["created"] is False and data["plan"]["vllm"]["num_blocks"] == 4
    out = kvpool_cli("stats", "--json", *target)
    assert out.returncode == 0, out.stderr
    (pool,) = json.loads(out.stdout)["pools"]
    assert (pool["architecture"], pool["page_size"]) == ("vllm", 128)
    assert pool["spaces"]["kv"]["capacity"] == 3
    assert pool["spaces"]["kv"]["unit"] == "blocks"
    out = kvpool_cli("stats", *target)
    assert out.returncode == 0 and "pool tl: vllm" in out.stdout, out.stderr


def test_cli_refuses_the_other_layouts_knobs(kvpoold: DaemonProcess) -> None:
    target = ["--target", kvpoold.target]
    out = kvpool_cli("configure", "tl", "--hf-config", str(MODEL), "--engine", "vllm",
                     "--budget", "12MiB", "--page-size", "16", *target)
    assert out.returncode == 2 and "an SGLang-layout option (set: --page-size)" in out.stderr
    out = kvpool_cli("configure", "tl", "--hf-config", str(MODEL), "--engine", "vllm",
                     "--budget", "12MiB", "--max-model-len", "256", "--elastic", *target)
    assert out.returncode == 2 and "--elastic" in out.stderr
    out = kvpool_cli("configure", "tl", "--hf-config", str(MODEL), "--budget", "12MiB",
                     "--block-size", "32", *target)
    assert out.returncode == 2 and "vLLM's knob (set: --block-size)" in out.stderr


def test_cli_configures_an_attention_free_pool(kvpoold: DaemonProcess) -> None:
    """Mamba-130M (SYNTHETIC): 24 Mamba-1 states of 58,368 B a block (a CPU without AVX-512
    BF16), 8 MiB make 5 blocks that hold states only."""
    mamba = REPO / "tests/integration/synthetic_configs/mamba-130m.json"
    out = kvpool_cli("configure", "m", "--hf-config", str(mamba), "--engine", "vllm",
                     "--budget", "8MiB", "--max-model-len", "2048", "--cpu-avx512-bf16", "no",
                     "--target", kvpoold.target)
    assert out.returncode == 0, out.stderr
    assert "page 128: 4 pages (Mamba states only)" in out.stdout
    assert "vllm: 5 blocks of 128 tokens (1.34 MiB each), 1 group(s), 1 KV-cache tensor(s), " \
           "layout LBNHC" in out.stdout
    assert "block ids 1..4 hold Mamba states" in out.stdout

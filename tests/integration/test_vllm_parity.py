"""kvpool's vLLM profile against vLLM 0.32's own KV-cache sizing, case by case.

Every case runs twice on the same inputs: ``kvpoold plan --engine vllm --json`` (its real
command, in this process, once per pipeline rank) and vLLM's own path in the side venv
(``tests/vllm/vllm_sizes.py``: the engine config ``LLM(...)`` builds, the model instantiated on
the meta device, each attention layer's ``get_kv_cache_spec``, ``get_kv_cache_configs``). The
comparison covers every layer's spec, the block count, the KV-cache groups (type, layers,
block size, page, window), the KV-cache tensors (size, layers, strides, offset), the layout,
``max_model_len`` and the max concurrency. Where vLLM refuses an input, kvpool must refuse it
too.

Two kinds of case do not compare, and say why instead of being skipped silently:
``VLLM_ENV_REFUSALS``, inputs vLLM cannot run in this side venv for reasons outside sizing
(kvpool still plans them), and ``NOT_PROFILED``, inputs vLLM sizes and the profile does not yet
(it refuses them by name).

Skipped (with the reason) when the side venv is absent; ``.ci/run`` creates it first.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.side_venv import selected_cases
from tests.integration.vllm_diff import (
    MODELS,
    Case,
    GiB,
    MiB,
    layer_index,
    layer_specs,
    run_kvpool,
    run_vllm,
    summary,
)

# vLLM refuses these in the side venv for a reason that is not its sizing.
VLLM_ENV_REFUSALS = {
    # vLLM's Gemma3ForConditionalGeneration imports transformers' image processor, which needs
    # torchvision, left out of the side venv (a CUDA-built wheel next to the CPU torch): the
    # model class fails to load ("failed to be inspected")
    "gemma-3-4b-it": "failed to be inspected",
    # vLLM's CPU platform has no sparse-attention (DSA indexer) backend; the profile does not
    # size DSA either and refuses it by name
    "deepseek-v3.2-exp": "Sparse Attention is not supported on CPU",
}
# vLLM sizes these; the profile refuses them by name (not yet profiled). None at present: the
# last one, a GraniteMoeHybrid whose layers are all Mamba (attention-free), is planned since.
NOT_PROFILED: dict[str, str] = {}
# vLLM 0.32 has no CPU path for these on any host, and both sides refuse for vLLM's reason:
# Kimi Linear's model class opens a CUDA stream while it is built; with prefix caching on,
# vLLM's config check refuses it before (the CPU platform turns prefix caching off for MLA on
# a CPU without AMX after the hybrid hook set mamba_block_size; the harness has vLLM see no
# AMX, the profile's CPU_MLA path; with AMX the config check would pass and the CUDA stream
# still stop it). The plan vLLM's GPU code path makes is checked by hand in
# tests/unit/test_kda.py. (case uses prefix caching) -> (vLLM's error, kvpool's)
VLLM_NO_CPU_PATH: dict[str, dict[bool, tuple[str, str]]] = {
    "corpus/kimi-linear-48b-a3b-instruct": {
        True: ("--mamba-block-size can only be set with --enable-prefix-caching",
               "can only be set with --enable-prefix-caching"),
        False: ("torch.cuda.Stream requires CUDA support", "opens a CUDA stream"),
    },
}
# Configs of the corpus (tests/data/models/corpus/) the profile is checked on too: the ones
# whose reading rule differs from the top level's (legacy key names, multi-query, switches).
CORPUS = (
    "corpus/gpt_bigcode-santacoder",  # n_layer / n_head / n_embd, multi_query: 1 KV head
    "corpus/falcon-40b-instruct",  # Falcon's new decoder: multi_query ignored, num_kv_heads
    "corpus/starcoder2-7b",  # a model-level window on every layer
    "corpus/nemotron-h-56b-base-8k",  # Mamba-2 + attention + MLP blocks by letter
    "corpus/ai21-jamba-1.5-mini",  # Mamba-1 + attention by period and offset
    "corpus/kimi-linear-48b-a3b-instruct",  # Kimi delta attention + MLA: no CPU path
)

# SYNTHETIC configs of Mamba models no real Hub file of which is reachable here
# (tests/integration/synthetic_configs/README.md): built from the published sizes, accepted by
# transformers' config classes; what they check is the reading rule, not a published model.
SYNTHETIC = (
    "synthetic/falcon-h1-0.5b",  # attention + Mamba-2 in every layer (FalconH1ParallelHybrid)
    "synthetic/falcon-h1-7b",
    # no mamba_d_ssm: FalconH1Config's default 1,024 (16 heads of 64), as the engines read it
    "synthetic/falcon-h1-0.5b-no-d-ssm",
    "synthetic/granite-4.0-h-tiny",  # Mamba-2 or attention by layer_types
    "synthetic/granite-4.0-h-small",
    "synthetic/granite-4.0-micro",  # every layer attention: not hybrid to vLLM, no state
    "synthetic/granite-4.0-h-tiny-no-attention",  # no layer_types: every layer Mamba
    "synthetic/zamba2-1.2b",  # Mamba-2 everywhere, one shared block at 6 hybrid layers
    "synthetic/zamba2-2.7b",  # two shared blocks (ABAB), an attention module per use
    "synthetic/zamba2-7b",  # the same at 81 layers, 2 Mamba groups, head_dim 224
    # three shared blocks over 7 hybrid layers: vLLM's attention names skip model.attn.5;
    # linear_attention layer names, the class defaults (8 Mamba heads of 512, state 64)
    "synthetic/zamba2-three-blocks",
    # attention-free (vLLM's IsAttentionFree classes): one Mamba state per layer, no KV
    "synthetic/mamba-130m",  # Mamba-1
    "synthetic/falcon-mamba-7b",  # Mamba-1 (vLLM's MambaForCausalLM), intermediate_size kept
    "synthetic/mamba2-2.7b",  # Mamba-2, float16, no pipeline parallelism
)


def _cases() -> list[Case]:
    """Every config at 4 GiB and 2,048 tokens, at its own max_model_len with 64 GiB, then
    variants of each knob (block size, cache dtype, TP, PP, the hybrid manager, in-flight
    tokens, async scheduling, the block override, memory at and below one request)."""
    hf = sorted(p.stem for p in MODELS.glob("*.json")) + list(CORPUS) + list(SYNTHETIC)
    cases = [Case(f"{m}/base", m, {"kv_cache_memory_bytes": 4 * GiB, "max_model_len": 2048})
             for m in hf]
    cases += [Case(f"{m}/own-max-len", m, {"kv_cache_memory_bytes": 64 * GiB}) for m in hf]

    def variant(model: str, name: str, **options: Any) -> None:
        base = {"kv_cache_memory_bytes": 4 * GiB, "max_model_len": 2048}
        cases.append(Case(f"{model}/{name}", model, {**base, **options}))

    for bs in (16, 32, 48, 64, 256):
        variant("llama-3.1-8b-instruct", f"block{bs}", block_size=bs)
        variant("gemma-2-2b", f"block{bs}", block_size=bs)
    variant("gemma-3-1b-it", "block64", block_size=64)
    variant("gpt-oss-20b", "block16", block_size=16)
    variant("deepseek-v3", "block64-ignored", block_size=64)
    for m in ("llama-3.1-8b-instruct", "gemma-2-2b", "deepseek-v3", "gpt-oss-20b"):
        variant(m, "fp8", kv_cache_dtype="fp8")
    variant("llama-3.1-8b-instruct", "fp8-e5m2", kv_cache_dtype="fp8_e5m2")
    variant("qwen3-8b", "fp8-e4m3", kv_cache_dtype="fp8_e4m3")
    variant("llama-3.1-8b-instruct", "bf16", kv_cache_dtype="bfloat16")
    variant("llama-3.1-8b-instruct", "fp16", kv_cache_dtype="float16")
    variant("tinyllama-1.1b-chat-v0.4", "bf16", kv_cache_dtype="bfloat16")
    for m, tp in (("llama-3.1-8b-instruct", 2), ("llama-3.1-8b-instruct", 8),
                  ("qwen2-7b-instruct", 8), ("qwen2-7b-instruct", 4),
                  ("tinyllama-1.1b-chat-v0.4", 8), ("gpt-oss-20b", 4), ("gemma-3-1b-it", 4),
                  ("deepseek-v3", 4), ("llama-3.1-8b-instruct", 3)):
        variant(m, f"tp{tp}", tp_size=tp)
    for m, pp in (("llama-3.1-8b-instruct", 2), ("llama-3.1-8b-instruct", 3),
                  ("qwen3-next-80b-a3b-instruct", 2),
                  ("gemma-2-2b", 2), ("gemma-3-1b-it", 3), ("gpt-oss-20b", 2),
                  ("deepseek-v3", 2), ("tinyllama-1.1b-chat-v0.4", 4)):
        variant(m, f"pp{pp}", pp_size=pp)
    for m in ("gemma-2-2b", "gemma-3-1b-it", "gpt-oss-20b", "mistral-7b-v0.1",
              "phi-3-mini-4k-instruct"):
        variant(m, "no-hybrid", disable_hybrid_kv_cache_manager=True)
    variant("gpt-oss-20b", "batched-256", max_num_batched_tokens=256)
    # max_num_batched_tokens unset: vLLM's default by entry point (CPU: 4,096 x TP x PP for
    # LLM(...), 2,048 x TP x PP for vllm serve) sets the blocks a sliding window holds
    variant("gpt-oss-20b", "serve", entrypoint="serve")
    variant("gpt-oss-20b", "serve-tp2", entrypoint="serve", tp_size=2)
    variant("gemma-3-1b-it", "serve-pp2", entrypoint="serve", pp_size=2)
    variant("mistral-7b-v0.1", "serve", entrypoint="serve")
    variant("gemma-2-2b", "llm-tp2", entrypoint="llm", tp_size=2)
    # Qwen3-Next's gated delta nets: TP stays 1 (the harness cannot split a mamba state)
    variant("qwen3-next-80b-a3b-instruct", "no-prefix-caching", no_enable_prefix_caching=True)
    variant("qwen3-next-80b-a3b-instruct", "block256", block_size=256)
    variant("qwen3-next-80b-a3b-instruct", "block1024", block_size=1024)
    variant("qwen3-next-80b-a3b-instruct", "fp8", kv_cache_dtype="fp8")
    variant("qwen3-next-80b-a3b-instruct", "no-hybrid", disable_hybrid_kv_cache_manager=True)
    variant("qwen3-next-80b-a3b-instruct", "memory-256MiB", kv_cache_memory_bytes=256 * MiB)
    # the SSM state dtype: vLLM's CPU platform stores an "auto" state in float32 on a CPU with
    # AVX-512 BF16 (the harness has vLLM see either CPU), a named dtype as named
    variant("qwen3-next-80b-a3b-instruct", "cpu-avx512-bf16", cpu_avx512_bf16="yes")
    variant("qwen3-next-80b-a3b-instruct", "cpu-no-avx512-bf16", cpu_avx512_bf16="no")
    variant("qwen3-next-80b-a3b-instruct", "pp2-cpu-no-avx512-bf16", pp_size=2,
            cpu_avx512_bf16="no")
    variant("qwen3-next-80b-a3b-instruct", "ssm-bf16-cpu-avx512-bf16",
            mamba_ssm_cache_dtype="bfloat16", cpu_avx512_bf16="yes")
    variant("qwen3-next-80b-a3b-instruct", "ssm-fp16-cpu-avx512-bf16",
            mamba_ssm_cache_dtype="float16", cpu_avx512_bf16="yes")
    variant("qwen3-next-80b-a3b-instruct", "ssm-fp32-cpu-no-avx512-bf16",
            mamba_ssm_cache_dtype="float32", cpu_avx512_bf16="no")
    # Mamba hybrids: Nemotron-H's SSM state is float32 unless named (its config hook), Jamba's
    # the model dtype (float32 on a CPU with AVX-512 BF16); a named half dtype stays on either
    # CPU (transformers calls both mixers linear_attention); TP stays 1
    nemotron, jamba = "corpus/nemotron-h-56b-base-8k", "corpus/ai21-jamba-1.5-mini"
    variant(nemotron, "block128-4096", block_size=128, max_model_len=4096)
    variant(nemotron, "ssm-bf16-cpu-avx512-bf16", mamba_ssm_cache_dtype="bfloat16",
            cpu_avx512_bf16="yes")
    variant(nemotron, "ssm-fp16-cpu-no-avx512-bf16", mamba_ssm_cache_dtype="float16",
            cpu_avx512_bf16="no")
    variant(nemotron, "no-prefix-caching", no_enable_prefix_caching=True)
    variant(nemotron, "pp2", pp_size=2)
    variant(nemotron, "fp8", kv_cache_dtype="fp8")
    variant(nemotron, "memory-512MiB", kv_cache_memory_bytes=512 * MiB)
    variant(jamba, "cpu-avx512-bf16", cpu_avx512_bf16="yes")
    variant(jamba, "cpu-no-avx512-bf16", cpu_avx512_bf16="no")
    variant(jamba, "ssm-bf16-cpu-avx512-bf16", mamba_ssm_cache_dtype="bfloat16",
            cpu_avx512_bf16="yes")
    variant(jamba, "pp3-cpu-no-avx512-bf16", pp_size=3, cpu_avx512_bf16="no")
    variant(jamba, "block512", block_size=512)
    variant(jamba, "no-hybrid", disable_hybrid_kv_cache_manager=True)
    # Falcon-H1's SSM state on a CPU with AVX-512 BF16 is float32 even when named half (its
    # layer_types, transformers' layers_block_type, lists no linear_attention), Granite-4.0-H's
    # stays as named; TP stays 1
    falcon, granite = "synthetic/falcon-h1-0.5b", "synthetic/granite-4.0-h-tiny"
    for m in (falcon, granite):
        variant(m, "cpu-avx512-bf16", cpu_avx512_bf16="yes")
        variant(m, "ssm-bf16-cpu-avx512-bf16", mamba_ssm_cache_dtype="bfloat16",
                cpu_avx512_bf16="yes")
        variant(m, "ssm-fp16-cpu-no-avx512-bf16", mamba_ssm_cache_dtype="float16",
                cpu_avx512_bf16="no")
        variant(m, "no-prefix-caching", no_enable_prefix_caching=True)
        variant(m, "pp2", pp_size=2)
        variant(m, "pp3", pp_size=3)
        variant(m, "block1024", block_size=1024)
        variant(m, "fp8", kv_cache_dtype="fp8")
        variant(m, "no-hybrid", disable_hybrid_kv_cache_manager=True)
        variant(m, "memory-256MiB", kv_cache_memory_bytes=256 * MiB)
    variant("synthetic/falcon-h1-7b", "ssm-fp32", mamba_ssm_cache_dtype="float32")
    # Zamba2: attention modules model.attn.{j} (one per use of a shared block) registered
    # before the mixers {h + i}.mixer; its layer_types (layers_block_type) lists
    # linear_attention, so a named half SSM dtype stays on a CPU with AVX-512 BF16; no
    # SupportsPP (both sides refuse pp2); TP stays 1
    zamba, small = "synthetic/zamba2-2.7b", "synthetic/zamba2-1.2b"
    variant(small, "cpu-avx512-bf16", cpu_avx512_bf16="yes")
    variant(small, "cpu-no-avx512-bf16", cpu_avx512_bf16="no")
    variant(small, "ssm-bf16-cpu-avx512-bf16", mamba_ssm_cache_dtype="bfloat16",
            cpu_avx512_bf16="yes")
    variant(small, "ssm-fp16-cpu-no-avx512-bf16", mamba_ssm_cache_dtype="float16",
            cpu_avx512_bf16="no")
    variant(zamba, "no-prefix-caching", no_enable_prefix_caching=True)
    variant(zamba, "pp2", pp_size=2)
    variant(zamba, "block1024", block_size=1024)
    variant(zamba, "fp8", kv_cache_dtype="fp8")
    variant(zamba, "no-hybrid", disable_hybrid_kv_cache_manager=True)
    variant(zamba, "memory-256MiB", kv_cache_memory_bytes=256 * MiB)
    variant("synthetic/zamba2-7b", "cpu-no-avx512-bf16", cpu_avx512_bf16="no")
    variant("synthetic/zamba2-7b", "block512-4096", block_size=512, max_model_len=4096,
            kv_cache_memory_bytes=16 * GiB)
    variant("synthetic/zamba2-1.2b", "ssm-fp32", mamba_ssm_cache_dtype="float32")
    # attention-free Mamba models: no attention backend, so vLLM's LBNHC layout and no block
    # alignment; with prefix caching states are kept per --block-size tokens, else per 16
    # (the block size the model's hook copies before the CPU platform sets 128), without it
    # per max_model_len; the SSM dtype follows the Mamba hybrids' rule (transformers lists
    # linear_attention for every layer); TP stays 1
    mamba1, mamba2 = "synthetic/mamba-130m", "synthetic/mamba2-2.7b"
    falcon_mamba = "synthetic/falcon-mamba-7b"
    no_attention = "synthetic/granite-4.0-h-tiny-no-attention"
    for m in (mamba1, mamba2, falcon_mamba, no_attention):
        variant(m, "no-prefix-caching", no_enable_prefix_caching=True)
        variant(m, "block64", block_size=64)
        variant(m, "cpu-avx512-bf16", cpu_avx512_bf16="yes")
        variant(m, "cpu-no-avx512-bf16", cpu_avx512_bf16="no")
        variant(m, "ssm-bf16-cpu-avx512-bf16", mamba_ssm_cache_dtype="bfloat16",
                cpu_avx512_bf16="yes")
        variant(m, "pp2", pp_size=2)  # Mamba2ForCausalLM: both refuse (no SupportsPP)
        variant(m, "memory-64MiB", kv_cache_memory_bytes=64 * MiB)
    variant(mamba1, "ssm-fp16-cpu-no-avx512-bf16", mamba_ssm_cache_dtype="float16",
            cpu_avx512_bf16="no")
    variant(mamba1, "block16-no-prefix-caching", block_size=16, no_enable_prefix_caching=True)
    variant(mamba1, "pp3", pp_size=3)
    variant(mamba1, "no-hybrid", disable_hybrid_kv_cache_manager=True)
    variant(mamba1, "fp8", kv_cache_dtype="fp8")
    variant(mamba1, "max-len-above-model", max_model_len=4096)
    variant(mamba1, "override-5", num_gpu_blocks_override=5)
    # a request holds 2 blocks of 24 x 107,520 B (float32 SSM states), the null block one more
    variant(mamba1, "memory-3-blocks", kv_cache_memory_bytes=3 * 24 * 107_520,
            cpu_avx512_bf16="yes")
    variant(mamba1, "memory-3-blocks-less-1", kv_cache_memory_bytes=3 * 24 * 107_520 - 1,
            cpu_avx512_bf16="yes")
    variant(mamba2, "ssm-fp32", mamba_ssm_cache_dtype="float32")
    variant(mamba2, "async", async_scheduling=True)
    kimi = "corpus/kimi-linear-48b-a3b-instruct"
    variant(kimi, "no-prefix-caching", no_enable_prefix_caching=True)
    variant(kimi, "no-prefix-caching-ssm-fp32", no_enable_prefix_caching=True,
            mamba_ssm_cache_dtype="float32")
    variant("gemma-3-1b-it", "async", async_scheduling=True)
    variant("llama-3.1-8b-instruct", "override-100", kv_cache_memory_bytes=GiB,
            num_gpu_blocks_override=100)
    variant("gemma-2-2b", "override-5", num_gpu_blocks_override=5)
    variant("llama-3.1-8b-instruct", "memory-1MiB", kv_cache_memory_bytes=MiB)
    variant("llama-3.1-8b-instruct", "memory-one-block", kv_cache_memory_bytes=16 * MiB)
    # a request of 2,048 tokens takes 16 blocks of 16 MiB, and the null block one more
    variant("llama-3.1-8b-instruct", "memory-exact", kv_cache_memory_bytes=17 * 16 * MiB)
    variant("llama-3.1-8b-instruct", "memory-exact-less-1",
            kv_cache_memory_bytes=17 * 16 * MiB - 1)
    variant("gpt-oss-20b", "memory-tight", kv_cache_memory_bytes=96 * MiB,
            max_num_batched_tokens=512)
    variant("tinyllama-1.1b-chat-v0.4", "max-len-above-model", max_model_len=4096)
    variant("llama-3.1-8b-instruct", "own-max-len-1GiB", max_model_len=None,
            kv_cache_memory_bytes=GiB)
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def vllm_results(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """vLLM's results for the cases this session runs (all, or those ``-k`` picks), from one
    run of the harness in the side venv."""
    return run_vllm(selected_cases(request, CASES))


def _check(case: Case, theirs: dict[str, Any]) -> None:
    if case.model in VLLM_NO_CPU_PATH:
        vllm_says, kvpool_says = VLLM_NO_CPU_PATH[case.model][
            not case.options.get("no_enable_prefix_caching", False)]
        ours = run_kvpool(case, 0)
        assert not theirs["ok"] and vllm_says in theirs["error"], theirs
        assert not ours["ok"] and "has no cpu path" in ours["error"], ours
        assert kvpool_says in ours["error"], ours["error"]
        return
    if case.model in VLLM_ENV_REFUSALS:
        assert not theirs["ok"] and VLLM_ENV_REFUSALS[case.model] in theirs["error"], theirs
        ours = run_kvpool(case, 0)
        if ours["ok"]:
            pytest.xfail(f"vLLM cannot run {case.model} here: {theirs['error'][:200]}")
        # a refusal on both sides (e.g. not enough memory) is still agreement
        return
    if case.model in NOT_PROFILED and theirs["ok"]:
        ours = run_kvpool(case, 0)
        assert not ours["ok"] and NOT_PROFILED[case.model] in ours["error"], ours
        pytest.xfail(f"vLLM sizes {case.model}; the profile does not yet "
                     f"({NOT_PROFILED[case.model]})")
    for rank in range(case.pp_size):
        ours = run_kvpool(case, rank)
        if not theirs["ok"]:
            assert not ours["ok"], (
                f"vLLM refuses ({theirs['error'][:300]}) but kvpool planned "
                f"{ours.get('num_blocks')} blocks")
            return
        assert ours["ok"], f"kvpool refused ({ours['error']}) what vLLM sized"
        stage = theirs["stages"][rank]
        assert summary(ours) == summary({**theirs, **stage}, stage)
        mine = layer_specs(ours["layers"])
        indices = {s[0] for s in mine}
        assert mine == [s for s in layer_specs(theirs["layers"]) if s[0] in indices]
        assert {layer_index(n) for g in stage["groups"] for n in g["layer_names"]} == indices


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kvpool_plans_what_vllm_sizes(case: Case,
                                      vllm_results: dict[str, dict[str, Any]]) -> None:
    _check(case, vllm_results[case.id])


def test_the_cases_cover_every_config_and_knob() -> None:
    """Every config, and each of vLLM's knobs the profile reads, in at least one case."""
    assert {c.model for c in CASES} == {p.stem for p in MODELS.glob("*.json")} | set(
        CORPUS) | set(SYNTHETIC)
    seen = {k for c in CASES for k in c.options}
    assert seen >= {"kv_cache_memory_bytes", "block_size", "kv_cache_dtype", "max_model_len",
                    "tp_size", "pp_size", "num_gpu_blocks_override",
                    "disable_hybrid_kv_cache_manager", "max_num_batched_tokens",
                    "async_scheduling", "no_enable_prefix_caching", "mamba_ssm_cache_dtype",
                    "cpu_avx512_bf16", "entrypoint"}

"""kvpool's plans against SGLang 0.5.23's own sizing code, case by case (the differential test).

Every case runs twice on the same inputs: ``kvpoold plan --json`` (its real command, in this
process) and SGLang's own startup and pool-sizing path (``tests/sglang/sglang_sizes.py`` in the
side virtualenv ``.venv-sglang`` that ``tests/sglang/setup_venv.sh`` makes; SGLang's budget is
the same byte count). The test compares what decides a pool: the architecture family, the
resolved KV dtype, the context length, ``max_total_num_tokens``, ``max_running_requests``, the
full/SWA token counts and ``mamba_cache_size``. Where SGLang refuses an input, kvpool must
refuse it too (exit 2 naming a field); where SGLang refuses only because this machine has no
GPU, the case says so (``CPU_REFUSALS``) instead of being skipped silently. The case, both
sides and the comparison are in ``sglang_diff.py`` (shared with ``test_sglang_corpus.py``).

Skipped (with the reason) when the side venv is absent; ``.ci/run`` creates it first.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.sglang_diff import MODELS, Case, GiB, check_case, run_sglang


def _cases() -> list[Case]:
    """The generated inputs: every config at page 16 (DSA: 64), then variants of each knob."""
    hf = sorted(p.stem for p in MODELS.glob("*.json"))
    page = {"deepseek-v3.2-exp": 64}
    cases = [Case(f"{m}/base", m, {"budget_bytes": 8 * GiB, "page_size": page.get(m, 16)})
             for m in hf]
    cases += [Case(f"{m}/page1-40GiB", m, {"budget_bytes": 40 * GiB, "page_size": 1})
              for m in hf if m not in page]

    def variants(model: str, name: str, options: dict[str, Any]) -> None:
        base = {"budget_bytes": 8 * GiB, "page_size": page.get(model, 16)}
        cases.append(Case(f"{model}/{name}", model, {**base, **options}))

    for m, tp in (("llama-3.1-8b-instruct", 2), ("llama-3.1-8b-instruct", 8),
                  ("qwen3-8b", 4), ("gpt-oss-20b", 2), ("gpt-oss-20b", 8),
                  ("deepseek-v3", 8), ("qwen3-next-80b-a3b-instruct", 2),
                  ("qwen3-next-80b-a3b-instruct", 4), ("tinyllama-1.1b-chat-v0.4", 8)):
        variants(m, f"tp{tp}", {"tp_size": tp})
    for m in ("llama-3.1-8b-instruct", "gpt-oss-20b", "qwen3-next-80b-a3b-instruct",
              "deepseek-v3", "gemma-2-2b"):
        for rank in (0, 1):
            variants(m, f"pp2-rank{rank}", {"pp_size": 2, "pp_rank": rank})
    for m in ("llama-3.1-8b-instruct", "deepseek-v3", "deepseek-v3.2-exp", "gpt-oss-20b",
              "qwen3-next-80b-a3b-instruct", "mistral-7b-v0.1"):
        variants(m, "fp8", {"kv_cache_dtype": "fp8_e4m3"})
    variants("llama-3.1-8b-instruct", "fp8-e5m2", {"kv_cache_dtype": "fp8_e5m2"})
    variants("tinyllama-1.1b-chat-v0.4", "bf16", {"kv_cache_dtype": "bfloat16"})
    for m in ("llama-3.1-8b-instruct", "deepseek-v3", "gpt-oss-20b", "qwen3-8b"):
        variants(m, "eagle", {"speculative_algorithm": "eagle",
                              "speculative_num_draft_layers": 1,
                              "speculative_num_draft_tokens": 4})
    for m in ("llama-3.1-8b-instruct", "gpt-oss-20b", "qwen3-next-80b-a3b-instruct",
              "deepseek-v3.2-exp"):
        variants(m, "max-total-tokens", {"max_total_tokens": 100_000})
    for m in ("llama-3.1-8b-instruct", "qwen3-next-80b-a3b-instruct", "gemma-3-1b-it"):
        variants(m, "context-8k", {"context_length": 8192})
    variants("llama-3.1-8b-instruct", "context-above-model", {"context_length": 1 << 20})
    variants("llama-3.1-8b-instruct", "context-above-model-allowed",
             {"context_length": 1 << 20, "allow_longer_context": True})
    for ratio in (0.5, 1.0):
        variants("gpt-oss-20b", f"swa-ratio-{ratio}", {"swa_full_tokens_ratio": ratio})
    for strategy in ("no_buffer", "extra_buffer"):
        variants("qwen3-next-80b-a3b-instruct", f"mamba-{strategy}",
                 {"mamba_radix_cache_strategy": strategy})
    variants("qwen3-next-80b-a3b-instruct", "mamba-no_buffer-page1-no-overlap",
             {"mamba_radix_cache_strategy": "no_buffer", "page_size": 1,
              "disable_overlap_schedule": True})
    variants("qwen3-next-80b-a3b-instruct", "mamba-no_buffer-page1-overlap",
             {"mamba_radix_cache_strategy": "no_buffer", "page_size": 1})
    variants("qwen3-next-80b-a3b-instruct", "mamba-extra_buffer-no-overlap",
             {"mamba_radix_cache_strategy": "extra_buffer", "disable_overlap_schedule": True})
    variants("qwen3-next-80b-a3b-instruct", "mamba-ratio-0.5", {"mamba_full_memory_ratio": 0.5})
    for m in ("qwen3-next-80b-a3b-instruct", "llama-3.1-8b-instruct", "gpt-oss-20b"):
        variants(m, "no-radix-mrr64", {"disable_radix_cache": True,
                                        "max_running_requests": 64})
    variants("llama-3.1-8b-instruct", "mrr-100", {"max_running_requests": 100})
    for name, options in (("chunk-2048", {"chunked_prefill_size": 2048}),
                          ("no-overlap", {"disable_overlap_schedule": True}),
                          ("max-total-tokens", {"max_total_tokens": 50_000}),
                          ("max-total-tokens-unaligned", {"max_total_tokens": 20_001})):
        variants("gpt-oss-20b", f"no-radix-mrr64-{name}",
                 {"disable_radix_cache": True, "max_running_requests": 64, **options})
    variants("llama-3.1-8b-instruct", "budget-too-small", {"budget_bytes": 1 << 20})
    variants("qwen3-next-80b-a3b-instruct", "budget-256MiB", {"budget_bytes": 256 << 20})
    variants("qwen3-next-80b-a3b-instruct", "budget-64MiB", {"budget_bytes": 64 << 20})
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def sglang_results() -> dict[str, dict[str, Any]]:
    """SGLang's results for every case, from one run of the harness in the side venv."""
    return run_sglang(CASES)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kvpool_plans_what_sglang_sizes(case: Case,
                                        sglang_results: dict[str, dict[str, Any]]) -> None:
    check_case(case, sglang_results[case.id])


def test_the_cases_cover_every_config_and_knob() -> None:
    """The matrix the issue asks for: every config, pages 1/16/64, TP 1-8, PP stages, fp8,
    EAGLE draft layers, max_total_tokens, context_length, SWA ratio, mamba strategies and
    ratio, disable_radix_cache with max_running_requests."""
    models = {p.stem for p in MODELS.glob("*.json")}
    assert {c.model for c in CASES} == models
    seen = {(k, str(v)) for c in CASES for k, v in c.options.items()}
    for needed in [("page_size", "1"), ("page_size", "16"), ("page_size", "64"),
                   ("tp_size", "2"), ("tp_size", "4"), ("tp_size", "8"), ("pp_rank", "1"),
                   ("kv_cache_dtype", "fp8_e4m3"), ("speculative_algorithm", "eagle"),
                   ("max_total_tokens", "100000"), ("context_length", "8192"),
                   ("swa_full_tokens_ratio", "0.5"),
                   ("mamba_radix_cache_strategy", "extra_buffer"),
                   ("mamba_full_memory_ratio", "0.5"), ("disable_radix_cache", "True")]:
        assert needed in seen, needed

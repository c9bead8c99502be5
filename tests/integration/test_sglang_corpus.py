"""kvpool's plans against SGLang 0.5.23's sizing over the whole config corpus (issue 27).

Every real ``config.json`` under ``tests/data/models`` (the top level and ``corpus/``; sources
in that folder's README) runs on three option sets, chosen so the corpus together covers
budgets 2/20/60 GiB, pages 1/16/64, TP 1/2/8 and KV dtypes auto/fp8_e4m3:

* ``20GiB-p16``: 20 GiB, page 16, TP 1, auto;
* ``60GiB-p64-fp8-tpN``: 60 GiB, page 64, ``fp8_e4m3``, TP 8 where the query heads divide by 8
  (else 2, else 1);
* ``2GiB-p1-tpN``: 2 GiB, page 1, TP 2 where the query heads are even (else 1), auto.

Each case runs ``kvpoold plan --json`` here and SGLang's launch path in the side venv
(``tests/sglang/sglang_sizes.py``, every case in one harness run) and goes through the same
check as ``test_sglang_parity.py`` (``sglang_diff.check_case``): the two agree on family, KV
dtype, context length and every pool size, or both refuse. A difference known today is listed
in ``KNOWN_DIFFS`` (one line per cause in ``tests/data/models/DIFFS.md``) and marks its cases
``xfail(strict=True)``: a fix turns them XPASS, which fails until the entry goes.

Skipped (with the reason) when the side venv is absent; ``.ci/run`` creates it first.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.sglang_diff import MODELS, Case, GiB, check_case, run_sglang
from tests.integration.side_venv import selected_cases

CONFIGS = sorted(str(p.relative_to(MODELS).with_suffix(""))
                 for p in [*MODELS.glob("*.json"), *MODELS.glob("corpus/*.json")])


def _query_heads(model: str) -> int:
    """The query heads of a config (its text config for multimodal wrappers), 1 when unstated."""
    config = json.loads((MODELS / f"{model}.json").read_text())  # Python reads Infinity/NaN
    text = config.get("text_config") or config.get("llm_config") or config
    return int(text.get("num_attention_heads") or text.get("n_head") or 1)


def _option_sets(model: str) -> dict[str, dict[str, Any]]:
    heads = _query_heads(model)
    wide = 8 if heads % 8 == 0 else 2 if heads % 2 == 0 else 1
    narrow = 2 if heads % 2 == 0 else 1
    return {
        "20GiB-p16": {"budget_bytes": 20 * GiB, "page_size": 16},
        f"60GiB-p64-fp8-tp{wide}": {"budget_bytes": 60 * GiB, "page_size": 64,
                                    "kv_cache_dtype": "fp8_e4m3", "tp_size": wide},
        f"2GiB-p1-tp{narrow}": {"budget_bytes": 2 * GiB, "page_size": 1, "tp_size": narrow},
    }


CASES = [Case(f"{m}/{name}", m, options) for m in CONFIGS
         for name, options in _option_sets(m).items()]
# The --gpu profiles: each device fact that changes SGLang's sizing, on a config it changes
# (Qwen3-VL's multimodal cache on Hopper, DSA's auto KV dtype on Blackwell, the prefill chunk a
# hybrid SWA pool without the radix cache is sized by).
CASES += [Case(f"{m}/{gpu}{suffix}", m, {"budget_bytes": 20 * GiB, "page_size": 16,
                                         "gpu": gpu, **extra})
          for m, suffix, extra in (
              ("corpus/qwen3-vl-8b-instruct", "", {}),
              ("corpus/deepseek-v3.2", "", {"page_size": 64}),
              ("gpt-oss-20b", "-no-radix-mrr64", {"disable_radix_cache": True,
                                                   "max_running_requests": 64}),
          )
          for gpu in ("h200", "b200", "a100-80g")]
# The multimodal reservation at high concurrency: every multimodal wrapper of the corpus (and
# those SGLang serves as text) at --max-running-requests 400, where SGLang's Qwen3-VL override
# raises its CUDA IPC feature pool from 1 to 3 GiB on a large Hopper GPU; the others keep the
# fixed 100 MiB (or nothing). The step's edge (399), a second Hopper, a GPU off that path.
_MM_WRAPPERS = ("corpus/gemma-4-26b-a4b", "corpus/kimi-k2.5",
                "corpus/llama-4-scout-17b-16e-instruct", "corpus/llava-1.5-7b-hf",
                "corpus/ministral-3-3b-instruct-2512",
                "corpus/qwen3-vl-8b-instruct", "corpus/qwen3-vl-30b-a3b-instruct",
                "corpus/qwen3.5-35b-a3b", "gemma-3-4b-it")
CASES += [Case(f"{m}/mrr400", m, {"budget_bytes": 20 * GiB, "page_size": 16,
                                  "max_running_requests": 400}) for m in _MM_WRAPPERS]
CASES += [Case(f"{m}/{gpu}-mrr{mrr}", m, {"budget_bytes": 20 * GiB, "page_size": 16, "gpu": gpu,
                                          "max_running_requests": mrr})
          for m, gpu, mrr in (("corpus/qwen3-vl-8b-instruct", "h100-80g", 399),
                              ("corpus/qwen3-vl-30b-a3b-instruct", "h200", 1024),
                              ("corpus/qwen3-vl-30b-a3b-instruct", "a100-80g", 1024))]
# 2 GiB at 400 requests: the 3 GiB reserved leaves nothing, and both refuse
CASES += [Case("corpus/qwen3-vl-8b-instruct/2GiB-mrr400", "corpus/qwen3-vl-8b-instruct",
               {"budget_bytes": 2 * GiB, "page_size": 16, "max_running_requests": 400})]
# DeepSeek-V4 beyond the matrix: its own engine defaults (ratio 0.1, 256 requests), speculative
# decoding (SGLang prices the draft worker as (L + 1) / L), a given ratio and request cap, PP.
_V4 = "corpus/deepseek-v4-flash"
CASES += [Case(f"{_V4}/{name}", _V4, {"budget_bytes": 20 * GiB, "page_size": 256, **options})
          for name, options in (
              ("eagle", {"speculative_algorithm": "eagle", "speculative_num_draft_tokens": 2}),
              ("ratio-0.5-mrr64", {"swa_full_tokens_ratio": 0.5, "max_running_requests": 64}),
              ("pp2-rank1", {"pp_size": 2, "pp_rank": 1}),
          )]

# Kimi Linear (Kimi delta attention) beyond the matrix: its state pool under each of SGLang's
# state rules (no radix cache, no_buffer, extra_buffer without the overlap schedule, the mamba
# memory ratio, a request cap), speculative decoding's intermediate states (no draft layers:
# SGLang prices a Kimi Linear draft by its num_nextn_predict_layers, 0), PP stages, TP sizes
# the 32 KDA heads do not split over, and budgets below one request's state (all refused).
_KIMI = "corpus/kimi-linear-48b-a3b-instruct"
_EAGLE = {"speculative_algorithm": "eagle", "speculative_num_draft_layers": 0,
          "speculative_num_draft_tokens": 4, "max_running_requests": 32}
CASES += [Case(f"{_KIMI}/{name}", _KIMI, {"budget_bytes": 20 * GiB, "page_size": 16, **options})
          for name, options in (
              ("no-radix-mrr64", {"disable_radix_cache": True, "max_running_requests": 64}),
              ("no_buffer-p1-no-overlap", {"page_size": 1, "disable_overlap_schedule": True,
                                           "mamba_radix_cache_strategy": "no_buffer"}),
              ("extra_buffer-no-overlap", {"mamba_radix_cache_strategy": "extra_buffer",
                                           "disable_overlap_schedule": True}),
              ("mamba-ratio-0.5", {"mamba_full_memory_ratio": 0.5}),
              ("mrr16", {"max_running_requests": 16}),
              ("max-total-tokens", {"max_total_tokens": 100_000}),
              ("eagle", _EAGLE),
              ("eagle-no-radix", {**_EAGLE, "disable_radix_cache": True}),
              ("pp2-rank0", {"pp_size": 2, "pp_rank": 0}),
              ("pp2-rank1", {"pp_size": 2, "pp_rank": 1}),
              ("tp3", {"tp_size": 3}),
              ("tp64", {"tp_size": 64}),
              ("budget-256MiB", {"budget_bytes": 256 << 20}),
              ("budget-64MiB", {"budget_bytes": 64 << 20}),
          )]

# Differences known today, by config (every case of it) or by case id; one line per cause in
# tests/data/models/DIFFS.md. None: every case agrees, or both refuse.
KNOWN_DIFFS: dict[str, str] = {}


def _params() -> list[Any]:
    params = []
    for case in CASES:
        reason = KNOWN_DIFFS.get(case.id) or KNOWN_DIFFS.get(case.model)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


@pytest.fixture(scope="module")
def sglang_results(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """SGLang's results for the corpus cases this session runs (all, or those ``-k`` picks),
    from one run of the harness in the side venv."""
    return run_sglang(selected_cases(request, CASES))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", _params())
def test_kvpool_plans_what_sglang_sizes(case: Case,
                                        sglang_results: dict[str, dict[str, Any]]) -> None:
    check_case(case, sglang_results[case.id])


def test_known_diffs_name_real_cases() -> None:
    """Every KNOWN_DIFFS key is a config or a case of the corpus (a stale key hides nothing)."""
    names = {c.id for c in CASES} | set(CONFIGS)
    assert not set(KNOWN_DIFFS) - names, sorted(set(KNOWN_DIFFS) - names)


def test_the_corpus_covers_the_families_and_schemes() -> None:
    """At least 50 real configs, with every attention family and quantization scheme the issue
    names, budgets 2/20/60 GiB, pages 1/16/64, TP 1/2/8, KV dtypes auto and fp8_e4m3."""
    assert len(CONFIGS) >= 50, len(CONFIGS)
    configs = [json.loads((MODELS / f"{m}.json").read_text()) for m in CONFIGS]
    architectures = {c["architectures"][0] for c in configs}
    for needed in ("LlamaForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                   "MixtralForCausalLM", "ChatGLMModel", "DeepseekV2ForCausalLM",
                   "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                   "GptOssForCausalLM", "Llama4ForConditionalGeneration",
                   "Gemma4ForConditionalGeneration", "MiMoV2FlashForCausalLM",
                   "Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration",
                   "NemotronHForCausalLM", "DeepseekV4ForCausalLM",
                   "Qwen3VLForConditionalGeneration", "LlavaForConditionalGeneration",
                   "KimiK25ForConditionalGeneration", "KimiLinearForCausalLM"):
        assert needed in architectures, needed
    quant = [c.get("quantization_config") or c.get("text_config", {}).get("quantization_config")
             or {} for c in configs]
    methods = {q.get("quant_method") for q in quant}
    assert {"fp8", "mxfp4", "modelopt", "compressed-tensors"} <= methods, methods
    assert any(q.get("kv_cache_scheme") for q in quant)
    assert any("Infinity" in (MODELS / f"{m}.json").read_text() for m in CONFIGS)
    seen = {(k, v) for c in CASES for k, v in c.options.items()}
    for needed in [("budget_bytes", 2 * GiB), ("budget_bytes", 20 * GiB),
                   ("budget_bytes", 60 * GiB), ("page_size", 1), ("page_size", 16),
                   ("page_size", 64), ("tp_size", 2), ("tp_size", 8),
                   ("kv_cache_dtype", "fp8_e4m3")]:
        assert needed in seen, needed

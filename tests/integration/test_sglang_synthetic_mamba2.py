"""The SYNTHETIC Falcon-H1 and Granite-4.0-H configs (``tests/integration/synthetic_configs``;
no real Hub file is reachable: see that folder's README) against SGLang 0.5.23, the same check
as the corpus (``sglang_diff.check_case``: family, KV dtype, token and request counts, state
slots), on the corpus's option sets. The folder's attention-free Mamba-1/2 configs are checked
too: SGLang 0.5.23 has no implementation of those classes and kvpool's SGLang profile refuses
them as well. The vLLM profile checks them all against vLLM 0.32 in ``test_vllm_parity.py``
(cases ``synthetic/...``). Skipped without the side venv.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sglang_diff import Case, GiB, check_case, run_sglang
from tests.integration.side_venv import selected_cases
from tests.integration.vllm_diff import SYNTHETIC

CONFIGS = sorted(p.stem for p in SYNTHETIC.glob("*.json"))


@dataclass
class FileCase(Case):
    """A case whose config is a synthetic file outside tests/data/models."""

    @property
    def config(self) -> Path:
        return SYNTHETIC / f"{self.model}.json"


OPTIONS: dict[str, dict[str, Any]] = {
    "20GiB-p16": {"budget_bytes": 20 * GiB, "page_size": 16},
    "60GiB-p64-fp8-tp2": {"budget_bytes": 60 * GiB, "page_size": 64,
                          "kv_cache_dtype": "fp8_e4m3", "tp_size": 2},
    "2GiB-p1": {"budget_bytes": 2 * GiB, "page_size": 1},
}
CASES = [FileCase(f"{m}/{o}", m, values) for m in CONFIGS for o, values in OPTIONS.items()]


@pytest.fixture(scope="module")
def sglang_results(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    return run_sglang(selected_cases(request, CASES))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_synthetic_mamba2_hybrid_is_planned_as_sglang_sizes_it(
        case: FileCase, sglang_results: dict[str, dict[str, Any]]) -> None:
    check_case(case, sglang_results[case.id])

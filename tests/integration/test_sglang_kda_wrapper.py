"""A multimodal wrapper whose text config is Kimi Linear, against SGLang 0.5.23 (issue 42).

SGLang's ``KimiK3Config`` builds its ``text_config`` as a ``KimiLinearConfig``, so
``hybrid_arch.kimi_linear_config`` gives it a Kimi delta attention state pool although the
class's architecture row (read from the wrapper class alone) says MLA. No complete published
Kimi-K3 ``config.json`` was found, so the wrappers here are SYNTHETIC: the real Kimi-Linear-48B
config (``tests/data/models/corpus/kimi-linear-48b-a3b-instruct.json``) as the ``text_config``
of ``KimiK3ForConditionalGeneration`` (``model_type: kimi_k3``), with and without the text
config's own ``model_type``. Each runs through ``kvpoold plan --json`` and SGLang's launch path
(the same check as the corpus, ``sglang_diff.check_case``). Skipped without the side venv.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sglang_diff import MODELS, Case, GiB, check_case, run_sglang

KIMI = MODELS / "corpus" / "kimi-linear-48b-a3b-instruct.json"


@dataclass
class FileCase(Case):
    """A case whose config is a file outside tests/data/models (a synthetic one)."""

    path: Path = Path()

    @property
    def config(self) -> Path:
        return self.path


def _wrapper(text_model_type: bool) -> dict[str, Any]:
    text = {k: v for k, v in json.loads(KIMI.read_text()).items()
            if k not in ("architectures", "auto_map")}
    if not text_model_type:
        del text["model_type"]
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "dtype": "bfloat16", "text_config": text}


OPTIONS = {
    "20GiB-p16": {"budget_bytes": 20 * GiB, "page_size": 16},
    "60GiB-p64-fp8-tp8": {"budget_bytes": 60 * GiB, "page_size": 64,
                          "kv_cache_dtype": "fp8_e4m3", "tp_size": 8},
    "mrr400": {"budget_bytes": 20 * GiB, "page_size": 16, "max_running_requests": 400},
}
WRAPPERS = {"kimi-k3-wrapper": True, "kimi-k3-wrapper-text-untyped": False}


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FileCase]:
    folder = tmp_path_factory.mktemp("kda-wrappers")
    out = {}
    for name, typed in WRAPPERS.items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps(_wrapper(typed), indent=2))
        for option, values in OPTIONS.items():
            case_id = f"{name}/{option}"
            out[case_id] = FileCase(case_id, name, values, path=path)
    return out


@pytest.fixture(scope="module")
def sglang_results(cases: dict[str, FileCase]) -> dict[str, dict[str, Any]]:
    return run_sglang(list(cases.values()))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case_id", [f"{w}/{o}" for w in WRAPPERS for o in OPTIONS])
def test_a_kimi_linear_text_config_is_planned_as_sglang_sizes_it(
        case_id: str, cases: dict[str, FileCase],
        sglang_results: dict[str, dict[str, Any]]) -> None:
    theirs = sglang_results[case_id]
    assert theirs["ok"] and theirs["is_mambaish"] and theirs["is_mla"], theirs
    check_case(cases[case_id], theirs)

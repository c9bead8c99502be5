"""The two sides of the SGLang differential tests and their comparison: a case, ``kvpoold plan
--json`` of it (in this process), SGLang 0.5.23's sizing of a batch of cases (one run of
``tests/sglang/sglang_sizes.py`` in the side venv), and the check that they agree or both refuse.
Shared by ``test_sglang_parity.py`` (the knobs) and ``test_sglang_corpus.py`` (the configs)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpool.contract.devices import gpu_profile
from kvpoold import main as kvpoold_cli
from tests.conftest import REPO
from tests.integration.side_venv import SGLANG_DIR, sglang_env, sglang_python_or_skip

MODELS = REPO / "tests" / "data" / "models"
GiB = 1 << 30

# kvpool architecture -> SGLang's pool family (its configurator and attention kind).
FAMILY = {
    "mha": "default/MHA", "fp4": "default/MHA", "mla": "default/MLA", "dsa": "default/DSA",
    "hybrid_linear": "default/mamba", "hybrid_swa": "hybrid_swa", "all_swa": "hybrid_swa",
    "dsv4": "dsv4",
}
# SGLang's dtype names -> kvpool's.
KV_DTYPE = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
# Inputs SGLang refuses on a CPU-only machine for reasons of the platform, not of sizing: the
# case still runs on kvpool, and the test records what SGLang said.
CPU_REFUSALS = ("requires platform support", "not supported on CPU")


@dataclass
class Case:
    """One input: a model config (its path under ``tests/data/models`` without ``.json``) and
    the options both sides get."""

    id: str
    model: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> Path:
        return MODELS / f"{self.model}.json"

    def sglang_case(self) -> dict[str, Any]:
        o = self.options
        algo = o.get("speculative_algorithm")
        case = {
            "id": self.id, "config": str(self.config), "budget_bytes": o.get("budget_bytes"),
            "page_size": o.get("page_size", 1), "kv_cache_dtype": o.get("kv_cache_dtype", "auto"),
            "tp_size": o.get("tp_size", 1), "pp_size": o.get("pp_size", 1),
            "pp_rank": o.get("pp_rank", 0), "context_length": o.get("context_length"),
            "max_running_requests": o.get("max_running_requests"),
            "max_total_tokens": o.get("max_total_tokens"),
            "speculative_algorithm": algo.upper() if algo else None,
            "speculative_num_draft_layers": o.get("speculative_num_draft_layers"),
            "speculative_num_draft_tokens": o.get("speculative_num_draft_tokens"),
            "swa_full_tokens_ratio": o.get("swa_full_tokens_ratio"),
            "mamba_full_memory_ratio": o.get("mamba_full_memory_ratio"),
            "mamba_radix_cache_strategy": o.get("mamba_radix_cache_strategy"),
            "disable_radix_cache": o.get("disable_radix_cache", False), "dtype": "auto",
            "chunked_prefill_size": o.get("chunked_prefill_size"),
            "disable_overlap_schedule": o.get("disable_overlap_schedule", False),
            # answer SGLang's four CPU-platform questions as CUDA does (see the harness):
            # kvpool plans GPU pools, and SGLang's CUDA defaults are what it must match
            "gpu_gates": True,
        }
        # the device facts of the case's --gpu profile (default h100-80g, as kvpoold plan)
        gpu = gpu_profile(o.get("gpu"))
        case["gpu_memory_gib"] = gpu.memory_gib
        case["cuda_capability"] = [gpu.sm // 10, gpu.sm % 10]
        if algo:  # SGLang's own choice is topk 4, which CPU attention cannot run at page > 1
            case["speculative_eagle_topk"] = 1
            case["speculative_num_steps"] = max(1, (o.get("speculative_num_draft_tokens") or 2)
                                                - 1)
        if o.get("allow_longer_context"):  # SGLang's switch is an environment variable
            case["env"] = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
        return case

    def plan_argv(self) -> list[str]:
        argv = ["plan", "--model-config", str(self.config), "--json"]
        for key, value in self.options.items():
            flag = "--budget" if key == "budget_bytes" else "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is not None and value is not False:
                argv += [flag, str(value)]
        return argv


def run_kvpool(case: Case) -> dict[str, Any]:
    """``kvpoold plan --json`` of the case: the plan, or the refusal's field and message."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = kvpoold_cli.main(case.plan_argv())
    if code != 0:
        return {"ok": False, "error": err.getvalue().strip()}
    return {"ok": True, **json.loads(out.getvalue())}


def run_sglang(cases: list[Case], timeout_s: float = 900) -> dict[str, dict[str, Any]]:
    """SGLang's results for ``cases``, by id, from one run of the harness in the side venv
    (skips the calling test when the venv is absent)."""
    python = sglang_python_or_skip()
    proc = subprocess.run(
        [str(python), str(SGLANG_DIR / "sglang_sizes.py")],
        input=json.dumps([c.sglang_case() for c in cases]), capture_output=True, text=True,
        env=sglang_env(), cwd=REPO, timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["id"]: r for r in json.loads(proc.stdout)}


def sglang_family(r: dict[str, Any]) -> str:
    kind = r["architecture_class"]
    if kind != "default":
        return "hybrid_swa" if kind == "swa_request_cap" else kind
    if r["is_mambaish"]:
        return "default/mamba"
    if r["is_dsa"]:
        return "default/DSA"
    return "default/MLA" if r["is_mla"] else "default/MHA"


def zero_if_none(value: int | None) -> int:
    return value or 0


# Counts both sides report under the same key (None and 0 alike: "no such pool").
COUNTS = ("context_length", "max_total_num_tokens", "max_running_requests",
          "full_max_total_num_tokens", "swa_max_total_num_tokens", "mamba_cache_size")


def sizes(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """What decides a pool, from kvpool's plan and from SGLang's result: (kvpool's, SGLang's)."""
    got = {"family": FAMILY[ours["architecture"]], "kv_cache_dtype": ours["kv_cache_dtype"],
           **{k: zero_if_none(ours[k]) for k in COUNTS}}
    want = {"family": sglang_family(theirs),
            "kv_cache_dtype": KV_DTYPE.get(theirs["kv_cache_dtype"], theirs["kv_cache_dtype"]),
            **{k: zero_if_none(theirs[k]) for k in COUNTS}}
    return got, want


def check_case(case: Case, theirs: dict[str, Any]) -> None:
    """kvpool plans what SGLang sizes, or refuses what SGLang refuses. A refusal SGLang gives
    only because this machine has no GPU (``CPU_REFUSALS``) xfails, kvpool still planning."""
    ours = run_kvpool(case)
    if not theirs["ok"]:
        if any(marker in (theirs["error"] or "") for marker in CPU_REFUSALS):
            # SGLang cannot run this input on a CPU-only machine: say so, and still require
            # kvpool to plan it (it is a valid GPU configuration).
            assert ours["ok"], ours["error"]
            pytest.xfail(f"SGLang refuses on CPU: {theirs['error'][:200]}")
        assert not ours["ok"], (
            f"SGLang refuses ({theirs['error'][:300]}) but kvpool planned "
            f"{ours.get('max_total_num_tokens')} tokens")
        return
    assert ours["ok"], f"kvpool refused ({ours['error']}) what SGLang sized: {theirs}"
    got, want = sizes(ours, theirs)
    assert got == want

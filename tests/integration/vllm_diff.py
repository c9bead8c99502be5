"""The two sides of the vLLM differential test and their comparison: a case, ``kvpoold plan
--engine vllm --json`` of it for every pipeline rank (in this process), vLLM 0.32's own
``get_kv_cache_configs`` of a batch of cases (one run of ``tests/vllm/vllm_sizes.py`` in the
side venv), and the check that they agree or both refuse."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any

from kvpoold import main as kvpoold_cli
from tests.conftest import REPO
from tests.integration.vllm_venv import VLLM_DIR, vllm_env, vllm_python_or_skip

MODELS = REPO / "tests" / "data" / "models"
# SYNTHETIC configs (no real Hub file of these families is in the corpus), cases
# ``synthetic/<name>``: see that folder's README
SYNTHETIC = REPO / "tests" / "integration" / "synthetic_configs"
GiB = 1 << 30
MiB = 1 << 20


@dataclass
class Case:
    """One input: a config of ``tests/data/models`` and vLLM's knobs (VllmOptions fields)."""

    id: str
    model: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> str:
        if self.model.startswith("synthetic/"):
            return str(SYNTHETIC / f"{self.model.removeprefix('synthetic/')}.json")
        return str(MODELS / f"{self.model}.json")

    @property
    def pp_size(self) -> int:
        return int(self.options.get("pp_size", 1))

    def vllm_case(self) -> dict[str, Any]:
        return {"id": self.id, "config": self.config, **self.options}

    def plan_argv(self, pp_rank: int) -> list[str]:
        argv = ["plan", "--engine", "vllm", "--model-config", self.config, "--json"]
        for key, value in {**self.options, "pp_rank": pp_rank}.items():
            flag = "--" + key.replace("_", "-")
            if key == "kv_cache_dtype" and value == "fp8":
                value = "fp8_e4m3"  # vLLM's fp8 is fp8_e4m3; the flag names only the latter
            if value is True:
                argv.append(flag)
            elif value is not None and value is not False:
                argv += [flag, str(value)]
        return argv


def run_kvpool(case: Case, pp_rank: int) -> dict[str, Any]:
    """``kvpoold plan --engine vllm --json`` of one rank: the plan, or the refusal."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = kvpoold_cli.main(case.plan_argv(pp_rank))
    if code != 0:
        return {"ok": False, "error": err.getvalue().strip()}
    return {"ok": True, **json.loads(out.getvalue())}


def run_vllm(cases: list[Case], timeout_s: float = 1500) -> dict[str, dict[str, Any]]:
    """vLLM's results for ``cases``, by id, from one run of the harness in the side venv
    (skips the calling test when the venv is absent)."""
    python = vllm_python_or_skip()
    proc = subprocess.run(
        [str(python), str(VLLM_DIR / "vllm_sizes.py")],
        input=json.dumps([c.vllm_case() for c in cases]), capture_output=True, text=True,
        env=vllm_env(), cwd=REPO, timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return {r["id"]: r for r in results}


def layer_index(name: str) -> int:
    """The index in a vLLM layer name (``model.layers.12.self_attn.attn`` -> 12, GPT-2
    style ``model.h.12.attn.attn`` too, Falcon-H1's mixers ``model.48.mixer`` -> 48, Zamba2's
    shared attention ``model.attn.3`` -> 3 and mixers ``57.mixer`` -> 57); the module path
    differs between models, the index is what both sides share."""
    found = re.search(r"(?:layers|\.h)\.(\d+)\.|^model\.(?:attn\.)?(\d+)(?:\.|$)|^(\d+)\.",
                      name)
    assert found, name
    return int(next(g for g in found.groups() if g is not None))


def _layers(names: list[str]) -> list[int]:
    return [layer_index(n) for n in names]


def summary(plan: dict[str, Any], stage: dict[str, Any] | None = None) -> dict[str, Any]:
    """What decides a vLLM KV cache, from either side: kvpool's plan alone, or vLLM's case
    result with one stage's config."""
    src = stage if stage is not None else plan
    out = {
        "num_blocks": src["num_blocks"],
        "groups": [(g["type"], _layers(g["layer_names"]), g["block_size"],
                    g["page_size_bytes"], g["sliding_window"], g["uniform_type"])
                   for g in src["groups"]],
        "tensors": [(t["size"], _layers(t["layers"]), t["layer_stride"], t["block_stride"],
                     t["offset"]) for t in src["tensors"]],
        "max_concurrency": round(src["max_concurrency"], 9),
        "block_size": plan["block_size"],
        "max_model_len": plan["max_model_len"],
        "layout": plan["layout"],
        "hybrid": plan["hybrid"],
    }
    return out


def layer_specs(layers: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each layer's spec as both sides report it (a mamba state: its block and page)."""
    return [(layer_index(s["name"]), s["type"], s["block_size"], s["page_size_bytes"])
            if s["type"] == "mamba" else
            (layer_index(s["name"]), s["type"], s["block_size"], s["num_kv_heads"],
             s["head_size"], s["head_size_v"], s["dtype"], s["sliding_window"],
             s["page_size_bytes"]) for s in layers]

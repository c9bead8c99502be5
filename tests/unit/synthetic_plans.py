"""The SYNTHETIC configs (``tests/integration/synthetic_configs``) as the vLLM-profile unit tests
read and plan them: one config, changed field by field, and its plan at the tests' defaults
(4 GiB, 2,048 tokens, a CPU without AVX-512 BF16)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpool.contract.vllm_plan import make_vllm_options
from kvpoold.sizing.vllm_profile import plan_vllm

SYNTHETIC = Path(__file__).resolve().parents[1] / "integration" / "synthetic_configs"
GiB = 1 << 30
BASE = {"kv_cache_memory_bytes": 4 * GiB, "max_model_len": 2048, "cpu_avx512_bf16": "no"}


def synthetic_config(name: str, **change: Any) -> dict[str, Any]:
    """The config ``name``.json with ``change`` applied (a value of ``...`` deletes the key)."""
    config = json.loads((SYNTHETIC / f"{name}.json").read_text())
    for key, value in change.items():
        if value is ...:
            del config[key]
        else:
            config[key] = value
    return config


def synthetic_plan(config: dict[str, Any] | str, **options: Any) -> Any:
    """The vLLM profile's plan of ``config`` (or of the synthetic config of that name) with
    ``options`` over :data:`BASE`."""
    if isinstance(config, str):
        config = synthetic_config(config)
    return plan_vllm(config, make_vllm_options(**{**BASE, **options}))

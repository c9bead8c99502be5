"""Print vLLM 0.32's batch defaults (``EngineArgs.get_batch_defaults``) for each device kind
kvpool names (``VllmPlatform``), with vLLM's platform answers faked per kind: one JSON object
``{platform: {world_size: {"llm": [tokens, seqs], "serve": [tokens, seqs]}}}``.

Runs in the vLLM side venv (``tests/integration/test_vllm_batch_defaults.py`` drives it). The
side venv is vLLM's CPU build, so a GPU is described to vLLM, not present: the function reads
only ``is_cpu``, ``is_tpu``, ``get_device_total_memory`` and ``get_device_name``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.engine import arg_utils
from vllm.engine.arg_utils import EngineArgs
from vllm.usage.usage_lib import UsageContext

GiB = 1 << 30
# kvpool's platform -> the devices vLLM is told about (memory, name, is it the CPU platform)
DEVICES = {
    "cpu": [(0, "cpu", True)],
    "gpu": [(24 * GiB, "nvidia l4", False), (80 * GiB, "nvidia a100-sxm4-80gb", False)],
    "gpu-70gib": [(80 * GiB, "nvidia h100 80gb hbm3", False),
                  (141 * GiB, "nvidia h200", False)],
    "gpu-160gib": [(180 * GiB, "nvidia b200", False)],
}


def main() -> int:
    platform = arg_utils.current_platform
    out: dict[str, list[dict[str, object]]] = {}
    for name, devices in DEVICES.items():
        for memory, device, cpu in devices:
            platform.get_device_total_memory = lambda *a, m=memory, **k: m  # type: ignore
            platform.get_device_name = lambda *a, d=device, **k: d  # type: ignore
            platform.is_cpu = lambda c=cpu: c  # type: ignore
            platform.is_tpu = lambda: False  # type: ignore
            for world in (1, 4):
                tokens, seqs = EngineArgs.get_batch_defaults(world)
                out.setdefault(name, []).append({
                    "device": device, "world_size": world,
                    "llm": [tokens[UsageContext.LLM_CLASS], seqs[UsageContext.LLM_CLASS]],
                    "serve": [tokens[UsageContext.OPENAI_API_SERVER],
                              seqs[UsageContext.OPENAI_API_SERVER]]})
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

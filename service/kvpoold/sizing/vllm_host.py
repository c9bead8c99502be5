"""The one fact of the host that vLLM 0.32's KV-cache sizing reads: whether the CPU has
AVX-512 BF16.

vLLM's CPU platform asks ``torch.cpu._is_avx512_bf16_supported()`` in its
``check_and_update_config``; with the instruction set there, it runs its accelerated
gated-delta-net kernels and, unless ``--mamba-ssm-cache-dtype`` names float32, bfloat16 or
float16, stores every SSM state in float32 (Qwen3-Next's state then takes about twice the
bytes). kvpool reads the same CPU feature from the kernel's view of it, the ``avx512_bf16``
flag of ``/proc/cpuinfo`` (present only where the CPU has it and the kernel enabled the
AVX-512 register state).
"""

from __future__ import annotations

import functools
from pathlib import Path

from kvpool.contract.vllm_plan import VllmCpuBf16, VllmOptions

CPUINFO = Path("/proc/cpuinfo")
FLAG = "avx512_bf16"


def cpuinfo_has_avx512_bf16(cpuinfo: str) -> bool:
    """Whether a ``/proc/cpuinfo`` text lists ``avx512_bf16`` among its CPUs' flags."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and FLAG in value.split():
            return True
    return False


@functools.cache
def host_has_avx512_bf16() -> bool:
    """This host's answer (False where ``/proc/cpuinfo`` cannot be read)."""
    try:
        return cpuinfo_has_avx512_bf16(CPUINFO.read_text())
    except OSError:
        return False


def has_avx512_bf16(options: VllmOptions) -> bool:
    """``options.cpu_avx512_bf16``, this host's when ``auto``."""
    if options.cpu_avx512_bf16 is VllmCpuBf16.auto:
        return host_has_avx512_bf16()
    return options.cpu_avx512_bf16 is VllmCpuBf16.yes

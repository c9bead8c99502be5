"""The GPU memory SGLang 0.5.23 takes off a multimodal model's KV budget before sizing it.

SGLang allocates its multimodal buffers only after the KV pool is sized, so it reserves them
first (``mem_cache/kv_cache_configurator.py: mm_runtime_reservation_gb``, subtracted in
``_profile_available_bytes`` on every rank, and again in the post-capture budget)::

    reserved = SGLANG_VLM_CACHE_SIZE_MB                  embedding cache, default 100 MiB
             + SGLANG_MM_FEATURE_CACHE_MB                feature-transport pool, default 1 GiB,
                 if --mm-feature-transport is cuda_ipc or cuda_vmm (default: cpu, no pool)
    budget   = free - slack - reserved

Only Qwen3-VL (``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``) on
SM90 with 60 GiB or more changes the terms (``arg_groups/model_overrides/qwen3_vl.py``): no
embedding cache (0 MiB), features over CUDA IPC, and a 1 GiB pool, raised to 3 GiB when
``--max-running-requests`` is given as 400 or more ("keep a full high-concurrency wave
GPU-resident"). That is the only way the reservation depends on running requests: a step at
400, read from the option as given (SGLang's override runs before it derives its own count,
so a derived 2,048 keeps 1 GiB); it does not grow per request, nor with the chunked prefill
size or the vision encoder's output size. Every other multimodal model reserves the fixed
100 MiB; a text model, or a wrapper SGLang serves as text, reserves nothing.

Worked example, Qwen3-VL-8B (36 layers, 8 KV heads of 128, bfloat16: cell 147,456 B) on an
``h100-80g`` at 20 GiB, page 16: with ``--max-running-requests`` unset or below 400, 1 GiB
reserved, 20,401,094,656 // 147,456 = 138,353 -> 138,352 tokens at the page; with 400 or more,
3 GiB reserved, 18,253,611,008 // 147,456 = 123,790 -> 123,776 tokens. On an ``a100-80g``
100 MiB at any request count: 21,369,978,880 // 147,456 = 144,924 -> 144,912 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.contract.devices import GpuProfile
from kvpool.contract.spec import ModelSpec

# SGLANG_VLM_CACHE_SIZE_MB's default: the multimodal embedding cache.
EMBEDDING_CACHE_BYTES = 100 << 20
# SGLANG_MM_FEATURE_CACHE_MB's default: the CUDA IPC / VMM feature-transport pool.
FEATURE_POOL_BYTES = 1 << 30
# What SGLang's Qwen3-VL Hopper override sets the pool to at high concurrency.
HIGH_CONCURRENCY_FEATURE_POOL_BYTES = 3 << 30
# The --max-running-requests from which that override raises the pool.
HIGH_CONCURRENCY_RUNNING_REQUESTS = 400
# Classes SGLang serves without an embedding cache on large Hopper GPUs
# (arg_groups/model_overrides/qwen3_vl.py: model types qwen3_vl and qwen3_vl_moe).
QWEN3_VL_CLASSES = frozenset({"Qwen3VLForConditionalGeneration",
                              "Qwen3VLMoeForConditionalGeneration"})


@dataclass(frozen=True)
class Reservation:
    """Bytes SGLang takes off the KV budget for multimodal buffers, and the plan's note."""

    nbytes: int
    why: str


def reservation(spec: ModelSpec, gpu: GpuProfile,
                max_running_requests: int | None) -> Reservation | None:
    """What SGLang reserves for ``spec``'s multimodal buffers on ``gpu``.

    Args:
        spec: the model; only ``multimodal`` and ``architecture`` are read.
        gpu: the device profile (Qwen3-VL's path depends on SM90 and 60 GiB).
        max_running_requests: ``--max-running-requests`` as given (None: unset).

    Returns:
        The reservation, or None for a model SGLang serves as text.
    """
    if not spec.multimodal:
        return None
    if spec.architecture not in QWEN3_VL_CLASSES or not gpu.large_hopper:
        return Reservation(EMBEDDING_CACHE_BYTES, (
            "SGLang's multimodal embedding cache (SGLANG_VLM_CACHE_SIZE_MB, 100 MiB; fixed, "
            "whatever --max-running-requests)"))
    where = f"Qwen3-VL on {gpu.describe()}"
    if (max_running_requests is not None
            and max_running_requests >= HIGH_CONCURRENCY_RUNNING_REQUESTS):
        return Reservation(HIGH_CONCURRENCY_FEATURE_POOL_BYTES, (
            f"SGLang's CUDA IPC feature-transport pool for {where} (SGLANG_MM_FEATURE_CACHE_MB "
            f"raised from 1 GiB to 3 GiB because --max-running-requests {max_running_requests:,}"
            f" is {HIGH_CONCURRENCY_RUNNING_REQUESTS} or more; no embedding cache there)"))
    given = ("unset" if max_running_requests is None
             else f"{max_running_requests:,}")
    return Reservation(FEATURE_POOL_BYTES, (
        f"SGLang's CUDA IPC feature-transport pool for {where} (SGLANG_MM_FEATURE_CACHE_MB, "
        f"1 GiB; 3 GiB from --max-running-requests {HIGH_CONCURRENCY_RUNNING_REQUESTS}, here "
        f"{given}; no embedding cache there)"))

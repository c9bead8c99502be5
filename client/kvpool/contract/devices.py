"""The device facts that change SGLang 0.5.23's sizing, as one explicit input (``--gpu``).

SGLang reads them from the GPU it runs on; kvpool plans for a named profile instead, so a plan
made on one machine (a CPU laptop, CI) is the plan SGLang makes on the target GPU. Every fact
here changes a number of the plan, and nothing else does:

- ``memory_gib``: the device memory SGLang sees. It picks ``chunked_prefill_size`` when none
  is given (``arg_groups/memory_hook.py``: 2,048 below 20 GiB, 4,096 below 60, 8,192 below
  160, else 16,384; 4,096 when SGLang cannot read it). The chunk sizes the SWA space of a
  hybrid SWA model served without the radix cache at a fixed ``max_running_requests``.
- ``sm``: the compute capability (``90`` = 9.0). A DSA model's ``--kv-cache-dtype auto`` is
  bfloat16 below SM100 and fp8_e4m3 from SM100 (Blackwell) on; on SM90 with 60 GiB or more,
  Qwen3-VL takes no multimodal embedding cache but a CUDA IPC feature pool
  (``arg_groups/model_overrides/qwen3_vl.py``), reserved from its budget instead
  (``kvpoold.sizing.multimodal``).

Profiles: ``h100-80g`` (the default of ``kvpoold plan``: SGLang's reference GPU), ``h200``,
``b200``, ``a100-80g``, and ``cpu`` (no GPU facts: SGLang's fallbacks).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvpool.contract.errors import InvalidArgument

GpuName = Literal["h100-80g", "h200", "b200", "a100-80g", "cpu"]
DEFAULT_GPU: GpuName = "h100-80g"


class GpuProfile(msgspec.Struct, frozen=True, kw_only=True):
    """What one device tells SGLang's sizing."""

    name: str
    memory_gib: float | None  # None: SGLang cannot read the device memory
    sm: int  # compute capability x 10 (90 = 9.0); 0 without a GPU
    what: str = ""

    def chunked_prefill_size(self) -> int:
        """SGLang's ``chunked_prefill_size`` when none is given, by device memory."""
        gib = self.memory_gib
        if gib is None:
            return 4096
        for below, size in ((20, 2048), (60, 4096), (160, 8192)):
            if gib < below:
                return size
        return 16384

    @property
    def blackwell(self) -> bool:
        return self.sm >= 100

    @property
    def large_hopper(self) -> bool:
        """SM90 with at least 60 GiB: SGLang's profiled Qwen3-VL serving path."""
        return self.sm == 90 and self.memory_gib is not None and self.memory_gib >= 60

    def describe(self) -> str:
        mem = "unknown memory" if self.memory_gib is None else f"{self.memory_gib:g} GiB"
        sm = "no GPU" if not self.sm else f"SM{self.sm}"
        return f"{self.name} ({mem}, {sm})"


GPU_PROFILES: dict[str, GpuProfile] = {
    p.name: p for p in (
        GpuProfile(name="h100-80g", memory_gib=80, sm=90, what="NVIDIA H100 80 GB"),
        GpuProfile(name="h200", memory_gib=141, sm=90, what="NVIDIA H200 141 GB"),
        GpuProfile(name="b200", memory_gib=180, sm=100, what="NVIDIA B200 180 GB"),
        GpuProfile(name="a100-80g", memory_gib=80, sm=80, what="NVIDIA A100 80 GB"),
        GpuProfile(name="cpu", memory_gib=None, sm=0, what="no GPU: SGLang's fallbacks"),
    )
}


def gpu_profile(name: str | None) -> GpuProfile:
    """The profile named ``name`` (None: :data:`DEFAULT_GPU`).

    Raises:
        InvalidArgument: an unknown name, listing the known ones.
    """
    profile = GPU_PROFILES.get(name or DEFAULT_GPU)
    if profile is None:
        raise InvalidArgument(f"unknown GPU profile {name!r} (known: {', '.join(GPU_PROFILES)})",
                              field="gpu")
    return profile


def profile_of_device(memory_bytes: int, major: int, minor: int) -> GpuName:
    """The profile closest to a CUDA device: same compute capability family, nearest
    memory (what ``kvpoold serve --device cuda:N`` plans for when Configure names none)."""
    sm = major * 10 + minor
    gib = memory_bytes / (1 << 30)
    same = [p for p in GPU_PROFILES.values() if p.sm // 10 == sm // 10 and p.memory_gib]
    pool = same or [p for p in GPU_PROFILES.values() if p.memory_gib]
    best = min(pool, key=lambda p: abs((p.memory_gib or 0) - gib))
    return best.name  # type: ignore[return-value]

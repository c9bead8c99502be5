"""The --gpu profiles: each fact, and which profile a CUDA device plans for."""

from __future__ import annotations

import pytest

from kvpool.contract.devices import GpuProfile, gpu_profile, profile_of_device
from kvpool.contract.errors import InvalidArgument

GiB = 1 << 30


@pytest.mark.parametrize(("memory_gib", "chunk"), [
    (16, 2048), (24, 4096), (40, 4096), (80, 8192), (141, 8192), (180, 16384), (None, 4096)])
def test_the_prefill_chunk_follows_sglangs_memory_steps(memory_gib: float | None,
                                                        chunk: int) -> None:
    profile = GpuProfile(name="x", memory_gib=memory_gib, sm=90)
    assert profile.chunked_prefill_size() == chunk


@pytest.mark.parametrize(("memory", "sm", "name"), [
    (int(79.1 * GiB), (9, 0), "h100-80g"),   # what an H100 80 GB reports
    (int(139.8 * GiB), (9, 0), "h200"),
    (int(178.4 * GiB), (10, 0), "b200"),
    (int(79.2 * GiB), (8, 0), "a100-80g"),
    (int(44.4 * GiB), (8, 9), "a100-80g"),   # L40S: the nearest of its family
])
def test_a_cuda_device_plans_for_the_nearest_profile(memory: int, sm: tuple[int, int],
                                                     name: str) -> None:
    assert profile_of_device(memory, *sm) == name


def test_profiles_say_what_they_are_and_unknown_names_are_refused() -> None:
    assert gpu_profile(None).name == "h100-80g"
    assert gpu_profile("b200").describe() == "b200 (180 GiB, SM100)"
    assert gpu_profile("b200").blackwell and not gpu_profile("h200").blackwell
    assert gpu_profile("h200").large_hopper and not gpu_profile("a100-80g").large_hopper
    with pytest.raises(InvalidArgument, match="known: h100-80g"):
        gpu_profile("b300")

"""kvpool.integrations.vllm.memory: the allocation context vLLM's KV cache is made in, and
the checks of a pool against vLLM's KV-cache config (the engine test runs both in vLLM)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from kvpool.contract.vllm_plan import make_vllm_options
from kvpool.integrations.vllm.memory import PoolAllocation, PoolMismatch, check_kv_cache
from kvpoold.sizing.vllm_profile import plan_vllm
from tests.conftest import REPO

MODEL = json.loads((REPO / "tests/data/models/tinyllama-1.1b-chat-v0.4.json").read_text())
PLAN = plan_vllm(MODEL, make_vllm_options(kv_cache_memory_bytes=12 << 20, max_model_len=256))


@dataclass
class KVCacheTensor:  # vLLM 0.32's KVCacheTensor, field for field
    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0


@dataclass
class KVCacheConfig:  # the fields of vLLM 0.32's KVCacheConfig the check reads
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)
    kv_cache_layout: str | None = None


def vllms_config(**changes: object) -> KVCacheConfig:
    tensors = [KVCacheTensor(t.size, list(t.layers), t.layer_stride, t.block_stride, t.offset)
               for t in PLAN.tensors]
    config = KVCacheConfig(PLAN.num_blocks, tensors, PLAN.layout.value)
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def test_the_plans_own_config_passes() -> None:
    check_kv_cache(PLAN, vllms_config(), pool="p")
    check_kv_cache(PLAN, vllms_config(kv_cache_layout=None), pool="p")


@pytest.mark.parametrize(("changes", "words"), [
    ({"num_blocks": 5}, "vLLM's KV cache has num_blocks 5 but kvpool pool 'p' has 4"),
    ({"kv_cache_layout": "LBNHC"}, "vLLM's KV-cache layout is LBNHC but kvpool pool 'p' is "
                                   "planned LBHNC"),
    ({"kv_cache_tensors": []}, "vLLM's KV cache has 0 KV-cache tensor(s) but kvpool pool 'p' "
                               "has 1"),
])
def test_a_difference_names_vllms_value_and_the_pools(changes: dict[str, object],
                                                      words: str) -> None:
    with pytest.raises(PoolMismatch) as info:
        check_kv_cache(PLAN, vllms_config(**changes), pool="p")
    assert words in str(info.value)


def test_a_tensor_of_another_size_is_named() -> None:
    config = vllms_config()
    config.kv_cache_tensors[0].size += 1
    with pytest.raises(PoolMismatch, match=r"tensor 0 has size 11,534,337 B.*'p''s has size "
                                           r"11,534,336 B"):
        check_kv_cache(PLAN, config, pool="p")


def test_vllms_int8_zeros_become_the_pools_tensor() -> None:
    pool = torch.arange(64, dtype=torch.int8)
    with PoolAllocation([pool], pool="p") as allocation:
        buf = torch.zeros(64, dtype=torch.int8, device=torch.device("cpu"))
        other = torch.zeros(64, dtype=torch.float32)  # not vLLM's KV backing: left alone
        small = torch.zeros((2, 32), dtype=torch.int8)  # not one dimension: left alone
    assert buf.data_ptr() == pool.data_ptr() and allocation.taken == [pool]
    assert buf[5].item() == 5  # the pool's bytes, not zeroed
    assert other.data_ptr() != pool.data_ptr() and not other.any()
    assert small.data_ptr() != pool.data_ptr()
    after = torch.zeros(64, dtype=torch.int8)  # outside the context: new memory
    assert after.data_ptr() != pool.data_ptr()


def test_another_size_more_or_fewer_allocations_are_refused() -> None:
    pool = torch.zeros(64, dtype=torch.int8)
    with pytest.raises(PoolMismatch, match="as 65 B but kvpool pool 'p''s is 64 B"), \
            PoolAllocation([pool], pool="p"):
        torch.zeros(65, dtype=torch.int8)
    with pytest.raises(PoolMismatch, match=r"backing 2 .* but kvpool pool 'p' has 1"), \
            PoolAllocation([pool], pool="p"):
        torch.zeros(64, dtype=torch.int8)
        torch.zeros(64, dtype=torch.int8)
    with pytest.raises(PoolMismatch, match=r"allocated 0 KV-cache backing.* 'p' has 1"), \
            PoolAllocation([pool], pool="p"):
        pass

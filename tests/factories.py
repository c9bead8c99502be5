"""Tiny spec factories for tests: real model geometries written out by hand, with defaults."""

from __future__ import annotations

from typing import Any

from kvpool.contract.spec import ModelSpec, decode_spec
from kvpoold.sizing import PoolPlan, make_options, plan

GiB = 1 << 30
MiB = 1 << 20


def llama_8b(**over: Any) -> ModelSpec:
    """Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128 (4096 / 32), bf16, 131,072 context."""
    return decode_spec({
        "architecture": "LlamaForCausalLM",
        "num_layers": 32,
        "attention": {"type": "mha", "num_kv_heads": 8, "head_dim": 128},
        "context_length": 131072,
        **over,
    })


def deepseek_v3(**over: Any) -> ModelSpec:
    """DeepSeek-V3: 61 layers, MLA latent 512 + rope 64, 1 MTP layer, 163,840 context."""
    return decode_spec({
        "architecture": "DeepseekV3ForCausalLM",
        "num_layers": 61,
        "attention": {"type": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64},
        "context_length": 163840,
        "num_nextn_predict_layers": 1,
        **over,
    })


def deepseek_v32(**over: Any) -> ModelSpec:
    """DeepSeek-V3.2-Exp: DeepSeek-V3 geometry plus the DSA indexer (index_head_dim 128)."""
    return deepseek_v3(architecture="DeepseekV32ForCausalLM", indexer={"index_head_dim": 128},
                       **over)


def plan_for(spec: ModelSpec, **options: Any) -> PoolPlan:
    return plan(spec, make_options(**options))


def elastic_llama_plan() -> PoolPlan:
    """Llama-3.1-8B, elastic, 1 GiB budget, context 2048, 8 requests: 8 groups of 1024 pages
    (each of the 64 K/V views' share of a group is one 2 MiB chunk, a group 128 MiB), the
    fixed part (req_to_token) the last chunk, at 1 GiB."""
    return plan_for(llama_8b(), budget_bytes=GiB, elastic=True, context_length=2048,
                    max_running_requests=8)


def map_elastic_backing(backing: Any, pool_plan: PoolPlan, groups: tuple[int, ...] = (0,),
                        pool: str = "p") -> Any:
    """The client's :class:`kvpool.mapping.elastic_map.ElasticRegion` of a daemon's
    ``SparseShmBacking`` (``ShmBackingFactory.create_elastic``), ``groups`` mapped."""
    from kvpool.mapping.elastic_map import map_elastic
    from kvpool.mapping.regions import check_layout

    handle = backing.handle()
    return map_elastic(handle, check_layout(int(handle.size), pool_plan.buffers),
                       plan=pool_plan, groups=groups, pool=pool)

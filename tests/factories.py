"""Tiny factories for tests: real model geometries written out by hand, and daemon snapshots
(Stats records), with defaults."""

from __future__ import annotations

from typing import Any

from kvpool.contract.records import (
    DaemonStats,
    ElasticStats,
    LeaseStats,
    PoolStats,
    SpaceStats,
    Stats,
)
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


# -- Stats records (what a daemon's snapshot holds), for the metrics, top and CLI renderers ---

def elastic_stats(**over: Any) -> ElasticStats:
    """An elastic Llama-8B-like pool: groups of 128 MiB (64 views x one 2 MiB chunk), 64 of
    them plus a 2 MiB fixed part (8 GiB + 2 MiB virtual); 12 granted (2 of them reclaiming),
    1.50 GiB + 2 MiB paid for, 1.50 GiB backed; floor 4, cap 64, weight 2; 20 groups granted
    and 8 taken back (0.6 s in all, 0.2 s the longest), one lease revoked."""
    fields: dict[str, Any] = {
        "group_bytes": 128 * MiB, "groups": 64, "granted_groups": 12, "reclaiming_groups": 2,
        "floor_groups": 4, "cap_groups": 64, "weight": 2.0,
        "virtual_bytes": 64 * 128 * MiB + 2 * MiB, "granted_bytes": 12 * 128 * MiB + 2 * MiB,
        "backed_bytes": 12 * 128 * MiB, "grants": 20, "reclaims": 8,
        "reclaim_seconds_sum": 0.6, "reclaim_seconds_max": 0.2, "revoked_leases": 1,
    }
    return ElasticStats(**{**fields, **over})


def pool_stats(name: str, *, elastic: ElasticStats | None = None, used: int = 20,
               capacity: int = 256, **over: Any) -> PoolStats:
    """A pool with a kv space (``used`` of ``capacity`` pages) and a req space (1 of 8 rows)."""
    fields: dict[str, Any] = {
        "name": name, "fingerprint": "f00d", "architecture": "mha", "kv_cache_dtype": "bf16",
        "page_size": 16, "max_total_num_tokens": capacity * 16, "max_running_requests": 8,
        "backing_bytes": 1 * MiB, "attached": 1, "age_seconds": 30.0, "sharing": "shm",
        "spaces": {
            "kv": SpaceStats(capacity=capacity, used=used, high_water=used, frees=5,
                             failed_allocs=0, unit="pages", bytes_per_unit=4096),
            "req": SpaceStats(capacity=8, used=1, high_water=1, frees=0, failed_allocs=0,
                              unit="rows", bytes_per_unit=1040),
        },
        "elastic": elastic,
    }
    return PoolStats(**{**fields, **over})


def stats_of(*pools: PoolStats, budget_bytes: int = 8 * GiB, uptime_s: float = 60.0) -> Stats:
    """A daemon's snapshot holding ``pools`` and one lease with nothing held."""
    return Stats(
        daemon=DaemonStats(version="1.0.0", device="cuda:0", budget_bytes=budget_bytes,
                           used_bytes=sum(p.backing_bytes for p in pools),
                           uptime_seconds=uptime_s, num_pools=len(pools), num_leases=1,
                           leases_opened=1, leases_closed=0, leases_expired=0),
        pools=list(pools),
        leases=[LeaseStats(lease_id=7, name="engine", ttl_seconds=10.0, expires_in_seconds=5.0,
                           held={}, attached=0)],
    )

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

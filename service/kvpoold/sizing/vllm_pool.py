"""A vLLM-layout pool: vLLM 0.32's KV cache (a :class:`VllmPlan`) as the daemon's
:class:`PoolPlan`.

The backing is what vLLM's ``allocate_kv_cache`` makes: **one int8 region** of
``num_blocks * bytes_per_block`` bytes (vLLM 0.32 places every KV-cache tensor in one
allocation; tensors of different groups alias it), here one buffer ``kv_cache`` of kind
``vllm_kv``. The id space ``kv`` has ``num_blocks - 1`` pages, ids ``1..num_blocks - 1``: a
page id is vLLM's block id, and id 0 (never handed out) is vLLM's null block. One page is
``bytes_per_block`` bytes: the bytes block ``b`` takes in every layer of the widest group.

An attention-free model's plan (:attr:`VllmPlan.state_only`: Mamba-1/2) is the same pool: its
blocks hold one request's Mamba state in each layer instead of KV, so the pool has no token
slots (``max_total_num_tokens`` and ``cell_size_bytes`` 0); the ``kv`` space is still vLLM's
block ids, which its block pool hands to the Mamba group as to any other.

Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool.contract.dtypes import DType
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import BufferKind, BufferSpec, IdSpaceSpec, PoolPlan
from kvpool.contract.vllm_plan import VllmOptions, VllmPlan
from kvpoold.sizing.vllm_profile import plan_vllm

# The one buffer of a vLLM-layout pool: vLLM's KV-cache backing region.
VLLM_BUFFER = "kv_cache"
# The knob that makes the kv space larger, quoted when it runs short.
VLLM_KNOB = "vllm.kv_cache_memory_bytes or vllm.num_gpu_blocks_override"
# The largest id an id space takes (IdSpaceSpec.capacity).
MAX_PAGES = (1 << 31) - 2


def pool_plan_of(vplan: VllmPlan) -> PoolPlan:
    """The daemon's plan of a vLLM-layout pool that holds ``vplan``'s KV cache (its ``gpu``
    is "": vLLM's device facts are ``vplan``'s backend, not an SGLang device profile).

    Raises:
        InvalidArgument: a plan of fewer than two blocks (vLLM's null block and one more) or
            of more block ids than an id space holds.
    """
    pages = vplan.num_blocks - 1
    if pages < 1:
        raise InvalidArgument(
            f"vLLM's plan has {vplan.num_blocks} block(s); a pool needs its null block and at "
            f"least one more; raise {VLLM_KNOB}", field="vllm.kv_cache_memory_bytes")
    if pages > MAX_PAGES:
        raise InvalidArgument(
            f"vLLM's plan has {vplan.num_blocks:,} blocks, more than the {MAX_PAGES + 1:,} "
            "block ids a pool holds; lower vllm.kv_cache_memory_bytes or raise "
            "vllm.block_size", field="vllm.kv_cache_memory_bytes")
    size = vplan.size_bytes
    backing = BufferSpec(
        name=VLLM_BUFFER, dtype=DType.int8, shape=(size,), offset_bytes=0, nbytes=size,
        kind=BufferKind.vllm_kv, page_bytes=vplan.bytes_per_block, in_budget=True,
        # a block's bytes are strided over the layers (vplan.tensors), not dim 0's unit u
        id_space="")
    kv = IdSpaceSpec(name="kv", capacity=pages, unit="blocks",
                     bytes_per_unit=vplan.bytes_per_block, knob=VLLM_KNOB)
    states = vplan.state_only
    notes = (*vplan.notes,
             f"vLLM-layout pool: block ids 1..{pages:,} are the kv pages; block 0 is vLLM's "
             "null block" if not states else
             f"vLLM-layout pool of an attention-free model: block ids 1..{pages:,} hold Mamba "
             "states (one request's state in each layer per block), no KV pages and no token "
             "slots; block 0 is vLLM's null block")
    return PoolPlan(
        architecture="vllm",
        architecture_source="hf_config",
        model_architecture=vplan.model_architecture,
        kv_cache_dtype=vplan.cache_dtype,
        page_size=vplan.block_size,
        context_length=vplan.max_model_len,
        # an attention-free model's blocks hold states: no bytes per token, no token slots
        cell_size_bytes=0 if states else vplan.bytes_per_block // vplan.block_size,
        max_total_num_tokens=0 if states else pages * vplan.block_size,
        # vLLM's scheduler caps requests itself (max_num_seqs); the pool has no request rows
        max_running_requests=0,
        full_max_total_num_tokens=None,
        swa_max_total_num_tokens=None,
        mamba_cache_size=None,
        c4_max_total_num_tokens=None,
        c128_max_total_num_tokens=None,
        c4_state_pool_size=None,
        c128_state_pool_size=None,
        total_bytes=size,
        aux_bytes=0,
        backing_bytes=size,
        budget_bytes=vplan.kv_cache_memory_bytes,
        num_pages=pages,
        swa_num_pages=None,
        tp_size=vplan.tp_size,
        pp_size=vplan.pp_size,
        pp_rank=vplan.pp_rank,
        layer_start=0,
        layer_end=len(vplan.layers),  # this stage's layers (vLLM names them)
        num_draft_layers=0,
        req_to_token_columns=0,
        notes=notes,
        buffers=(backing,),
        id_spaces=(kv,),
        vllm=vplan,
    )


def plan_vllm_pool(config: Mapping[str, Any], options: VllmOptions, *,
                   where: str = "config.json") -> PoolPlan:
    """Plan vLLM's KV cache for ``config`` (:func:`plan_vllm`) and the pool that holds it.

    Raises:
        InvalidArgument: a config or knob vLLM refuses, or memory that holds no request.
    """
    return pool_plan_of(plan_vllm(config, options, where=where))

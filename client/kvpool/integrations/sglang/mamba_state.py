"""SGLang's hybrid linear (mamba) model pools on a kvpool daemon pool (Qwen3-Next, SGLang 0.5.23).

SGLang builds a hybrid linear model's memory in two places, and the platform's hooks reach
each differently:

- **The full-attention KV.** ``HybridLinearKVPool`` builds its full-attention layers with the
  platform's pool class (``get_kv_pool_cls(kind="mha")``, or ``"mla"``), over those layers
  only, numbered densely from 0. kvpool's pool class maps the daemon's ``hybrid_linear`` plan:
  its dense layer ``i`` is the plan's ``i``-th full-attention layer (``k.<l>``/``v.<l>``;
  ``daemon_pool.pool_layers``). Pages come from the lease through the paged allocator, as for MHA.
- **The conv / SSM state.** ``HybridReqToTokenPool`` builds its ``MambaPool`` (and its
  ``MambaSlotAllocator``) itself, before the KV pool, without asking the platform: no hook
  builds them. The first hook that sees them is the paged allocator
  (``get_paged_allocator_cls()``), which SGLang builds with ``kvcache`` = the
  ``HybridLinearKVPool``, whose ``mamba_pool`` is the req pool's. There :func:`bind_state`
  replaces the mamba pool's state tensors with views of the daemon's ``conv.<l>`` /
  ``ssm.<l>`` buffers, one ``(layers, slots, ...)`` strided view per kind, the shape and dtype
  SGLang allocated (checked), before any model or attention backend has read them; and the
  scheduler's lease takes the pool's whole ``state`` id space, slots ``1..N``, exactly the
  slots SGLang's ``MambaSlotAllocator`` hands out (slot 0 is the padding slot in both), so the
  daemon's Stats show the engine's state slots held by its lease and a crashed engine's come
  back with its pages.

What stays SGLang's, and why (no hook reaches it in SGLang 0.5.23):

- The slot allocator itself (``MambaSlotAllocator``, inside ``HybridReqToTokenPool``), the
  request -> state-slot table (``req_index_to_mamba_index_mapping``; the daemon's
  ``req_to_state`` buffer stays unused) and the request -> token table: only the configurator
  builds them, and the hooks receive no reference to the req pool.
- The memory SGLang allocated for the state before the hook ran: it is released when the
  views replace it, so the engine's peak memory at startup still includes one copy of the state.
- Page size 1: SGLang's token allocator is built without the hook, so nothing reaches the
  mamba pool; the KV is still the daemon's and the state stays SGLang's.
- The int8 mamba checkpoint pool (``--enable-int8-mamba-checkpoint``), built beside the mamba
  pool inside ``HybridReqToTokenPool``: the daemon has no plan for it.
- Speculative decoding's intermediate states, ReplaySSM rings, the page-major envelope layout
  and Qwen4-Exp side states: refused at startup, naming the option.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

from kvpool.contract.errors import ResourceExhausted
from kvpool.contract.plan import BufferKind, PoolPlan
from kvpool.integrations.sglang.daemon_pool import Attachment, PoolMismatch, kv_layers
from kvpool.mapping.regions import MappedRegion

log = logging.getLogger("kvpool.sglang")

PLAN_ARCHITECTURE = "hybrid_linear"
STATE_SPACE = "state"
# The daemon's state buffers of one linear layer, and the State field SGLang keeps them in.
CONV, SSM = "conv", "ssm"


def state_layers(plan: PoolPlan) -> tuple[int, ...]:
    """The global layer ids of the plan's linear layers (those with ``conv.<l>``), ascending."""
    return tuple(sorted(int(b.name.partition(".")[2]) for b in plan.buffers
                        if b.kind == BufferKind.state and b.name.startswith(CONV + ".")))


def stacked_view(region: MappedRegion, names: list[str]) -> torch.Tensor:
    """One ``(len(names), *shape)`` tensor over equal buffers placed at one stride.

    Raises:
        PoolMismatch: the buffers differ in shape or dtype, or are not evenly spaced.
    """
    views = [region[name] for name in names]
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    item = first.element_size()
    strides = {b.data_ptr() - a.data_ptr() for a, b in itertools.pairwise(views)}
    same = all(v.shape == first.shape and v.dtype == first.dtype for v in views)
    if not same or len(strides) != 1 or next(iter(strides)) % item:
        raise PoolMismatch(
            f"the daemon's buffers {names[0]}..{names[-1]} are not one evenly spaced stack of "
            f"equal buffers (strides {sorted(strides)} B), which SGLang's (layers, slots, ...) "
            "state tensor needs; the daemon's hybrid_linear layout places them so: upgrade "
            "the daemon", field="buffers")
    return first.as_strided((len(views), *first.shape),
                            (next(iter(strides)) // item, *first.stride()),
                            first.storage_offset())


def _refuse_unsupported(mamba: Any, where: str) -> None:
    cache = mamba.mamba_cache
    unsupported = [
        ("speculative decoding's intermediate states", hasattr(cache, "intermediate_ssm"),
         "--speculative-algorithm"),
        ("ReplaySSM ring buffers", getattr(cache, "replayssm_g", None) is not None,
         "--enable-linear-replayssm(-spec)"),
        ("the page-major envelope layout", hasattr(mamba, "_raw"),
         "--enable-page-major-kv-layout"),
        ("Qwen4-Exp side states", bool(mamba._slot_siblings), "the model's short-conv / ngram"),
        ("more than one conv state per layer", len(cache.conv) != 1, "the model"),
    ]
    for what, present, knob in unsupported:
        if present:
            raise PoolMismatch(
                f"kvpool maps SGLang's mamba state into {where} without {what}; drop {knob}, "
                "or use --page-size 1 (the state then stays SGLang's)", field="mamba_state")


def bind_state(kvcache: Any) -> bool:
    """Put SGLang's mamba state in the daemon's state buffers and the lease's ``state`` slots.

    Called with the ``kvcache`` SGLang gives the paged allocator; anything but a
    ``HybridLinearKVPool`` whose full-attention pool is kvpool's is left alone.

    Returns:
        Whether the state was bound.

    Raises:
        PoolMismatch: the plan's linear layers, slot count, state shapes or dtypes differ from
            SGLang's mamba pool (both named), or a mode kvpool does not map.
        ResourceExhausted: another lease holds some of the pool's state slots.
    """
    if not isinstance(kvcache, HybridLinearKVPool):
        return False
    attachment: Attachment | None = getattr(kvcache.full_kv_pool, "kvpool_attachment", None)
    if attachment is None or attachment.configured.plan.architecture != PLAN_ARCHITECTURE:
        return False
    plan = attachment.configured.plan
    binding = attachment.binding
    where = f"kvpool pool {binding.pool!r}"
    full = tuple(sorted(kvcache.full_attention_layer_id_mapping))
    if full != kv_layers(plan):
        raise PoolMismatch(
            f"SGLang's full-attention layers are {list(full)} but {where} planned "
            f"{list(kv_layers(plan))}", field="model")
    mamba = kvcache.mamba_pool
    layers = tuple(mamba.mamba_layer_ids)
    if layers != state_layers(plan):
        raise PoolMismatch(
            f"SGLang's mamba pool holds linear layers {list(layers)} but {where} planned state "
            f"for {list(state_layers(plan))}; check --pp-size / the PP rank", field="model")
    if mamba.size != plan.mamba_cache_size:
        raise PoolMismatch(
            f"SGLang's mamba pool has {mamba.size} state slots but {where} planned "
            f"{plan.mamba_cache_size}; give SGLang --max-mamba-cache-size "
            f"{plan.mamba_cache_size}, or configure the pool with SGLang's numbers "
            "(--max-running-requests, the radix cache and overlap options decide the daemon's "
            "slots)", field="mamba_cache_size")
    _refuse_unsupported(mamba, where)
    cache = mamba.mamba_cache
    region = attachment.region
    conv = stacked_view(region, [f"{CONV}.{layer}" for layer in layers])
    temporal = stacked_view(region, [f"{SSM}.{layer}" for layer in layers])
    for name, theirs, ours in (("conv", cache.conv[0], conv), ("ssm", cache.temporal, temporal)):
        if theirs.shape != ours.shape or theirs.dtype != ours.dtype:
            raise PoolMismatch(
                f"SGLang's mamba {name} state is {tuple(theirs.shape)} {theirs.dtype} but "
                f"{where} has {tuple(ours.shape)} {ours.dtype} (layers, slots, ...)",
                field="buffers")
        if theirs.device.type != ours.device.type:
            raise PoolMismatch(
                f"SGLang's mamba state is on {theirs.device} but {where} lives on "
                f"{ours.device}: point KVPOOL_TARGET at the daemon of this device",
                field="device")
    slots = _hold_state_slots(attachment, int(mamba.size))
    mamba.mamba_cache = dataclasses.replace(cache, conv=[conv], temporal=temporal)
    # Cached facts about the old tensors (CUDA's fused slot kernels): computed again from these.
    for cached in ("_conv_fuse_ok", "_conv_slot_desc"):
        mamba.__dict__.pop(cached, None)
    mamba._warmup_fused_copy_slot_kernel()
    kvcache.full_kv_pool.kvpool_state_slots = slots
    log.info("kvpool pool %r: SGLang's mamba state (%d linear layers, %d slots) in the "
             "daemon's state buffers, slots held by lease %s", binding.pool, len(layers),
             mamba.size, binding.lease.lease_id)
    return True


def _hold_state_slots(attachment: Attachment, count: int) -> np.ndarray:
    """The lease takes the whole ``state`` space: ids ``1..count``, SGLang's slots."""
    binding = attachment.binding
    try:
        ids = binding.lease.allocate(binding.pool, STATE_SPACE, count)
    except ResourceExhausted as exc:
        raise ResourceExhausted(
            f"kvpool pool {binding.pool!r} could not give this scheduler all {count} of its "
            f"state slots (SGLang's mamba pool needs every one): another lease holds some; "
            f"one scheduler per hybrid linear pool, or configure another pool name "
            f"({exc.message})", field="state") from exc
    if sorted(ids.tolist()) != list(range(1, count + 1)):
        binding.lease.free(binding.pool, STATE_SPACE, ids)
        raise PoolMismatch(
            f"kvpool pool {attachment.binding.pool!r} gave state ids "
            f"{int(ids.min())}..{int(ids.max())}, not SGLang's slots 1..{count}",
            field="state")
    return ids


__all__ = ["PLAN_ARCHITECTURE", "bind_state", "stacked_view", "state_layers"]

"""SGLang's hybrid sliding-window pools (gpt-oss, ...) over one kvpool daemon pool (SGLang 0.5.23).

SGLang builds a hybrid SWA model's KV cache as its in-tree ``SWAKVPool``, which composes two
pools of the class ``get_kv_pool_cls(kind="mha")`` returns (kvpool's), one per side:
``allocation_label="Full"`` (the full-attention layers, ``size`` = SGLang's full token count)
first, then ``allocation_label="SWA"`` (the sliding layers, ``size`` = its SWA token count). Its
in-tree ``SWATokenToKVPoolAllocator`` takes its two inner paged allocators from
``get_paged_allocator_cls()`` (kvpool's), one per side, and keeps the full -> SWA token-slot
mapping ``full_to_swa_index_mapping`` that its attention backends read.

What kvpool does with them:

1. The full side configures the daemon pool with ``swa_pairing="engine"`` (SGLang pairs the
   pages, so the daemon's ``swa`` is an id space of its own and ``full_to_swa`` has SGLang's
   token-slot shape), SGLang's full token count as ``max_total_tokens`` and its
   ``swa_full_tokens_ratio``; it checks the plan (architecture ``hybrid_swa``, the full token
   count, page size, as many full layers as SGLang's side) and attaches it with the
   scheduler's lease. The SWA side takes the same attachment (SGLang builds the two sides one
   after the other in one constructor that gives them nothing in common: :class:`SidePairing`
   hands the full side's attachment to the SWA side) and checks the plan's SWA token count.
2. Each side's buffers are the daemon's ``k.<layer>`` / ``v.<layer>`` of its kind (``kv`` or
   ``swa_kv``) in layer order; SGLang's layer ids are checked against them once they are
   known (``model_layer_ids``, set after the sides are built).
3. Each inner allocator takes pages of its side's id space (``kv`` or ``swa``) from the one
   lease's page cache, so the daemon's Stats show the lease holding both: SGLang builds the
   inner allocators with the side's pool alone, so each side's allocator configuration (its
   space, and for the SWA side the mapping's adoption below) is recorded for that pool in
   ``allocator_config.CONFIGS``, where the allocator looks it up.
4. The mapping: when ``SWATokenToKVPoolAllocator`` first clears its inner SWA allocator (in its
   constructor, after it made the mapping and before it registers it with the pool), the
   mapping tensor's storage is set to the daemon's ``full_to_swa`` view (its contents, zeros
   and the trailing -1, copied first), so SGLang's writes and its attention backends' reads
   go to daemon memory. The allocator is found as the caller of that ``clear`` (the nearest
   frames); an allocator built some other way keeps its own mapping.
5. The request table: SGLang gives its SWA allocator the request pool (``req_to_token_pool``);
   at the same moment its ``req_to_token`` moves into the daemon's ``req_to_token`` the same
   way, when the shapes agree (else it stays SGLang's, logged). Both belong to one scheduler,
   so the full side refuses a pool something else has attached.

Not covered: all-SWA models (SGLang's ``PureSWATokenToKVPoolAllocator``, page size 1 only),
MLA/DSA hybrid SWA pools, quantized KV, SGLang's SWA request cap (``--disable-radix-cache``
with a fixed ``--max-running-requests``: the plan's SWA count then differs and the SWA side
refuses it, naming both), speculative draft layers sharing the pool.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

from kvpool.contract.errors import AlreadyExists, FailedPrecondition
from kvpool.contract.plan import FULL_TO_SWA, BufferKind
from kvpool.contract.records import ConfigureResult
from kvpool.integrations.sglang.allocator_config import CONFIGS, AllocatorConfig
from kvpool.integrations.sglang.daemon_pool import (
    Attachment,
    EngineSettings,
    PoolMismatch,
    engine_settings,
    existing_pool_differs,
    model_config_path,
    plan_request,
)
from kvpool.integrations.sglang.scheduler_binding import PoolBinding, binding_from_env

log = logging.getLogger("kvpool.sglang")

ARCHITECTURE = "hybrid_swa"
REQ_TO_TOKEN = "req_to_token"
# SGLang's allocation_label of each side of its SWAKVPool -> the daemon's id space and the
# buffer kind of that side's layers.
SIDES: dict[str, tuple[str, BufferKind]] = {
    "Full": ("kv", BufferKind.kv),
    "SWA": ("swa", BufferKind.swa_kv),
}
# How many frames above the inner allocator's clear() the SWA allocator may be (its clear(),
# then its constructor).
CALLER_FRAMES = 4


def side_of(pool: Any) -> str | None:
    """The side (``Full`` or ``SWA``) of SGLang's SWAKVPool that ``pool`` is, else None."""
    label = getattr(pool, "allocation_label", None)
    return label if label in SIDES else None


def swa_full_tokens_ratio() -> float | None:
    """SGLang's resolved ``--swa-full-tokens-ratio`` (None outside a scheduler, where SGLang
    has published no schedule: ValueError)."""
    try:
        from sglang.srt.runtime_context import get_schedule

        ratio = get_schedule().swa_full_tokens_ratio
    except (AttributeError, RuntimeError, ValueError, ImportError):
        return None
    return None if ratio is None else float(ratio)


@dataclass
class SidePairing:
    """The full side's attachment, waiting for the SWA side SGLang builds right after it."""

    pending: Attachment | None = None

    def put(self, attachment: Attachment) -> None:
        self.pending = attachment

    def take(self, pool: Any) -> Attachment:
        """The full side's attachment for the SWA side ``pool``.

        Raises:
            FailedPrecondition: no full side was built before it.
        """
        attachment, self.pending = self.pending, None
        if attachment is None:
            raise FailedPrecondition(
                f"SGLang built the SWA side of a hybrid sliding-window pool ({pool.size} "
                "tokens) without its full side first; kvpool's SWA pools are built by SGLang's "
                "SWAKVPool, full side then SWA side", field="kv_pool")
        return attachment


# One per process, by necessity: SGLang builds the two sides inside one SWAKVPool constructor
# and gives them no common argument; one scheduler process builds one SWAKVPool.
PAIRING = SidePairing()


def configure_options(settings: EngineSettings, pool: Any,
                      ratio: float | None) -> dict[str, Any]:
    """The Configure options of the hybrid pool, from the full side SGLang builds."""
    options = plan_request(settings, size=pool.size, page_size=pool.page_size, dtype=pool.dtype)
    options["swa_pairing"] = "engine"
    if ratio is not None:
        options["swa_full_tokens_ratio"] = ratio
    return options


def check_side(result: ConfigureResult, pool: Any, side: str, name: str) -> None:
    """Refuse a plan that is not SGLang's side ``side``: architecture, pairing, that side's
    token count, page size.

    Raises:
        PoolMismatch: naming SGLang's value and the plan's.
    """
    plan = result.plan
    where = f"kvpool pool {name!r}"
    if plan.architecture != ARCHITECTURE:
        raise PoolMismatch(
            f"SGLang builds a hybrid sliding-window KV pool but the daemon planned {where} as "
            f"{plan.architecture!r}", field="architecture")
    spaces = {s.name: s for s in plan.id_spaces}
    if "swa" not in spaces or spaces["swa"].follows is not None:
        raise PoolMismatch(
            f"{where} pairs its full and SWA pages in the daemon (swa follows kv); SGLang's SWA "
            "allocator pairs them itself: drop the pool (`kvpool drop`) so it is configured "
            "with swa_pairing=engine", field="swa_pairing")
    if plan.page_size != pool.page_size:
        raise PoolMismatch(f"SGLang's page size is {pool.page_size} but {where} has page_size "
                           f"{plan.page_size}", field="page_size")
    if side == "Full":
        have, knob = plan.full_max_total_num_tokens, "max_total_tokens"
        hint = "set --max-total-tokens (or --mem-fraction-static) so both agree"
    else:
        have, knob = plan.swa_max_total_num_tokens, "swa_full_tokens_ratio"
        hint = ("the plan follows --swa-full-tokens-ratio; SGLang's request cap "
                "(--disable-radix-cache with --max-running-requests) is not planned by the "
                "plugin")
    if have != pool.size:
        raise PoolMismatch(
            f"SGLang sized the {side} side of its hybrid SWA pool at {pool.size} tokens but "
            f"{where} plans {have}: {hint}, or drop the pool if it was configured with other "
            "options", field=knob)


def attach_full_side(pool: Any, settings: EngineSettings | None = None,
                     binding: PoolBinding | None = None) -> Attachment:
    """Configure, check and attach the hybrid pool for SGLang's full side ``pool``.

    Args:
        pool: the full side being built (reads ``size``, ``page_size``, ``dtype``).
        settings: SGLang's settings (default: the running scheduler's).
        binding: the binding to use (default: one from the environment, closed at exit).

    Raises:
        FailedPrecondition: ``KVPOOL_POOL`` unset; a plan that differs from SGLang's side.
        KVPoolError: the daemon's refusal.
    """
    own = binding is None
    binding = binding_from_env() if binding is None else binding
    try:
        settings = engine_settings() if settings is None else settings
        options = configure_options(settings, pool, swa_full_tokens_ratio())
        config = model_config_path(settings.model_path, settings.revision)
        try:
            configured = binding.client.configure(binding.pool, hf_config=config, **options)
        except AlreadyExists as exc:
            raise existing_pool_differs(binding, options, exc) from exc
        log.info("kvpool pool %r %s for SGLang (hybrid SWA, %d full tokens, page %d, %s): "
                 "fingerprint %s", binding.pool, "created" if configured.created else "reused",
                 pool.size, pool.page_size, options["kv_cache_dtype"], configured.fingerprint)
        check_side(configured, pool, "Full", binding.pool)
        stack = contextlib.ExitStack()
        region = stack.enter_context(binding.client.attach(
            binding.pool, configured.fingerprint, lease=binding.lease))
        binding.on_close(stack.close)
        attached = binding.client.stats(binding.pool).pool(binding.pool).attached
        if attached > 1:
            raise FailedPrecondition(
                f"kvpool pool {binding.pool!r} is attached {attached} times: a hybrid SWA pool's "
                f"{FULL_TO_SWA} mapping (and request table) is written by one SGLang scheduler; "
                "give each scheduler its own pool (KVPOOL_POOL), or, after a crash, start "
                "again once the dead scheduler's lease expired (KVPOOL_LEASE_TTL_S)",
                field="pool")
    except BaseException:
        if own:
            binding.close()
        raise
    if own:
        atexit.register(binding.close)
    return Attachment(binding, configured, region)


def side_layers(configured: ConfigureResult, kind: BufferKind) -> list[int]:
    """The model layer ids of the plan's ``k.<layer>`` buffers of ``kind``, ascending (draft
    layers left out)."""
    return sorted(int(b.name[2:]) for b in configured.plan.buffers
                  if b.kind == kind and b.name.startswith("k."))


def create_side_buffers(pool: Any) -> None:
    """SGLang's ``_create_buffers_normal`` of one side of its SWAKVPool: the daemon's views.

    Sets ``k_buffer``/``v_buffer``, ``kvpool_binding``, ``kvpool_configured``,
    ``kvpool_attachment`` and ``kvpool_layer_ids``, and records the configuration of the
    side's paged allocator (its id space; the SWA side's adopts the mapping on clear).

    Raises:
        PoolMismatch: the plan's layers or buffers differ from SGLang's side.
        FailedPrecondition: the SWA side without a full side before it.
    """
    side = side_of(pool)
    assert side is not None
    space, kind = SIDES[side]
    if side == "Full":
        attachment = attach_full_side(pool)
        PAIRING.put(attachment)
    else:
        attachment = PAIRING.take(pool)
        check_side(attachment.configured, pool, side, attachment.binding.pool)
    layers = side_layers(attachment.configured, kind)
    if len(layers) != pool.layer_num:
        raise PoolMismatch(
            f"SGLang's {side} side holds {pool.layer_num} layers but kvpool pool "
            f"{attachment.binding.pool!r} plans {len(layers)} ({layers}); check --pp-size and "
            "the model's layer types", field="layers")
    k_shape, v_shape = pool._kv_buffer_shapes()
    pool.k_buffer = [attachment.view(f"k.{layer}", k_shape, pool.store_dtype, pool.device)
                     for layer in layers]
    pool.v_buffer = [attachment.view(f"v.{layer}", v_shape, pool.store_dtype, pool.device)
                     for layer in layers]
    pool.kvpool_binding = attachment.binding
    pool.kvpool_configured = attachment.configured
    pool.kvpool_attachment = attachment
    pool.kvpool_layer_ids = tuple(layers)
    CONFIGS.set(pool, AllocatorConfig(space=space,
                                      on_clear=adopt_mapping if side == "SWA" else None))


def check_layer_ids(pool: Any) -> None:
    """SGLang's layer ids of a side (``model_layer_ids``) against the plan's.

    Raises:
        PoolMismatch: they differ.
    """
    have = tuple(getattr(pool, "model_layer_ids", ()))
    want = getattr(pool, "kvpool_layer_ids", have)
    if have != want:
        raise PoolMismatch(
            f"SGLang's {side_of(pool)} side holds model layers {list(have)} but kvpool pool "
            f"{pool.kvpool_binding.pool!r} planned {list(want)} for it", field="layers")


def calling_swa_allocator(inner: Any) -> Any:
    """The ``SWATokenToKVPoolAllocator`` among the nearest callers whose SWA allocator is
    ``inner``, else None."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    frame = sys._getframe(1)
    for _ in range(CALLER_FRAMES + 1):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        outer = frame.f_locals.get("self")
        if (isinstance(outer, SWATokenToKVPoolAllocator)
                and getattr(outer, "swa_attn_allocator", None) is inner):
            return outer
    return None


def adopt_mapping(inner: Any) -> None:
    """Put the SWA allocator's ``full_to_swa_index_mapping`` into the daemon's ``full_to_swa``
    (once; the inner SWA allocator's ``clear`` calls this).

    Raises:
        PoolMismatch: the mapping's shape or dtype is not the plan's, or a side's layer ids
            differ from the plan's.
    """
    pool = inner._kvcache
    if getattr(pool, "kvpool_mapping", None) is not None:
        return
    outer = calling_swa_allocator(inner)
    if outer is None:
        return
    mapping = getattr(outer, "full_to_swa_index_mapping", None)
    if not isinstance(mapping, torch.Tensor):
        return
    full = getattr(outer.full_attn_allocator, "_kvcache", None)
    for side in (full, pool):
        check_layer_ids(side)
    attachment = pool.kvpool_attachment
    pool.kvpool_mapping = move_into(attachment, FULL_TO_SWA, mapping)
    log.info("kvpool pool %r: SGLang's full->SWA mapping (%d slots) is the daemon's %s",
             pool.kvpool_binding.pool, mapping.shape[0], FULL_TO_SWA)
    table = getattr(getattr(outer, "_req_to_token_pool", None), "req_to_token", None)
    if type(getattr(outer, "_req_to_token_pool", None)) is not ReqToTokenPool or not isinstance(
            table, torch.Tensor):
        return
    have = attachment.region[REQ_TO_TOKEN]
    if tuple(have.shape) != tuple(table.shape) or have.dtype != table.dtype:
        log.info("kvpool pool %r: SGLang's request table is %s %s, the plan's %s %s "
                 "(max_running_requests or context length differ): it stays SGLang's",
                 pool.kvpool_binding.pool, tuple(table.shape), table.dtype,
                 tuple(have.shape), have.dtype)
        return
    pool.kvpool_req_to_token = move_into(attachment, REQ_TO_TOKEN, table)
    log.info("kvpool pool %r: SGLang's request table %s is the daemon's %s",
             pool.kvpool_binding.pool, tuple(table.shape), REQ_TO_TOKEN)


def move_into(attachment: Attachment, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Make SGLang's ``tensor`` a view of the daemon's buffer ``name``: its contents copied
    there, then its storage set to it (every holder of the tensor object sees daemon memory).

    Returns:
        The daemon's view.

    Raises:
        PoolMismatch: the buffer's shape, dtype or device is not the tensor's.
    """
    view = attachment.view(name, tuple(tensor.shape), tensor.dtype, tensor.device)
    view.copy_(tensor)
    with torch.no_grad():
        tensor.set_(view)
    return view


__all__ = ["PAIRING", "SIDES", "SidePairing", "adopt_mapping", "attach_full_side",
           "check_side", "create_side_buffers", "side_of"]

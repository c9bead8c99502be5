"""The plan's table of allocatable id spaces, declared from an architecture's numbers.

Every pool has ``kv`` (pages of the full, or only, token space) and ``req`` (request rows of
``req_to_token``); a hybrid sliding-window pool adds ``swa``, which follows ``kv`` through the
``full_to_swa`` buffer (or, when the engine pairs the pages, ``swa_pairing="engine"``: a mapping
that no id space addresses, ``swa`` stands alone); a hybrid linear pool adds ``state`` (mamba
slots); DeepSeek-V4 adds its compress-state rings (``c4_state``, ``c128_state``) through
``Sizing.extra_spaces``. Below the sizing modules nothing branches on architecture: the
allocator, Stats, metrics and ``kvpool top`` iterate this table.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.contract.plan import FULL_TO_SWA, BufferSpec, IdSpaceSpec
from kvpoold.sizing.common import Sizing

# name -> (what one id is, the option that makes the space larger); a space not listed here
# counts "units" and names the budget.
TRAITS: dict[str, tuple[str, str]] = {
    "kv": ("pages", "budget_bytes or max_total_tokens"),
    "swa": ("pages", "budget_bytes or swa_full_tokens_ratio"),
    "req": ("rows", "max_running_requests"),
    "state": ("slots", "budget_bytes or mamba_full_memory_ratio"),
    "c4_state": ("slots", "budget_bytes or swa_full_tokens_ratio"),
    "c128_state": ("slots", "max_running_requests"),
}


def declare_spaces(sizing: Sizing, buffers: Sequence[BufferSpec]) -> tuple[IdSpaceSpec, ...]:
    """The id spaces of a plan, in allocation order; spaces without ids are left out.

    ``bytes_per_unit`` of a space is the sum of ``page_bytes`` over the buffers it addresses.

    Args:
        sizing: the architecture's numbers.
        buffers: the plan's buffers (tagged with ``id_space``).
    """
    mapping = next((b for b in buffers if b.name == FULL_TO_SWA), None)
    sizes: list[tuple[str, int, str | None]] = [("kv", sizing.num_pages, None)]
    if sizing.swa_num_pages and mapping is not None:
        # A mapping the daemon writes is addressed by kv ids; the engine's by no space.
        sizes.append(("swa", sizing.swa_num_pages, "kv" if mapping.id_space else None))
    sizes.append(("req", sizing.max_running_requests, None))
    if sizing.mamba_cache_size:
        sizes.append(("state", sizing.mamba_cache_size, None))
    sizes += [(name, capacity, None) for name, capacity in sizing.extra_spaces]
    unit_bytes: dict[str, int] = {}
    for b in buffers:
        if b.id_space:
            unit_bytes[b.id_space] = unit_bytes.get(b.id_space, 0) + b.page_bytes
    return tuple(
        IdSpaceSpec(
            name=name,
            capacity=capacity,
            unit=TRAITS.get(name, ("units", "budget_bytes"))[0],
            bytes_per_unit=unit_bytes.get(name, 0),
            knob=TRAITS.get(name, ("units", "budget_bytes"))[1],
            follows=follows,
            mapping=FULL_TO_SWA if follows else None,
        )
        for name, capacity, follows in sizes
        if capacity > 0
    )

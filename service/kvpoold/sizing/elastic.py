"""The layout of an elastic pool (``--elastic``): the fixed layout's views over a virtual range of
whole groups, each view's share of a group whole 2 MiB chunks (issue 23).

The architecture sizes the pool as usual from the budget (or ``--max-total-tokens``): that token
count is the **virtual range**. It is rounded down to whole groups (at least one), the views are
laid out again at that count, each view starts on a chunk, and the aux buffers (request->token
table, page maps) follow in chunks of their own: the **fixed part**, backed for the pool's life.
Nothing here touches memory; the daemon backs groups as it grants them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import msgspec

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import CHUNK_BYTES, BufferKind, BufferSpec, ElasticPlan
from kvpoold.sizing.common import Sizing, SizingContext

# The views a group cuts: token-major KV rows and the page-major DSA indexer, both addressed by
# the kv page id. State slots, SWA pages and compressed spaces are other id spaces (not yet).
GROUP_KINDS = frozenset({BufferKind.kv, BufferKind.index})


def pages_per_group(page_bytes: Sequence[int]) -> int:
    """The fewest pages whose bytes are whole chunks in every view (``page_bytes`` per view).

    Raises:
        InvalidArgument: no views, or a view with no bytes per page.
    """
    if not page_bytes or min(page_bytes) <= 0:
        raise InvalidArgument(f"an elastic pool needs views with bytes per page (got "
                              f"{tuple(page_bytes)})", field="elastic")
    pages = 1
    for b in page_bytes:
        pages = math.lcm(pages, CHUNK_BYTES // math.gcd(CHUNK_BYTES, b))
    return pages


def _round_chunk(n: int) -> int:
    return -(-n // CHUNK_BYTES) * CHUNK_BYTES


def elastic_layout(
    name: str,
    ctx: SizingContext,
    sizing: Sizing,
    layout: Callable[[SizingContext, Sizing], list[BufferSpec]],
    aux: Callable[[Sizing], list[BufferSpec]],
) -> tuple[Sizing, tuple[BufferSpec, ...], int, ElasticPlan]:
    """Lay an architecture's buffers out as an elastic pool.

    Args:
        name: the architecture (messages).
        ctx, sizing: as the architecture sized the pool.
        layout: the architecture's buffer layout.
        aux: the buffers outside the budget the planner adds (the request->token table).

    Returns:
        The sizing at the virtual range, the placed buffers, the region's bytes (whole chunks)
        and the groups.

    Raises:
        InvalidArgument: an architecture with buffers a group cannot cut (state slots, SWA
            pages, compressed spaces); floor above cap.
    """
    options = ctx.options
    first = layout(ctx, sizing)
    views = [b for b in first if b.in_budget]
    other = sorted({b.kind.value for b in views if b.kind not in GROUP_KINDS})
    if other:
        raise InvalidArgument(
            f"{name} pools hold {', '.join(other)} buffers, which a group of KV "
            "pages cannot cut; elastic pools serve MHA, MLA and DSA layouts (one page space "
            "over token-indexed views): Configure this model without --elastic",
            field="elastic")
    per_group = pages_per_group([b.page_bytes for b in views])
    groups = max(1, (sizing.num_pages + 1) // per_group)
    num_pages = groups * per_group - 1
    page = ctx.page_size
    changes: dict[str, object] = {"num_pages": num_pages}
    if sizing.max_total_num_tokens is not None:
        changes["max_total_num_tokens"] = num_pages * page
    if sizing.full_max_total_num_tokens is not None:
        changes["full_max_total_num_tokens"] = num_pages * page
    virtual = dataclasses.replace(sizing, **changes)  # type: ignore[arg-type]
    buffers = layout(ctx, virtual)
    in_budget = [b for b in buffers if b.in_budget]
    placed: list[BufferSpec] = []
    offset = 0
    for b in in_budget:
        share = per_group * b.page_bytes
        if b.nbytes != groups * share:  # a layout that is not page-indexed: a bug, say so
            raise InvalidArgument(f"{name} buffer {b.name} has {b.nbytes:,} B, not "
                                  f"{groups} groups of {share:,} B", field="elastic")
        placed.append(msgspec.structs.replace(b, offset_bytes=offset))
        offset += b.nbytes
    fixed_offset = offset
    for b in [*(b for b in buffers if not b.in_budget), *aux(virtual)]:
        offset = -(-offset // 256) * 256
        placed.append(msgspec.structs.replace(b, offset_bytes=offset))
        offset += b.nbytes
    backing = _round_chunk(offset)
    tokens = per_group * page
    group_bytes = sum(per_group * b.page_bytes for b in in_budget)
    # Group 0 holds the padding page 0, which engines write: at least one group, always.
    floor_tokens = options.elastic_floor_tokens
    if floor_tokens is None:
        floor_tokens = ctx.context_length + page
    floor = min(groups, max(1, -(-floor_tokens // tokens)))
    cap = groups if options.elastic_cap_tokens is None else min(
        groups, -(-options.elastic_cap_tokens // tokens))
    if floor > cap:
        raise InvalidArgument(
            f"the elastic floor ({floor} groups of {tokens:,} tokens) is above the cap "
            f"({cap} groups, from --elastic-cap-tokens {options.elastic_cap_tokens:,}); "
            "raise --elastic-cap-tokens or lower --elastic-floor-tokens",
            field="elastic_cap_tokens")
    plan = ElasticPlan(
        tokens_per_group=tokens, pages_per_group=per_group, group_bytes=group_bytes,
        groups=groups, chunk_bytes=CHUNK_BYTES, views=tuple(b.name for b in in_budget),
        fixed_offset=fixed_offset, fixed_bytes=backing - fixed_offset, floor_groups=floor,
        cap_groups=cap, weight=options.elastic_weight)
    return virtual, tuple(placed), backing, plan

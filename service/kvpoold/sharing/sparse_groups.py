"""Group geometry and the sparse file backing of an elastic pool on CPU (issue 23).

A **group** is the same token range in every per-token view of a pool, long enough that each
view's share of it is whole 2 MiB chunks: the unit the daemon grants, commits and takes back.
For Llama-3.1-8B (64 K/V views of 2 KiB per token) a group is 1,024 tokens and 64 chunks,
128 MiB; a view whose row does not divide 2 MiB evenly (MLA's 1,152 B) takes the least common
multiple (16,384 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import PoolPlan, group_ranges
from kvpool.mapping.sparse import CHUNK_BYTES, commit, punch
from kvpoold.sizing.elastic import pages_per_group


@dataclass(frozen=True)
class GroupGeometry:
    """Tokens, bytes and chunks of one group, and how many groups the virtual range holds.

    Attributes:
        tokens: tokens per group (a multiple of the page size).
        share_bytes: each view's bytes of one group (whole chunks), in view order.
        groups: groups in the virtual range.
    """

    tokens: int
    share_bytes: tuple[int, ...]
    groups: int

    @property
    def bytes(self) -> int:
        """Bytes of one group over all views."""
        return sum(self.share_bytes)

    @property
    def view_bytes(self) -> tuple[int, ...]:
        """Each view's bytes over the whole range (the views' sizes, whole chunks)."""
        return tuple(s * self.groups for s in self.share_bytes)


def group_geometry(row_bytes: tuple[int, ...], page_size: int,
                   capacity_tokens: int) -> GroupGeometry:
    """The smallest group of whole chunks in every token-major view of ``row_bytes`` a token,
    and the groups that cover ``capacity_tokens``.

    Raises:
        InvalidArgument: no views, a row or page size that is not positive.
    """
    if not row_bytes or min(row_bytes) <= 0 or page_size <= 0 or capacity_tokens <= 0:
        raise InvalidArgument(
            f"an elastic pool needs per-token views and positive sizes (rows {row_bytes}, "
            f"page {page_size}, capacity {capacity_tokens})", field="elastic")
    tokens = pages_per_group([r * page_size for r in row_bytes]) * page_size
    return GroupGeometry(tokens, tuple(tokens * r for r in row_bytes),
                         -(-capacity_tokens // tokens))


def plan_geometry(plan: PoolPlan) -> tuple[GroupGeometry, tuple[int, ...]]:
    """An elastic plan's groups and each grouped view's offset in the region.

    Raises:
        InvalidArgument: a fixed plan.
    """
    e = plan.elastic
    if e is None:
        raise InvalidArgument(f"pool layout {plan.fingerprint()} is not elastic", field="elastic")
    shares = plan.group_shares()
    geo = GroupGeometry(e.tokens_per_group, tuple(share for _, share in shares), e.groups)
    return geo, tuple(offset for offset, _ in shares)


class SparseBacking:
    """The views of one elastic pool in one sparse file: view ``i`` starts at ``offsets[i]``
    (chunk-aligned); group ``g`` is rows ``[g * tokens, (g + 1) * tokens)`` of every view.

    Args:
        fd: the pool's file (``ftruncate``d to the virtual size).
        geometry: the pool's groups.
        offsets: each view's byte offset in the file, in :attr:`GroupGeometry.share_bytes`
            order.
    """

    def __init__(self, fd: int, geometry: GroupGeometry, offsets: tuple[int, ...]) -> None:
        if len(offsets) != len(geometry.share_bytes) or any(o % CHUNK_BYTES for o in offsets):
            raise InvalidArgument("each view needs a chunk-aligned offset", field="elastic")
        self.fd = fd
        self.geometry = geometry
        self.offsets = offsets
        self.granted: set[int] = set()

    def ranges(self, group: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of group ``group`` in each view: whole chunks."""
        g = self.geometry
        if not 0 <= group < g.groups:
            raise InvalidArgument(f"group {group} is outside 0..{g.groups - 1}", field="group")
        return group_ranges(list(zip(self.offsets, g.share_bytes, strict=True)), group)

    def grant(self, group: int) -> None:
        """Back group ``group`` with memory (all views); a failure leaves nothing of it
        committed."""
        if group in self.granted:
            return
        done: list[tuple[int, int]] = []
        try:
            for offset, length in self.ranges(group):
                commit(self.fd, offset, length)
                done.append((offset, length))
        except BaseException:
            for offset, length in done:
                punch(self.fd, offset, length)
            raise
        self.granted.add(group)

    def release(self, group: int) -> None:
        """Free group ``group``'s memory (every process has unmapped it first)."""
        if group not in self.granted:
            return
        for offset, length in self.ranges(group):
            punch(self.fd, offset, length)
        self.granted.discard(group)

"""Group geometry and the sparse file backing of an elastic pool on CPU (issue 23).

A **group** is the same token range in every per-token view of a pool, long enough that each
view's share of it is whole 2 MiB chunks: the unit the daemon grants, commits and takes back.
For Llama-3.1-8B (64 K/V views of 2 KiB per token) a group is 1,024 tokens and 64 chunks,
128 MiB; a view whose row does not divide 2 MiB evenly (MLA's 1,152 B) takes the least common
multiple (16,384 tokens).
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass

from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.plan import PoolPlan, group_ranges
from kvpool.mapping.sparse import CHUNK_BYTES, backed_bytes, commit, punch
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

    It owns which ranges of the file are committed (the fixed part and the granted groups):
    every other range is a hole, and memory found there (an attached process that touched a
    range the daemon punched, or never granted) is *stray*: :meth:`stray_extents` finds it,
    :meth:`punch_strays` and :meth:`punch_gaps` free it (``kvpoold.elastic.backing_audit``).

    Thread-safe: grants and releases run in worker threads and an audit in another; each
    holds :attr:`lock` while it changes the file or reads the committed set, so an audit never
    punches a group being committed.

    Args:
        fd: the pool's file (``ftruncate``d to the virtual size).
        geometry: the pool's groups.
        offsets: each view's byte offset in the file, in :attr:`GroupGeometry.share_bytes`
            order.
        fixed: ``(offset, length)`` committed for the file's life (the aux buffers).
    """

    def __init__(self, fd: int, geometry: GroupGeometry, offsets: tuple[int, ...],
                 fixed: tuple[int, int] = (0, 0)) -> None:
        if len(offsets) != len(geometry.share_bytes) or any(o % CHUNK_BYTES for o in offsets):
            raise InvalidArgument("each view needs a chunk-aligned offset", field="elastic")
        self.fd = fd
        self.geometry = geometry
        self.offsets = offsets
        self.fixed = fixed
        self.size = os.fstat(fd).st_size
        self.granted: set[int] = set()
        # Guards the file's committed ranges (granted, _bound) against an audit. A leaf lock.
        self.lock = threading.Lock()
        # Groups granted or being committed: read without the lock (an int), so it is raised
        # before a commit and lowered after a punch, never below what the file holds.
        self._bound = 0
        self.closed = False  # set under the lock before the file's descriptor is closed

    def ranges(self, group: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of group ``group`` in each view: whole chunks."""
        g = self.geometry
        if not 0 <= group < g.groups:
            raise InvalidArgument(f"group {group} is outside 0..{g.groups - 1}", field="group")
        return group_ranges(list(zip(self.offsets, g.share_bytes, strict=True)), group)

    def grant(self, group: int) -> None:
        """Back group ``group`` with memory (all views), reading zeros; a failure leaves
        nothing of it committed.

        The ranges are punched first: a commit keeps pages already there, and a process that
        kept a mapping of the group after its release may have written into it since (a
        hole punch of a hole costs microseconds; this runs in a worker thread)."""
        with self.lock:
            if self.closed:
                raise FailedPrecondition(f"the pool's file is closed; group {group} not granted")
            if group in self.granted:
                return
            ranges = self.ranges(group)
            self._bound += 1
            done: list[tuple[int, int]] = []
            try:
                for offset, length in ranges:
                    punch(self.fd, offset, length)
                    commit(self.fd, offset, length)
                    done.append((offset, length))
            except BaseException:
                for offset, length in done:
                    punch(self.fd, offset, length)
                self._bound -= 1
                raise
            self.granted.add(group)

    def release(self, group: int) -> None:
        """Free group ``group``'s memory (every process has unmapped it first)."""
        with self.lock:
            if self.closed or group not in self.granted:
                return
            for offset, length in self.ranges(group):
                punch(self.fd, offset, length)
            self.granted.discard(group)
            self._bound -= 1

    def committed_bytes(self) -> int:
        """The most memory the file should hold now: the fixed part and the groups granted
        or being committed (O(1), without the lock)."""
        return self.fixed[1] + self._bound * self.geometry.bytes

    def excess_bytes(self) -> int:
        """Memory behind the file beyond :meth:`committed_bytes` (``st_blocks``; O(1)): above
        0, something touched a hole (or a commit is finishing: see :meth:`stray_extents`)."""
        return backed_bytes(self.fd) - self.committed_bytes()

    def gaps(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of every range that should be a hole, in order: O(granted
        ranges). Call with :attr:`lock` held."""
        held = sorted([self.fixed] + [r for g in self.granted for r in self.ranges(g)])
        out: list[tuple[int, int]] = []
        at = 0
        for offset, length in held:
            if length and offset > at:
                out.append((at, offset - at))
            at = max(at, offset + length)
        if at < self.size:
            out.append((at, self.size - at))
        return out

    def stray_extents(self, gaps: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The pages in ``gaps`` that hold memory someone touched (``SEEK_DATA`` /
        ``SEEK_HOLE``: one or two ``lseek`` a gap and a stray run; it never reads a page).
        Pages committed with ``fallocate`` and never touched do not show (tmpfs reports them
        as holes): :meth:`excess_bytes` still counts them. Call with :attr:`lock` held."""
        out: list[tuple[int, int]] = []
        for start, length in gaps:
            at, end = start, start + length
            while at < end:
                try:
                    data = os.lseek(self.fd, at, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # no data from here to the end of the file
                        return out
                    raise
                if data >= end:
                    break
                hole = min(os.lseek(self.fd, data, os.SEEK_HOLE), end)
                out.append((data, hole - data))
                at = hole
        return out

    def punch_strays(self, extents: list[tuple[int, int]]) -> None:
        """Punch the chunks around ``extents`` (found in gaps, so the chunks are holes too).
        Call with :attr:`lock` held."""
        for offset, length in extents:
            lo = offset - offset % CHUNK_BYTES
            hi = -(-(offset + length) // CHUNK_BYTES) * CHUNK_BYTES
            punch(self.fd, lo, hi - lo)

    def punch_gaps(self, gaps: list[tuple[int, int]]) -> None:
        """Punch every gap (what :meth:`stray_extents` cannot see: memory committed with
        ``fallocate`` by another holder of the file). Call with :attr:`lock` held."""
        for offset, length in gaps:
            punch(self.fd, offset, length)

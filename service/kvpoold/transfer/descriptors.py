"""Where a pool's pages are for NIXL: its page layout as sent, its buffers' addresses, and the
``(address, length, device)`` rows of one WRITE.

Descriptors are rows of a uint64 ``Nx3`` array (NIXL's own format): per buffer a transfer
moves (``page_layout.page_buffers``), one row per page at ``buffer address + id * page
bytes``, buffers in plan order, so row ``i`` on the sender matches row ``i`` on the receiver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvpool.contract.plan import BufferSpec
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.transfer.messages import Acceptance
from kvpoold.transfer.nixl_module import mem_type
from kvpoold.transfer.page_layout import KV_SPACE, page_buffers, page_layout

if TYPE_CHECKING:
    from kvpoold.pools.pool import Pool


@dataclass(frozen=True)
class PageMemory:
    """A pool's page buffers in memory: the buffers a transfer moves (plan order), each one's
    address, and NIXL's memory type and device of the backing."""

    buffers: tuple[BufferSpec, ...]
    addresses: list[int]
    memory: str
    device: int

    def nbytes(self, pages: int, swa_pages: int) -> int:
        """Bytes moved for ``pages`` kv pages and ``swa_pages`` SWA pages."""
        return sum(b.page_bytes * (pages if b.id_space == KV_SPACE else swa_pages)
                   for b in self.buffers)


def page_memory(entry: Pool) -> PageMemory:
    """Where ``entry``'s page buffers are."""
    backing = entry.backing.tensor
    base = backing.data_ptr()
    memory, device = mem_type(backing)
    bufs = page_buffers(entry.plan)
    return PageMemory(bufs, [base + b.offset_bytes for b in bufs], memory, device)


def descriptor_rows(addresses: np.ndarray, page_bytes: np.ndarray, ids: list[np.ndarray],
                    device: int) -> np.ndarray:
    """NIXL rows ``(address, length, device)``: per buffer b, one row per id in ``ids[b]`` at
    ``addresses[b] + id * page_bytes[b]``, buffers in order. O(buffers x pages)."""
    counts = [int(x.shape[0]) for x in ids]
    total = sum(counts)
    rows = np.empty((total, 3), dtype=np.uint64)
    at = 0
    for b, x in enumerate(ids):
        n = counts[b]
        if not n:
            continue
        rows[at:at + n, 0] = addresses[b] + x.astype(np.uint64) * page_bytes[b]
        rows[at:at + n, 1] = page_bytes[b]
        at += n
    rows[:, 2] = device
    return rows


def write_rows(mine: PageMemory, pages: np.ndarray, swa: np.ndarray, acc: Acceptance
               ) -> tuple[np.ndarray, np.ndarray]:
    """The local and remote rows of one WRITE: ``pages`` (and their SWA pairs ``swa``) of this
    pool into the pages the peer accepted, buffer by buffer."""
    page_bytes = np.array([b.page_bytes for b in mine.buffers], dtype=np.uint64)
    local_ids = [pages if b.id_space == KV_SPACE else swa for b in mine.buffers]
    remote_ids = [acc.pages if b.id_space == KV_SPACE else acc.swa_pages for b in mine.buffers]
    local = descriptor_rows(np.array(mine.addresses, dtype=np.uint64), page_bytes, local_ids,
                            mine.device)
    remote = descriptor_rows(np.array(acc.buffer_addresses, dtype=np.uint64), page_bytes,
                             remote_ids, acc.device)
    return local, remote


class Layouts:
    """Each pool's page layout, built once per (pool, fingerprint)."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[str, str], pb.PageLayout] = {}

    def of(self, entry: Pool) -> pb.PageLayout:
        """The page layout of ``entry``, as sent to a peer and compared with a peer's."""
        key = (entry.name, entry.fingerprint)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = page_layout(entry.plan)
        return layout

    def forget(self, pool: str) -> None:
        """Drop the layouts of a pool that is going."""
        self._layouts = {k: v for k, v in self._layouts.items() if k[0] != pool}

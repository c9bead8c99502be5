"""The paged allocator's host<->device copies: token indices to the device from pinned memory,
and page-id frees copied back to the host without waiting (CUDA).

The page arithmetic runs on the host, so indices go host->device and freed ids device->host.
Neither may make the scheduler wait for the GPU where SGLang's own allocator does not: indices
go to the device from pinned memory, asynchronously (a copy from pageable memory would wait
for everything queued on the stream, the forward pass), and page-id frees start a copy into
pinned memory and record a CUDA event; :meth:`DeviceCopies.done` hands back the ids whose
copies finished (polled at the next allocation, waited for only when the pool runs short, and
at ``close``). Meanwhile they count as free, as in SGLang.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.integrations.sglang.token_slots import ExtendSlots

I64 = np.int64


def cpu_int64(values: Any) -> np.ndarray:
    """``values`` (a tensor on any device, an array, a list) as a 1-D int64 numpy array."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.int64).reshape(-1).numpy()
    return np.asarray(values, dtype=I64).reshape(-1)


class DeviceCopies:
    """Copies between the host and ``device``; page-id frees deferred when ``defer``.

    Args:
        device: where token indices live.
        defer: whether page-id frees on CUDA are copied back without waiting (not for elastic
            pools, whose idle checks count the pages themselves, nor in SGLang's debug mode,
            whose checks synchronize anyway).
    """

    def __init__(self, device: Any, *, defer: bool) -> None:
        self.device = device
        self.cuda = torch.device(device).type == "cuda"
        self.defer = self.cuda and defer
        # (pinned host ids, the event after their copy), oldest first.
        self._pending: list[tuple[torch.Tensor, Any]] = []
        self.pending_pages = 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """``array`` on the device (from pinned memory, asynchronously, on CUDA)."""
        t = torch.from_numpy(array)
        if self.cuda:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    def extend_indices(self, slots: ExtendSlots, last_loc: torch.Tensor) -> torch.Tensor:
        """An extend's token indices on the device: tokens on new pages at their slots, tokens
        on a request's old page after its ``last_loc`` (added on ``last_loc``'s device)."""
        if not slots.in_old.any():
            return self.to_device(slots.new_slot)
        packed = self.to_device(np.stack((
            slots.owner, np.where(slots.in_old, slots.local, slots.new_slot),
            slots.in_old.astype(I64))))
        follow = last_loc.to(torch.int64)[packed[0]] + 1
        return packed[1] + packed[2] * follow

    def decode_indices(self, first_slots: np.ndarray, starts: np.ndarray,
                       last_loc: torch.Tensor) -> torch.Tensor:
        """A decode step's token index per request on the device: ``first_slots`` (the first
        slot of its new page) where its token ``starts`` one, else the slot after
        ``last_loc``."""
        if not starts.any():
            return last_loc.to(torch.int64) + 1
        if starts.all():
            return self.to_device(first_slots)
        new_slot = np.zeros(starts.shape[0], dtype=I64)
        new_slot[starts] = first_slots
        packed = self.to_device(np.stack((new_slot, starts.astype(I64))))
        return torch.where(packed[1].bool(), packed[0], last_loc.to(torch.int64) + 1)

    def deferrable(self, page_ids: torch.Tensor) -> bool:
        """Whether a free of ``page_ids`` is copied back without waiting."""
        return self.defer and page_ids.is_cuda

    def start(self, page_ids: torch.Tensor) -> None:
        """Start copying ``page_ids`` to pinned host memory; :meth:`done` returns them."""
        src = page_ids.reshape(-1).to(torch.int64)
        host = torch.empty(src.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()  # on the current stream, after the copy
        self._pending.append((host, event))
        self.pending_pages += int(host.numel())

    def done(self, *, wait: bool) -> list[np.ndarray]:
        """The deferred frees whose copies are done, oldest first, forgotten here (``wait``:
        all of them, waiting for the copies: a synchronization)."""
        out = []
        while self._pending:
            host, event = self._pending[0]
            if wait:
                event.synchronize()
            elif not event.query():
                break
            self._pending.pop(0)
            self.pending_pages -= int(host.numel())
            out.append(host.numpy())
        return out

    def drop(self) -> None:
        """Forget every deferred free (``clear`` frees their pages with the rest; the pinned
        blocks stay torch's until the copies are done)."""
        self._pending = []
        self.pending_pages = 0


__all__ = ["DeviceCopies", "cpu_int64"]

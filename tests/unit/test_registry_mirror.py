"""The full->SWA mapping of a pool on an accelerator: a host copy the allocator writes, each
write mirrored to the device buffer. Exercised here with a second CPU tensor as the "device"."""

from __future__ import annotations

import numpy as np
import torch

from kvpoold.ids import Kind, PoolAllocator
from kvpoold.server.live_pools import device_mirror


def test_every_mapping_write_reaches_the_device_buffer():
    device_buf = torch.full((33,), -7, dtype=torch.int64)  # stands in for a cuda tensor
    host, sync = device_mirror(device_buf)
    alloc = PoolAllocator("p", kv_pages=32, swa_pages=16, full_to_swa=host,
                          full_to_swa_on_write=sync, req_rows=4)
    # The allocator zeroes 1..32 on the host only; no write has been mirrored yet.
    assert host[1:].tolist() == [0] * 32
    full = alloc.allocate_batch(1, [(Kind.KV, 5)])[0]
    idx = full.astype(np.int64)
    assert torch.equal(device_buf[idx], torch.from_numpy(host[idx]))
    assert (device_buf[idx] > 0).all()
    alloc.free_batch(1, [(Kind.SWA, full[:2])])  # sliding-window release: SWA side only
    assert device_buf[idx[:2]].tolist() == [0, 0]
    assert (device_buf[idx[2:]] > 0).all()
    alloc.free_batch(1, [(Kind.KV, full)])
    assert device_buf[idx].tolist() == [0] * 5
    untouched = np.setdiff1d(np.arange(33), idx)
    assert (device_buf[untouched] == -7).all()  # only written entries are copied

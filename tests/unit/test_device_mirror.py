"""The full->SWA mapping of a pool on an accelerator: a host copy the id spaces write, each
write mirrored to the device buffer. Exercised here with a second CPU tensor as the "device";
tests/gpu/test_daemon_cuda.py runs the same path on a GPU."""

from __future__ import annotations

import numpy as np
import torch

from kvpool.contract.plan import FULL_TO_SWA, IdSpaceSpec
from kvpoold.ids import MappingBuffer, PoolIds
from kvpoold.pools.pool import device_mirror


def hybrid(host: np.ndarray, sync) -> PoolIds:  # type: ignore[no-untyped-def]
    spaces = [
        IdSpaceSpec(name="kv", capacity=32, unit="pages", bytes_per_unit=64, knob="budget"),
        IdSpaceSpec(name="swa", capacity=16, unit="pages", bytes_per_unit=32, knob="ratio",
                    follows="kv", mapping=FULL_TO_SWA),
        IdSpaceSpec(name="req", capacity=4, unit="rows", bytes_per_unit=8, knob="mrr"),
    ]
    return PoolIds("p", spaces, {FULL_TO_SWA: MappingBuffer(host, sync)})


def test_every_mapping_write_reaches_the_device_buffer() -> None:
    device_buf = torch.full((33,), -7, dtype=torch.int64)  # stands in for a cuda tensor
    host, sync = device_mirror(device_buf)
    ids = hybrid(host, sync)
    # Building the pairing zeroes entries 1..32 and mirrors them; index 0 is left alone.
    assert host[1:].tolist() == [0] * 32 and device_buf[1:].tolist() == [0] * 32
    assert device_buf[0].item() == -7
    kv, swa = ids.space("kv", "f"), ids.space("swa", "f")
    grant = ids.allocate(1, [(kv, 5)])[0]
    idx = grant.ids.astype(np.int64)
    assert grant.paired is not None and grant.paired_space == "swa"
    assert device_buf[idx].tolist() == grant.paired.tolist()
    ids.free(1, [(swa, grant.ids[:2].copy())])  # sliding-window release: SWA side only
    assert device_buf[idx[:2]].tolist() == [0, 0]
    assert (device_buf[idx[2:]] > 0).all()
    ids.free(1, [(kv, grant.ids.copy())])
    assert device_buf[idx].tolist() == [0] * 5
    assert torch.equal(device_buf[1:], torch.from_numpy(host[1:]))

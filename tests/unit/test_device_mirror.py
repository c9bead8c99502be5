"""The full->SWA mapping of a pool on an accelerator: a host copy the id spaces write, each
write copied to the device buffer in the mirror's worker thread (never on the event loop), the
Allocate reply waiting for the copy that covers it. Exercised here with a second CPU tensor as
the "device"; tests/gpu/test_daemon_cuda.py runs the same path on a GPU."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import torch

from kvpool.contract.plan import FULL_TO_SWA, IdSpaceSpec
from kvpoold.ids import MappingBuffer, PoolIds
from kvpoold.pools.pool import DeviceMirror


def hybrid(mirror: DeviceMirror) -> PoolIds:
    spaces = [
        IdSpaceSpec(name="kv", capacity=32, unit="pages", bytes_per_unit=64, knob="budget"),
        IdSpaceSpec(name="swa", capacity=16, unit="pages", bytes_per_unit=32, knob="ratio",
                    follows="kv", mapping=FULL_TO_SWA),
        IdSpaceSpec(name="req", capacity=4, unit="rows", bytes_per_unit=8, knob="mrr"),
    ]
    return PoolIds("p", spaces, {FULL_TO_SWA: MappingBuffer(mirror.array, mirror.on_write)})


def test_every_mapping_write_reaches_the_device_buffer_once_flushed() -> None:
    device_buf = torch.full((33,), -7, dtype=torch.int64)  # stands in for a cuda tensor
    mirror = DeviceMirror(device_buf)
    ids = hybrid(mirror)
    host = mirror.array
    # Building the pairing zeroes entries 1..32; the copy waits for a flush (the pool's
    # builder flushes in its worker thread); index 0 is left alone.
    assert host[1:].tolist() == [0] * 32 and device_buf[1:].tolist() == [-7] * 32
    mirror.flush_now()
    assert device_buf[1:].tolist() == [0] * 32 and device_buf[0].item() == -7

    async def scenario() -> None:
        kv, swa = ids.space("kv", "f"), ids.space("swa", "f")
        grant = ids.allocate(1, [(kv, 5)])[0]
        idx = grant.ids.astype(np.int64)
        assert grant.paired is not None and grant.paired_space == "swa"
        assert device_buf[idx].tolist() == [0] * 5  # not yet: nothing copied on the loop
        await mirror.flush()
        assert device_buf[idx].tolist() == grant.paired.tolist()
        ids.free(1, [(swa, grant.ids[:2].copy())])  # sliding-window release: SWA side only
        await mirror.flush()
        assert device_buf[idx[:2]].tolist() == [0, 0]
        assert (device_buf[idx[2:]] > 0).all()
        ids.free(1, [(kv, grant.ids.copy())])
        await mirror.flush()
        assert device_buf[idx].tolist() == [0] * 5
        assert torch.equal(device_buf[1:], torch.from_numpy(host[1:]))

    asyncio.run(scenario())
    mirror.close()


def test_copies_run_off_the_loop_in_order_and_a_flush_covers_earlier_ones() -> None:
    """Two flushes in flight: the copies run in the mirror's thread, not the loop's, in the
    order they were taken (the later values win), and a flush with nothing new of its own
    still waits for the copy in flight (another caller took its entries)."""
    device_buf = torch.zeros(9, dtype=torch.int64)
    mirror = DeviceMirror(device_buf)
    threads: list[str] = []
    real_copy = mirror._copy

    def copy(index: torch.Tensor, values: torch.Tensor) -> None:
        threads.append(threading.current_thread().name)
        real_copy(index, values)

    mirror._copy = copy  # type: ignore[method-assign]

    async def scenario() -> None:
        mirror.array[3] = 1
        mirror.on_write(np.array([3]))
        first = asyncio.ensure_future(mirror.flush())
        await asyncio.sleep(0)  # the first flush takes index 3 = 1 and submits its copy
        mirror.array[3] = 2
        mirror.on_write(np.array([3]))
        second = asyncio.ensure_future(mirror.flush())
        await asyncio.sleep(0)
        third = asyncio.ensure_future(mirror.flush())  # nothing new: waits for the last copy
        await asyncio.gather(first, second, third)
        assert device_buf[3].item() == 2

    asyncio.run(scenario())
    assert len(threads) == 2 and all(t.startswith("kvpoold-mirror") for t in threads)
    mirror.close()

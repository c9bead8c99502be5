"""CUDA IPC across processes: export in this process, import by UUID in a child (needs a GPU).

The child gets the handle as plain JSON (bytes as hex) on stdin, never a pickled tensor, and
maps it with ``kvpool.mapping.regions.map_region``, as an engine will after Attach. Skipped without
CUDA; see tests/gpu/README.md for how to run it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.contract.errors import FailedPrecondition
from kvpool.mapping.regions import BufferLayout, map_region, visible_cuda_uuids
from kvpoold.sharing import CudaIpcBackingFactory, SharedHandle
from tests.procs import Child

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
SIZE = 64 * MiB
HALF = SIZE // 2
BYTE_FIELDS = ("ipc_handle", "ref_counter_handle", "event_handle")

# Every child's own prelude (after tests.procs.PRELUDE): map the one-buffer region it is sent.
PRELUDE = r"""
import torch
from kvpool.contract.shared_handle import SharedHandle
from kvpool.mapping.regions import BufferLayout, map_region

def region_of(msg):
    h = dict(msg["handle"])
    for k in ("ipc_handle", "ref_counter_handle", "event_handle"):
        h[k] = bytes.fromhex(h[k])
    size = h["size"]
    return map_region(SharedHandle(**h), [BufferLayout("b", "uint8", (size,), 0, size)])

def pattern(n, device):
    return (torch.arange(n, device=device) % 251).to(torch.uint8)
"""

# Check the parent's first half, write the second half, then keep the mapping until told.
IMPORTER = r"""
msg = recv()
try:
    region = region_of(msg)
except Exception as exc:
    send({"error": type(exc).__name__, "message": str(exc)})
    sys.exit(0)
b = region["b"]
half = b.numel() // 2
ok = bool(torch.equal(b[:half], pattern(half, b.device)))
b[half:] = 0x5A
torch.cuda.synchronize()
send({"ok": ok, "device": str(b.device)})
while (cmd := recv()) == "check":
    torch.cuda.synchronize()
    send({"ok": bool(torch.equal(b[:half], pattern(half, b.device)))})
region.close()
del b
torch.cuda.synchronize()
send("closed")
"""


def plain(handle: SharedHandle) -> dict[str, Any]:
    """Every handle field as JSON: bytes as hex, the rest as they are."""
    fields = {
        k: getattr(handle, k)
        for k in ("kind", "size", "path", "device_uuid", "storage_offset", "storage_size",
                  "ref_counter_offset", "event_sync_required")
    }
    fields.update({k: getattr(handle, k).hex() for k in BYTE_FIELDS})
    return {"handle": fields}


def importer(script: str, **env: str) -> Child:
    """A child process running ``script`` with ``env`` set on top of this environment."""
    return Child(script, prelude=PRELUDE, env=env)


def pattern(n: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(n, device=device) % 251).to(torch.uint8)


@pytest.fixture
def factory() -> Any:
    f = CudaIpcBackingFactory("cuda:0")
    try:
        yield f
    finally:
        f.close()


def test_export_import_write_read_both_ways(factory):
    """Parent writes 0..250 repeating in the first 32 MiB; the child (another process) sees it
    and writes 0x5A into the last 32 MiB; the parent sees that."""
    backing = factory.create(SIZE, "gpu-pool")
    t = backing.tensor
    t[:HALF] = pattern(HALF, t.device)
    h = backing.handle()
    assert h.sharing == "cuda_ipc" and h.size == SIZE and h.storage_size >= SIZE
    assert h.device_uuid == visible_cuda_uuids()[0]
    with importer(IMPORTER) as child:
        child.send(plain(h))
        assert child.recv() == {"ok": True, "device": "cuda:0"}
        torch.cuda.synchronize()
        assert bool((t[HALF:] == 0x5A).all())
        child.send("close")
        assert child.recv() == "closed"
    backing.close()


def test_each_attach_gets_its_own_export(factory):
    """Two importers, one fresh handle each (one ref-counter slot each), both see the data."""
    backing = factory.create(SIZE, "shared")
    backing.tensor[:HALF] = pattern(HALF, backing.tensor.device)
    h1, h2 = backing.handle(), backing.handle()
    assert (h1.ref_counter_handle, h1.ref_counter_offset) != (
        h2.ref_counter_handle, h2.ref_counter_offset)
    with importer(IMPORTER) as c1, importer(IMPORTER) as c2:
        c1.send(plain(h1))
        c2.send(plain(h2))
        assert c1.recv()["ok"] and c2.recv()["ok"]
        for c in (c1, c2):
            c.send("close")
            assert c.recv() == "closed"


def test_memory_stays_valid_for_an_importer_after_the_daemon_closes(factory):
    """The daemon drops its tensor while a child still maps it: torch's IPC ref counter keeps
    the block out of reuse, so a new 64 MiB allocation filled with 0xFF does not land on it
    and the child still reads the pattern."""
    backing = factory.create(SIZE, "lifetime")
    backing.tensor[:HALF] = pattern(HALF, backing.tensor.device)
    with importer(IMPORTER) as child:
        child.send(plain(backing.handle()))
        assert child.recv()["ok"]
        backing.close()
        torch.cuda.empty_cache()
        other = torch.full((SIZE,), 0xFF, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        child.send("check")
        assert child.recv() == {"ok": True}
        child.send("close")
        assert child.recv() == "closed"
        del other


def test_device_uuid_mismatch_lists_the_visible_devices(factory):
    backing = factory.create(MiB, "p")
    h = backing.handle()
    fake = SharedHandle(**{**plain(h)["handle"], **{k: getattr(h, k) for k in BYTE_FIELDS},
                           "device_uuid": "00000000-1111-2222-3333-444444444444"})
    with pytest.raises(FailedPrecondition) as err:
        map_region(fake, [BufferLayout("b", "uint8", (MiB,), 0, MiB)])
    assert "device UUID mismatch" in str(err.value)
    assert h.device_uuid in str(err.value)


def test_the_exporting_process_cannot_open_its_own_handle(factory):
    backing = factory.create(MiB, "p")
    with pytest.raises(FailedPrecondition, match="not in the daemon itself"):
        map_region(backing.handle(), [BufferLayout("b", "uint8", (MiB,), 0, MiB)])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_importer_with_other_visible_devices_finds_the_gpu_by_uuid(factory):
    """The child sees the GPUs in the other order, so the daemon's cuda:0 is its cuda:1."""
    u0, u1 = visible_cuda_uuids()[:2]
    backing = factory.create(SIZE, "p")
    backing.tensor[:HALF] = pattern(HALF, backing.tensor.device)
    with importer(IMPORTER, CUDA_VISIBLE_DEVICES=f"GPU-{u1},GPU-{u0}") as child:
        child.send(plain(backing.handle()))
        assert child.recv() == {"ok": True, "device": "cuda:1"}
        child.send("close")
        assert child.recv() == "closed"
    with importer(IMPORTER, CUDA_VISIBLE_DEVICES=f"GPU-{u1}") as child:
        child.send(plain(backing.handle()))
        got = child.recv()
        assert got["error"] == "FailedPrecondition" and "device UUID mismatch" in got["message"]


REFUSE_ENV = r"""
from kvpool.contract.errors import FailedPrecondition
from kvpoold.sharing import CudaIpcBackingFactory
try:
    CudaIpcBackingFactory("cuda:0")
except FailedPrecondition as exc:
    send({"refused": str(exc)})
else:
    send({"refused": None})
"""

REFUSE_RUNTIME = r"""
from kvpool.contract.errors import FailedPrecondition
from kvpoold.sharing import CudaIpcBackingFactory
factory = CudaIpcBackingFactory("cuda:0")
torch.cuda.memory._set_allocator_settings("expandable_segments:True")
backing = factory.create(64 << 20, "p")
try:
    backing.handle()
except (FailedPrecondition, RuntimeError) as exc:
    send({"refused": f"{type(exc).__name__}: {exc}"})
else:
    send({"refused": None})
"""


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_expandable_segments_in_the_environment_are_refused(var):
    with importer(REFUSE_ENV, **{var: "expandable_segments:True"}) as child:
        refused = child.recv()["refused"]
    assert refused and "pytorch#165685" in refused and var in refused


def test_expandable_segments_switched_on_at_runtime_are_refused_at_export():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": ""}
    with importer(REFUSE_RUNTIME, **env) as child:
        refused = child.recv()["refused"]
    assert refused, "an expandable-segment handle was exported"

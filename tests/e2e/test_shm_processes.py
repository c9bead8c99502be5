"""Shared-memory regions across real processes: plain data in, the same bytes out, no copies.

Each child is a fresh ``python`` process that gets only plain values (path, size, buffer
layouts) as JSON lines on stdin and answers on stdout, the way an engine gets a handle over
gRPC. No daemon yet: the test process plays the daemon with a :class:`ShmBackingFactory`.
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

import torch

from kvpool.mapping.regions import BufferLayout
from kvpoold.sharing import ShmBackingFactory
from tests.procs import Child

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20

# Every child's own prelude (after tests.procs.PRELUDE): map the region it is sent.
PRELUDE = r"""
import hashlib, time
import torch
from kvpool.mapping.regions import BufferLayout, SharedHandle, map_region, page_view

def region_of(msg):
    layout = [BufferLayout(b["name"], b["dtype"], tuple(b["shape"]), b["offset_bytes"],
                           b["nbytes"]) for b in msg["buffers"]]
    return map_region(SharedHandle(**msg["handle"]), layout)
"""


def plain(handle: Any, layout: list[BufferLayout]) -> dict[str, Any]:
    """The handle and layout as JSON-able plain values (what Attach will carry)."""
    return {
        "handle": {"sharing": handle.sharing, "path": handle.path, "size": handle.size},
        "buffers": [
            {"name": b.name, "dtype": b.dtype, "shape": list(b.shape),
             "offset_bytes": b.offset_bytes, "nbytes": b.nbytes}
            for b in layout
        ],
    }


# A toy pool in 8 MiB: K and V of one layer (2,048 tokens x 4 heads x 128 dims, bf16
# = 2 MiB each) and a request->token table (64 x 2,048 int32 = 512 KiB), page_size 16.
LAYOUT = [
    BufferLayout("k.0", "bfloat16", (2048, 4, 128), 0, 2 * MiB),
    BufferLayout("v.0", "bfloat16", (2048, 4, 128), 2 * MiB, 2 * MiB),
    BufferLayout("req_to_token", "int32", (64, 2048), 4 * MiB, MiB // 2),
]

READER_WRITER = r"""
msg = recv()
region = region_of(msg)
g = torch.Generator().manual_seed(msg["seed"])
expect_k = torch.randn(region["k.0"].shape, generator=g).to(torch.bfloat16)
send({"sha256": hashlib.sha256(region.base.numpy().tobytes()).hexdigest(),
      "k_equal": bool(torch.equal(region["k.0"], expect_k))})
assert recv() == "write"  # the parent has closed (unlinked) its backing by now
page_view(region["v.0"], 5, 16)[:] = 7.0
region["req_to_token"][3] = torch.arange(2048, dtype=torch.int32)
region.close()
send("done")
"""


def test_child_sees_exactly_the_daemons_bytes_and_the_daemon_sees_the_childs(shm_dir):
    """The child checks K (seeded randn) value by value and the whole 8 MiB by sha256, then
    writes page 5 of V (rows 80..95) and row 3 of req_to_token after the parent unlinked the
    file; the parent sees both through the view it kept."""
    with ShmBackingFactory(shm_dir) as factory, Child(READER_WRITER, prelude=PRELUDE) as child:
        backing = factory.create(8 * MiB, "toy")
        k = backing.tensor[: 2 * MiB].view(torch.bfloat16).view(2048, 4, 128)
        k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(5)))
        backing.tensor[6 * MiB :] = 0xAB  # bytes outside any buffer are shared too
        want = hashlib.sha256(backing.tensor.numpy().tobytes()).hexdigest()

        child.send({**plain(backing.handle(), LAYOUT), "seed": 5})
        got = child.recv()
        assert got == {"sha256": want, "k_equal": True}

        kept = backing.tensor  # the daemon's pool views outlive the backing object
        backing.close()
        assert not backing.path.exists()
        child.send("write")
        assert child.recv() == "done"
        child.wait_ok()

        v = kept[2 * MiB : 4 * MiB].view(torch.bfloat16).view(2048, 4, 128)
        assert torch.equal(v[80:96], torch.full((16, 4, 128), 7.0, dtype=torch.bfloat16))
        assert int(v[:80].count_nonzero()) == 0 and int(v[96:].count_nonzero()) == 0
        r2t = kept[4 * MiB : 4 * MiB + MiB // 2].view(torch.int32).view(64, 2048)
        assert torch.equal(r2t[3], torch.arange(2048, dtype=torch.int32))
    assert list(shm_dir.iterdir()) == []


RSS_PROBE = r"""
msg = recv()
before = rss_bytes()
region = region_of(msg)
mapped = rss_bytes()
page_sum = int(region["b"][:4096].sum())
one_page = rss_bytes()
full_sum = int(region["b"][::4096].sum(dtype=torch.int64))  # one byte per page
everything = rss_bytes()
send({"before": before, "mapped": mapped, "one_page": one_page, "everything": everything,
      "page_sum": page_sum, "full_sum": full_sum})
"""


def test_mapping_256_mib_does_not_grow_the_childs_resident_memory(shm_dir):
    """The parent fills 256 MiB with 1s (so every page exists); mapping it in the child adds
    < 10% of 256 MiB (25.6 MiB) to its VmRSS, and so does reading one 4 KiB page (sum 4,096).
    Touching every page (one byte each: 65,536 pages, sum 65,536) then does add ~256 MiB:
    the probe would see a copy."""
    size = 256 * MiB
    with ShmBackingFactory(shm_dir) as factory, Child(RSS_PROBE, prelude=PRELUDE) as child:
        backing = factory.create(size, "big")
        backing.tensor.fill_(1)
        child.send(plain(backing.handle(), [BufferLayout("b", "uint8", (size,), 0, size)]))
        r = child.recv()
        child.wait_ok()
    assert r["page_sum"] == 4096 and r["full_sum"] == size // 4096
    assert r["mapped"] - r["before"] < size // 10, r
    assert r["one_page"] - r["before"] < size // 10, r
    assert r["everything"] - r["before"] > size * 9 // 10, r


VICTIM = r"""
from kvpoold.sharing import ShmBackingFactory
from tests.procs import Child
msg = recv()
factory = ShmBackingFactory(msg["dir"], "victim")
backing = factory.create(1 << 20, "doomed")
backing.tensor[:16] = 1
send({"files": sorted([str(factory.lock_path), str(backing.path)])})
time.sleep(120)
"""


def test_files_of_a_sigkilled_daemon_are_removed_by_the_next_one(shm_dir):
    """A child daemon is SIGKILLed holding one region: its lock and region stay behind, a live
    daemon's files sit next to them; a new factory removes exactly the dead one's two files."""
    with ShmBackingFactory(shm_dir, "alive") as alive:
        kept = alive.create(4096, "keep")
        with Child(VICTIM, prelude=PRELUDE) as child:
            child.send({"dir": str(shm_dir)})
            files = [Path(p) for p in child.recv()["files"]]
            os.kill(child.proc.pid, signal.SIGKILL)
            assert child.proc.wait(timeout=10) == -signal.SIGKILL
        assert all(p.exists() for p in files)

        with ShmBackingFactory(shm_dir) as fresh:
            assert sorted(fresh.swept) == sorted(files)
            assert not any(p.exists() for p in files)
            assert kept.path.exists() and alive.lock_path.exists()
    assert list(shm_dir.iterdir()) == []

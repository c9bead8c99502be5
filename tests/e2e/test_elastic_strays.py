"""Memory put into an elastic pool's holes by an attached process (issue 38): a real
``kvpoold serve``, a hostile engine process that maps the pool's sparse file whole and writes
into groups the daemon never granted, and an honest engine beside it.

The daemon frees the stray memory (the file's ``st_blocks`` comes back to what it committed)
and ends the hostile engine's lease; the honest engine keeps its lease. Which lease is a fact:
each engine mapped the pool from the descriptor the daemon's side socket handed it under its
lease (the kernel told the daemon the pid), and the kernel's page tables say which pid touched
the pages. So it holds with leases named alike too (a name is not a proof).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import run_daemon, temp_dir
from tests.procs import Child

MiB = 1 << 20
# 2 layers x K/V, 2 heads x 16 x bf16 = 64 B a token a view, page 16: a group is 2,048 pages
# x 4 views = 8 MiB; the fixed part is 2 MiB. The budget holds the fixed part and 3 groups.
SPEC = {"num_layers": 2, "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
        "context_length": 256}
GROUP, FIXED, PAGES = 8 * MiB, 2 * MiB, 2048
BUDGET = FIXED + 3 * GROUP

# An engine on pool "a" under a lease named "name" (default: the client's, <host>:<pid>). With
# "stray": after attaching, it maps the pool's file whole (as any process of the daemon's
# user may) and writes into groups 4.. (never granted) until it has written that many bytes.
# Then it answers "alive" with whether its lease still works, until "done".
ENGINE = r"""
import mmap, os, time
from kvpool.clients.client import KVPoolClient

from kvpool.contract.errors import NotFound

msg = recv()
try:
  with KVPoolClient(msg["target"]) as client, \
        client.lease(msg.get("name"), ttl_s=30.0) as lease, \
        client.attach("a", lease=lease) as region:
    wrote = 0
    if msg.get("stray"):
        fd = os.open(msg["path"], os.O_RDWR)
        m = mmap.mmap(fd, os.fstat(fd).st_size)
        g = 4
        while wrote < msg["stray"]:
            for off, length in region.plan.group_ranges(g):
                m[off:off + length] = b"\x77" * length
                wrote += length
            g += 1
    send({"lease_id": lease.lease_id, "wrote": wrote})
    while recv() != "done":
        try:
            lease.allocate("a", "kv", 1)
            send({"alive": True})
        except Exception as exc:
            send({"alive": False, "error": type(exc).__name__})
except NotFound:  # closing a lease the daemon ended
    pass
send("closed")
"""


def backed(shm: Path) -> int:
    return sum(os.stat(f).st_blocks * 512 for f in shm.iterdir() if f.name.startswith("kvpool-"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [None, "engine"], ids=["default-names", "same-names"])
def test_a_process_writing_into_holes_is_freed_and_loses_its_lease(name: str | None) -> None:
    with temp_dir() as sock_dir, temp_dir("kvp-shm-", "/dev/shm") as shm, \
            run_daemon(sock_dir, "--shm-dir", str(shm), budget=str(BUDGET)) as daemon, \
            KVPoolClient(daemon.target) as client:
        client.configure("a", spec=SPEC, max_total_tokens=8 * PAGES * 16, elastic=True,
                         page_size=16, max_running_requests=8)
        committed = FIXED + GROUP  # the floor: one group
        assert backed(shm) == committed
        (path,) = [f for f in shm.iterdir() if f.name.startswith("kvpool-") and "-a-" in f.name]
        with Child(ENGINE, timeout_s=60) as honest, Child(ENGINE, timeout_s=60) as hostile:
            honest.send({"target": daemon.target, "name": name})
            honest_lease = honest.recv()["lease_id"]
            hostile.send({"target": daemon.target, "path": str(path), "stray": 4 * GROUP,
                          "name": name})
            got = hostile.recv()
            assert got["wrote"] == 4 * GROUP
            while any(x.lease_id == got["lease_id"] for x in client.stats().leases):
                time.sleep(0.02)  # the daemon ends the hostile lease (pytest's timeout bounds)
            while backed(shm) > committed:
                time.sleep(0.02)
            assert backed(shm) == committed
            stats = client.stats("a").pool("a").elastic
            assert stats is not None
            assert stats.revoked_leases == 1
            assert stats.backed_bytes == stats.granted_bytes == committed
            hostile.send(None)
            assert hostile.recv()["alive"] is False
            honest.send(None)
            assert honest.recv() == {"alive": True}
            assert any(x.lease_id == honest_lease for x in client.stats().leases)
            for c in (honest, hostile):
                c.send("done")
                assert c.recv() == "closed"

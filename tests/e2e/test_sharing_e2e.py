"""Zero-copy sharing end to end: ``kvpoold serve`` as a process, engines as other processes.

Every daemon here runs with its own shared-memory directory under /dev/shm (``--shm-dir``), so
the tests can look at exactly its files. Child processes get only the target, pool name and
fingerprint, attach over gRPC (``KVPoolClient.attach``) and map the pool themselves.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.clients.client import KVPoolClient
from kvpool.contract.errors import FailedPrecondition, NotFound
from kvpool.tools.demo_worker import pattern
from tests.conftest import REPO, TINY_SPEC, DaemonProcess, run_daemon, subprocess_env, temp_dir
from tests.procs import Child

MiB = 1 << 20
# TINY_SPEC at 1 MiB and page 16: 256 B per token, 256 pages and the padding page 0 on top:
# 4,112 token rows; k.0, v.0, k.1, v.1 are [4112, 2, 16] bf16 = 257 KiB each, page_bytes 4,096.
SMALL = {"budget_bytes": 1 * MiB, "page_size": 16, "max_running_requests": 8}

# Every child's own prelude (after tests.procs.PRELUDE): connect to the daemon it is sent.
PRELUDE = r"""
import hashlib, time
import torch
from kvpool.clients.client import KVPoolClient
from kvpool.tools.demo_worker import check_zero_outside, kv_buffers, page_bytes_of, pattern

msg = recv()
client = KVPoolClient(msg["target"])
"""

# Allocate pages under a lease, fill them with the demo's pattern, report the whole region's
# sha256, then wait (attached) until told to go.
WRITER = r"""
lease = client.lease("writer", ttl_s=10.0)
pages = [int(p) for p in lease.allocate(msg["pool"], "kv", msg["pages"])]
with client.attach(msg["pool"], expected_fingerprint=msg["fingerprint"], lease=lease) as region:
    for i, name in enumerate(kv_buffers(region)):
        for p in pages:
            dst = page_bytes_of(region, name, p)
            dst.copy_(pattern(i, p, dst.numel()))
    send({"pages": pages, "sha256": hashlib.sha256(region.base.numpy()).hexdigest(),
          "path": region.path})
    recv()
lease.close()
send("bye")
"""

# Map the pool, check the pattern in the given pages and zeros elsewhere, hash everything;
# then on "check" look again (after a forced Drop unlinked the file).
READER = r"""
def look(region):
    verified = 0
    for i, name in enumerate(kv_buffers(region)):
        for p in msg["pages"]:
            got = page_bytes_of(region, name, p)
            assert torch.equal(got, pattern(i, p, got.numel())), (name, p)
            verified += got.numel()
        check_zero_outside(region, name, msg["pages"])
    return verified

with client.attach(msg["pool"], expected_fingerprint=msg["fingerprint"]) as region:
    send({"verified": look(region), "sha256": hashlib.sha256(region.base.numpy()).hexdigest(),
          "device": str(region.device), "sharing": region.sharing})
    while recv() == "check":
        send({"verified": look(region)})
send("bye")
"""

RSS = r"""
before = rss_bytes()
with client.attach(msg["pool"]) as region:
    mapped = rss_bytes()
    page_sum = int(region.page("k.0", 1).view(torch.uint8).sum())
    one_page = rss_bytes()
    send({"size": region.size, "before": before, "mapped": mapped, "one_page": one_page,
          "page_sum": page_sum})
send("bye")
"""

# Attach under a lease, report, then hang until SIGKILLed.
HOLDER = r"""
lease = client.lease("doomed", ttl_s=1.0)
with client.attach(msg["pool"], lease=lease) as region:
    region["k.0"][0] = 1.0
    send({"lease_id": lease.lease_id, "attach_id": region.attach_id})
    time.sleep(120)
"""


def client_child(script: str, first: dict[str, Any] | None = None) -> Child:
    """A client process running ``script`` once it has its first message (now, or later with
    :meth:`Child.send` when ``first`` is None)."""
    return Child(script, prelude=PRELUDE, first=first)


def new_shm_dir() -> contextlib.AbstractContextManager[Path]:
    """A private directory on /dev/shm for one daemon, removed on exit."""
    return temp_dir(prefix="kvpoole2e-", parent="/dev/shm")


def kvpool_files(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.glob("kvpool-*"))


@pytest.fixture(scope="module")
def daemon() -> Iterator[tuple[DaemonProcess, Path]]:
    """One daemon (512 MiB budget, its own shm dir) for the tests that do not stop it."""
    with temp_dir() as sockets, new_shm_dir() as shm_dir, \
            run_daemon(sockets, "--shm-dir", str(shm_dir), budget="512MiB") as d:
        yield d, shm_dir


def configure(client: KVPoolClient, pool: str, **options: Any) -> Any:
    return client.configure(pool, spec=TINY_SPEC, **{**SMALL, **options})


def attached(client: KVPoolClient, pool: str) -> int:
    return client.stats(pool).pool(pool).attached


def test_reader_sees_exactly_the_writers_bytes(daemon: tuple[DaemonProcess, Path]) -> None:
    """A writer process fills 5 pages of k.0, v.0, k.1, v.1 with the demo pattern: a row is
    2 heads x 16 dims x 2 B = 64 B, a page 16 rows = 1,024 B, so 4 x 5 x 1,024 = 20,480 B.
    A reader process, attached by fingerprint, finds every one of those bytes, zeros in the
    other 251 pages, and the same sha256 of the whole region as the writer. Stats count both
    attachments, and none after they go; Drop then removes the file."""
    d, shm_dir = daemon
    with KVPoolClient(d.target) as client:
        result = configure(client, "rw")
        assert client.stats("rw").pool("rw").sharing == "shm"
        go = {"target": d.target, "pool": "rw", "fingerprint": result.fingerprint, "pages": 5}
        with client_child(WRITER, go) as writer, client_child(READER) as reader:
            wrote = writer.recv()
            assert Path(wrote["path"]).parent == shm_dir
            assert Path(wrote["path"]).name.startswith("kvpool-")
            reader.send({**go, "pages": wrote["pages"]})
            assert reader.recv() == {"verified": 4 * 5 * 16 * 64, "sha256": wrote["sha256"],
                                     "device": "cpu", "sharing": "shm"}
            assert attached(client, "rw") == 2
            for child in (reader, writer):
                child.send("stop")
                assert child.recv() == "bye"
        assert attached(client, "rw") == 0
        client.drop("rw")
        assert not Path(wrote["path"]).exists()


def test_attaching_maps_instead_of_copying(daemon: tuple[DaemonProcess, Path]) -> None:
    """A 256 MiB pool (TINY_SPEC: 1,048,576 token rows of 256 B) filled with 1s by the test
    process (every tmpfs page exists): attaching it in another process adds < 10% of it
    (25.6 MiB) to that process's VmRSS, and so does reading page 1 of k.0 (16 rows x 64 B =
    1,024 B of bf16 1.0 = 0x3F80: bytes 0x80 + 0x3F = 191 per element, 512 elements ->
    97,792)."""
    d, _ = daemon
    with KVPoolClient(d.target) as client, client_child(RSS) as child:
        configure(client, "big", budget_bytes=256 * MiB)
        with client.attach("big") as region:
            region.base.view(torch.bfloat16)[: 128 * MiB].fill_(1.0)
            size = region.size
        child.send({"target": d.target, "pool": "big"})
        r = child.recv()
        assert child.recv() == "bye"  # detached
        client.drop("big")
    assert r["size"] == size > 256 * MiB
    assert r["page_sum"] == 512 * 191
    assert r["mapped"] - r["before"] < size // 10, r
    assert r["one_page"] - r["before"] < size // 10, r


def test_drop_while_attached_is_refused_unless_forced(daemon: tuple[DaemonProcess, Path]) -> None:
    """Two attachments (a reader process and this process, which wrote 2 pages: 4 buffers x
    2 x 1,024 B = 8,192 B): Drop is FAILED_PRECONDITION naming "2 clients attached"; Drop with
    force detaches both and unlinks the file, and the reader's mapping still holds the data.
    Leaving this process's ``with`` block after that is no error (the attachment ended)."""
    d, _ = daemon
    with KVPoolClient(d.target) as client, client_child(READER) as reader:
        result = configure(client, "pinned")
        with client.lease("w") as lease, client.attach("pinned", lease=lease) as region:
            pages = [int(p) for p in lease.allocate("pinned", "kv", 2)]
            for i, name in enumerate(["k.0", "v.0", "k.1", "v.1"]):
                for p in pages:
                    dst = region.page(name, p).view(torch.uint8).reshape(-1)
                    dst.copy_(pattern(i, p, dst.numel()))
            path = Path(region.path)
            reader.send({"target": d.target, "pool": "pinned",
                         "fingerprint": result.fingerprint, "pages": pages})
            assert reader.recv()["verified"] == 4 * 2 * 16 * 64
            assert attached(client, "pinned") == 2
            with pytest.raises(FailedPrecondition, match="2 clients attached") as info:
                client.drop("pinned")
            assert info.value.field == "force"
            assert path.exists()
            dropped = client.drop("pinned", force=True)
            assert dropped.detached == 2 and dropped.held == {"pinned": {"kv": 2}}
            assert not path.exists()
            reader.send("check")
            assert reader.recv() == {"verified": 4 * 2 * 16 * 64}
            reader.send("stop")
            assert reader.recv() == "bye"
            assert region["k.0"].shape == (4112, 2, 16)  # our mapping outlived the unlink too


def test_fingerprint_mismatch_is_refused(daemon: tuple[DaemonProcess, Path]) -> None:
    d, _ = daemon
    with KVPoolClient(d.target) as client:
        result = configure(client, "fp")
        with pytest.raises(FailedPrecondition) as info, \
                client.attach("fp", expected_fingerprint="0" * 32):
            pass
        assert info.value.field == "expected_fingerprint"
        assert result.fingerprint in str(info.value)
        with client.attach("fp", expected_fingerprint=result.fingerprint) as region:
            assert region.fingerprint == result.fingerprint and region.page_size == 16
            assert attached(client, "fp") == 1
        assert attached(client, "fp") == 0
        with pytest.raises(NotFound), client.attach("nope"):
            pass
        client.drop("fp")


def test_a_sigkilled_clients_lease_takes_its_attachment_along(
        daemon: tuple[DaemonProcess, Path]) -> None:
    """A process attached under a 1 s lease is SIGKILLed: within TTL + 1 s the lease expires,
    the attachment ends with it, and Drop (unforced) succeeds."""
    d, _ = daemon
    with KVPoolClient(d.target) as client:
        configure(client, "crashy")
        with client_child(HOLDER, {"target": d.target, "pool": "crashy"}) as child:
            report = child.recv()
            assert attached(client, "crashy") == 1
            (lease,) = [x for x in client.stats().leases if x.lease_id == report["lease_id"]]
            assert lease.attached == 1
            child.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            child.proc.wait(10)
            while attached(client, "crashy"):
                assert time.monotonic() - killed < 60.0, "attachment outlived its lease"
                time.sleep(0.05)
        client.drop("crashy")
    with KVPoolClient(d.target) as client, pytest.raises(NotFound):
        client.detach(report["attach_id"])


async def test_the_async_client_attaches_too(daemon: tuple[DaemonProcess, Path]) -> None:
    """``async with client.attach(...)``: writes through it are seen by a sync attachment."""
    from kvpool.clients.aio import AsyncKVPoolClient

    d, _ = daemon
    async with AsyncKVPoolClient(d.target) as client:
        result = await client.configure("async", spec=TINY_SPEC, **SMALL)
        async with client.attach("async", result.fingerprint) as region:
            region.page("v.1", 7).fill_(2.5)
            assert (await client.stats("async")).pool("async").attached == 1
        assert (await client.stats("async")).pool("async").attached == 0
    with KVPoolClient(d.target) as sync, sync.attach("async") as again:
        assert bool((again["v.1"][112:128] == 2.5).all())
        assert int(again["v.1"][:112].count_nonzero()) == 0
        sync.drop("async", force=True)


def test_sigterm_removes_every_file_and_the_body_error_wins(tmp_path: Path) -> None:
    """A daemon with two pools and an attached client is SIGTERMed inside the client's
    ``with`` block, which then raises: the block's RuntimeError comes out (the failed Detach
    only adds a note), the daemon exits 0, and its shm dir holds no kvpool-* file (two
    regions and the instance lock were there). The client's mapping still reads its data."""
    with temp_dir() as sockets, new_shm_dir() as shm_dir:
        with run_daemon(sockets, "--shm-dir", str(shm_dir)) as d, \
                KVPoolClient(d.target) as client:
            configure(client, "one")
            configure(client, "two")
            files = kvpool_files(shm_dir)
            assert len(files) == 3 and sum(f.endswith(".lock") for f in files) == 1
            with pytest.raises(RuntimeError, match="body") as info, \
                    client.attach("one") as region:
                region["k.0"][5] = 3.0
                assert d.stop(signal.SIGTERM) == 0
                assert kvpool_files(shm_dir) == []
                assert bool((region["k.0"][5] == 3.0).all())
                raise RuntimeError("body")
            assert any("detach" in note for note in info.value.__notes__)
        assert "event=shm_ready" in d.log_text() and "event=stopped" in d.log_text()


def test_a_new_daemon_removes_the_files_of_a_sigkilled_one() -> None:
    """Daemon A builds a pool and is SIGKILLed: its region and lock stay in the shm dir.
    Daemon B started on the same dir removes both at start and logs them; B's own lock is
    the only file left while it runs, and nothing after its SIGTERM."""
    with temp_dir() as sockets, new_shm_dir() as shm_dir:
        with run_daemon(sockets, "--shm-dir", str(shm_dir)) as a:
            with KVPoolClient(a.target) as client:
                configure(client, "orphan")
            left = kvpool_files(shm_dir)
            assert a.stop(signal.SIGKILL) == -signal.SIGKILL
        assert kvpool_files(shm_dir) == left and len(left) == 2
        with run_daemon(sockets, "--shm-dir", str(shm_dir)) as b:
            now = kvpool_files(shm_dir)
            assert len(now) == 1 and now[0].endswith(".lock") and now[0] not in left
            log = b.log_text()
            assert "event=shm_orphans_removed" in log and "count=2" in log
            assert all(name in log for name in left)
        assert kvpool_files(shm_dir) == []


def test_cuda_with_expandable_segments_refuses_to_start(tmp_path: Path) -> None:
    """Checked before CUDA is touched, so it is refused (exit 2, naming the variable and
    pytorch#165685) on this GPU-less machine too. (Both variables: test_sharing_attach.)"""
    var = "PYTORCH_CUDA_ALLOC_CONF"
    env = subprocess_env(**{var: "expandable_segments:True", "PYTORCH_ALLOC_CONF": ""})
    out = subprocess.run(
        [sys.executable, "-m", "kvpoold.main", "serve", "--device", "cuda:0",
         "--listen", f"unix://{tmp_path}/k.sock"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert var in out.stderr and "pytorch#165685" in out.stderr
    assert not os.path.exists(tmp_path / "k.sock")

"""``kvpoold serve --device cuda:0`` end to end: engines attach over gRPC and map by CUDA IPC.

The daemon is its own process (it exports); a child process and this test process attach
(both import, which only works outside the exporter) and see each other's writes in GPU
memory. Skipped without CUDA; see tests/gpu/README.md.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.clients.client import KVPoolClient
from kvpool.contract.errors import FailedPrecondition
from kvpool.mapping.regions import visible_cuda_uuids
from tests.conftest import REPO, TINY_SPEC, DaemonProcess, run_daemon, subprocess_env, temp_dir
from tests.procs import Child

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MiB = 1 << 20
# TINY_SPEC at 64 MiB and page 16: 256 B per token -> 262,144 token rows, 16,384 pages; k.0 is
# [262144, 2, 16] bf16 (16 MiB), a page 16 rows x 64 B = 1,024 B.
OPTIONS = {"budget_bytes": 64 * MiB, "page_size": 16, "max_running_requests": 8}
CLEAN_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": ""}

# Attach, check what the test wrote in page 2 of k.0, write page 3 of v.1, hold until told.
ENGINE = r"""
import torch
from kvpool.clients.client import KVPoolClient
from kvpool.contract.errors import KVPoolError

msg = recv()
with KVPoolClient(msg["target"]) as client:
    try:
        with client.attach(msg["pool"], expected_fingerprint=msg["fingerprint"]) as region:
            ok = bool((region.page("k.0", 2) == 1.25).all())
            region.page("v.1", 3).fill_(-2.0)
            torch.cuda.synchronize()
            send({"ok": ok, "sharing": region.sharing, "device": str(region.device)})
            sys.stdin.readline()
    except KVPoolError as exc:
        send({"error": type(exc).__name__, "message": str(exc)})
send("detached")
"""


def engine(env: dict[str, str] | None = None) -> Child:
    """An engine process (:data:`ENGINE`) with a clean allocator config and ``env`` on top."""
    return Child(ENGINE, env={**CLEAN_ENV, **(env or {})})


@pytest.fixture
def cuda_daemon(monkeypatch: pytest.MonkeyPatch) -> Iterator[DaemonProcess]:
    for var, value in CLEAN_ENV.items():
        monkeypatch.setenv(var, value)  # run_daemon's child inherits os.environ
    with temp_dir() as sockets, run_daemon(sockets, "--device", "cuda:0", budget="1GiB") as d:
        yield d


def test_engines_share_gpu_memory_through_the_daemon(cuda_daemon: DaemonProcess) -> None:
    """This process writes 1.25 into page 2 of k.0 through its attachment; an engine process
    sees it and writes -2.0 into page 3 of v.1 (rows 48..63), which this process then sees.
    Two attachments are counted; Drop is refused while they last; after both detach it
    succeeds, and SIGTERM stops the daemon with status 0."""
    d = cuda_daemon
    with KVPoolClient(d.target) as client:
        result = client.configure("gpu", spec=TINY_SPEC, **OPTIONS)
        stats = client.stats("gpu")
        assert stats.daemon.device == "cuda:0" and stats.pool("gpu").sharing == "cuda_ipc"
        with engine() as eng:
            with client.attach("gpu", expected_fingerprint=result.fingerprint) as region:
                assert region.sharing == "cuda_ipc" and region.device.type == "cuda"
                region.page("k.0", 2).fill_(1.25)
                torch.cuda.synchronize()
                eng.send({"target": d.target, "pool": "gpu", "fingerprint": result.fingerprint})
                got = eng.recv()
                assert got == {"ok": True, "kind": "cuda_ipc", "device": "cuda:0"}
                torch.cuda.synchronize()
                v1 = region["v.1"]
                assert bool((v1[48:64] == -2.0).all()) and int(v1[:48].count_nonzero()) == 0
                assert client.stats("gpu").pool("gpu").attached == 2
                with pytest.raises(FailedPrecondition, match="2 clients attached"):
                    client.drop("gpu")
                eng.send("go")
                assert eng.recv() == "detached"
                del v1
            eng.wait_ok()
        assert client.stats("gpu").pool("gpu").attached == 0
        assert client.drop("gpu").released_bytes == result.plan.backing_bytes
    assert d.stop(signal.SIGTERM) == 0


def test_an_engine_without_the_gpu_is_refused_and_not_left_attached(
        cuda_daemon: DaemonProcess) -> None:
    """An engine that sees no GPU (CUDA_VISIBLE_DEVICES empty) or only another GPU gets
    FailedPrecondition from the mapping, and its attachment ends anyway."""
    d = cuda_daemon
    uuids = visible_cuda_uuids()
    hidden = [""] + ([f"GPU-{uuids[1]}"] if len(uuids) > 1 else [])
    with KVPoolClient(d.target) as client:
        result = client.configure("gpu2", spec=TINY_SPEC, **OPTIONS)
        for visible in hidden:
            with engine({"CUDA_VISIBLE_DEVICES": visible}) as eng:
                eng.send({"target": d.target, "pool": "gpu2", "fingerprint": result.fingerprint})
                got = eng.recv()
                assert got["error"] == "FailedPrecondition", got
                want = "device UUID mismatch" if visible else "CUDA is not available"
                assert want in got["message"], got
                assert eng.recv() == "detached"
            assert client.stats("gpu2").pool("gpu2").attached == 0
        client.drop("gpu2")


def test_expandable_segments_stop_the_daemon_at_start(tmp_path: Path) -> None:
    """The same refusal as tests/e2e (test_cuda_with_expandable_segments_refuses_to_start),
    kept here so tests/gpu/run_on_device.sh checks it where CUDA is real."""
    env = subprocess_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
                         PYTORCH_ALLOC_CONF="")
    out = subprocess.run([sys.executable, "-m", "kvpoold.main", "serve", "--device", "cuda:0",
                          "--listen", f"unix://{tmp_path}/k.sock"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "pytorch#165685" in out.stderr, out.stderr


# Attach a hybrid pool, then for each list of kv pages sent, read their full_to_swa entries
# from GPU memory at once (no waiting, no synchronize before the read) and send them back.
MAPPING_READER = r"""
from kvpool.clients.client import KVPoolClient

msg = recv()
with KVPoolClient(msg["target"]) as client:
    with client.attach(msg["pool"]) as region:
        mapping = region["full_to_swa"]
        send("attached")
        while (pages := recv()) != "stop":
            send(mapping[pages].tolist())
send("detached")
"""
HYBRID_SPEC = {**TINY_SPEC, "sliding_window": {"window": 32, "layers": [0]}}


def test_full_to_swa_on_the_gpu_is_written_before_allocate_replies(
        cuda_daemon: DaemonProcess) -> None:
    """The daemon writes each kv page's SWA page into the device full_to_swa buffer (through
    its host mirror) and synchronizes before Allocate replies: an engine process that reads the
    buffer as soon as it has the reply sees every pair, and the zeros after a free."""
    d = cuda_daemon
    with KVPoolClient(d.target) as client:
        result = client.configure("hyb", spec=HYBRID_SPEC, **OPTIONS)
        assert result.plan.id_space("swa").follows == "kv"
        with Child(MAPPING_READER, env=CLEAN_ENV) as reader, client.lease("gpu-test") as lease:
            reader.send({"target": d.target, "pool": "hyb"})
            assert reader.recv() == "attached"
            for count in (1, 7, 300):
                full, swa = lease.allocate_swa_pairs("hyb", count)
                reader.send(full.tolist())
                assert reader.recv() == swa.tolist()
                lease.free("hyb", "swa", full[: count // 2])  # the window slid past these
                reader.send(full.tolist())
                half = count // 2
                assert reader.recv() == [0] * half + swa[half:].tolist()
                lease.free("hyb", "kv", full)
            reader.send("stop")
            assert reader.recv() == "detached"
            reader.wait_ok()
        client.drop("hyb")

"""Attach cost: map a pool's shm region in another process vs send it with torch.multiprocessing.

What it measures, for regions of 64 MiB and 1 GiB (median of ``--reps``, after a warm-up):

* **kvpool Attach RPC**: the real path. ``kvpoold serve`` runs as its own process (own shm
  dir); a pool is configured from the Qwen3-8B config shipped with kvpool with a KV budget of
  the size (72 K/V views plus the request table; the backing is a few MiB larger) and filled
  by this process through an attachment, so every page exists. The child process times
  ``with client.attach(pool) as region`` from the call to having every view: the Attach RPC
  over the Unix socket, the plan's decode, the checks of the file and the map; then Detach.
* **kvpool shm map**: the mapping alone: the parent sends the plain handle (path, size, one
  buffer layout) over a pipe and the child maps it with ``kvpool.mapping.regions.map_region``. Time
  from send to the child holding the views.
* **torch.mp fresh**: the same bytes in an ordinary tensor, ``put`` on a
  ``torch.multiprocessing`` spawn-context Queue with the default ``file_descriptor`` strategy;
  time from put to the child having the tensor. torch first moves the tensor into a new
  shared-memory segment (a copy of every byte), then passes the fd.
* **torch.mp pre-shared**: as above but ``share_memory_()`` was already called (its copy is
  reported separately), so only the fd passing and the map are timed.

"Bytes copied" is read from the system, not assumed: the growth of /dev/shm usage during the
attach (torch's copy lands there) and the child's VmRSS growth after it has the tensor and after
it reads one 4 KiB page. Clocks: ``time.monotonic_ns`` (CLOCK_MONOTONIC, shared by processes).

Run (about 30-60 s on 2 vCPUs; needs ~5 GiB of RAM and /dev/shm for 1 GiB)::

    cd /work/main && PYTHONPATH=client:service python bench/attach.py
    # options: --sizes-mib 64,1024 --reps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as tmp

from kvpool.clients.client import KVPoolClient
from kvpool.contract.shared_handle import SharedHandle
from kvpool.mapping.regions import BufferLayout, map_region
from kvpoold.sharing import ShmBackingFactory

MiB = 1 << 20
PAGE = 4096
REPO = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    """This process's VmRSS."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def shm_used_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def child_shm(conn: Connection) -> None:
    """Engine side for kvpool: map from plain values, report timings and RSS."""
    while (msg := conn.recv()) is not None:
        path, size = msg
        rss0 = rss_bytes()
        region = map_region(SharedHandle(sharing="shm", size=size, path=path),
                            [BufferLayout("b", "uint8", (size,), 0, size)])
        t_have = time.monotonic_ns()
        rss1 = rss_bytes()
        page_sum = int(region["b"][:PAGE].sum())
        rss2 = rss_bytes()
        region.close()
        conn.send((t_have, rss0, rss1, rss2, page_sum))


def child_rpc(target: str, conn: Connection) -> None:
    """Engine side for the RPC path: Attach + map by pool name, then read one page."""
    with KVPoolClient(target) as client:
        while (pool := conn.recv()) is not None:
            rss0 = rss_bytes()
            t0 = time.monotonic_ns()
            with client.attach(pool) as region:
                views = region.views
                t_have = time.monotonic_ns()
                rss1 = rss_bytes()
                page_sum = int(region.base[:PAGE].sum())
                rss2 = rss_bytes()
                del views
            conn.send((t0, t_have, rss0, rss1, rss2, page_sum))


def child_tmp(queue: Any, conn: Connection) -> None:
    """Engine side for torch.multiprocessing: take the tensor off the queue, same report."""
    while True:
        rss0 = rss_bytes()
        t = queue.get()
        if t is None:
            return
        t_have = time.monotonic_ns()
        rss1 = rss_bytes()
        page_sum = int(t[:PAGE].sum())
        rss2 = rss_bytes()
        del t
        conn.send((t_have, rss0, rss1, rss2, page_sum))


@dataclass
class Sample:
    ms: float
    shm_bytes: int
    rss_map: int
    rss_page: int


def sample(t_send: int, shm0: int, reply: tuple[int, int, int, int, int], fill: int) -> Sample:
    t_have, rss0, rss1, rss2, page_sum = reply
    assert page_sum == fill * PAGE, f"child read {page_sum}, expected {fill * PAGE}"
    return Sample((t_have - t_send) / 1e6, shm_used_bytes() - shm0, rss1 - rss0, rss2 - rss0)


def run_shm(factory: ShmBackingFactory, conn: Connection, size: int, reps: int) -> list[Sample]:
    backing = factory.create(size, f"bench{size // MiB}")
    backing.tensor.fill_(3)  # a pool in use: every page exists
    out = []
    for _ in range(reps):
        shm0 = shm_used_bytes()
        t_send = time.monotonic_ns()
        conn.send((str(backing.path), size))
        out.append(sample(t_send, shm0, conn.recv(), 3))
    backing.close()
    return out


@dataclass
class Daemon:
    """The bench's ``kvpoold serve``, its shm dir and the directory of its socket."""

    proc: subprocess.Popen[bytes]
    target: str
    work: Path
    socket_dir: Path

    def stop(self) -> None:
        """Stop it and remove both directories."""
        self.proc.terminate()
        self.proc.wait(30)
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def start_daemon(budget: int) -> Daemon:
    """``kvpoold serve`` on a temp socket with its own shm dir under /dev/shm."""
    work = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="kvpoolbench-"))
    sock = Path(tempfile.mkdtemp(prefix="kvpb-", dir="/tmp")) / "k.sock"
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'client'}:{REPO / 'service'}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpoold.main", "serve", "--listen", f"unix://{sock}",
         "--budget", str(budget), "--shm-dir", str(work), "--log-level", "warning"],
        env=env, cwd=REPO,
    )
    deadline = time.monotonic() + 60
    while True:  # connect only once it listens: a failed first connect backs off for ~1 s
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(str(sock))
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvpoold did not start") from None
        time.sleep(0.02)
    return Daemon(proc, f"unix://{sock}", work, sock.parent)


def configure_filled(client: KVPoolClient, pool: str, budget: int) -> int:
    """A Qwen3-8B pool with a KV budget of ``budget``, every byte written (3); its backing."""
    config = (resources.files("kvpool") / "data" / "qwen3-8b.json").read_text()
    result = client.configure(pool, hf_config=config, budget_bytes=budget, page_size=16,
                              context_length=4096)
    with client.attach(pool) as region:
        region.base.fill_(3)
    return result.plan.backing_bytes


def run_rpc(client: KVPoolClient, conn: Connection, size: int, reps: int
            ) -> tuple[list[Sample], int]:
    pool = f"rpc{size // MiB}"
    backing = configure_filled(client, pool, size)
    out = []
    for _ in range(reps):
        shm0 = shm_used_bytes()
        conn.send(pool)
        t0, t_have, rss0, rss1, rss2, page_sum = conn.recv()
        assert page_sum == 3 * PAGE, page_sum
        out.append(Sample((t_have - t0) / 1e6, shm_used_bytes() - shm0, rss1 - rss0,
                          rss2 - rss0))
    client.drop(pool)
    return out, backing


def run_tmp(
    queue: Any, conn: Connection, size: int, reps: int, *, preshared: bool
) -> tuple[list[Sample], float]:
    """Send ``reps`` tensors; fresh ones each time, or one tensor shared once up front."""
    out, share_ms = [], 0.0
    kept = None
    if preshared:
        kept = torch.empty(size, dtype=torch.uint8).fill_(3)
        t0 = time.monotonic_ns()
        kept.share_memory_()
        share_ms = (time.monotonic_ns() - t0) / 1e6
    for _ in range(reps):
        t = kept if kept is not None else torch.empty(size, dtype=torch.uint8).fill_(3)
        shm0 = shm_used_bytes()
        t_send = time.monotonic_ns()
        queue.put(t)
        out.append(sample(t_send, shm0, conn.recv(), 3))
        del t  # only after the child has it: torch.mp needs the sender alive until then
    return out, share_ms


def med(xs: list[float] | list[int]) -> float:
    return float(statistics.median(xs))


def mib(n: float) -> str:
    return f"{n / MiB:8.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="64,1024")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) * MiB for s in args.sizes_mib.split(",")]

    t_start = time.monotonic()
    daemon = start_daemon(2 * max(sizes) + 256 * MiB)
    client = KVPoolClient(daemon.target)
    ctx = tmp.get_context("spawn")
    shm_parent, shm_child = ctx.Pipe()
    tmp_parent, tmp_child = ctx.Pipe()
    rpc_parent, rpc_child = ctx.Pipe()
    queue = ctx.Queue()
    procs = [ctx.Process(target=child_shm, args=(shm_child,)),
             ctx.Process(target=child_tmp, args=(queue, tmp_child)),
             ctx.Process(target=child_rpc, args=(daemon.target, rpc_child))]
    for p in procs:
        p.start()
    shm_dir = tempfile.mkdtemp(dir="/dev/shm", prefix="kvpoolbench-")
    rows = []
    try:
        with ShmBackingFactory(shm_dir) as factory:
            # Warm-up: first calls pay one-off costs (lazy imports, first mmap) in the children.
            run_rpc(client, rpc_parent, 16 * MiB, 1)
            run_shm(factory, shm_parent, MiB, 1)
            run_tmp(queue, tmp_parent, MiB, 1, preshared=False)
            for size in sizes:
                rpc, backing = run_rpc(client, rpc_parent, size, args.reps)
                ours = run_shm(factory, shm_parent, size, args.reps)
                fresh, _ = run_tmp(queue, tmp_parent, size, args.reps, preshared=False)
                pre, share_ms = run_tmp(queue, tmp_parent, size, args.reps, preshared=True)
                rows.append((size, rpc, backing, ours, fresh, pre, share_ms))
    finally:
        shm_parent.send(None)
        rpc_parent.send(None)
        queue.put(None)
        for p in procs:
            p.join(timeout=30)
        shutil.rmtree(shm_dir, ignore_errors=True)
        client.close()
        daemon.stop()

    print(f"attach: median of {args.reps}; torch {torch.__version__}; {os.cpu_count()} CPUs")
    print(f"{'size':>9}  {'method':<22} {'attach ms':>10}  {'/dev/shm growth':>15}  "
          f"{'child RSS +map':>15}  {'+1 page read':>15}")
    for size, rpc, backing, ours, fresh, pre, share_ms in rows:
        for name, s in (("kvpool Attach RPC", rpc), ("kvpool shm map", ours),
                        ("torch.mp fresh", fresh), ("torch.mp pre-shared", pre)):
            print(f"{size // MiB:>5} MiB  {name:<22} {med([x.ms for x in s]):>10.2f}  "
                  f"{mib(med([x.shm_bytes for x in s])):>15}  "
                  f"{mib(med([x.rss_map for x in s])):>15}  "
                  f"{mib(med([x.rss_page for x in s])):>15}")
        rpc_ms = med([x.ms for x in rpc])
        print(f"{'':>9}  Attach RPC pool backing {backing / MiB:.2f} MiB (72 K/V views + "
              f"request table); torch.mp fresh / Attach RPC = "
              f"{med([x.ms for x in fresh]) / rpc_ms:.0f}x; pre-shared / Attach RPC = "
              f"{med([x.ms for x in pre]) / rpc_ms:.2f}x")
        ratio = med([x.ms for x in fresh]) / med([x.ms for x in ours])
        ratio_pre = med([x.ms for x in pre]) / med([x.ms for x in ours])
        print(f"{'':>9}  torch.mp fresh / shm map = {ratio:.0f}x; pre-shared / shm map = "
              f"{ratio_pre:.1f}x (its share_memory_ copy: {share_ms:.1f} ms)")
    print(f"total {time.monotonic() - t_start:.1f} s")


if __name__ == "__main__":
    main()

"""Disaggregated prefill/decode with kvpool: two daemons, KV pages moved by NIXL.

Starts two ``kvpoold serve`` processes (a prefill and a decode daemon, on Unix sockets in a
temporary directory), configures the same model on both (the decode pool twice as large: the
layouts of their *pages* agree, which is what a transfer needs), then plays both engines:

1. decode: allocates pages for a request and grants them (``lease.grant_receive``);
2. prefill: allocates its own pages and, with the grant's token, has its daemon prepare the
   write to the decode daemon (``client.send(..., hold=True)``: the daemons' handshake and
   the descriptors happen now, off the hot path); writes the request's KV into its pages
   through its zero-copy mapping of its pool (random bytes here, where a model would write);
   then posts the write (``handle.post``: one message to its own daemon, on the post channel,
   answered once the write ended); the decode side waits for the grant;
3. decode: reads every byte of every granted page through its own mapping and compares.

Needs ``kvpool[server,nixl]``. From a fresh clone, at the repository root, in one command
(docs/pd-transfer.md, "Try it")::

    python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && \
        .venv/bin/pip install -q -c .ci/constraints.txt -e ".[server,nixl]" && \
        .venv/bin/python examples/pd_disagg.py [--pages 64]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvpool import KVPoolClient

MODEL = {"num_layers": 4, "context_length": 4096,
         "attention": {"type": "mha", "num_kv_heads": 4, "head_dim": 64}}
POOL = "llama-ish"


def start(sock: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "kvpoold.main", "serve", "--listen",
                             f"unix://{sock}", "--budget", "256MiB", "--log-level", "warning"],
                            env=dict(os.environ), stderr=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=64, help="pages of the request's KV")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvp-pd-", dir="/tmp") as tmp:
        prefill_sock, decode_sock = Path(tmp) / "prefill.sock", Path(tmp) / "decode.sock"
        procs = [start(prefill_sock), start(decode_sock)]
        decode_target = f"unix://{decode_sock}"
        try:
            with KVPoolClient(f"unix://{prefill_sock}") as prefill, \
                    KVPoolClient(decode_target) as decode:
                prefill.wait_serving()
                decode.wait_serving()
                opts = {"page_size": 16, "max_running_requests": 8}
                prefill.configure(POOL, spec=MODEL, budget_bytes=32 << 20, **opts)
                decode.configure(POOL, spec=MODEL, budget_bytes=64 << 20, **opts)
                if not prefill.stats().daemon.nixl_agent:
                    print("the daemons run without NIXL: from the repository root, "
                          "pip install -e '.[server,nixl]'")
                    return 1
                with decode.lease("decode-engine") as d_lease, \
                        prefill.lease("prefill-engine") as p_lease, \
                        prefill.attach(POOL, lease=p_lease) as p_mem, \
                        decode.attach(POOL, lease=d_lease) as d_mem:
                    # 1. decode: pages for the request, and a grant for them.
                    dst = d_lease.allocate(POOL, "kv", args.pages)
                    grant = d_lease.grant_receive(POOL, dst, ttl_s=30)
                    # (the token and the decode daemon's address travel to the prefill engine
                    # over the engines' own channel: a router, a request header...)

                    # 2. prefill: its pages, the write prepared while it computes (the
                    # daemons' handshake happens now), the KV computed into the pages, then
                    # the write posted: the one message on the hot path.
                    src = p_lease.allocate(POOL, "kv", args.pages)
                    handle = prefill.send(POOL, src, peer=decode_target, token=grant.token,
                                          lease=p_lease, hold=True)
                    names = [b.name for b in p_mem.plan.buffers if b.id_space == "kv"]
                    for name in names:
                        for page in src:
                            view = p_mem.page(name, int(page)).view(-1).view(torch.uint8)
                            view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8))
                    start_t = time.perf_counter()
                    sent = handle.post(30)  # answered once the write ended
                    posted = time.perf_counter() - start_t
                    received = grant.wait(30)
                    took = time.perf_counter() - start_t

                    # 3. decode: every byte of every granted page is the prefill's.
                    for name in names:
                        for a, b in zip(src, dst, strict=True):
                            mine = d_mem.page(name, int(b)).view(-1).view(torch.uint8)
                            theirs = p_mem.page(name, int(a)).view(-1).view(torch.uint8)
                            if not torch.equal(mine, theirs):
                                print(f"page {b} of {name} differs from prefill page {a}")
                                return 1
                    print(f"moved {args.pages} pages ({sent.bytes / 2**20:.1f} MiB over "
                          f"{len(names)} buffers, {handle.descriptors} NIXL descriptors) from "
                          f"{received.peer}: the post answered in {posted * 1e3:.1f} ms, the "
                          f"decode side knew in {took * 1e3:.1f} ms (the first transfer to a "
                          "peer also connects); every byte verified on the decode side")
                    d_lease.free(POOL, "kv", dst)  # the decode engine frees when done
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

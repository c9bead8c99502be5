"""The daemon's descriptor socket (``kvpoold.elastic.fd_server.FdServer``) served by a process of
its own, for e2e tests on machines without CUDA (the daemon starts it for CUDA VMM pools only):
``python -m tests.e2e.fd_socket_child PATH [--gid G] [--nofile N] [--max-connections N]``.

It hands out one memfd of 4 chunks whose first bytes are ``kvpool-bytes`` to lease 7 with the
secret ``"ab" * 16`` (pool ``tiny``), prints one JSON line when it serves and one per change of
its accept loop (``{"accepting": bool, "why": str}``), and stops when stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
from pathlib import Path

from kvpool.contract.errors import NotFound, PermissionDenied
from kvpool.contract.fd_channel import FdAsk
from kvpool.mapping.sparse import CHUNK_BYTES, commit
from kvpoold.elastic.fd_server import FdServer

SECRET = "ab" * 16
CONTENT = b"kvpool-bytes"


def send(obj: object) -> None:
    print(json.dumps(obj), flush=True)


async def serve(path: Path, gid: int | None, max_connections: int) -> None:
    fd = os.memfd_create("kvpool-e2e-fd", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4 * CHUNK_BYTES)
    commit(fd, 0, CHUNK_BYTES)
    os.pwrite(fd, CONTENT, 0)

    def authorize(ask: FdAsk, uid: int, pid: int) -> tuple[int, int, str]:
        if ask.pool != "tiny":
            raise NotFound(f"no pool {ask.pool!r}", field="pool")
        if ask.lease_id != 7 or ask.secret != SECRET:
            raise PermissionDenied("lease 7's secret does not match", field="secret")
        return fd, 4 * CHUNK_BYTES, "memfd"

    server = FdServer(path, authorize, gid=gid, max_connections=max_connections,
                      on_state=lambda accepting, why: send({"accepting": accepting, "why": why}))
    await server.start()
    loop = asyncio.get_running_loop()
    send({"serving": str(path), "pid": os.getpid()})
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes our stdin
    await server.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path", type=Path)
    parser.add_argument("--gid", type=int)
    parser.add_argument("--nofile", type=int, help="lower RLIMIT_NOFILE (soft and hard) first")
    parser.add_argument("--max-connections", type=int, default=1024)
    args = parser.parse_args()
    if args.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    asyncio.run(serve(args.path, args.gid, args.max_connections))


if __name__ == "__main__":
    main()

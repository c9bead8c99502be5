"""The descriptor side channel: a real AF_UNIX socket served on this test's event loop, clients
in child processes that map what they receive. Refusals carry a status code and no
descriptor."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvpool.contract.errors import NotFound, PermissionDenied
from kvpool.contract.fd_channel import FdAsk
from kvpool.mapping.sparse import CHUNK_BYTES, commit
from kvpoold.elastic.fd_server import FdServer
from tests.conftest import REPO

SECRET = "ab" * 16


@pytest.fixture
def memfd() -> int:
    fd = os.memfd_create("kvpool-test-fd", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4 * CHUNK_BYTES)
    commit(fd, 0, CHUNK_BYTES)
    os.pwrite(fd, b"kvpool-bytes", 0)
    return fd


def authorize_for(fd: int):  # type: ignore[no-untyped-def]
    def authorize(ask: FdAsk, uid: int) -> tuple[int, int, str]:
        if ask.pool != "tiny":
            raise NotFound(f"no pool {ask.pool!r}", field="pool")
        if ask.lease_id != 7 or ask.secret != SECRET:
            raise PermissionDenied("lease 7's secret does not match", field="secret")
        return fd, 4 * CHUNK_BYTES, "memfd"
    return authorize


@pytest.fixture
async def server(socket_dir: Path, memfd: int) -> AsyncIterator[FdServer]:
    srv = FdServer(socket_dir / "k.sock.fd", authorize_for(memfd))
    await srv.start()
    yield srv
    await srv.close()
    os.close(memfd)


async def client(path: Path, pool: str = "tiny", lease_id: int = 7,
                 secret: str = SECRET) -> subprocess.CompletedProcess[str]:
    """A child process that fetches the descriptor, maps chunk 0 and prints its first bytes."""
    code = textwrap.dedent(f"""
        import ctypes, os
        from kvpool.contract.errors import KVPoolError
        from kvpool.contract.fd_channel import FdAsk
        from kvpool.mapping.fd_client import fetch_fd
        from kvpool.mapping.sparse import CHUNK_BYTES, Reservation
        try:
            fd, answer = fetch_fd({str(path)!r}, FdAsk(pool={pool!r}, lease_id={lease_id},
                                                        secret={secret!r}))
        except KVPoolError as exc:
            print("refused", exc.code, exc.message)
            raise SystemExit(0)
        r = Reservation(fd, answer.size)
        r.map(0, CHUNK_BYTES)
        print("mapped", answer.kind, ctypes.string_at(r.address, 12).decode())
    """)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'client'}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return subprocess.CompletedProcess([], proc.returncode or 0, out.decode(), err.decode())


async def test_a_lease_holder_gets_the_descriptor_and_maps_the_pool(server: FdServer) -> None:
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    out = await client(server.path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "mapped memfd kvpool-bytes"
    assert (server.answered, server.refused) == (1, 0)


@pytest.mark.parametrize(("kwargs", "code"), [
    ({"secret": "cd" * 16}, "PERMISSION_DENIED"),
    ({"lease_id": 8}, "PERMISSION_DENIED"),
    ({"pool": "other"}, "NOT_FOUND"),
])
async def test_refusals_carry_a_code_and_no_descriptor(server: FdServer, kwargs: dict[str, object],
                                                       code: str) -> None:
    out = await client(server.path, **kwargs)  # type: ignore[arg-type]
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"refused {code}")
    assert server.refused == 1


async def test_garbage_oversized_and_silent_asks_are_refused(server: FdServer) -> None:
    loop = asyncio.get_running_loop()

    async def raw(payload: bytes | None) -> bytes:
        reader, writer = await asyncio.open_unix_connection(str(server.path))
        if payload is not None:
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return data

    assert b'"code":"INVALID_ARGUMENT"' in await raw(b"\x00not json")
    assert b"over 4096" in await raw(b"x" * 10_000)
    start = loop.time()
    from kvpoold.elastic import fd_server
    fd_server.ASK_TIMEOUT_S, saved = 0.2, fd_server.ASK_TIMEOUT_S
    try:
        assert await raw(None) == b""  # said nothing: closed without an answer
    finally:
        fd_server.ASK_TIMEOUT_S = saved
    assert loop.time() - start < 5
    assert server.refused == 3 and server.answered == 0


async def test_a_uid_not_served_is_refused(socket_dir: Path, memfd: int) -> None:
    srv = FdServer(socket_dir / "u.sock.fd", authorize_for(memfd),
                   uids=frozenset({os.getuid() + 12345}))
    await srv.start()
    try:
        out = await client(srv.path)
        assert out.stdout.startswith("refused PERMISSION_DENIED") and "uid" in out.stdout
    finally:
        await srv.close()
    assert not srv.path.exists()

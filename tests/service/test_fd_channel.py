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

import msgspec
import pytest

from kvpool.contract.errors import NotFound, PermissionDenied
from kvpool.contract.fd_channel import (
    MAX_ASK_BYTES,
    MAX_FDS_PER_ANSWER,
    MAX_GROUPS_PER_ASK,
    FdAnswer,
    FdAsk,
    groups_per_ask,
)
from kvpool.mapping.sparse import CHUNK_BYTES, commit
from kvpoold.elastic.fd_server import FdGrant, FdServer
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
    def authorize(ask: FdAsk, uid: int, pid: int) -> tuple[int, int, str]:
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
    async def raw(payload: bytes | None) -> bytes:
        reader, writer = await asyncio.open_unix_connection(str(server.path))
        if payload is not None:
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
        data = await asyncio.wait_for(reader.read(), 60)  # a ceiling for a hang only
        writer.close()
        return data

    assert b'"code":"INVALID_ARGUMENT"' in await raw(b"\x00not json")
    assert b"over 4096" in await raw(b"x" * 10_000)
    from kvpoold.elastic import fd_server
    fd_server.ASK_TIMEOUT_S, saved = 0.2, fd_server.ASK_TIMEOUT_S
    try:
        assert await raw(None) == b""  # said nothing: closed without an answer
    finally:
        fd_server.ASK_TIMEOUT_S = saved
    assert server.refused == 3 and server.answered == 0


async def test_one_connection_over_the_per_uid_cap_is_refused_at_once(socket_dir: Path,
                                                                      memfd: int) -> None:
    """Two silent connections of this uid are served (waiting for their asks); a third of the
    same uid is answered RESOURCE_EXHAUSTED at once, naming the cap and its flag; once one
    ends, the next is served."""
    srv = FdServer(socket_dir / "q.sock.fd", authorize_for(memfd), max_connections_per_uid=2)
    await srv.start()
    silent = [await asyncio.open_unix_connection(str(srv.path)) for _ in range(2)]
    try:
        while srv.connections < 2:  # both accepted
            await asyncio.sleep(0.01)
        out = await client(srv.path)
        assert out.stdout.startswith(
            f"refused RESOURCE_EXHAUSTED connections: uid {os.getuid()} has 2 connections open "
            "on the descriptor socket, at most 2 (kvpoold serve --max-connections-per-uid)"), out
        silent.pop()[1].close()
        while srv.connections > 1:
            await asyncio.sleep(0.01)
        out = await client(srv.path)
        assert out.stdout == "mapped memfd kvpool-bytes\n", out
    finally:
        for _reader, writer in silent:
            writer.close()
        await srv.close()


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


def parts_authorize(made: list[int]):  # type: ignore[no-untyped-def]
    """Answer an ask of parts with one fresh memfd per range (fixed part: chunk 0; group g:
    chunks 1 + 2g and 2 + 2g, like two views), each holding its own offset as text."""
    def authorize(ask: FdAsk, uid: int, pid: int) -> FdGrant:
        if ask.lease_id != 7 or ask.secret != SECRET:
            raise PermissionDenied("lease 7's secret does not match", field="secret")
        if any(g >= 200 for g in ask.groups):
            raise NotFound(f"groups {ask.groups} are not all granted", field="groups")
        ranges = [(0, CHUNK_BYTES)] if ask.fixed else []
        for g in ask.groups:
            ranges += [((1 + 2 * g) * CHUNK_BYTES, CHUNK_BYTES),
                       ((2 + 2 * g) * CHUNK_BYTES, CHUNK_BYTES)]
        fds = []
        for offset, length in ranges:
            fd = os.memfd_create("kvpool-test-part", os.MFD_CLOEXEC)
            os.ftruncate(fd, length)
            os.pwrite(fd, f"at {offset}".encode(), 0)
            fds.append(fd)
        made.extend(fds)
        return FdGrant(tuple(fds), tuple(ranges), 401 * CHUNK_BYTES, "memfd")
    return authorize


async def parts_client(path: Path, groups: tuple[int, ...], fixed: bool
                       ) -> subprocess.CompletedProcess[str]:
    """A child that asks for parts and prints, per descriptor, its range and its first
    bytes."""
    code = textwrap.dedent(f"""
        import os
        from kvpool.contract.errors import KVPoolError
        from kvpool.contract.fd_channel import FdAsk
        from kvpool.mapping.fd_client import fetch_fds
        try:
            fds, answer = fetch_fds({str(path)!r}, FdAsk(pool="tiny", lease_id=7,
                secret={SECRET!r}, groups={groups!r}, fixed={fixed!r}))
        except KVPoolError as exc:
            print("refused", exc.code, exc.message)
            raise SystemExit(0)
        print(len(fds), answer.size)
        for fd, (offset, length) in zip(fds, answer.ranges, strict=True):
            print(offset, length, os.pread(fd, 32, 0).rstrip(b"\\0").decode())
            os.close(fd)
    """)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'client'}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return subprocess.CompletedProcess([], proc.returncode or 0, out.decode(), err.decode())


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


async def test_an_ask_of_parts_gets_many_descriptors_in_order(socket_dir: Path) -> None:
    """The fixed part, then groups 5 and 2 (as asked), each group's two views: 5 descriptors,
    each mapping to the range the answer names; the server closed every one it made."""
    made: list[int] = []
    srv = FdServer(socket_dir / "p.sock.fd", parts_authorize(made))
    await srv.start()
    try:
        out = await parts_client(srv.path, (5, 2), True)
    finally:
        await srv.close()
    assert out.returncode == 0, out.stderr
    c = CHUNK_BYTES
    expected = [(0, c), (11 * c, c), (12 * c, c), (5 * c, c), (6 * c, c)]
    assert out.stdout.splitlines() == [f"5 {401 * c}"] + [
        f"{o} {n} at {o}" for o, n in expected]
    assert not set(made) & open_fds()
    assert (srv.answered, srv.refused) == (1, 0)


async def test_a_full_answer_carries_max_fds_and_one_more_is_refused(socket_dir: Path) -> None:
    """groups_per_ask(2, fixed=True) groups fill one answer (2 * 126 + 1 = 253 descriptors,
    Linux's SCM_MAX_FD); one group more is refused with no descriptor, and the server closed
    all it made either way."""
    per_ask = groups_per_ask(2, fixed=True)
    assert 2 * per_ask + 1 <= MAX_FDS_PER_ANSWER < 2 * (per_ask + 1) + 1
    made: list[int] = []
    srv = FdServer(socket_dir / "m.sock.fd", parts_authorize(made))
    await srv.start()
    try:
        full = await parts_client(srv.path, tuple(range(per_ask)), True)
        over = await parts_client(srv.path, tuple(range(per_ask + 1)), True)
        refused = await parts_client(srv.path, (1, 250), False)
    finally:
        await srv.close()
    assert full.returncode == 0, full.stderr
    lines = full.stdout.splitlines()
    assert lines[0] == f"{2 * per_ask + 1} {401 * CHUNK_BYTES}"
    assert all(line.endswith(f"at {line.split()[0]}") for line in lines[1:])
    assert over.stdout.startswith("refused INTERNAL") and "fewer groups" in over.stdout
    assert refused.stdout.startswith("refused NOT_FOUND")
    assert not set(made) & open_fds()
    assert (srv.answered, srv.refused) == (1, 2)


def test_asks_and_answers_stay_compatible_with_the_one_file_form() -> None:
    """An ask without parts encodes as before (no new keys needed to decode it); an ask's
    groups are bounded and non-negative."""
    old = msgspec.json.encode({"pool": "tiny", "lease_id": 7, "secret": SECRET})
    ask = msgspec.json.decode(old, type=FdAsk)
    assert (ask.groups, ask.fixed, ask.parts) == ((), False, False)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"pool":"p","lease_id":1,"secret":"","groups":[-1]}', type=FdAsk)
    too_many = msgspec.json.encode({"pool": "p", "lease_id": 1, "secret": "",
                                    "groups": list(range(MAX_GROUPS_PER_ASK + 1))})
    assert len(too_many) < MAX_ASK_BYTES
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(too_many, type=FdAsk)
    answer = msgspec.json.decode(b'{"code":"OK","size":4,"kind":"memfd"}', type=FdAnswer)
    assert answer.ranges == ()
    with pytest.raises(ValueError, match="more descriptors"):
        groups_per_ask(MAX_FDS_PER_ANSWER + 1)
    assert groups_per_ask(64) == 3 and groups_per_ask(1) == MAX_GROUPS_PER_ASK

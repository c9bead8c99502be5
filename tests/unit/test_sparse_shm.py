"""Sparse shared memory (elastic pools on CPU): real memfds, real mappings, real child processes.
Memory exists only where committed; a client touching a range it has not mapped faults."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from kvpool.contract.errors import InvalidArgument
from kvpool.mapping.sparse import CHUNK_BYTES, Reservation, backed_bytes, commit, punch
from tests.conftest import REPO

SIZE = 32 * CHUNK_BYTES  # 64 MiB virtual


@pytest.fixture
def fd() -> Iterator[int]:
    fd = os.memfd_create("kvpool-test-sparse", os.MFD_CLOEXEC)
    os.ftruncate(fd, SIZE)
    yield fd
    os.close(fd)


def child(fd: int, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a child that has ``fd`` and a ``Reservation r`` over it."""
    code = textwrap.dedent(f"""
        import ctypes, sys
        from kvpool.mapping.sparse import CHUNK_BYTES, Reservation
        r = Reservation({fd}, {SIZE})
    """) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'client'}"}
    return subprocess.run([sys.executable, "-c", code], pass_fds=[fd], env=env,
                          capture_output=True, text=True, timeout=60)


def test_memory_exists_only_where_committed(fd: int) -> None:
    assert backed_bytes(fd) == 0
    commit(fd, 0, 2 * CHUNK_BYTES)
    commit(fd, 10 * CHUNK_BYTES, CHUNK_BYTES)
    assert backed_bytes(fd) == 3 * CHUNK_BYTES
    punch(fd, 0, CHUNK_BYTES)
    assert backed_bytes(fd) == 2 * CHUNK_BYTES
    assert os.fstat(fd).st_size == SIZE  # the virtual size stays


def test_ranges_must_be_whole_chunks(fd: int) -> None:
    for offset, length in ((1, CHUNK_BYTES), (0, CHUNK_BYTES + 4096), (0, 0)):
        with pytest.raises(InvalidArgument):
            commit(fd, offset, length)
    r = Reservation(fd, SIZE)
    with pytest.raises(InvalidArgument, match="past the end"):
        r.map(SIZE, CHUNK_BYTES)
    r.close()


def test_a_mapped_chunk_is_shared_and_a_tensor_can_view_it(fd: int) -> None:
    commit(fd, 4 * CHUNK_BYTES, CHUNK_BYTES)
    r = Reservation(fd, SIZE)
    r.map(4 * CHUNK_BYTES, CHUNK_BYTES)
    view = torch.frombuffer((ctypes.c_uint8 * SIZE).from_address(r.address), dtype=torch.uint8)
    chunk = view[4 * CHUNK_BYTES: 5 * CHUNK_BYTES]
    chunk[:8] = torch.arange(1, 9, dtype=torch.uint8)
    out = child(fd, """
        r.map(4 * CHUNK_BYTES, CHUNK_BYTES)
        print(list(ctypes.string_at(r.address + 4 * CHUNK_BYTES, 8)))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(list(range(1, 9)))
    assert backed_bytes(fd) == CHUNK_BYTES  # reading and writing allocated nothing more
    del view, chunk
    r.close()


def test_touching_a_chunk_that_is_not_mapped_faults(fd: int) -> None:
    commit(fd, 0, SIZE)  # even memory that exists: not mapped here means not reachable
    out = child(fd, """
        r.map(0, CHUNK_BYTES)
        ctypes.memset(r.address, 7, 16)             # mapped: fine
        print("mapped ok", flush=True)
        ctypes.memset(r.address + CHUNK_BYTES, 7, 16)  # not mapped: SIGSEGV
        print("not reached", flush=True)
    """)
    assert out.returncode == -signal.SIGSEGV
    assert "mapped ok" in out.stdout and "not reached" not in out.stdout


def test_an_unmapped_chunk_faults_again_and_a_punched_one_reads_zeros_elsewhere(fd: int) -> None:
    commit(fd, 0, CHUNK_BYTES)
    out = child(fd, """
        r.map(0, CHUNK_BYTES)
        ctypes.memset(r.address, 9, 16)
        r.unmap(0, CHUNK_BYTES)
        print("unmapped", flush=True)
        ctypes.memset(r.address, 9, 16)  # faults: the range is no-access again
    """)
    assert out.returncode == -signal.SIGSEGV and "unmapped" in out.stdout
    # A process that did not unmap keeps reading: zeros after the punch, never old bytes.
    r = Reservation(fd, SIZE)
    r.map(0, CHUNK_BYTES)
    assert ctypes.string_at(r.address, 16) == b"\x09" * 16
    punch(fd, 0, CHUNK_BYTES)
    assert ctypes.string_at(r.address, 16) == b"\x00" * 16
    r.close()


def test_group_geometry_takes_whole_chunks_of_every_view() -> None:
    from kvpoold.sharing.sparse_groups import group_geometry

    llama = group_geometry((2048,) * 64, page_size=16, capacity_tokens=327_680)
    assert (llama.tokens, llama.bytes, llama.groups) == (1024, 128 << 20, 320)
    mla = group_geometry((1152,) * 61, page_size=64, capacity_tokens=100_000)
    assert mla.tokens == 16_384 and mla.tokens * 1152 % CHUNK_BYTES == 0
    assert mla.groups == 7
    odd_page = group_geometry((2048,), page_size=3, capacity_tokens=10)
    assert odd_page.tokens == 3072  # lcm(page 3, 1024 tokens a chunk)
    with pytest.raises(InvalidArgument):
        group_geometry((), page_size=16, capacity_tokens=1)


def test_a_group_is_granted_and_released_in_every_view(fd: int) -> None:
    from kvpoold.sharing.sparse_groups import SparseBacking, group_geometry

    geo = group_geometry((2048, 2048, 4096), page_size=16, capacity_tokens=4096)
    assert geo.tokens == 1024 and geo.groups == 4
    offsets, at = [], 0
    for size in geo.view_bytes:
        offsets.append(at)
        at += size
    assert at <= SIZE
    backing = SparseBacking(fd, geo, tuple(offsets))
    backing.grant(2)
    assert backed_bytes(fd) == geo.bytes
    assert [o for o, _ in backing.ranges(2)] == [2 * 2 << 20, (4 + 2) * 2 << 20,
                                                 (8 + 2 * 2) * 2 << 20]
    backing.grant(2)  # idempotent
    backing.release(2)
    assert backed_bytes(fd) == 0 and not backing.granted

"""The sparse backing's holes and their audit (kvpoold.sharing.sparse_groups,
kvpoold.elastic.backing_audit) on a real /dev/shm file and real child processes: a re-granted
group reads zeros, memory put into holes is found, attributed to the process whose page tables
hold it, and freed."""

from __future__ import annotations

import mmap
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvpool.mapping.sparse import CHUNK_BYTES, backed_bytes, commit
from kvpoold.elastic.backing_audit import audit
from kvpoold.sharing.sparse_groups import SparseBacking, group_geometry

# Two views of 64 B a token, page 16: a group is 32,768 tokens, one 2 MiB chunk a view;
# 8 groups; the fixed part is the last chunk of the file.
GEOMETRY = group_geometry((64, 64), page_size=16, capacity_tokens=8 * 32768)
VIEW = GEOMETRY.view_bytes[0]
SIZE = 2 * VIEW + CHUNK_BYTES
FIXED = (2 * VIEW, CHUNK_BYTES)


@pytest.fixture
def backing() -> Iterator[SparseBacking]:
    path = f"/dev/shm/kvpool-test-audit-{secrets.token_hex(4)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        commit(fd, *FIXED)
        yield SparseBacking(fd, GEOMETRY, (0, VIEW), FIXED)
    finally:
        os.close(fd)
        os.unlink(path)


def _fill(m: mmap.mmap, ranges: list[tuple[int, int]], byte: bytes) -> None:
    for offset, length in ranges:
        m[offset:offset + length] = byte * length


def _nonzero_bytes(fd: int, ranges: list[tuple[int, int]]) -> int:
    out = 0
    for offset, length in ranges:
        data = os.pread(fd, length, offset)  # pread of a hole allocates nothing
        out += len(data) - data.count(0)
    return out


def test_a_regranted_group_reads_zero_after_a_stale_mapping_wrote_into_it(
        backing: SparseBacking) -> None:
    m = mmap.mmap(backing.fd, SIZE)  # a process that kept its mapping of the whole file
    backing.grant(3)
    _fill(m, backing.ranges(3), b"\x55")
    backing.release(3)
    assert _nonzero_bytes(backing.fd, backing.ranges(3)) == 0
    _fill(m, backing.ranges(3), b"\xaa")  # after the punch: the pages come back, its bytes
    assert backing.excess_bytes() == GEOMETRY.bytes
    backing.grant(3)
    assert _nonzero_bytes(backing.fd, backing.ranges(3)) == 0
    assert backing.excess_bytes() == 0
    m.close()


def test_holes_are_the_complement_of_the_fixed_part_and_the_granted_groups(
        backing: SparseBacking) -> None:
    with backing.lock:
        assert backing.gaps() == [(0, 2 * VIEW)]
    backing.grant(0)
    backing.grant(5)
    c = CHUNK_BYTES
    with backing.lock:
        assert backing.gaps() == [(c, 4 * c), (6 * c, 2 * c), (VIEW + c, 4 * c),
                                  (VIEW + 6 * c, 2 * c)]
    assert backing.committed_bytes() == FIXED[1] + 2 * GEOMETRY.bytes
    assert backing.excess_bytes() == 0


def test_pages_touched_in_a_hole_are_found_and_punched(backing: SparseBacking) -> None:
    backing.grant(0)
    m = mmap.mmap(backing.fd, SIZE)
    m[VIEW + 3 * CHUNK_BYTES + 4096] = 1  # one page of group 3's second view
    _ = m[6 * CHUNK_BYTES]  # a read of a hole takes a page too
    assert backing.excess_bytes() == 2 * 4096
    with backing.lock:
        gaps = backing.gaps()
        strays = backing.stray_extents(gaps)
        assert strays == [(6 * CHUNK_BYTES, 4096), (VIEW + 3 * CHUNK_BYTES + 4096, 4096)]
        backing.punch_strays(strays)
    assert backing.excess_bytes() == 0
    assert m[6 * CHUNK_BYTES] == 0
    m.close()


def test_memory_committed_into_a_hole_by_fallocate_is_counted_and_punched(
        backing: SparseBacking) -> None:
    commit(backing.fd, 4 * CHUNK_BYTES, CHUNK_BYTES)  # another holder of the file
    assert backing.excess_bytes() == CHUNK_BYTES
    with backing.lock:
        assert backing.stray_extents(backing.gaps()) == []  # tmpfs: untouched = a hole
    found = audit(backing)
    assert found is not None
    assert found.excess_bytes == CHUNK_BYTES and found.touched == {} and found.left_bytes == 0
    assert backed_bytes(backing.fd) == FIXED[1]


# A child maps the file (by /proc/<parent>/fd), touches ``touch`` bytes of group 2's first view
# (or nothing) and waits for a line on stdin.
CHILD = r"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, int(sys.argv[2]))
at, n = int(sys.argv[3]), int(sys.argv[4])
for i in range(at, at + n, 4096):
    m[i] = 7
print("ready", flush=True)
sys.stdin.readline()
"""


def test_the_audit_names_the_process_whose_page_tables_hold_the_stray_pages(
        backing: SparseBacking) -> None:
    backing.grant(0)
    path = f"/proc/{os.getpid()}/fd/{backing.fd}"
    kids = [subprocess.Popen([sys.executable, "-c", CHILD, path, str(SIZE), str(at), str(n)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for at, n in ((2 * CHUNK_BYTES, 5 * 4096), (0, 4096))]  # a stray; group 0 only
    try:
        for kid in kids:
            assert kid.stdout is not None and kid.stdout.readline() == "ready\n"
        assert backing.excess_bytes() == 5 * 4096
        found = audit(backing)
        assert found is not None
        assert found.touched == {kids[0].pid: 5 * 4096}
        assert {kids[0].pid, kids[1].pid} <= found.mappers
        assert found.strays == ((2 * CHUNK_BYTES, 5 * 4096),)
        assert found.left_bytes == 0 and backing.excess_bytes() == 0
        assert audit(backing) is None  # nothing left
    finally:
        for kid in kids:
            kid.kill()
            kid.wait()


def test_a_closed_backing_is_not_audited_or_granted(backing: SparseBacking) -> None:
    commit(backing.fd, 4 * CHUNK_BYTES, CHUNK_BYTES)
    backing.closed = True
    assert audit(backing) is None
    with pytest.raises(Exception, match="closed"):
        backing.grant(1)
    backing.closed = False

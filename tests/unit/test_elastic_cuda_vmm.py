"""The CUDA VMM region of elastic pools, the parts that run without a GPU: the driver error
table, the granularity check, the refusal without cuda-bindings, and the daemon's and the
client's regions over a host stand-in for the VMM calls.

The stand-in (:class:`HostVmm`) keeps each allocation in a real memfd and exports real
descriptors (dups of it), so the tests check what the regions decide: which allocations exist
at which offsets, all or nothing under an out-of-memory in the middle of a group, the order of
the descriptors over a real side socket, and that a client's mapping of offset ``o`` holds the
bytes the daemon wrote at ``o``. The driver calls themselves run only in tests/gpu.
"""

from __future__ import annotations

import asyncio
import enum
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvpool.contract.codec import handle_from_pb, handle_to_pb
from kvpool.contract.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
)
from kvpool.contract.fd_channel import FdAnswer, FdAsk
from kvpool.contract.plan import CHUNK_BYTES, PoolPlan
from kvpool.mapping.cuda_driver import (
    check,
    check_granularity,
    driver_error,
    load_driver,
    uuid_text,
)
from kvpool.mapping.cuda_vmm import CudaVmmRegion, expected_ranges, socket_asker
from kvpoold.elastic.fd_server import FdGrant, FdServer
from kvpoold.sharing.vmm import CudaVmmBacking, check_layout, create_vmm_region
from tests.conftest import REPO
from tests.factories import MiB, llama_8b, plan_for

BASE = 1 << 40  # where the stand-in's reservations start


def small_plan() -> PoolPlan:
    """2 layers of Llama-8B: 4 views (k.0 v.0 k.1 v.1) of 16 MiB, 8 groups of 1,024 tokens
    (each view's share 2 MiB, a group 8 MiB), the 2 MiB fixed part at 64 MiB: 66 MiB."""
    return plan_for(llama_8b(num_layers=2, context_length=4096), budget_bytes=64 * MiB,
                    elastic=True, max_running_requests=4)


class HostVmm:
    """The VMM calls over host memory: an allocation is a memfd, a mapping a record of which
    allocation sits at which address. ``fail_create_at``: the n-th create (from 1) runs out of
    memory."""

    ordinal = 0
    granularity = CHUNK_BYTES

    def __init__(self, fail_create_at: int | None = None) -> None:
        self.fail_create_at = fail_create_at
        self.creates = 0
        self.next_address = BASE
        self.reserved: dict[int, int] = {}
        self.handles: dict[int, int] = {}  # live handle -> its memfd
        self.maps: dict[int, tuple[int, int]] = {}  # address -> (memfd, length)
        self.syncs = 0
        self._next_handle = 1

    def reserve(self, size: int, alignment: int = CHUNK_BYTES) -> int:
        assert size % CHUNK_BYTES == 0 and alignment % self.granularity == 0
        address = self.next_address
        self.reserved[address] = size
        self.next_address += size + alignment
        return address

    def free_address(self, address: int, size: int) -> None:
        assert self.reserved.pop(address) == size
        assert not any(address <= a < address + size for a in self.maps), "mapped inside"

    def _handle(self, memfd: int) -> int:
        h, self._next_handle = self._next_handle, self._next_handle + 1
        self.handles[h] = memfd
        return h

    def create(self, size: int) -> int:
        self.creates += 1
        if self.creates == self.fail_create_at:
            raise driver_error(f"cuMemCreate({size:,} B)", "CUDA_ERROR_OUT_OF_MEMORY", 2)
        fd = os.memfd_create("kvpool-test-vmm", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        os.pwrite(fd, b"\xff" * 16, 0)  # not zero: the region must zero what it grants
        return self._handle(fd)

    def release(self, handle: int) -> None:
        fd = self.handles.pop(handle)
        if all(m != fd for m, _ in self.maps.values()):
            os.close(fd)

    def map(self, address: int, size: int, handle: int) -> None:
        base = next(a for a, s in self.reserved.items() if a <= address < a + s)
        assert address + size <= base + self.reserved[base] and address % CHUNK_BYTES == 0
        assert not any(a < address + size and address < a + n for a, (_, n) in
                       self.maps.items()), "overlapping map"
        fd = self.handles[handle]
        assert os.fstat(fd).st_size == size, "a mapping is a whole allocation"
        self.maps[address] = (fd, size)

    def unmap(self, address: int, size: int) -> None:
        fd, n = self.maps.pop(address)
        assert n == size, "unmap the whole mapping"
        if fd not in self.handles.values() and all(m != fd for m, _ in self.maps.values()):
            os.close(fd)

    def zero(self, address: int, size: int) -> None:
        fd, _ = self.maps[address]
        os.pwrite(fd, bytes(size), 0)

    def synchronize(self) -> None:
        self.syncs += 1

    def export_fd(self, handle: int) -> int:
        return os.dup(self.handles[handle])

    def import_fd(self, fd: int) -> int:
        return self._handle(os.dup(fd))

    # test helpers
    def write(self, address: int, data: bytes) -> None:
        fd, _ = self._mapping_at(address)
        os.pwrite(fd, data, address - self._start(address))

    def read(self, address: int, n: int) -> bytes:
        fd, _ = self._mapping_at(address)
        return os.pread(fd, n, address - self._start(address))

    def _start(self, address: int) -> int:
        return next(a for a, (_, n) in self.maps.items() if a <= address < a + n)

    def _mapping_at(self, address: int) -> tuple[int, int]:
        return self.maps[self._start(address)]

    def mapped_offsets(self, base: int) -> list[tuple[int, int]]:
        return sorted((a - base, n) for a, (_, n) in self.maps.items())


def answer_of(grant: FdGrant) -> FdAnswer:
    """What the side channel answers for ``grant``."""
    return FdAnswer(code="OK", size=grant.size, kind=grant.kind, ranges=grant.ranges)


def placeholder(address: int, nbytes: int, ordinal: int) -> torch.Tensor:
    """The regions' tensor on a host: an empty one (the real one views device memory)."""
    return torch.empty(0, dtype=torch.uint8)


def region(driver: HostVmm, plan: PoolPlan | None = None) -> CudaVmmBacking:
    return create_vmm_region(driver, plan or small_plan(), "tiny", device_uuid="ab-cd",
                             fd_socket="/run/k.sock.fd", tensor_of=placeholder)


class FakeResult(enum.IntEnum):
    """Stand-in for cuda-bindings' CUresult (an IntEnum with the driver's names)."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_ILLEGAL_ADDRESS = 700


# --- pure parts --------------------------------------------------------------------------

def test_driver_results_become_typed_errors_naming_the_call_and_the_result() -> None:
    oom = driver_error("cuMemCreate(2,097,152 B)", "CUDA_ERROR_OUT_OF_MEMORY", 2)
    assert isinstance(oom, ResourceExhausted) and oom.field == "budget"
    assert "cuMemCreate(2,097,152 B) failed: CUDA_ERROR_OUT_OF_MEMORY (2)" in str(oom)
    assert "--budget" in str(oom)
    assert isinstance(driver_error("cuInit", "CUDA_ERROR_NO_DEVICE", 100), FailedPrecondition)
    assert isinstance(driver_error("cuMemMap", "CUDA_ERROR_INVALID_VALUE", 1), InvalidArgument)
    other = driver_error("cuMemUnmap", "CUDA_ERROR_ILLEGAL_ADDRESS", 700, "the context is lost")
    assert isinstance(other, Internal) and str(other).endswith("; the context is lost")


def test_check_unpacks_values_and_raises_on_a_failed_result() -> None:
    assert check("cuMemGetInfo", (FakeResult.CUDA_SUCCESS, 5, 9)) == (5, 9)
    assert check("cuMemCreate", (FakeResult.CUDA_SUCCESS, 42)) == 42
    assert check("cuMemUnmap", (FakeResult.CUDA_SUCCESS,)) is None
    with pytest.raises(ResourceExhausted, match=r"cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"):
        check("cuMemCreate", (FakeResult.CUDA_ERROR_OUT_OF_MEMORY, None))
    with pytest.raises(FailedPrecondition, match="NO_DEVICE"):
        check("cuInit", FakeResult.CUDA_ERROR_NO_DEVICE)


@pytest.mark.parametrize("granularity", [4096, 64 << 10, CHUNK_BYTES])
def test_a_granularity_dividing_a_chunk_is_accepted(granularity: int) -> None:
    check_granularity(granularity)


@pytest.mark.parametrize("granularity", [0, 3 << 20, 4 << 20, 96 << 10])
def test_a_granularity_not_dividing_a_chunk_is_refused(granularity: int) -> None:
    with pytest.raises(FailedPrecondition, match=r"granularity is [\d,]+ B.*2,097,152"):
        check_granularity(granularity, "cuda:0")


def test_without_cuda_bindings_the_refusal_names_the_extra() -> None:
    """In a child whose import of ``cuda`` fails (whatever this environment has installed)."""
    code = textwrap.dedent("""
        import sys
        sys.modules["cuda"] = None  # import cuda... raises ImportError
        from kvpool.contract.errors import FailedPrecondition
        from kvpool.mapping.cuda_driver import CudaDriver, load_driver
        for make in (load_driver, lambda: CudaDriver(0)):
            try:
                make()
            except FailedPrecondition as exc:
                print(exc.code, exc)
    """)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'client'}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("FAILED_PRECONDITION sharing: ")
        assert "pip install 'kvpool[cuda]'" in line and "cuda-bindings" in line


def test_load_driver_here_imports_or_refuses() -> None:
    try:
        drv = load_driver()
    except FailedPrecondition as exc:
        assert "kvpool[cuda]" in str(exc)
    else:
        assert hasattr(drv, "cuMemCreate")


def test_uuid_text_is_torchs_form() -> None:
    raw = bytes(range(16))
    assert uuid_text(raw) == "00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_layout_check_refuses_fixed_plans() -> None:
    fixed = plan_for(llama_8b(num_layers=2, context_length=4096), budget_bytes=64 * MiB,
                     max_running_requests=4)
    with pytest.raises(InvalidArgument, match="not elastic"):
        check_layout(fixed)
    check_layout(small_plan())


# --- the daemon's region -----------------------------------------------------------------

def test_the_fixed_part_is_backed_at_creation_and_groups_on_grant() -> None:
    plan = small_plan()
    e = plan.elastic
    assert e is not None
    vmm = HostVmm()
    r = region(vmm, plan)
    assert r.sharing == "cuda_vmm"
    assert r.handle().device_uuid == "ab-cd" and r.handle().path == "/run/k.sock.fd"
    assert r.handle().size == plan.backing_bytes == 66 * MiB
    assert vmm.reserved == {r.address: plan.backing_bytes}
    assert vmm.mapped_offsets(r.address) == [(e.fixed_offset, e.fixed_bytes)]
    assert r.backed_bytes() == e.fixed_bytes == 2 * MiB
    r.grant(3)
    r.grant(3)  # idempotent
    assert r.granted == {3}
    assert r.backed_bytes() == e.fixed_bytes + e.group_bytes
    assert vmm.mapped_offsets(r.address) == sorted(
        [(e.fixed_offset, e.fixed_bytes), *plan.group_ranges(3)])
    # granted memory reads as zeros even where the allocation held bytes
    assert vmm.read(r.address + plan.group_ranges(3)[0][0], 16) == bytes(16)
    r.release(3)
    r.release(3)
    assert r.backed_bytes() == e.fixed_bytes and vmm.syncs >= 1
    assert vmm.mapped_offsets(r.address) == [(e.fixed_offset, e.fixed_bytes)]
    r.close()
    r.close()
    assert vmm.reserved == {} and vmm.maps == {} and vmm.handles == {}
    with pytest.raises(FailedPrecondition, match="closed"):
        r.grant(1)


def test_out_of_memory_in_the_middle_of_a_group_leaves_nothing_of_it() -> None:
    """The fixed part is create 1; group 2's four views are creates 2..5: the third of them
    (create 4) fails, so the two created before it are unmapped and released."""
    vmm = HostVmm(fail_create_at=4)
    r = region(vmm)
    before = (dict(vmm.maps), dict(vmm.handles), r.backed_bytes())
    with pytest.raises(ResourceExhausted, match="CUDA_ERROR_OUT_OF_MEMORY"):
        r.grant(2)
    assert (vmm.maps, vmm.handles, r.backed_bytes()) == before
    assert r.granted == frozenset()
    r.grant(2)  # the device has room again
    assert r.granted == {2}
    r.close()
    assert vmm.handles == {} and vmm.reserved == {}


def test_out_of_memory_for_the_fixed_part_gives_the_range_back() -> None:
    vmm = HostVmm(fail_create_at=1)
    with pytest.raises(ResourceExhausted):
        region(vmm)
    assert vmm.reserved == {} and vmm.maps == {} and vmm.handles == {}


def test_groups_outside_the_range_and_unmapped_exports_are_refused() -> None:
    vmm = HostVmm()
    r = region(vmm)
    with pytest.raises(InvalidArgument, match="no group 8"):
        r.grant(8)
    r.grant(1)
    with pytest.raises(FailedPrecondition, match=r"groups \[5\] .* not granted \(granted: \[1\]"):
        r.export([1, 5], fixed=False)
    r.close()


def test_export_hands_fresh_descriptors_in_the_channels_order() -> None:
    plan = small_plan()
    e = plan.elastic
    assert e is not None
    vmm = HostVmm()
    r = region(vmm, plan)
    r.grant(5)
    r.grant(1)
    grant = r.export([5, 1], fixed=True)
    try:
        assert isinstance(grant, FdGrant) and grant.owned and grant.kind == "cuda_vmm"
        assert list(grant.ranges) == expected_ranges(plan, (5, 1), True) == [
            (e.fixed_offset, e.fixed_bytes), *plan.group_ranges(5), *plan.group_ranges(1)]
        assert grant.size == plan.backing_bytes and len(grant.fds) == 9
        for fd, (offset, _n) in zip(grant.fds, grant.ranges, strict=True):
            vmm.write(r.address + offset, f"at {offset}".encode())
            assert os.pread(fd, 16, 0).startswith(f"at {offset}".encode())
    finally:
        grant.close()
    r.close()


# --- the client's region -----------------------------------------------------------------

def test_a_client_maps_groups_through_the_side_socket(socket_dir: Path) -> None:
    """The daemon's region behind a real FdServer; the client region (its own stand-in
    driver, as a second process would have) asks over the socket. Each mapped range holds
    what the daemon wrote at that offset; a group the daemon has not granted is refused;
    unmapping gives the client's mappings back."""
    plan = small_plan()
    e = plan.elastic
    assert e is not None
    daemon = HostVmm()
    backing = region(daemon, plan)
    for g in (0, 2, 3):
        backing.grant(g)
    for offset, _n in [(e.fixed_offset, 0), *[r for g in (0, 2, 3) for r in
                                              plan.group_ranges(g)]]:
        daemon.write(backing.address + offset, f"daemon {offset}".encode())

    def authorize(ask: FdAsk, uid: int, pid: int) -> FdGrant:
        return backing.export(ask.groups, ask.fixed)

    async def run() -> None:
        srv = FdServer(socket_dir / "v.sock.fd", authorize)
        await srv.start()
        try:
            await asyncio.to_thread(client_side, str(srv.path))
        finally:
            await srv.close()

    def client_side(path: str) -> None:
        mine = HostVmm()
        mine.next_address = BASE + (1 << 36)  # another process's addresses
        with CudaVmmRegion(mine, plan, socket_asker(path, "tiny", 7, "ab" * 16),
                           tensor_of=placeholder) as client:
            assert client.mapped_groups == frozenset()
            assert mine.mapped_offsets(client.address) == [(e.fixed_offset, e.fixed_bytes)]
            client.ensure_groups([3, 0, 3])
            client.ensure_groups([0])  # already mapped: no ask
            assert client.mapped_groups == {0, 3}
            for g in (0, 3):
                for offset, _n in plan.group_ranges(g):
                    assert mine.read(client.address + offset, 32).startswith(
                        f"daemon {offset}".encode())
            with pytest.raises(FailedPrecondition, match="not granted"):
                client.ensure_groups([2, 4])
            assert client.mapped_groups == {0, 3}  # a refused ask maps nothing
            client.unmap_groups([3, 6])
            assert client.mapped_groups == {0}
            assert mine.mapped_offsets(client.address) == sorted(
                [(e.fixed_offset, e.fixed_bytes), *plan.group_ranges(0)])
        assert mine.maps == {} and mine.reserved == {} and mine.handles == {}

    asyncio.run(run())
    backing.close()
    assert daemon.handles == {} and daemon.maps == {}


def test_a_client_region_asks_in_batches_that_fit_one_answer() -> None:
    """Llama-8B's 64 views: 3 groups per answer (192 descriptors), so 7 groups take 3 asks."""
    plan = plan_for(llama_8b(context_length=4096), budget_bytes=2 << 30, elastic=True,
                    max_running_requests=4)
    e = plan.elastic
    assert e is not None and len(e.views) == 64
    daemon = HostVmm()
    backing = region(daemon, plan)
    asks: list[tuple[tuple[int, ...], bool]] = []

    def ask(groups: tuple[int, ...], fixed: bool) -> tuple[list[int], FdAnswer]:
        asks.append((groups, fixed))
        grant = backing.export(groups, fixed)
        return list(grant.fds), answer_of(grant)

    for g in range(7):
        backing.grant(g)
    client = CudaVmmRegion(HostVmm(), plan, ask, tensor_of=placeholder)
    client.ensure_groups(range(7))
    assert asks == [((), True), ((0, 1, 2), False), ((3, 4, 5), False), ((6,), False)]
    assert client.mapped_groups == set(range(7))
    client.close()
    backing.close()


def test_the_handle_crosses_the_wire_with_its_socket_and_device() -> None:
    vmm = HostVmm()
    r = region(vmm)
    handle = r.handle()
    assert handle_from_pb(handle_to_pb(handle)) == handle
    assert (handle.sharing, handle.path, handle.device_uuid) == ("cuda_vmm", "/run/k.sock.fd",
                                                                 "ab-cd")
    r.close()
    with pytest.raises(FailedPrecondition, match="closed"):
        r.handle()

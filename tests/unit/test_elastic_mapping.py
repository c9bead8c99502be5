"""Client-side mapping of elastic pools (``kvpool.mapping.elastic_map``): the daemon's real sparse
region on /dev/shm, real reservations and mappings, real child processes for the faults.

The plan: llama-3.1-8b, 1 GiB budget, elastic, context 2048, 8 requests. Its 64 K/V views (one
2048-byte page of 1 token each) are cut into groups of 1024 pages: each view's share of a group
is 1024 * 2048 B = 2 MiB, one chunk, so a group is 64 * 2 MiB = 128 MiB and the 1 GiB of views
holds 8 groups; the fixed part (req_to_token) is the last 2 MiB chunk, at offset 1 GiB.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpool.clients.client import map_allocated
from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.plan import CHUNK_BYTES, PoolPlan
from kvpool.contract.records import AttachInfo
from kvpool.mapping.attach import Attachment, region_of
from kvpool.mapping.elastic_map import NO_LEASE, ElasticRegion
from kvpool.mapping.regions import map_region
from kvpool.mapping.sparse import backed_bytes
from kvpoold.hf import load_model
from kvpoold.sharing.shm import ShmBackingFactory, SparseShmBacking
from kvpoold.sizing import make_options, plan
from tests.conftest import PYTHONPATH, REPO
from tests.factories import map_elastic_backing

MODEL = REPO / "tests/data/models/llama-3.1-8b-instruct.json"
GROUP_BYTES = 128 << 20


def elastic_plan() -> PoolPlan:
    spec, _ = load_model(MODEL)
    return plan(spec, make_options(budget_bytes=1 << 30, elastic=True, context_length=2048,
                                   max_running_requests=8))


@pytest.fixture(scope="module")
def pool_plan() -> PoolPlan:
    return elastic_plan()


@pytest.fixture
def backing(shm_dir: Path, pool_plan: PoolPlan) -> Iterator[SparseShmBacking]:
    factory = ShmBackingFactory(shm_dir)
    try:
        b = factory.create_elastic(pool_plan, "p")
        b.grant(0)  # group 0 holds the padding page: always granted
        yield b
    finally:
        factory.close()


def mapped(backing: SparseShmBacking, pool_plan: PoolPlan, groups: tuple[int, ...] = (0,)
           ) -> ElasticRegion:
    return map_elastic_backing(backing, pool_plan, groups)


def child(backing: SparseShmBacking, pool_plan: PoolPlan, body: str
          ) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a child process that mapped the region as ``r`` (groups: ``[0]``)."""
    h = backing.handle()
    code = textwrap.dedent(f"""
        import ctypes, sys
        from kvpool.contract.plan import PoolPlan
        from kvpool.mapping.regions import SharedHandle, map_region
        plan = PoolPlan.from_json(sys.stdin.read())
        r = map_region(SharedHandle("shm_sparse", {h.size}, {h.path!r}), plan.buffers,
                       plan=plan, groups=[0], pool="p")
        def touch(offset):
            ctypes.memset(r.base.data_ptr() + offset, 7, 16)
    """) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    return subprocess.run([sys.executable, "-c", code], input=pool_plan.to_json().decode(),
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_plan_is_what_the_docstring_says(pool_plan: PoolPlan) -> None:
    e = pool_plan.elastic
    assert e is not None
    assert (e.pages_per_group, e.group_bytes, e.groups) == (1024, GROUP_BYTES, 8)
    assert (e.fixed_offset, e.fixed_bytes) == (1 << 30, CHUNK_BYTES)
    assert pool_plan.group_ranges(1)[:2] == [(CHUNK_BYTES, CHUNK_BYTES),
                                             (8 * CHUNK_BYTES + CHUNK_BYTES, CHUNK_BYTES)]


def test_a_granted_group_is_shared_both_ways(backing, pool_plan) -> None:
    backing.grant(1)
    with mapped(backing, pool_plan, (0, 1)) as region:
        assert isinstance(region, ElasticRegion) and region.sharing == "shm_sparse"
        assert region.mapped_groups == {0, 1}
        assert region.size == backing.handle().size
        k5 = region["k.5"]  # the whole virtual range of the view, mapped or not
        assert k5.shape[0] == pool_plan.num_pages + 1
        page = 1024 + 3  # in group 1
        k5[page].view(torch.uint8).fill_(3)
        daemon = backing.tensor
        off = pool_plan.buffer("k.5").offset_bytes + page * 2048
        assert bool((daemon[off:off + 2048] == 3).all())  # the daemon sees the client's write
        daemon[off:off + 16] = 9
        assert region.page("k.5", page).view(torch.uint8).reshape(-1)[:16].tolist() == [9] * 16
        del k5
    gc.collect()
    # Writing the granted groups allocated nothing beyond them and the fixed part.
    assert backed_bytes(backing.fd) == 2 * GROUP_BYTES + CHUNK_BYTES


def test_ensure_pages_maps_exactly_the_groups_of_the_ids(backing, pool_plan) -> None:
    for g in (2, 5):
        backing.grant(g)
    with mapped(backing, pool_plan) as region:
        ids = np.array([2 * 1024 + 7, 5 * 1024, 2 * 1024 + 1023, 5], dtype=np.int32)
        assert region.ensure_pages(ids) == [2, 5]
        assert region.mapped_groups == {0, 2, 5}
        assert region.ensure_pages(ids) == []  # all mapped: no mmap
        chunks = set(region._mapper.reservation.mapped)
        want = {o for g in (0, 2, 5) for o, _ in pool_plan.group_ranges(g)}
        want.add(pool_plan.elastic.fixed_offset)
        assert chunks == want
        assert region.ensure_groups([5, 5, 0]) == []
        with pytest.raises(InvalidArgument, match=r"groups 0\.\.7"):
            region.ensure_pages([8 * 1024])


def test_a_child_touching_a_group_not_mapped_dies_of_sigsegv(backing, pool_plan) -> None:
    backing.grant(3)  # granted, but the child has not mapped it
    before = backed_bytes(backing.fd)
    g3 = pool_plan.group_ranges(3)[0][0]
    out = child(backing, pool_plan, f"""
        touch(0)                   # group 0 of k.0: mapped
        touch({pool_plan.elastic.fixed_offset})  # the fixed part: always mapped
        print("mapped ok", flush=True)
        touch({g3})                # group 3: not mapped here
        print("not reached", flush=True)
    """)
    assert out.returncode == -signal.SIGSEGV, out.stderr
    assert "mapped ok" in out.stdout and "not reached" not in out.stdout
    assert backed_bytes(backing.fd) == before  # the fault allocated nothing


def test_a_child_faults_again_after_unmap_groups(backing, pool_plan) -> None:
    backing.grant(1)
    g1 = pool_plan.group_ranges(1)[5][0]  # view v.2's share of group 1
    out = child(backing, pool_plan, f"""
        assert r.ensure_pages([1024 + 1]) == [1]
        touch({g1})
        assert r.unmap_groups([1, 4]) == [1]  # 4 was not mapped: skipped
        assert r.mapped_groups == {{0}}
        print("unmapped", flush=True)
        touch({g1})
        print("not reached", flush=True)
    """)
    assert out.returncode == -signal.SIGSEGV, out.stderr
    assert "unmapped" in out.stdout and "not reached" not in out.stdout


def test_the_fixed_part_stays_mapped_when_every_group_is_unmapped(backing, pool_plan) -> None:
    out = child(backing, pool_plan, """
        r.unmap_groups(range(8))
        rt = r["req_to_token"]
        rt[7, :4] = 11
        print(rt[7, :4].tolist(), flush=True)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[11, 11, 11, 11]"
    with mapped(backing, pool_plan) as region:  # the daemon's file holds the child's write
        assert region["req_to_token"][7, :4].tolist() == [11] * 4


def test_close_releases_the_reservation_once_no_view_is_left(backing, pool_plan) -> None:
    region = mapped(backing, pool_plan)
    reservation = region._mapper.reservation
    region.close()
    gc.collect()
    assert reservation.address == 0  # no view alive: released at close
    region = mapped(backing, pool_plan)
    reservation = region._mapper.reservation
    kept = region["k.0"]
    region.close()
    assert reservation.address != 0 and not reservation.mapped  # kept view: no access
    del kept
    gc.collect()
    assert reservation.address == 0
    with pytest.raises(FailedPrecondition, match="closed"):
        region.ensure_groups([0])


def test_a_child_touching_a_view_kept_past_close_faults(backing, pool_plan) -> None:
    out = child(backing, pool_plan, """
        kept = r["k.0"]
        kept[0] = 1
        r.close()
        print("closed", flush=True)
        kept[0] = 2
        print("not reached", flush=True)
    """)
    assert out.returncode == -signal.SIGSEGV, out.stderr
    assert "closed" in out.stdout and "not reached" not in out.stdout


def test_map_region_needs_the_elastic_plan(backing, pool_plan) -> None:
    with pytest.raises(InvalidArgument, match="elastic plan"):
        map_region(backing.handle(), pool_plan.buffers)


def test_allocated_pages_are_mapped_in_every_region_of_the_pool(backing, pool_plan) -> None:
    backing.grant(6)
    with mapped(backing, pool_plan) as a, mapped(backing, pool_plan) as b:
        kv, req = np.array([6 * 1024 + 2], np.int32), np.array([3], np.int32)
        map_allocated((a, b), ["req", "kv"], [req, kv])
        assert a.mapped_groups == b.mapped_groups == {0, 6}
        a.page("v.31", 6 * 1024 + 2)[:] = 5
        assert bool((b.page("v.31", 6 * 1024 + 2) == 5).all())


def attach_info(backing: SparseShmBacking, pool_plan: PoolPlan) -> AttachInfo:
    return AttachInfo(pool_plan.fingerprint(), pool_plan, pool_plan.to_json().decode(),
                      backing.handle(), attach_id=7, device="cpu", elastic_groups=(0,))


def test_attach_of_an_elastic_pool_needs_a_lease_and_detaches_when_refused(backing, pool_plan):
    info = attach_info(backing, pool_plan)
    detached: list[int] = []
    with pytest.raises(FailedPrecondition) as err, Attachment(lambda: info, detached.append,
                                                               pool="p"):
        pass
    assert NO_LEASE in str(err.value) and err.value.field == "lease" and detached == [7]


class Registry:
    """What an Attachment needs of a lease to attach an elastic pool (a lease's side of it is
    tested with the real session in test_session.py)."""

    def __init__(self) -> None:
        self.regions: list[ElasticRegion] = []

    def _register_region(self, region: ElasticRegion) -> None:
        self.regions.append(region)
        region.on_close(self.regions.remove)


def test_an_attached_elastic_region_registers_until_it_closes(backing, pool_plan) -> None:
    lease = Registry()
    with Attachment(lambda: attach_info(backing, pool_plan), lambda _id: None, pool="p",
                    lease=lease) as region:  # type: ignore[arg-type]
        assert lease.regions == [region] and region.pool == "p"
        assert region.mapped_groups == {0}
    assert lease.regions == [] and region.closed
    with region_of(attach_info(backing, pool_plan), "p") as again:
        assert isinstance(again, ElasticRegion) and again.pool == "p"



def test_a_cuda_vmm_handle_needs_a_lease_and_the_descriptor_socket(pool_plan) -> None:
    """map_region routes ``cuda_vmm`` (an elastic pool on a GPU) to the VMM mapper, which
    fetches descriptors for a lease from the side socket the handle names: without either it
    refuses before touching CUDA."""
    from kvpool.contract.errors import FailedPrecondition
    from kvpool.contract.shared_handle import SharedHandle
    from kvpool.mapping.regions import map_region

    handle = SharedHandle(sharing="cuda_vmm", size=pool_plan.backing_bytes, device_uuid="GPU-x")
    with pytest.raises(FailedPrecondition, match="under a lease"):
        map_region(handle, pool_plan.buffers, plan=pool_plan, pool="p")
    with pytest.raises(FailedPrecondition, match="descriptor socket"):
        map_region(handle, pool_plan.buffers, plan=pool_plan, pool="p", lease=(1, b"s"))

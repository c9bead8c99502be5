"""Shared-memory backings, the instance lock and orphan sweep, and client-side shm mapping."""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.contract.dtypes import DTYPE_NAMES, ITEMSIZE, DType, itemsize, torch_dtype
from kvpool.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvpool.contract.limits import check_pool_name
from kvpool.mapping.regions import BufferLayout, SharedHandle, map_region, page_rows, page_view
from kvpoold.pools import build_pool
from kvpoold.sharing import InstanceLock, ShmBackingFactory, sweep_orphans
from kvpoold.sharing.shm import free_bytes
from tests.factories import MiB, llama_8b, plan_for

HEX16 = "[0-9a-f]{16}"


@pytest.fixture
def factory(shm_dir: Path) -> Iterator[ShmBackingFactory]:
    f = ShmBackingFactory(shm_dir)
    try:
        yield f
    finally:
        f.close()


def mapped_count(path: Path) -> int:
    """How many mappings of ``path`` this process has (lines of /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(str(path)))


# --- files: name, mode, contents -------------------------------------------------------------


def test_region_file_is_named_for_instance_and_pool_with_mode_0600(factory, shm_dir):
    backing = factory.create(4096, "llama-3.1_8b")
    assert re.fullmatch(rf"kvpool-{factory.instance}-llama-3\.1_8b-{HEX16}", backing.path.name)
    assert backing.path.parent == shm_dir
    st = backing.path.stat()
    assert st.st_mode & 0o777 == 0o600
    assert st.st_uid == os.geteuid()
    lock = factory.lock_path
    assert lock.name == f"kvpool-{factory.instance}.lock"
    assert lock.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted([backing.path.name, lock.name])


@pytest.mark.parametrize("mask", [0o000, 0o377])
def test_modes_are_exactly_0600_whatever_the_umask(shm_dir, mask):
    """umask 0 would allow 0600 as asked; umask 0377 would strip it to 0400: both end at 0600."""
    old = os.umask(mask)
    try:
        with ShmBackingFactory(shm_dir) as f:
            backing = f.create(4096, "p")
            assert backing.path.stat().st_mode & 0o777 == 0o600
            assert f.lock_path.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_region_is_zero_filled_and_sparse(factory):
    """1 MiB via ftruncate: all zeros, exactly 1,048,576 B, and no page backed until touched."""
    backing = factory.create(MiB, "p")
    st = backing.path.stat()
    assert st.st_size == MiB
    assert st.st_blocks == 0  # before anything reads it: tmpfs backs a page on first touch
    t = backing.tensor
    assert t.dtype == torch.uint8 and tuple(t.shape) == (MiB,)
    assert int(t.count_nonzero()) == 0


def test_preallocate_backs_every_page(shm_dir):
    with ShmBackingFactory(shm_dir, preallocate=True) as f:
        backing = f.create(MiB, "p")
        assert backing.path.stat().st_blocks * 512 >= MiB
        assert int(backing.tensor.count_nonzero()) == 0


def test_handle_is_path_and_size(factory):
    backing = factory.create(12288, "p")
    h = backing.handle()
    assert (h.sharing, h.path, h.size) == ("shm", str(backing.path), 12288)
    assert h.ipc_handle == b"" and h.device_uuid == ""


def test_writes_in_the_backing_land_in_the_file(factory):
    backing = factory.create(4096, "p")
    backing.tensor[100:104] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    with open(backing.path, "rb") as fh:
        fh.seek(100)
        assert fh.read(4) == b"\x01\x02\x03\x04"


# --- close -----------------------------------------------------------------------------------


def test_close_unlinks_is_idempotent_and_keeps_existing_views(factory):
    backing = factory.create(4096, "p")
    kept = backing.tensor  # a pool view: keeps the daemon's mapping alive past close()
    backing.close()
    backing.close()
    assert not backing.path.exists()
    kept[0] = 7  # still mapped after the unlink
    assert int(kept[0]) == 7
    with pytest.raises(FailedPrecondition):
        backing.handle()
    with pytest.raises(FailedPrecondition):
        _ = backing.tensor
    assert factory.backings == ()


def test_factory_close_removes_every_file_and_the_lock(shm_dir):
    f = ShmBackingFactory(shm_dir)
    for name in ("a", "b", "c"):
        f.create(8192, name)
    assert len(list(shm_dir.iterdir())) == 4
    f.close()
    f.close()
    assert list(shm_dir.iterdir()) == []
    with pytest.raises(FailedPrecondition):
        f.create(4096, "d")


# --- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["", "A", "Pool", "-x", ".x", "_x", "a/b", "../x", "a b", "a" * 64, "é", "a\x00"]
)
def test_bad_pool_names_are_refused(factory, name):
    with pytest.raises(InvalidArgument) as err:
        factory.create(4096, name)
    assert err.value.field == "pool"


@pytest.mark.parametrize("name", ["a", "0", "qwen3-8b", "llama-3.1_8b", "a" * 63])
def test_good_pool_names(name):
    assert check_pool_name(name) == name


@pytest.mark.parametrize("instance", ["", "a-b", "A", "x" * 33, "a.b"])
def test_bad_instance_names_are_refused(shm_dir, instance):
    with pytest.raises(InvalidArgument):
        ShmBackingFactory(shm_dir, instance)
    assert list(shm_dir.iterdir()) == []


def test_bad_sizes_are_refused(factory):
    for nbytes in (0, -1):
        with pytest.raises(InvalidArgument):
            factory.create(nbytes, "p")


def test_a_live_instance_cannot_be_started_twice(shm_dir):
    with ShmBackingFactory(shm_dir, "d1") as first:
        with pytest.raises(FailedPrecondition, match="held by a live daemon"):
            ShmBackingFactory(shm_dir, "d1")
        assert first.lock_path.exists()


def test_missing_directory_is_refused(shm_dir):
    with pytest.raises(FailedPrecondition, match="does not exist"):
        ShmBackingFactory(shm_dir / "nope")


# --- capacity --------------------------------------------------------------------------------


def test_more_than_the_free_space_is_resource_exhausted(factory, shm_dir):
    want = free_bytes(shm_dir) + MiB
    with pytest.raises(ResourceExhausted) as err:
        factory.create(want, "big")
    msg = str(err.value)
    assert str(shm_dir) in msg and "free" in msg and f"{want:,}" in msg
    assert "--budget" in msg
    assert [p.name for p in shm_dir.iterdir()] == [factory.lock_path.name]


def test_untouched_sparse_regions_still_count_against_free_space(factory, shm_dir):
    """Two sparse regions of 60% of the free space each would overcommit tmpfs: the second
    is refused although statvfs still shows the first one's pages as free."""
    part = int(free_bytes(shm_dir) * 0.6) // 4096 * 4096
    first = factory.create(part, "one")
    with pytest.raises(ResourceExhausted):
        factory.create(part, "two")
    first.close()
    factory.create(part, "two").close()


# --- orphan sweep ----------------------------------------------------------------------------


def fake_dead_daemon(shm_dir: Path, instance: str, pools: tuple[str, ...]) -> list[Path]:
    """Files as a SIGKILLed daemon leaves them: a lock nobody flocks and its regions."""
    paths = [shm_dir / f"kvpool-{instance}.lock"]
    paths += [shm_dir / f"kvpool-{instance}-{p}-{i:016x}" for i, p in enumerate(pools)]
    for p in paths:
        p.write_bytes(b"\0" * 64)
        p.chmod(0o600)
    return paths


def test_sweep_removes_dead_instances_and_keeps_live_and_foreign_files(shm_dir):
    with ShmBackingFactory(shm_dir, "live") as live:
        kept = live.create(4096, "pool")
        dead = fake_dead_daemon(shm_dir, "dead", ("a", "b-c.d"))
        # Same prefix letters as "live" but another instance: must not be confused with it.
        dead += fake_dead_daemon(shm_dir, "liv", ("x",))
        lockless = shm_dir / "kvpool-gone-pool-00000000000000ff"
        lockless.write_bytes(b"x")
        foreign = [shm_dir / n for n in ("kvpool-notes", "kvpool-Bad-x", "other", "kvpool-.lock")]
        for p in foreign:
            p.write_bytes(b"x")

        removed = sweep_orphans(shm_dir)

        assert removed == sorted([*dead, lockless])
        assert kept.path.exists() and live.lock_path.exists()
        assert all(p.exists() for p in foreign)
        assert sweep_orphans(shm_dir) == []


def test_a_new_factory_sweeps_at_start(shm_dir):
    dead = fake_dead_daemon(shm_dir, "dead", ("p",))
    with ShmBackingFactory(shm_dir) as f:
        assert sorted(f.swept) == sorted(dead)
        assert not any(p.exists() for p in dead)


def test_a_stale_lock_of_the_same_instance_is_taken_over(shm_dir):
    """A daemon of the same name that died after our sweep: the lock clears its files."""
    dead = fake_dead_daemon(shm_dir, "d1", ("p",))
    lock = InstanceLock(shm_dir, "d1")
    try:
        assert lock.held and lock.path == dead[0] and lock.path.exists()
        assert not dead[1].exists()
    finally:
        lock.release()
    assert list(shm_dir.iterdir()) == []


def test_sweep_of_a_missing_directory_is_empty(shm_dir):
    assert sweep_orphans(shm_dir / "nope") == []


# --- client mapping, in-process --------------------------------------------------------------


def test_map_region_gives_typed_views_of_the_same_memory(factory):
    """Layout: k (int32, 4x4 = 64 B) at 0, v (bfloat16, 2x8 = 32 B) at 256, in 4096 B."""
    backing = factory.create(4096, "p")
    layout = [BufferLayout("k", "int32", (4, 4), 0, 64),
              BufferLayout("v", "bfloat16", (2, 8), 256, 32)]
    backing.tensor[0:64].view(torch.int32)[:] = torch.arange(16, dtype=torch.int32)
    with map_region(backing.handle(), layout) as region:
        assert set(region) == {"k", "v"} and len(region) == 2
        assert region.device == torch.device("cpu")
        assert torch.equal(region["k"], torch.arange(16, dtype=torch.int32).view(4, 4))
        assert region["v"].dtype == torch.bfloat16 and tuple(region["v"].shape) == (2, 8)
        region["v"][1] = 2.5
        daemon_v = backing.tensor[256:288].view(torch.bfloat16).view(2, 8)
        assert torch.equal(daemon_v[1], torch.full((8,), 2.5, dtype=torch.bfloat16))
    assert region.closed
    with pytest.raises(FailedPrecondition):
        region["k"]


def test_map_region_over_a_built_pool_matches_the_daemon_views(factory):
    """The daemon builds a llama-8B pool (page 16, 32 MiB budget) in shm; the client maps it
    from the handle and the plan's BufferSpecs and sees the same bytes in every view."""
    plan = plan_for(llama_8b(context_length=2048), budget_bytes=32 * MiB, page_size=16)
    pool = build_pool(plan, "cpu", allocate=lambda n, _dev: factory.create(n, "llama").tensor)
    (backing,) = factory.backings
    pool.views["k.3"][16:32] = 1.25
    pool.views["v.31"][-1] = -3.0
    with map_region(backing.handle(), plan.buffers) as region:
        assert set(region) == set(pool.views)
        for name, view in pool.views.items():
            assert region[name].dtype == view.dtype and region[name].shape == view.shape
        assert torch.equal(region["k.3"], pool.views["k.3"])
        assert torch.equal(region["v.31"], pool.views["v.31"])


def test_close_unmaps_the_region(factory):
    backing = factory.create(8192, "p")
    assert mapped_count(backing.path) == 1  # the daemon's own mapping
    region = map_region(backing.handle(), [BufferLayout("b", "uint8", (8192,), 0, 8192)])
    assert mapped_count(backing.path) == 2
    region.close()
    gc.collect()
    assert mapped_count(backing.path) == 1


def test_mapping_outlives_the_unlink(factory):
    backing = factory.create(4096, "p")
    region = map_region(backing.handle(), [BufferLayout("b", "uint8", (4096,), 0, 4096)])
    kept = backing.tensor
    backing.close()
    region["b"][9] = 42
    assert int(kept[9]) == 42
    region.close()


def _one_buffer(size: int) -> list[BufferLayout]:
    return [BufferLayout("b", "uint8", (size,), 0, size)]


def test_map_refuses_a_file_others_can_read(factory):
    backing = factory.create(4096, "p")
    backing.path.chmod(0o644)
    with pytest.raises(PermissionDenied, match="mode 644"):
        map_region(backing.handle(), _one_buffer(4096))


def test_map_refuses_a_size_mismatch(factory):
    backing = factory.create(4096, "p")
    h = SharedHandle(sharing="shm", path=str(backing.path), size=8192)
    with pytest.raises(FailedPrecondition, match="4,096 B, the handle says 8,192 B"):
        map_region(h, _one_buffer(8192))


def test_map_refuses_a_missing_file(shm_dir):
    with pytest.raises(NotFound):
        map_region(SharedHandle("shm", 4096, str(shm_dir / "kvpool-x-p-0")), _one_buffer(4096))


def test_map_refuses_symlinks_directories_and_relative_paths(factory, shm_dir):
    backing = factory.create(4096, "p")
    link = shm_dir / "link"
    link.symlink_to(backing.path)
    with pytest.raises(PermissionDenied):
        map_region(SharedHandle("shm", 4096, str(link)), _one_buffer(4096))
    with pytest.raises(PermissionDenied):
        map_region(SharedHandle("shm", 4096, str(shm_dir)), _one_buffer(4096))
    with pytest.raises(InvalidArgument):
        map_region(SharedHandle("shm", 4096, "kvpool-x"), _one_buffer(4096))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_map_refuses_another_users_file(factory):
    backing = factory.create(4096, "p")
    os.chown(backing.path, 54321, -1)
    with pytest.raises(PermissionDenied, match="owned by uid 54321"):
        map_region(backing.handle(), _one_buffer(4096))


def test_map_refuses_sharing_none_and_unknown_sharings(factory):
    with pytest.raises(FailedPrecondition, match="not shareable"):
        map_region(SharedHandle("none", 4096), _one_buffer(4096))
    with pytest.raises(InvalidArgument, match="unknown sharing"):
        map_region(SharedHandle("nfs", 4096, "/x"), _one_buffer(4096))


@pytest.mark.parametrize(
    ("buf", "field"),
    [
        (BufferLayout("b", "float8", (4,), 0, 4), "buffers[1].dtype"),
        (BufferLayout("b", "int32", (4,), 0, 15), "buffers[1].nbytes"),
        (BufferLayout("b", "int32", (4,), 2, 16), "buffers[1].offset_bytes"),  # misaligned
        (BufferLayout("b", "int32", (4,), 4090, 16), "buffers[1].offset_bytes"),  # past end
        (BufferLayout("a", "uint8", (4,), 0, 4), "buffers[1].name"),  # repeated
        (BufferLayout("b", "uint8", (-4,), 0, 0), "buffers[1].shape"),
    ],
)
def test_bad_layouts_are_refused_naming_the_field(factory, buf, field):
    backing = factory.create(4096, "p")
    with pytest.raises(InvalidArgument) as err:
        map_region(backing.handle(), [BufferLayout("a", "uint8", (4,), 0, 4), buf])
    assert err.value.field == field


# --- pages and dtypes ------------------------------------------------------------------------


def test_page_rows_are_p_times_page_size_to_next_page_minus_one():
    """Page 3 of size 16 holds rows 48..63; page 0 rows 0..15."""
    assert page_rows(3, 16) == slice(48, 64)
    assert page_rows(0, 1) == slice(0, 1)
    for bad in ((-1, 16), (0, 0)):
        with pytest.raises(InvalidArgument):
            page_rows(*bad)


def test_page_view_is_a_view_and_checks_bounds():
    """64 rows with page 16 = pages 0..3; page 3 is rows 48..63, page 4 does not exist."""
    t = torch.zeros(64, 2, dtype=torch.float32)
    page_view(t, 3, 16)[:] = 1.0
    assert int(t[48:64].sum()) == 32 and int(t[:48].sum()) == 0
    with pytest.raises(InvalidArgument, match="4 pages of 16"):
        page_view(t, 4, 16)


def test_client_dtype_table_matches_the_daemon_and_torch():
    assert set(DTYPE_NAMES) == {d.value for d in DType}
    for d in DType:
        assert itemsize(d) == d.itemsize == torch_dtype(d).itemsize
        assert ITEMSIZE[d.value] == d.itemsize
    with pytest.raises(InvalidArgument, match="known: bfloat16"):
        torch_dtype("float8")

"""Attach wiring: one handle type, page addressing, the daemon's backing factory and exports,
and ``client.attach`` against an in-process daemon on shared memory."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvpool.clients.aio import AsyncKVPoolClient
from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.shared_handle import SharedHandle
from kvpool.mapping.regions import BufferLayout, map_region
from kvpoold.access import LOCAL_ADMIN
from kvpoold.server.args import ConfigureArgs
from kvpoold.server.backing_select import make_backing_factory
from kvpoold.server.daemon import Daemon
from kvpoold.server.planning import plan_from_args
from kvpoold.server.run import create_server
from kvpoold.settings import Listener, load_config, resolve
from kvpoold.sharing import PlainBacking, PlainBackingFactory, ShmBackingFactory
from tests.conftest import REPO, TINY_OPTIONS, TINY_SPEC, subprocess_env

MiB = 1 << 20


# -- one handle type ----------------------------------------------------------------------------

def test_there_is_one_handle_type_and_it_needs_no_torch() -> None:
    import kvpool.contract.records
    import kvpool.contract.wire
    import kvpool.mapping.regions
    import kvpoold.sharing
    import kvpoold.sharing.base

    assert kvpoold.sharing.SharedHandle is SharedHandle
    assert kvpoold.sharing.base.SharedHandle is SharedHandle
    assert not hasattr(kvpool.mapping.regions, "RegionHandle")
    assert kvpool.contract.records.AttachInfo.__annotations__["handle"] == "SharedHandle"
    assert not hasattr(kvpool.contract.wire, "RemoteHandle")
    out = subprocess.run(
        [sys.executable, "-c", "import sys, kvpool.contract.shared_handle, kvpool.contract.wire, "
                               "kvpool.clients.client; print('torch' in sys.modules)"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )
    assert out.stdout.strip() == "False", out.stderr


def test_a_proto_handle_converts_both_ways() -> None:
    from kvpool.contract.codec import handle_from_pb as shared_handle
    from kvpool.contract.codec import handle_to_pb as handle_message

    h = SharedHandle(sharing="cuda_ipc", size=4096, device_uuid="abc", ipc_handle=b"\x01c",
                     storage_offset=512, storage_size=8192, ref_counter_handle=b"/rc",
                     ref_counter_offset=3, event_handle=b"ev", event_sync_required=True)
    assert shared_handle(handle_message(h)) == h
    shm = SharedHandle(sharing="shm", size=10, path="/dev/shm/kvpool-a-p-00")
    assert shared_handle(handle_message(shm)) == shm


# -- pages --------------------------------------------------------------------------------------

def tiny_plan(**options: object):  # -> PoolPlan
    return plan_from_args(ConfigureArgs("tiny", spec=TINY_SPEC,
                                        options={**TINY_OPTIONS, **options}), 1 << 30)


def test_page_addresses_one_allocation_unit_of_any_buffer(shm_dir: Path) -> None:
    """TINY_SPEC at page 16: page 3 of k.0 is rows 48..63 (16 rows of [2, 16] bf16); the
    request table's unit (its page_bytes) is one row, so its "page" 5 is row 5. k.0 has
    (256 + 1) pages * 16 = 4,112 rows (ids 0..256, the padding page on top); 257 is refused,
    naming the count."""
    plan = tiny_plan()
    with ShmBackingFactory(shm_dir) as factory:
        backing = factory.create(plan.backing_bytes, "tiny")
        region = map_region(backing.handle(), plan.buffers, plan=plan)
        k0 = region["k.0"]
        assert region.page_size == 16 and k0.shape == (4112, 2, 16)
        region.page("k.0", 3).fill_(1.5)
        assert bool((k0[48:64] == 1.5).all()) and int(k0[:48].count_nonzero()) == 0
        assert int(k0[64:].count_nonzero()) == 0
        r2t = region["req_to_token"]
        assert region.page("req_to_token", 5).shape == (1, r2t.shape[1])
        region.page("req_to_token", 5)[0, :3] = torch.tensor([7, 8, 9], dtype=torch.int32)
        assert r2t[5, :3].tolist() == [7, 8, 9]
        assert region.page("k.0", 256).shape == (16, 2, 16)
        with pytest.raises(InvalidArgument, match=r"257 units of 16 row\(s\)") as info:
            region.page("k.0", 257)
        assert info.value.field == "page_id"
        with pytest.raises(InvalidArgument):
            region.page("k.0", -1)
        with pytest.raises(KeyError):
            region.page("k.9", 0)
        # the daemon's own view of the same bytes
        assert bool((backing.tensor[:4096 * 64].view(torch.bfloat16)[48 * 32:64 * 32] == 1.5)
                    .all())
        region.close()


def test_page_needs_the_layouts_page_bytes(shm_dir: Path) -> None:
    with ShmBackingFactory(shm_dir) as factory:
        backing = factory.create(4096, "p")
        no_pages = map_region(backing.handle(), [BufferLayout("b", "uint8", (64, 64), 0, 4096)])
        with pytest.raises(InvalidArgument, match="without page_bytes"):
            no_pages.page("b", 0)
        paged = map_region(backing.handle(),
                           [BufferLayout("b", "uint8", (64, 64), 0, 4096, page_bytes=256)])
        assert paged.page("b", 15).shape == (4, 64)
        with pytest.raises(InvalidArgument, match="not a whole number"):
            map_region(backing.handle(),
                       [BufferLayout("b", "uint8", (64, 64), 0, 4096, page_bytes=100)])


# -- the daemon's factory -----------------------------------------------------------------------

def test_cpu_gets_shared_memory_and_the_sweep_runs_first(shm_dir: Path) -> None:
    """Files of a dead instance (a lock nobody flocks, and its region) are gone once the
    factory exists; a live one holds its own lock until closed."""
    (shm_dir / "kvpool-dead.lock").write_bytes(b"")
    os.chmod(shm_dir / "kvpool-dead.lock", 0o600)
    (shm_dir / "kvpool-dead-pool-0011").write_bytes(b"x")
    settings = resolve({"shm_dir": str(shm_dir), "shm_preallocate": True}, None)
    factory = make_backing_factory(settings)
    try:
        assert isinstance(factory, ShmBackingFactory) and factory.preallocate
        assert sorted(p.name for p in factory.swept) == ["kvpool-dead-pool-0011",
                                                         "kvpool-dead.lock"]
        assert [p.name for p in shm_dir.iterdir()] == [factory.lock_path.name]
    finally:
        factory.close()
    assert list(shm_dir.iterdir()) == []


def test_sharing_none_gives_plain_memory(shm_dir: Path) -> None:
    factory = make_backing_factory(resolve({"sharing": "none", "shm_dir": str(shm_dir)}, None))
    assert isinstance(factory, PlainBackingFactory)
    assert list(shm_dir.iterdir()) == []


def test_a_missing_shm_dir_is_a_bad_setting(shm_dir: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist") as info:
        make_backing_factory(resolve({"shm_dir": str(shm_dir / "nope")}, None))
    assert info.value.field == "shm_dir"


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_cuda_refuses_expandable_segments_as_a_bad_setting(
        var: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """InvalidArgument (exit 2 from ``kvpoold serve``), before CUDA is asked anything."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv(var, "max_split_size_mb:64,expandable_segments:True")
    with pytest.raises(InvalidArgument, match="pytorch#165685") as info:
        make_backing_factory(resolve({"device": "cuda:0"}, None))
    assert info.value.field == var


def test_sharing_settings_from_toml_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "kvpoold.toml"
    path.write_text('sharing = "none"\nshm_preallocate = true\n')
    config = load_config(path)
    s = resolve({}, config)
    assert (s.sharing, s.shm_preallocate) == ("none", True)
    s = resolve({"sharing": "auto"}, config)
    assert (s.sharing, s.shm_preallocate) == ("auto", True)
    assert (resolve({}, None).sharing, resolve({}, None).shm_preallocate) == ("auto", False)
    with pytest.raises(InvalidArgument) as info:
        resolve({"sharing": "cuda"}, None)
    assert info.value.field == "sharing"
    path.write_text('sharing = "maybe"\n')
    with pytest.raises(InvalidArgument, match=r"\$.sharing"):
        load_config(path)


# -- the daemon exports per Attach --------------------------------------------------------------

@dataclass
class CountingFactory:
    """Plain memory whose backings count handle() calls (the CUDA IPC export's contract)."""

    exports: list[int] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def create(self, nbytes: int, pool_name: str) -> PlainBacking:
        exports = self.exports

        class Counting(PlainBacking):
            def handle(self) -> SharedHandle:
                exports.append(1)
                return super().handle()

        return Counting(torch.zeros(nbytes, dtype=torch.uint8))

    def close(self) -> None:
        return None


async def test_attach_exports_a_fresh_handle_each_time_and_build_exports_none() -> None:
    """A CUDA IPC export serves one importer: Configure and Stats export nothing, each
    Attach exactly one."""
    factory = CountingFactory()
    daemon = Daemon("cpu", 64 * MiB, factory)
    await daemon.configure(LOCAL_ADMIN, ConfigureArgs("tiny", spec=TINY_SPEC,
                                                      options=TINY_OPTIONS))
    daemon.stats(LOCAL_ADMIN)
    assert factory.exports == []
    a, b = daemon.attach(LOCAL_ADMIN, "tiny"), daemon.attach(LOCAL_ADMIN, "tiny")
    assert len(factory.exports) == 2 and a.attach_id != b.attach_id
    assert daemon.stats(LOCAL_ADMIN).pools[0].sharing == "none"
    daemon.close()


# -- client.attach against an in-process daemon on shared memory --------------------------------

@pytest.fixture
async def served_shm(socket_dir: Path, shm_dir: Path) -> AsyncIterator[tuple[Daemon, str]]:
    daemon = Daemon("cpu", 64 * MiB, ShmBackingFactory(shm_dir))
    server = create_server(daemon, [Listener("unix", str(socket_dir / "k.sock"))])
    await server.start()
    try:
        yield daemon, f"unix://{socket_dir / 'k.sock'}"
    finally:
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()


async def test_attach_views_are_the_daemons_memory(served_shm: tuple[Daemon, str]) -> None:
    """A write through the client's view is in the daemon's own pool view (one memory), the
    attachment is counted while the block runs and ended after it."""
    daemon, target = served_shm
    async with AsyncKVPoolClient(target) as client:
        result = await client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        async with client.attach("tiny", result.fingerprint) as region:
            assert region.sharing == "shm" and region.device == torch.device("cpu")
            assert region.plan == result.plan and region.attach_id
            region.page("v.1", 2).fill_(-4.0)
            assert daemon.attachments.count_pool("tiny") == 1
            theirs = daemon.pools["tiny"].buffers.views["v.1"]
            assert bool((theirs[32:48] == -4.0).all()) and int(theirs[:32].count_nonzero()) == 0
        assert region.closed and daemon.attachments.count_pool("tiny") == 0


async def test_a_body_error_is_not_hidden_by_a_failed_detach(
        served_shm: tuple[Daemon, str]) -> None:
    target = served_shm[1]
    async with AsyncKVPoolClient(target, timeout_s=2.0) as client:
        await client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        with pytest.raises(ZeroDivisionError) as info:
            async with client.attach("tiny") as region:
                await client.close()  # Detach at exit will fail: no channel
                region["k.0"][0] = 1.0
                _ = 1 / 0
        notes = getattr(info.value, "__notes__", [])
        assert len(notes) == 1 and "detach of attachment" in notes[0]


async def test_an_unshareable_pool_is_refused_and_not_left_attached(socket_dir: Path) -> None:
    daemon = Daemon("cpu", 64 * MiB, PlainBackingFactory(torch.device("cpu")))
    server = create_server(daemon, [Listener("unix", str(socket_dir / "k.sock"))])
    await server.start()
    try:
        async with AsyncKVPoolClient(f"unix://{socket_dir / 'k.sock'}") as client:
            await client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
            with pytest.raises(FailedPrecondition, match="--sharing none") as info:
                async with client.attach("tiny"):
                    pass
            assert info.value.field == "sharing"
            assert daemon.attachments.count_pool("tiny") == 0
    finally:
        await server.shutdown(0)
        server.remove_sockets()
        daemon.close()

"""Elastic pools on a GPU (sharing ``cuda_vmm``): the daemon's region of CUDA VMM allocations,
its descriptors over the real side socket, a child process mapping them (needs a GPU and
cuda-bindings).

The child is a fresh interpreter (as ``spawn`` gives), an engine in all but name: it gets the
side socket's path, the plan as JSON and the device UUID, maps the fixed part and the groups
it is told to with ``kvpool.mapping.cuda_vmm`` and checks the daemon's bytes on the device.
Skipped without CUDA or without cuda-bindings; see tests/gpu/README.md.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from kvpool.contract.errors import ResourceExhausted
from kvpool.contract.fd_channel import FdAsk
from kvpool.contract.plan import CHUNK_BYTES, PoolPlan
from kvpoold.elastic.fd_server import FdGrant, FdServer
from kvpoold.sharing import CudaIpcBackingFactory
from kvpoold.sharing.vmm import CudaVmmBacking
from tests.factories import GiB, llama_8b, plan_for
from tests.procs import Child

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("cuda") is None
                       or importlib.util.find_spec("cuda.bindings") is None,
                       reason="needs cuda-bindings (pip install 'kvpool[cuda]')"),
]

SECRET = "ab" * 16
POOL = "vmm"

# The child: map the region, then obey "map [groups]", "check {offset: byte}", "write
# offset byte", "unmap [groups]", "close".
ENGINE = r"""
import torch
from kvpool.contract.plan import PoolPlan
from kvpool.mapping.cuda_vmm import open_vmm_region, socket_asker

first = recv()
plan = PoolPlan.from_json(first["plan"])
region = open_vmm_region(first["uuid"], plan, socket_asker(first["path"], first["pool"], 7,
                                                           first["secret"]))
t = region.tensor
send({"device": str(t.device), "groups": sorted(region.mapped_groups)})
while True:
    cmd = recv()
    op = cmd["op"]
    if op == "map":
        region.ensure_groups(cmd["groups"])
        send(sorted(region.mapped_groups))
    elif op == "check":
        bad = []
        for offset, (length, value) in cmd["ranges"].items():
            view = t[int(offset):int(offset) + length]
            if not bool((view == value).all()):
                bad.append(int(offset))
        send(bad)
    elif op == "write":
        t[cmd["offset"]:cmd["offset"] + cmd["length"]].fill_(cmd["value"])
        torch.cuda.synchronize()
        send("written")
    elif op == "unmap":
        region.unmap_groups(cmd["groups"])
        send(sorted(region.mapped_groups))
    elif op == "close":
        del t
        region.close()
        region.driver.close()
        send("closed")
        break
"""


def small_plan(budget_bytes: int = 1 * GiB) -> PoolPlan:
    """Llama-8B's 64 K/V views, 1,024-token groups of 128 MiB (2 MiB a view), 8 of them for
    1 GiB, and the 2 MiB fixed part: 64 descriptors a group, so three groups fill an answer."""
    return plan_for(llama_8b(context_length=4096), budget_bytes=budget_bytes, elastic=True,
                    max_running_requests=4)


def value_at(offset: int) -> int:
    """The byte the daemon writes into the chunk at ``offset`` (never 0, so zeros show)."""
    return 1 + (offset // CHUNK_BYTES) % 250


@pytest.fixture
def factory() -> Iterator[CudaIpcBackingFactory]:
    with CudaIpcBackingFactory("cuda:0") as f:
        yield f


@pytest.fixture
async def served(factory: CudaIpcBackingFactory, socket_dir: Path
                 ) -> AsyncIterator[tuple[CudaVmmBacking, FdServer]]:
    backing = factory.create_elastic(small_plan(), POOL)

    def authorize(ask: FdAsk, uid: int, pid: int) -> FdGrant:
        assert ask.pool == POOL and ask.lease_id == 7 and ask.secret == SECRET
        return backing.export(ask.groups, ask.fixed)

    srv = FdServer(socket_dir / "k.sock.fd", authorize)
    await srv.start()
    try:
        yield backing, srv
    finally:
        await srv.close()
        backing.close()


def mem_free() -> int:
    free, _total = torch.cuda.mem_get_info(0)
    return free


async def ask(child: Child, obj: object) -> object:
    child.send(obj)
    return await asyncio.to_thread(child.recv)


async def test_a_child_maps_granted_groups_and_the_daemon_takes_one_back(
        served: tuple[CudaVmmBacking, FdServer]) -> None:
    backing, srv = served
    plan = backing.plan
    e = plan.elastic
    assert e is not None
    assert backing.backed_bytes() == e.fixed_bytes
    for g in (0, 1, 2, 5):
        backing.grant(g)
    assert backing.backed_bytes() == e.fixed_bytes + 4 * e.group_bytes
    t = backing.tensor
    assert t.device.type == "cuda" and t.numel() == plan.backing_bytes
    ranges = [(e.fixed_offset, e.fixed_bytes)] + [r for g in (0, 1, 2, 5)
                                                  for r in plan.group_ranges(g)]
    for offset, length in ranges:
        assert bool((t[offset:offset + length] == 0).all())  # granted memory reads zero
        t[offset:offset + length].fill_(value_at(offset))
    torch.cuda.synchronize()

    with Child(ENGINE, timeout_s=120) as child:
        child.send({"path": str(srv.path), "plan": plan.to_json().decode(), "pool": POOL,
                    "uuid": backing.device_uuid, "secret": SECRET})
        first = await asyncio.to_thread(child.recv)
        assert first == {"device": "cuda:0", "groups": []}
        # four groups: 256 descriptors, more than one answer carries, so two asks
        assert await ask(child, {"op": "map", "groups": [0, 1, 2, 5]}) == [0, 1, 2, 5]
        check = {str(o): (n, value_at(o)) for o, n in ranges}
        assert await ask(child, {"op": "check", "ranges": check}) == []
        # the child's write lands in the daemon's memory
        g1 = plan.group_ranges(1)[7]
        assert await ask(child, {"op": "write", "offset": g1[0], "length": g1[1],
                                 "value": 0x5A}) == "written"
        torch.cuda.synchronize()
        assert bool((t[g1[0]:g1[0] + g1[1]] == 0x5A).all())
        assert srv.answered == 3 and srv.refused == 0

        # released while the child still maps it: the memory stays until it unmaps
        free_before = mem_free()
        backing.release(5)
        assert backing.backed_bytes() == e.fixed_bytes + 3 * e.group_bytes
        assert mem_free() < free_before + e.group_bytes // 2
        assert await ask(child, {"op": "unmap", "groups": [5]}) == [0, 1, 2]
        assert mem_free() >= free_before + e.group_bytes - 4 * CHUNK_BYTES

        # unmapped by the child first, then released: the memory comes back at once
        assert await ask(child, {"op": "unmap", "groups": [2]}) == [0, 1]
        free_before = mem_free()
        backing.release(2)
        assert mem_free() >= free_before + e.group_bytes - 4 * CHUNK_BYTES
        assert backing.backed_bytes() == e.fixed_bytes + 2 * e.group_bytes

        del check[str(plan.group_ranges(1)[7][0])]  # the child's write
        still = {k: v for k, v in check.items()
                 if any(int(k) == o for g in (0, 1) for o, _ in plan.group_ranges(g))
                 or int(k) == e.fixed_offset}
        assert await ask(child, {"op": "check", "ranges": still}) == []
        assert await ask(child, {"op": "close"}) == "closed"
        child.wait_ok()
    del t


async def test_a_refused_group_raises_in_the_client(
        served: tuple[CudaVmmBacking, FdServer]) -> None:
    backing, srv = served
    backing.grant(0)
    code = ENGINE.replace('region.ensure_groups(cmd["groups"])', """try:
            region.ensure_groups(cmd["groups"])
        except Exception as exc:
            send({"error": type(exc).__name__, "message": str(exc)})
            continue""")
    with Child(code, timeout_s=120) as child:
        child.send({"path": str(srv.path), "plan": backing.plan.to_json().decode(),
                    "pool": POOL, "uuid": backing.device_uuid, "secret": SECRET})
        await asyncio.to_thread(child.recv)
        reply = await ask(child, {"op": "map", "groups": [0, 3]})
        assert isinstance(reply, dict) and reply["error"] == "FailedPrecondition"
        assert "not granted" in reply["message"]
        assert await ask(child, {"op": "map", "groups": [0]}) == [0]
        assert await ask(child, {"op": "close"}) == "closed"
        child.wait_ok()


def test_close_gives_all_memory_back(factory: CudaIpcBackingFactory) -> None:
    plan = small_plan()
    e = plan.elastic
    assert e is not None
    torch.cuda.synchronize()
    free_before = mem_free()
    backing = factory.create_elastic(plan, POOL)
    for g in range(4):
        backing.grant(g)
    assert mem_free() <= free_before - 4 * e.group_bytes
    backing.close()
    assert mem_free() >= free_before - 4 * CHUNK_BYTES
    assert factory.backings == ()


@pytest.mark.timeout(600)
def test_out_of_device_memory_is_resource_exhausted_and_leaves_the_group_out(
        factory: CudaIpcBackingFactory) -> None:
    """A region larger than the device: grants succeed until the memory runs out, the one
    that fails is ResourceExhausted and holds nothing, and the granted ones still work."""
    _free, total = torch.cuda.mem_get_info(0)
    plan = plan_for(llama_8b(num_layers=2, context_length=4096),
                    budget_bytes=total + 8 * GiB, elastic=True, max_running_requests=4)
    e = plan.elastic
    assert e is not None
    backing = factory.create_elastic(plan, POOL)
    try:
        granted = 0
        with pytest.raises(ResourceExhausted, match="CUDA_ERROR_OUT_OF_MEMORY"):
            for g in range(e.groups):
                backing.grant(g)
                granted += 1
        assert 0 < granted < e.groups
        assert backing.granted == set(range(granted))
        assert backing.backed_bytes() == e.fixed_bytes + granted * e.group_bytes
        for g in range(granted - 1, granted // 2, -1):
            backing.release(g)
        backing.grant(granted - 1)  # room again
    finally:
        backing.close()

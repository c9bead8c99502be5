"""The vLLM integration's environment contract (``kvpool.integrations.vllm.engine_core_binding``):
it imports no vLLM, so it is tested here, against a real daemon where it connects."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvpool import KVPoolClient
from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.integrations.vllm.engine_core_binding import (
    DEFAULT_TTL_S,
    VLLMBinding,
    binding_from_env,
)
from tests.conftest import REPO, TINY_OPTIONS, TINY_SPEC, DaemonProcess


def test_binding_imports_neither_vllm_nor_torch() -> None:
    """``import kvpool.integrations.vllm.engine_core_binding`` works without vLLM and loads no
    torch (a fresh interpreter, this checkout's client on its path)."""
    code = ("import sys, kvpool.integrations.vllm, kvpool.integrations.vllm.engine_core_binding; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(REPO / "client")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out


def test_pool_must_be_named() -> None:
    with pytest.raises(FailedPrecondition, match="KVPOOL_POOL is not set") as info:
        binding_from_env({"KVPOOL_TARGET": "unix:///tmp/x.sock"})
    assert "vLLM engine" in str(info.value) and "unix:///tmp/x.sock" in str(info.value)


def test_ttl_is_checked_before_connecting() -> None:
    with pytest.raises(InvalidArgument, match="KVPOOL_LEASE_TTL_S='soon'"):
        binding_from_env({"KVPOOL_POOL": "p", "KVPOOL_LEASE_TTL_S": "soon"})


def test_binding_from_env_holds_one_vllm_lease_and_closes_it(kvpoold: DaemonProcess) -> None:
    binding = binding_from_env({"KVPOOL_TARGET": kvpoold.target, "KVPOOL_POOL": "vbind"})
    assert isinstance(binding, VLLMBinding)
    assert binding.pool == "vbind" and binding.ttl_s == DEFAULT_TTL_S
    assert binding.lease_name == f"vllm@{socket.gethostname()}:{os.getpid()}"
    assert not binding.lease_open  # lazily opened
    binding.client.configure("vbind", spec=TINY_SPEC, **TINY_OPTIONS)
    lease = binding.lease
    assert binding.lease is lease and binding.lease_open
    lease.allocate("vbind", "kv", 2)
    closed: list[str] = []
    binding.on_close(lambda: closed.append("cache"))
    binding.close_at_exit()
    with KVPoolClient(kvpoold.target) as other:
        mine = [s for s in other.stats("vbind").leases if s.lease_id == lease.lease_id]
        assert len(mine) == 1 and mine[0].held == {"vbind": {"kv": 2}}
        assert mine[0].name == binding.lease_name
        binding.close()
        assert closed == ["cache"] and not binding.lease_open
        stats = other.stats("vbind")
        assert all(s.lease_id != lease.lease_id for s in stats.leases)
        assert stats.pool("vbind").spaces["kv"].used == 0
        other.drop("vbind")
    binding.close()  # idempotent

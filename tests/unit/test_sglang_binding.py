"""The SGLang integration's environment contract
(``kvpool.integrations.sglang.scheduler_binding``): it imports no SGLang, so it is tested here,
against a real daemon where it connects."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool import KVPoolClient
from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.integrations.sglang.scheduler_binding import (
    DEFAULT_TTL_S,
    ElasticSettings,
    binding_from_env,
    binding_of,
    elastic_from,
    target_for_this_gpu,
    ttl_from,
)
from tests.conftest import TINY_OPTIONS, TINY_SPEC, DaemonProcess


def test_ttl_is_read_and_bounded() -> None:
    assert ttl_from({}) == DEFAULT_TTL_S
    assert ttl_from({"KVPOOL_LEASE_TTL_S": " 2.5 "}) == 2.5
    with pytest.raises(InvalidArgument, match="KVPOOL_LEASE_TTL_S='ten': expected seconds"):
        ttl_from({"KVPOOL_LEASE_TTL_S": "ten"})
    with pytest.raises(InvalidArgument, match=r"between 0\.1 and 3600"):
        ttl_from({"KVPOOL_LEASE_TTL_S": "0"})


def test_elastic_settings_from_env() -> None:
    assert elastic_from({}) is None
    assert elastic_from({"KVPOOL_ELASTIC": "0", "KVPOOL_ELASTIC_FLOOR_TOKENS": "64"}) is None
    assert elastic_from({"KVPOOL_ELASTIC": "1"}) == ElasticSettings()
    assert ElasticSettings().options() == {"elastic": True}
    got = elastic_from({"KVPOOL_ELASTIC": "true", "KVPOOL_ELASTIC_FLOOR_TOKENS": "512",
                        "KVPOOL_ELASTIC_CAP_TOKENS": "4096", "KVPOOL_ELASTIC_WEIGHT": "2.5"})
    assert got == ElasticSettings(floor_tokens=512, cap_tokens=4096, weight=2.5)
    assert got is not None and got.options() == {
        "elastic": True, "elastic_floor_tokens": 512, "elastic_cap_tokens": 4096,
        "elastic_weight": 2.5}
    with pytest.raises(InvalidArgument, match="KVPOOL_ELASTIC='yes': expected 1 or 0"):
        elastic_from({"KVPOOL_ELASTIC": "yes"})
    with pytest.raises(InvalidArgument, match="KVPOOL_ELASTIC_CAP_TOKENS='-1': must be"):
        elastic_from({"KVPOOL_ELASTIC": "1", "KVPOOL_ELASTIC_CAP_TOKENS": "-1"})
    with pytest.raises(InvalidArgument, match="KVPOOL_ELASTIC_WEIGHT='heavy': expected"):
        elastic_from({"KVPOOL_ELASTIC": "1", "KVPOOL_ELASTIC_WEIGHT": "heavy"})
    with pytest.raises(InvalidArgument, match="FLOOR_TOKENS=900 is above"):
        elastic_from({"KVPOOL_ELASTIC": "1", "KVPOOL_ELASTIC_FLOOR_TOKENS": "900",
                      "KVPOOL_ELASTIC_CAP_TOKENS": "512"})


def test_gpu_placeholder() -> None:
    assert target_for_this_gpu("unix:///run/kvpool/gpu{gpu}.sock", 3) == \
        "unix:///run/kvpool/gpu3.sock"
    assert target_for_this_gpu("unix:///run/kvpool/gpu{gpu}.sock") == \
        "unix:///run/kvpool/gpu0.sock"  # no CUDA here
    assert target_for_this_gpu("localhost:50051", 3) == "localhost:50051"


def test_pool_must_be_named() -> None:
    with pytest.raises(FailedPrecondition, match="KVPOOL_POOL is not set") as info:
        binding_from_env({"KVPOOL_TARGET": "unix:///tmp/x.sock"})
    assert "unix:///tmp/x.sock" in str(info.value)


def test_binding_from_env_holds_one_lease_and_closes_it(kvpoold: DaemonProcess,
                                                        tmp_path: Path) -> None:
    binding = binding_from_env({"KVPOOL_TARGET": kvpoold.target, "KVPOOL_POOL": "bind",
                                "KVPOOL_LEASE_TTL_S": "5"})
    assert binding.pool == "bind" and binding.ttl_s == 5.0
    binding.client.configure("bind", spec=TINY_SPEC, **TINY_OPTIONS)
    lease = binding.lease
    assert binding.lease is lease  # one lease per scheduler
    lease.allocate("bind", "kv", 3)
    closed: list[str] = []
    binding.on_close(lambda: closed.append("first"))
    binding.on_close(lambda: closed.append("second"))

    class Pool:
        kvpool_binding = binding

    assert binding_of(Pool()) is binding and binding_of(object()) is None
    with KVPoolClient(kvpoold.target) as other:
        assert any(s.lease_id == lease.lease_id and s.held == {"bind": {"kv": 3}}
                   for s in other.stats("bind").leases)
        binding.close()
        assert closed == ["second", "first"]  # last in, first out
        stats = other.stats("bind")
        assert all(s.lease_id != lease.lease_id for s in stats.leases)
        assert stats.pool("bind").spaces["kv"].used == 0
        other.drop("bind")
    binding.close()  # idempotent

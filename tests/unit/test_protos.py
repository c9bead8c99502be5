"""The committed stubs in client/kvpool/v1/ are exactly what the pinned generator makes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_generator() -> ModuleType:
    path = REPO / "protos" / "generate.py"
    spec = importlib.util.spec_from_file_location("kvpool_protos_generate", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    """Regenerate into a temp dir; every stub must equal the committed file byte for byte."""
    pytest.importorskip("grpc_tools")
    generate = _load_generator()
    paths = generate.generate(tmp_path)
    assert len(paths) == 3
    for path in paths:
        committed = REPO / "client" / "kvpool" / "v1" / path.name
        assert committed.exists(), f"{committed} is missing: run python protos/generate.py"
        assert path.read_bytes() == committed.read_bytes(), (
            f"{committed.name} differs from the proto: run python protos/generate.py"
        )


def test_grpc_stub_imports_the_package_path() -> None:
    """The grpc module imports ``kvpool.v1.kvpool_pb2`` (not a top-level ``kvpool_pb2``)."""
    from kvpool.v1 import kvpool_pb2, kvpool_pb2_grpc

    assert kvpool_pb2_grpc.kvpool_dot_v1_dot_kvpool__pb2 is kvpool_pb2
    assert kvpool_pb2.DESCRIPTOR.package == "kvpool.v1"
    names = [m.name for m in kvpool_pb2.DESCRIPTOR.services_by_name["KVPool"].methods]
    assert names == [
        "Configure", "OpenLease", "KeepAlive", "CloseLease", "Allocate", "Free", "Stats",
        "WatchStats", "Drop", "Attach", "Detach",
    ]

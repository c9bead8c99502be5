"""The committed stubs in client/kvpool/v1/ are exactly what the pinned generator makes."""

from __future__ import annotations

import importlib.util
import subprocess
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
    """Regenerate into a temp dir; every stub must equal the committed file byte for byte.

    protoc runs in a child process: grpc_tools' compiler and NIXL's bundled protobuf/gRPC
    libraries crash one process that loads both (kvpool[nixl] is installed beside the tests).
    """
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed")
    proc = subprocess.run([sys.executable, str(REPO / "protos" / "generate.py"), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    paths = [Path(line) for line in proc.stdout.split()]
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
        "WatchStats", "Drop", "Attach", "Detach", "GrantReceive", "Send", "WaitTransfer",
        "PeerReceive", "PeerDone", "CancelGrant", "Seal", "Unseal", "Adopt", "Sealed",
    ]

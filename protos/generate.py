"""Regenerate the Python stubs of ``kvpool/v1/kvpool.proto`` into ``client/`` (or another root).

Run ``python protos/generate.py`` after editing the proto, with the pinned grpcio-tools 1.85.1
(the stubs check the protobuf runtime version at import, so generator and runtime go together).
``tests/unit/test_protos.py`` regenerates into a temporary directory and compares.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PROTO = "kvpool/v1/kvpool.proto"
STUBS = ("kvpool_pb2.py", "kvpool_pb2.pyi", "kvpool_pb2_grpc.py")
PINNED_TOOLS = "1.85.1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc on the proto, writing ``<out_root>/kvpool/v1/kvpool_pb2{,_grpc}.py`` and ``.pyi``.

    Args:
        out_root: the package root the stubs go under (``client/`` for the committed ones).

    Returns:
        The paths of the generated files.

    Raises:
        RuntimeError: when grpcio-tools is not the pinned version or protoc fails.
    """
    from importlib.metadata import version

    from grpc_tools import protoc

    tools = version("grpcio-tools")
    if tools != PINNED_TOOLS:
        raise RuntimeError(
            f"grpcio-tools {tools} is installed; the stubs are made with {PINNED_TOOLS} "
            f"(pip install grpcio-tools=={PINNED_TOOLS})"
        )
    out_dir = out_root / "kvpool" / "v1"
    out_dir.mkdir(parents=True, exist_ok=True)
    # -I protos makes the generated grpc module import `kvpool.v1.kvpool_pb2`, the package path.
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(PROTO_ROOT / PROTO),
        ]
    )
    if status != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {status})")
    paths = [out_dir / name for name in STUBS]
    grpc_file = out_dir / "kvpool_pb2_grpc.py"
    text = grpc_file.read_text()
    expected = "from kvpool.v1 import kvpool_pb2 as kvpool_dot_v1_dot_kvpool__pb2"
    if expected not in text:
        raise RuntimeError(f"{grpc_file}: the generated import is not {expected!r}")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "client", help="package root (default: client/)"
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

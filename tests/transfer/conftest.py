"""Transfers need NIXL (``kvpool[nixl]``): without it the tests here skip, saying what to
install; with ``KVPOOL_REQUIRE_NIXL=1`` (as ``.ci/run`` sets) its absence fails them instead.

NIXL is only ever imported by the daemons under test, never by pytest's process: its bundled
protobuf/gRPC libraries crash a process that also loads grpc_tools (tests/unit/test_protos.py).
"""

from __future__ import annotations

import os

import pytest

from kvpoold.transfer import nixl_installed

MISSING = "NIXL is not installed: pip install -c .ci/constraints.txt -e '.[nixl]'"

if not nixl_installed() and os.environ.get("KVPOOL_REQUIRE_NIXL") == "1":
    raise RuntimeError("NIXL is not installed (pip install -c .ci/constraints.txt -e '.[nixl]') "
                       "and KVPOOL_REQUIRE_NIXL=1 says the transfer tests must not skip")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not nixl_installed():
        for item in items:
            if "tests/transfer/" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=MISSING))

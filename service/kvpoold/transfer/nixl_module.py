"""The optional NIXL package: whether it is installed, importing it, its memory types.

NIXL is optional (``kvpool[nixl]``, the ``nixl-cu12`` wheel, imported as ``nixl_cu12``; the
``nixl`` meta package's module is tried too); without it the daemon runs and the transfer RPCs
answer :data:`NIXL_MISSING`, which says what to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from types import ModuleType

import torch

NIXL_MISSING = (
    "transfers between daemons need NIXL in kvpoold's environment: from the repository "
    "root, pip install -e '.[server,nixl]' (the nixl-cu12 wheel; it runs on CPU too) and "
    "restart kvpoold"
)

NIXL_MODULES = ("nixl_cu12", "nixl")
# Makes a logger write through the given handlers only, at a level (the daemon's log setup).
Adopt = Callable[[logging.Logger, list[logging.Handler], int | str], None]


def nixl_installed() -> bool:
    """Whether a NIXL module is importable, without importing it (NIXL bundles its own
    protobuf and gRPC C++ libraries, which crash a process that also loads grpc_tools'
    compiler: the tests check with this and leave the import to the daemons)."""
    return any(importlib.util.find_spec(name) is not None for name in NIXL_MODULES)


def load_nixl(adopt: Adopt | None = None) -> ModuleType | None:
    """The NIXL Python module (``nixl_cu12``, else ``nixl``), or None when not installed.

    Args:
        adopt: how the daemon sets up a logger; given, NIXL's logger is put back through
            kvpoold's handlers after the import (see :func:`_rehome_nixl_logs`).
    """
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            if adopt is not None:
                _rehome_nixl_logs(adopt)
            return module
    return None


def _rehome_nixl_logs(adopt: Adopt) -> None:
    """NIXL's Python package installs its own handler at import (plain text, on stdout); put
    its records back through kvpoold's (``--log-format``, ``--log-level``, stderr), so
    ``--log-format json`` stays one JSON object per line."""
    daemon = logging.getLogger("kvpoold")
    adopt(logging.getLogger("nixl"), list(daemon.handlers), daemon.level)


def mem_type(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor: ``("DRAM", 0)`` or ``("VRAM", n)``."""
    dev = tensor.get_device()
    return ("DRAM", 0) if dev < 0 else ("VRAM", dev)

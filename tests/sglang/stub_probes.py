"""Shared by the side-venv scripts in this directory (run as scripts, so ``import
stub_probes`` finds this file beside them)."""

from __future__ import annotations

import sys


def hide_stubs() -> None:
    """Let torch and transformers see what this CPU install has: no triton, no torchvision.

    ``stubs/`` provides those names for SGLang's unconditional module-level imports only; torch's
    inductor and transformers' image utilities would take them for real packages and import
    their internals. So their cached availability probes (and the torch modules that try-import
    triton) run first with both names blocked, for every script here.
    """
    import importlib.util

    blocked = ("triton", "torchvision")
    if all(importlib.util.find_spec(name) is None for name in blocked):
        return  # no stubs on the path: nothing to hide
    saved = {name: sys.modules.get(name) for name in blocked}
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises
    try:
        import torch
        import torch._inductor.compile_fx
        import torch.utils._triton as torch_triton
        from transformers.utils import import_utils

        torch_triton.has_triton_package()
        torch.compile(lambda x: x)
        import_utils.is_torchvision_available()
        import transformers.models.auto.processing_auto  # noqa: F401
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module

"""kvpool's SGLang platform: SGLang's device behaviour plus KV pools in kvpool daemon memory.

SGLang calls :func:`activate` (entry point ``kvpool`` in group ``sglang.srt.platforms``) in every
process that resolves its platform. The plugin is active only when asked for:
``SGLANG_PLATFORM=kvpool``, or ``KVPOOL_POOL`` naming a pool (SGLang then auto-discovers it);
otherwise :func:`activate` returns None and SGLang picks its own platform as if kvpool were not
installed.

The platform defers everything to SGLang's behaviour for the device and adds two hooks:
``get_kv_pool_cls(kind=...)`` (``kvpool.integrations.sglang.pools``) and
``get_paged_allocator_cls()`` (``kvpool.integrations.sglang.allocator`` when present).

- CUDA: :class:`KVPoolCudaPlatform`, SGLang's own ``CudaSRTPlatform``.
- CPU: :class:`KVPoolCpuPlatform`, an out-of-tree platform with SGLang's CPU device operations
  and the ``torch_native`` attention backend. SGLang's in-tree CPU engine needs the ``sgl_kernel``
  CPU build; the out-of-tree platform runs SGLang's torch-native paths instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.cuda import CudaSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from kvpool.integrations.sglang.scheduler_binding import POOL_ENV

log = logging.getLogger("kvpool.sglang")

PLUGIN_NAME = "kvpool"
SELECT_ENV = "SGLANG_PLATFORM"
CPU_ATTENTION_BACKEND = "torch_native"


class KVPoolHooks:
    """The two hooks kvpool adds to a platform: its KV pool classes and its paged allocator."""

    def get_kv_pool_cls(self, *, kind: str) -> type | None:
        """kvpool's pool class for ``kind`` (``mha``, ``mla``, ``dsa``): SGLang's in-tree class
        with its buffers in the daemon's pool named by ``KVPOOL_POOL``."""
        from kvpool.integrations.sglang.pools import pool_class

        return pool_class(kind)

    def get_paged_allocator_cls(self) -> type | None:
        """kvpool's paged allocator (pages from the scheduler's lease), or None (SGLang's own)
        while ``kvpool.integrations.sglang.allocator`` is not installed."""
        try:
            from kvpool.integrations.sglang.allocator import PagedAllocator
        except ImportError as exc:
            if exc.name != "kvpool.integrations.sglang.allocator":
                raise
            return None
        return PagedAllocator


class KVPoolCudaPlatform(KVPoolHooks, CudaSRTPlatform):
    """SGLang's CUDA platform with kvpool's KV pools and paged allocator."""


class KVPoolCpuPlatform(KVPoolHooks, CpuDeviceMixin, SRTPlatform):
    """A CPU platform (SGLang's CPU device operations, ``torch_native`` attention) with kvpool's
    KV pools and paged allocator.

    Out of tree (``PlatformEnum.OOT``): SGLang's in-tree CPU platform selects ``sgl_kernel`` CPU
    kernels, which only a source build of SGLang provides. Capabilities stay at SGLang's
    conservative defaults (no Triton, no graph capture): the allocator and the request-to-token
    writers take their torch fallbacks.
    """

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        return CPU_ATTENTION_BACKEND

    def is_pin_memory_available(self, device: Any = None) -> bool:
        return False


def selected(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether the user asked for the plugin: ``SGLANG_PLATFORM=kvpool`` or ``KVPOOL_POOL``."""
    env = os.environ if env is None else env
    return (env.get(SELECT_ENV, "").strip() == PLUGIN_NAME
            or bool(env.get(POOL_ENV, "").strip()))


def platform_class_path(cuda: bool) -> str:
    """The dotted path SGLang resolves (``pkgutil.resolve_name``) to the platform class."""
    cls = KVPoolCudaPlatform if cuda else KVPoolCpuPlatform
    return f"{cls.__module__}:{cls.__qualname__}"


def activate() -> str | None:
    """SGLang's plugin entry point: the platform class's dotted path when selected, else None.

    CUDA when ``torch.cuda.is_available()`` (and torch is not a ROCm build, which the plugin does
    not support: None, with a warning), else CPU.
    """
    if not selected():
        return None
    import torch

    if torch.cuda.is_available():
        if torch.version.hip is not None:
            log.warning("kvpool's SGLang plugin supports CUDA and CPU, not ROCm (torch %s): "
                        "not activated; unset %s and %s to use SGLang's ROCm platform",
                        torch.__version__, SELECT_ENV, POOL_ENV)
            return None
        return platform_class_path(cuda=True)
    return platform_class_path(cuda=False)


__all__ = ["KVPoolCpuPlatform", "KVPoolCudaPlatform", "KVPoolHooks", "activate", "selected"]

"""Import-only stand-in for ``sgl_kernel`` used by kvpool's SGLang differential test.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports kernels from ``sgl_kernel``
at module level, and some model modules bind ``torch.ops.sgl_kernel.<name>_cpu`` when
imported; the CPU build of ``sgl_kernel`` is compiled from SGLang's source tree and is
not on PyPI. Pool sizing never runs a kernel: every name here, and every ``*_cpu`` op
of the ``torch.ops.sgl_kernel`` namespace installed below, is a function that refuses
to run. Other op names stay missing: SGLang probes them with ``hasattr`` to decide
whether to register fake kernels.
"""

import torch


def _unavailable(name):
    def kernel(*_args, **_kwargs):
        raise RuntimeError(f"sgl_kernel stub: kernel {name} cannot run")

    kernel.__name__ = name
    return kernel


class _OpNamespace:
    """Stands in for the ``torch.ops.sgl_kernel`` namespace the real build registers."""

    def __getattr__(self, name):
        if not name.endswith("_cpu"):
            raise AttributeError(f"sgl_kernel stub: no op {name}")
        return _unavailable(f"torch.ops.sgl_kernel.{name}")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(name)


torch.ops.sgl_kernel = _OpNamespace()

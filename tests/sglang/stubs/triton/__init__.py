"""Import-only stand-in for ``triton`` (GPU-only) used by kvpool's SGLang differential test.

SGLang imports triton at module level and decorates kernels with ``triton.jit``;
nothing here ever compiles or launches a kernel. Pool sizing never calls a kernel.
"""

from triton import language  # noqa: F401
from triton.runtime.jit import JITFunction

__version__ = "0.0.0+kvpool-stub"


class Config:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def jit(fn=None, **_kwargs):
    if fn is None:
        return lambda f: JITFunction(f)
    return JITFunction(fn)


def _passthrough_decorator(*_args, **_kwargs):
    return lambda fn: fn


autotune = heuristics = _passthrough_decorator


def cdiv(a, b):
    return -(a // -b)


def next_power_of_2(n):
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()

"""Import-only stand-in for ``triton.language.extra.libdevice`` (see the ``triton`` stub)."""

from triton.language import _Placeholder


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name)

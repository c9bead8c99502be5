"""Import-only stand-in for ``triton.language.extra.cuda`` (see the ``triton`` stub)."""

from triton.language import _Placeholder

libdevice = _Placeholder("libdevice")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name)

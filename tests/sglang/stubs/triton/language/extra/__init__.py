"""Import-only stand-in for ``triton.language.extra`` (see the ``triton`` stub)."""

from triton.language import _Placeholder

libdevice = _Placeholder("libdevice")

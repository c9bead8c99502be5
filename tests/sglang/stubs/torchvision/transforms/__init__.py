"""Import-only stand-in for ``torchvision.transforms`` (see the ``torchvision`` stub).

Transform classes (``Compose``, ``Normalize``, ...) are named only inside
functions; any attribute resolves to a class that refuses to be used.
"""

from torchvision.transforms import functional  # noqa: F401
from torchvision.transforms.functional import InterpolationMode  # noqa: F401


class _Unavailable:
    def __init__(self, *_args, **_kwargs):
        raise RuntimeError("torchvision stub: image transforms are not available")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Unavailable,), {})

"""Import-only stand-in for ``torchvision.transforms.functional``.

See the ``torchvision`` stub.
"""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _unavailable(*_args, **_kwargs):
        raise RuntimeError(f"torchvision stub: {name} is not available")

    return _unavailable

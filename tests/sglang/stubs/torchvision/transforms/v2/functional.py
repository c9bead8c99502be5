"""Import-only stand-in for ``torchvision.transforms.v2.functional``.

See the ``torchvision`` stub.
"""

from torchvision.transforms.functional import __getattr__  # noqa: F401

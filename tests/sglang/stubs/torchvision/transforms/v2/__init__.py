"""Import-only stand-in for ``torchvision.transforms.v2`` (see the ``torchvision`` stub)."""

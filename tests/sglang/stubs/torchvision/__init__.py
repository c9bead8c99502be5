"""Import-only stand-in for ``torchvision`` used by kvpool's SGLang differential test.

PyPI's torchvision wheel is CUDA-linked and fails beside the CPU torch build;
SGLang's multimodal config modules import ``torchvision.transforms`` at module
level for image preprocessing that pool sizing never runs.
"""

from torchvision import transforms  # noqa: F401

__version__ = "0.0.0+kvpool-stub"

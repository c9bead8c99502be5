"""Buffer dtype names to ``torch.dtype``: the client's canonical table (``kvpool.dtypes``)."""

from __future__ import annotations

import torch

from kvpool import dtypes
from kvpoold.spec import DType


def torch_dtype(dtype: DType | str) -> torch.dtype:
    return dtypes.torch_dtype(str(dtype))

"""The one place where buffer dtype names become ``torch.dtype``."""

from __future__ import annotations

import torch

from kvpoold.spec import DType

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.bfloat16: torch.bfloat16,
    DType.float16: torch.float16,
    DType.float32: torch.float32,
    DType.uint8: torch.uint8,
    DType.int32: torch.int32,
    DType.int64: torch.int64,
}


def torch_dtype(dtype: DType | str) -> torch.dtype:
    return TORCH_DTYPES[DType(dtype)]

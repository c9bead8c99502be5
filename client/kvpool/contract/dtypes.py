"""Buffer element types: the one table of names, item sizes and ``torch.dtype``.

Names are the wire form (proto ``Buffer.dtype``, plan JSON) and the values of :class:`DType`.
torch is imported only inside :func:`torch_dtype` so that ``import kvpool`` stays light (no
1.5 s torch import for ``kvpool stats``).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from kvpool.contract.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

# name -> bytes per element; DType's members are these names.
ITEMSIZE: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "uint8": 1,
    "int8": 1,
    "int32": 4,
    "int64": 8,
}

DTYPE_NAMES: tuple[str, ...] = tuple(ITEMSIZE)


class DType(enum.StrEnum):
    """Element types of buffers, by name (no ``torch.dtype`` in any Struct)."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"
    uint8 = "uint8"
    int8 = "int8"  # vLLM's KV-cache backing (allocate_kv_cache's torch.int8 region)
    int32 = "int32"
    int64 = "int64"

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.value]


def check_dtype_name(name: str, *, field: str = "dtype") -> str:
    """Return ``name`` as a plain ``str`` if it names a known buffer dtype.

    Args:
        name: a dtype name (``"bfloat16"``); a ``str`` enum member is accepted.
        field: the input field reported in the error.

    Raises:
        InvalidArgument: for an unknown name (lists the known ones).
    """
    key = str(name)
    if key not in ITEMSIZE:
        raise InvalidArgument(
            f"unknown dtype {key!r} (known: {', '.join(DTYPE_NAMES)})", field=field
        )
    return key


def itemsize(name: str) -> int:
    """Bytes per element of dtype ``name``.

    Raises:
        InvalidArgument: for an unknown name.
    """
    return ITEMSIZE[check_dtype_name(name)]


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` for ``name`` (imports torch).

    Raises:
        InvalidArgument: for an unknown name.
    """
    import torch

    return getattr(torch, check_dtype_name(name))

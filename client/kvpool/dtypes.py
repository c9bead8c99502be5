"""Buffer element types by name: the canonical name -> itemsize / ``torch.dtype`` table.

Names are the wire form (proto ``Buffer.dtype``, plan JSON); they equal the values of the
daemon's ``kvpoold.spec.DType``. torch is imported only inside :func:`torch_dtype` so that
``import kvpool`` stays light (no 1.5 s torch import for ``kvpool stats``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

# name -> bytes per element; the same six names as kvpoold.spec.DType.
ITEMSIZE: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}

DTYPE_NAMES: tuple[str, ...] = tuple(ITEMSIZE)


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

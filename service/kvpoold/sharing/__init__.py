"""Backings: where pool memory lives (plain, shared memory on CPU, CUDA IPC) and its handles."""

from kvpoold.sharing.base import (
    Backing,
    BackingFactory,
    PlainBacking,
    PlainBackingFactory,
    SharedHandle,
)

__all__ = ["Backing", "BackingFactory", "PlainBacking", "PlainBackingFactory", "SharedHandle"]

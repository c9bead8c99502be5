"""Placeholder: being written (see the helper brief). Not registered as done."""

from __future__ import annotations

from kvpoold.sizing.common import Sizing, SizingContext
from kvpoold.sizing.plan import BufferSpec
from kvpoold.spec import ModelSpec

NAME = "hybrid_linear"


def matches(spec: ModelSpec) -> bool:
    return False


def size(ctx: SizingContext) -> Sizing:
    raise NotImplementedError


def layout(ctx: SizingContext, sizing: Sizing) -> list[BufferSpec]:
    raise NotImplementedError

"""Pure sizing: model spec + options -> :class:`PoolPlan`, one module per architecture."""

from kvpool.options import KVCacheDType, PlanOptions, make_options
from kvpool.plan import BufferKind, BufferSpec, PoolPlan
from kvpoold.sizing.planner import plan

__all__ = ["BufferKind", "BufferSpec", "KVCacheDType", "PlanOptions", "PoolPlan", "make_options",
           "plan"]

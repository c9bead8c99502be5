"""Pure sizing: model spec + options -> :class:`PoolPlan`, one module per architecture."""

from kvpool.contract.options import KVCacheDType, PlanOptions, make_options
from kvpool.contract.plan import BufferKind, BufferSpec, PoolPlan
from kvpoold.sizing.planner import plan

__all__ = ["BufferKind", "BufferSpec", "KVCacheDType", "PlanOptions", "PoolPlan", "make_options",
           "plan"]

"""Allocators: id spaces with an ownership ledger, hybrid SWA pairs, per-pool batch calls."""

from kvpoold.alloc.checks import OWNER_MAX
from kvpoold.alloc.ids import IdPool, PoolCounters
from kvpoold.alloc.manager import Kind, PoolAllocator
from kvpoold.alloc.swa import SwaPair

__all__ = ["OWNER_MAX", "IdPool", "Kind", "PoolAllocator", "PoolCounters", "SwaPair"]

"""Allocators: id spaces with an ownership ledger, hybrid SWA pairs, per-pool batch calls."""

from kvpoold.ids.faults import OWNER_MAX
from kvpoold.ids.pairing import SwaPair
from kvpoold.ids.pool_ids import Kind, PoolAllocator
from kvpoold.ids.space import IdPool, PoolCounters

__all__ = ["OWNER_MAX", "IdPool", "Kind", "PoolAllocator", "PoolCounters", "SwaPair"]

"""Buffers built from a plan: one backing region per pool, named views over it."""

from kvpoold.pools.builder import FILLS, PoolBuffers, allocate_zeros, build_pool, carve

__all__ = ["FILLS", "PoolBuffers", "allocate_zeros", "build_pool", "carve"]

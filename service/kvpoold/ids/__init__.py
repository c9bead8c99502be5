"""Allocator core: id spaces with an ownership ledger, leader/follower pairings, a pool's table."""

from kvpoold.ids.faults import OWNER_MAX
from kvpoold.ids.pairing import Pairing
from kvpoold.ids.pool_ids import Grant, MappingBuffer, PoolIds
from kvpoold.ids.space import IdSpace

__all__ = [
    "OWNER_MAX",
    "Grant",
    "IdSpace",
    "MappingBuffer",
    "Pairing",
    "PoolIds",
]

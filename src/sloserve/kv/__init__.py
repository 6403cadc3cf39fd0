"""KV cache: a block pool with physical slot ids under interchangeable managers."""

from sloserve.kv.block_pool import BlockPool
from sloserve.kv.manager import (
    ExactReservationKVManager,
    KVCacheManager,
    MaxAllocationKVManager,
    PagedKVManager,
)
from sloserve.kv.registry import KV_MANAGERS

__all__ = [
    "KV_MANAGERS",
    "BlockPool",
    "ExactReservationKVManager",
    "KVCacheManager",
    "MaxAllocationKVManager",
    "PagedKVManager",
]

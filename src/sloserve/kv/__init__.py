"""KV cache: a block pool with physical slot ids under interchangeable managers."""

from sloserve.kv.block_pool import BlockPool
from sloserve.kv.manager import (
    KV_MANAGERS,
    ExactReservationKVManager,
    KVCacheManager,
    MaxAllocationKVManager,
    PagedKVManager,
)

__all__ = [
    "KV_MANAGERS",
    "BlockPool",
    "ExactReservationKVManager",
    "KVCacheManager",
    "MaxAllocationKVManager",
    "PagedKVManager",
]

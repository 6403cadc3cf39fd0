"""The KV managers by name (a scheduler config's ``kv_manager``): the factory beside what it chooses
from, so no manager imports another to register it."""

from __future__ import annotations

from sloserve.kv.bidirectional import BidirectionalKVManager
from sloserve.kv.manager import ExactReservationKVManager, KVCacheManager, MaxAllocationKVManager, PagedKVManager
from sloserve.kv.pipelined import PipelinedKVManager

KV_MANAGERS: dict[str, type[KVCacheManager]] = {
    "paged": PagedKVManager,
    "max": MaxAllocationKVManager,
    "exact": ExactReservationKVManager,
    "bidirectional": BidirectionalKVManager,  # BROS's (kv/bidirectional.py)
    "pipelined": PipelinedKVManager,  # EconoServe's (kv/pipelined.py)
}

"""KV cache managers: where every token of every request lives.

Layering as in vLLM: a ``BlockPool`` (GPU) and an optional CPU ``BlockPool`` (swap space) under a
manager; the scheduler asks the manager for slots and never touches blocks itself.

The managers differ only in how many slots they hold for a request once it asks for ``n`` tokens:

    PagedKVManager           ceil(n / block_size) blocks (vLLM)
    MaxAllocationKVManager   prompt + max_tokens, taken at the first allocation (ORCA)
    ExactReservationKVManager  a reservation set by the policy, e.g. I + O - 1 or predicted + padding

With prefix caching (``enable_prefix_caching``, kv/prefix_cache.py) the GPU blocks are shared: a
request admitted with the blocks ``find_cached_prefix`` found holds them in its table beside its own,
and ``blocks_needed``, ``can_allocate`` and ``allocate_slots`` take them as ``cached``. The rule every
manager here follows: a block goes back to the pool (or to the evictable cache) only when the last
table holding it lets go; a swap-out copies a request's blocks, shared ones too, and lets go of them
(another user keeps a shared block on the GPU); a swap-in takes fresh blocks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import BlockCopy
from sloserve.core.request import Request
from sloserve.kv.array_mirror import ArrayMirror
from sloserve.kv.block_pool import BlockPool
from sloserve.kv.cached_states import CachedStates
from sloserve.kv.prefix_cache import EvictionQueue, PrefixCache


class KVCacheManager:
    """Paged block allocation; subclasses change how many slots a request holds (``target_slots``).

    Args:
        num_blocks: GPU blocks (capacity = num_blocks * block_size token slots).
        block_size: token slots per block.
        kv_bytes_per_token: bytes of K and V per token over all layers (for swap traffic).
        num_cpu_blocks: blocks of CPU swap space (0: swapping is unavailable).
        enable_prefix_caching: share computed full blocks between requests (kv/prefix_cache.py).
    """

    name = "paged"
    # True when a decoding request needs one new block every block_size tokens (paged growth).
    periodic_growth = True
    # Whether the manager shares full blocks between requests with ``enable_prefix_caching``.
    supports_prefix_caching = True
    # Whether the manager itself copies KV to CPU memory and back (not only on a policy's swap).
    copies_kv_to_cpu = False
    # Whether ``max_requests`` bounds the requests holding blocks (a table each in ``block_tables``)
    supports_max_requests = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        kv_bytes_per_token: int = 0,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ConfigError(
                f"KV capacity must hold at least one block of {block_size} tokens, got {num_blocks} blocks"
            )
        self.block_size = block_size
        self.gpu = BlockPool(num_blocks, block_size)
        # NOTE: the GPU pool's free list itself (the pool changes it in place): its len() is read
        # every step, and through the pool's property it cost two calls.
        self._gpu_free = self.gpu.free_list
        # Where blocks come from and go back to: the pool, or the prefix cache in front of it.
        self.prefix_cache = PrefixCache(self.gpu) if enable_prefix_caching else None
        if self.prefix_cache is None:
            self._allocate, self._release = self.gpu.allocate, self.gpu.release
            self._evictable = EvictionQueue(0)  # never filled: no block is ever cached
        else:
            self._allocate, self._release = self._allocate_cached, self.prefix_cache.release
            self._evictable = self.prefix_cache.evictable  # cached blocks nobody uses: free too
            self._num_registered: dict[Request, int] = {}  # leading table blocks registered
        self.cpu = BlockPool(num_cpu_blocks, block_size)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.block_tables: dict[Request, list[int]] = {}  # GPU blocks per request, in token order
        self.cpu_tables: dict[Request, list[int]] = {}  # CPU blocks of swapped-out requests
        # Tokens per entry of ``block_id_tables``: a block (token-slot managers: one token).
        self.table_block_size = block_size
        # NOTE: a block table only ever grows in place (``extend``); any other change gives the
        # request a new list (swap-in, allocation after ``free``), so its mirror needs no drop but
        # when the request leaves the GPU.
        self._block_arrays = ArrayMirror()
        self.num_allocation_failures = 0
        self.swapped_bytes = 0
        # Tokens a decoding request grows by per allocation when allocations recur periodically
        # (one block every block_size tokens); None when growth is not periodic.
        self.growth_period: int | None = block_size if self.periodic_growth else None
        # Blocks reserved by count (decode cohort growth) whose ids are assigned later (settle_blocks).
        # NOTE: free + used + owed = capacity; owed blocks are not free.
        self._owed_blocks = 0
        # At most this many requests hold blocks at once (None: any number): a model with state layers keeps
        # states of that many requests beside their KV (engine/state_cache.py), so a request that would be
        # one more cannot start, as if the blocks had run out
        self.max_requests: int | None = None
        # With prefix caching, for such a model: the states saved at cached prefixes' ends (kv/cached_states.py),
        # a prefix found only up to one of them (None: a model without state layers)
        self.cached_states: CachedStates | None = None

    # --- capacity ----------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.gpu.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take (cached blocks nobody uses included), owed ones excluded."""
        # NOTE: .count, not len(): an attribute read costs less than a call, and this runs every step
        return len(self._gpu_free) + self._evictable.count - self._owed_blocks

    @property
    def allocated_tokens(self) -> int:
        """Token slots held by requests (whole blocks, owed ones included; a shared block once)."""
        used = self.gpu.num_blocks - len(self._gpu_free) - self._evictable.count + self._owed_blocks
        return used * self.block_size

    def _take(self, num_blocks: int) -> list[int] | None:
        """Blocks from the free pool, leaving the owed ones alone; None (counted) if too few."""
        if num_blocks > self.num_free_blocks:
            self.num_allocation_failures += 1
            return None
        return self._allocate(num_blocks)

    @property
    def num_shared_tokens(self) -> int:
        """Tokens the requests' tables hold more than once (prefix caching: a shared block's KV is
        in memory once however many tables hold it); 0 without prefix caching."""
        return 0 if self.prefix_cache is None else self.prefix_cache.num_extra_refs * self.block_size

    def num_blocks_released(self, requests: Collection[Request], taken: Sequence[int] = ()) -> int:
        """GPU blocks that freeing every one of ``requests`` would make free: their tables', less
        those a request not among them also holds (prefix caching), a block they share counted once,
        and less those in ``taken`` (cached blocks found for requests about to take them)."""
        held = [r for r in requests if r in self.block_tables]
        if self.prefix_cache is None:
            return sum(len(self.block_tables[r]) for r in held)
        return self.prefix_cache.num_released([self._table_ids(r) for r in held], taken)

    def _table_ids(self, request: Request) -> np.ndarray:
        """``request``'s block table as an int64 array (a view, valid until the table changes): with
        prefix caching, what the cache's array operations take, converted once per table, not per call."""
        return self._block_arrays.array(request, self.block_tables[request])

    def num_slots(self, request: Request) -> int:
        """Token slots ``request`` holds on the GPU."""
        table = self.block_tables.get(request)
        return 0 if table is None else len(table) * self.block_size

    def num_tracked_tokens(self, request: Request) -> int:
        """Tokens of ``request`` whose KV the manager keeps (on the GPU or checkpointed)."""
        return self.num_slots(request)

    def target_slots(self, request: Request, num_tokens: int) -> int:
        """Slots the manager holds for ``request`` once it needs ``num_tokens`` (policy hook)."""
        return num_tokens

    def blocks_needed(self, request: Request, num_tokens: int, cached: list[int] | tuple = ()) -> int:
        """Free blocks ``allocate_slots(request, num_tokens, cached)`` would take: new ones, and the
        ``cached`` ones nobody used (they count as free until taken)."""
        target = self.target_slots(request, num_tokens)
        have = len(self.block_tables.get(request, ()))
        if cached:
            have = len(cached) - self.prefix_cache.num_evictable(cached)
        need = -(-target // self.block_size) - have
        return need if need > 0 else 0

    def can_allocate(
        self, request: Request, num_tokens: int, reserve_blocks: int = 0, cached: list[int] | tuple = ()
    ) -> bool:
        if not self._may_hold(request):
            return False
        return self.blocks_needed(request, num_tokens, cached) + reserve_blocks <= self.num_free_blocks

    def _may_hold(self, request: Request) -> bool:
        """Whether ``request`` holds blocks or may start to (``max_requests``)."""
        return self.max_requests is None or request in self.block_tables or len(self.block_tables) < self.max_requests

    # --- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_tokens: int, cached: list[int] | tuple = ()) -> bool:
        """Make ``request`` hold slots for its first ``num_tokens`` tokens; a request that holds none
        yet may start its table with the ``cached`` blocks ``find_cached_prefix`` found. All or
        nothing: on failure nothing changes and the failure is counted."""
        table = self.block_tables.get(request)
        if table is None and not self._may_hold(request):
            self.num_allocation_failures += 1
            return False
        if table is None and self.prefix_cache is not None:
            return self._allocate_with_prefix(request, num_tokens, cached)
        need = self.blocks_needed(request, num_tokens)
        if need == 0:
            return True
        blocks = self._take(need)
        if blocks is None:
            return False
        if table is None:
            self.block_tables[request] = blocks
        else:
            table.extend(blocks)
        return True

    # --- prefix caching ------------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks that hold the start of ``request``'s prompt ([] without prefix caching,
        for a request that holds blocks, or one whose prompt content is unknown). At least one token
        is left to compute: the step that samples a token needs one in the batch (vLLM does the same)."""
        prompt = request.prompt_blocks
        if self.prefix_cache is None or prompt is None or self.num_tracked_tokens(request):
            return []
        limit = (request.num_tokens - 1) // self.block_size
        index = prompt.block_index(self.block_size)
        blocks = self.prefix_cache.match(index, limit)
        if self.cached_states is not None and len(blocks):  # (up to a block that ends at saved states)
            blocks = blocks[: self.cached_states.longest(index.keys, len(blocks))]
        return blocks

    def _allocate_with_prefix(self, request: Request, num_tokens: int, cached: list[int] | tuple) -> bool:
        cache = self.prefix_cache
        need = self.blocks_needed(request, num_tokens, cached)
        if need > self.num_free_blocks:
            self.num_allocation_failures += 1
            return False
        fresh = -(-self.target_slots(request, num_tokens) // self.block_size) - len(cached)
        if fresh <= 0 and not cached:
            return True
        cache.share(cached)  # NOTE: first, so that the allocation below cannot evict them
        ids = cache.allocate_ids(fresh, keep_free=self._owed_blocks) if fresh > 0 else None
        assert ids is not None or fresh <= 0
        if cached:
            ids = cache.ids(cached) if ids is None else np.concatenate((cache.ids(cached), ids))
        table = self.block_tables[request] = ids.tolist()
        self._block_arrays.adopt(request, table, ids)  # (registering and releasing take the array)
        self._num_registered[request] = len(cached)
        if self.cached_states is not None:
            self._start_states(request, len(cached))
        return True

    def _start_states(self, request: Request, num_cached: int) -> None:
        """A model with state layers: ``request``, admitted with ``num_cached`` cached blocks, starts from the
        states saved at their end, and saves its own at its prompt's last full block before its last token
        (``CachedStates``), unless that is where it starts."""
        if request.prompt_blocks is None:
            return
        keys = request.prompt_blocks.block_index(self.block_size).keys
        if num_cached:
            self.cached_states.use(request, int(keys[num_cached - 1]))
        save = (request.num_prompt_tokens - 1) // self.block_size
        if num_cached < save <= len(keys):  # (a workload's prompt content may cover fewer blocks than its length)
            self.cached_states.reserve(request, int(keys[save - 1]), save * self.block_size)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register ``request``'s full prompt blocks among its first ``num_tokens`` tokens, so later
        requests find them. The policy calls it when it schedules the chunk that computes them (as vLLM
        v1 does): a request admitted later in the same step may share them, since a step writes every
        token's KV before its attention reads any (layer by layer)."""
        prompt = request.prompt_blocks
        if prompt is None:
            return
        index, table = prompt.block_index(self.block_size), self.block_tables[request]
        done = self._num_registered.get(request, 0)
        # NOTE: a decode cohort member's table may lag its tokens (blocks reserved by count, settled later)
        upto = min(num_tokens // self.block_size, index.num_blocks, len(table))
        if upto > done:
            self.prefix_cache.register(self._table_ids(request)[done:upto], index, done)
            self._num_registered[request] = upto

    def reserve_blocks(self, num_blocks: int) -> bool:
        """Reserve ``num_blocks`` blocks by count, their ids assigned later by ``settle_blocks`` (the
        decode cohort's growth). All or nothing."""
        if num_blocks > self.num_free_blocks:
            self.num_allocation_failures += 1
            return False
        self._owed_blocks += num_blocks
        if self.prefix_cache is not None and self._owed_blocks > len(self._gpu_free):
            # NOTE: evicted now, as an engine that takes the blocks now would: a later request must
            # not find in the cache what a reservation has already claimed.
            self.prefix_cache.evict_to_pool(self._owed_blocks - len(self._gpu_free))
        return True

    def _allocate_cached(self, num_blocks: int) -> list[int] | None:
        """With prefix caching: blocks never used first, except those owed to reservations, then
        evicted ones."""
        return self.prefix_cache.allocate(num_blocks, keep_free=self._owed_blocks)

    def settle_blocks(self, request: Request, num_blocks: int) -> None:
        """Assign ``num_blocks`` of the reserved blocks to ``request`` (appended to its table)."""
        self.release_owed_blocks(num_blocks)
        if num_blocks:
            blocks = self._allocate(num_blocks)
            assert blocks is not None
            self.block_tables[request].extend(blocks)

    def release_owed_blocks(self, num_blocks: int) -> None:
        """Give back ``num_blocks`` blocks reserved by count and never assigned (a cohort member that
        leaves with its KV freed)."""
        assert 0 <= num_blocks <= self._owed_blocks, (num_blocks, self._owed_blocks)
        self._owed_blocks -= num_blocks

    def free(self, request: Request) -> None:
        """Release everything ``request`` holds, on the GPU and in swap space."""
        if self.cached_states is not None:
            self.cached_states.release(request)
        if request in self.block_tables:
            self._release_table(request)
        self.block_tables.pop(request, None)
        self._block_arrays.drop(request)
        cpu = self.cpu_tables.pop(request, None)
        if cpu:
            self.cpu.release(cpu)

    def _release_table(self, request: Request) -> None:
        """Give back the blocks of ``request``'s table (before the table goes: finish, preemption,
        swap-out). With prefix caching, the full blocks it computed past its scheduled chunks are
        registered first, their content known (a conversation turn's answer, which the next turn
        resends), and the table goes as its array (``_table_ids``), its registered blocks counted."""
        if self.prefix_cache is None:
            self._release(self.block_tables[request])
            return
        self.cache_blocks(request, request.num_computed_tokens)
        # NOTE: a table's registered blocks lead it, and no other block of it is cached: the rest were
        # taken uncached (fresh or evicted) and only this request could have registered them
        self.prefix_cache.release(self._table_ids(request), num_cached=self._num_registered.pop(request, 0))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``), and with it the states saved at their
        ends: a later prompt finds nothing cached until new blocks are registered. False, and nothing
        changed, while a request holds KV on the GPU (with prefix caching off too, as vLLM's)."""
        if self.allocated_tokens:
            return False
        if self.prefix_cache is not None and not self.prefix_cache.reset():
            return False
        if self.cached_states is not None:
            self.cached_states.clear()
        return True

    def slot_ids(self, request: Request, start: int, end: int) -> list[int]:
        """Physical slot ids of tokens ``start..end-1`` of ``request`` (the engine writes KV there)."""
        table = self.block_tables[request]
        bs = self.block_size
        if end > len(table) * bs:
            raise IndexError(f"{request}: token {end - 1} has no slot ({len(table) * bs} held)")
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def slot_table(self, request: Request, num_tokens: int) -> np.ndarray:
        """``(num_tokens,)`` physical slot ids of ``request``'s first ``num_tokens`` tokens (vectorized
        ``slot_ids``; the engine reads a request's context through it)."""
        return self.slot_tables([request], np.array([num_tokens]))[0]

    def slot_tables(self, requests: list[Request], num_tokens: np.ndarray) -> np.ndarray:
        """``(len(requests), max(num_tokens))`` slot ids: row i holds the first ``num_tokens[i]``
        slots of ``requests[i]`` (``slot_table`` for a whole batch at once); entries past a row's
        length are valid slot ids of no meaning (readers mask them by length)."""
        ids = self.block_id_tables(requests, num_tokens)  # (B, max blocks)
        return expand_block_ids(ids, self.table_block_size)[:, : int(num_tokens.max())]

    def block_id_tables(self, requests: list[Request], num_tokens: np.ndarray) -> np.ndarray:
        """``slot_tables`` in compact form, ``(len(requests), ceil(max(num_tokens) / g))`` with
        ``g = table_block_size``: token t of row i is in slot ``ids[i, t // g] * g + t % g``
        (``expand_block_ids``). Here g is the block size and the rows are block tables, so a batch of
        long contexts is g times smaller to build and to send to the device than its slot tables.
        Entries past a row's blocks are block 0."""
        bs = self.block_size
        num_blocks = -(-num_tokens // bs)  # (B,)
        ids = np.zeros((len(requests), int(num_blocks.max())), dtype=np.int64)  # (B, max blocks)
        for row, (request, n) in enumerate(zip(requests, num_blocks.tolist(), strict=True)):
            table = self._block_arrays.array(request, self.block_tables[request])
            if n > len(table):
                raise IndexError(f"{request}: token {num_tokens[row] - 1} has no slot ({len(table) * bs} held)")
            ids[row, :n] = table[:n]
        return ids

    # --- swapping ------------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[BlockCopy] | None:
        """Move ``request``'s GPU blocks to CPU swap space; None when swap space is short."""
        table = self.block_tables.get(request, [])
        cpu_blocks = self.cpu.allocate(len(table))
        if cpu_blocks is None:
            return None
        self._release_table(request)
        del self.block_tables[request]
        self._block_arrays.drop(request)
        self.cpu_tables[request] = cpu_blocks
        self.swapped_bytes += len(table) * self.block_size * self.kv_bytes_per_token
        return [BlockCopy(g, c) for g, c in zip(table, cpu_blocks, strict=True)]

    def swap_in_blocks_needed(self, request: Request) -> int:
        return len(self.cpu_tables.get(request, ()))

    def swap_in(self, request: Request) -> list[BlockCopy] | None:
        """Bring a swapped-out request's blocks back to the GPU; None when GPU blocks are short."""
        cpu_blocks = self.cpu_tables.get(request, [])
        gpu_blocks = self._take(len(cpu_blocks))
        if gpu_blocks is None:
            return None
        del self.cpu_tables[request]
        self.cpu.release(cpu_blocks)
        self.block_tables[request] = gpu_blocks
        self.swapped_bytes += len(cpu_blocks) * self.block_size * self.kv_bytes_per_token
        return [BlockCopy(c, g) for c, g in zip(cpu_blocks, gpu_blocks, strict=True)]

    def swap_bytes(self, copies: list[BlockCopy]) -> int:
        return len(copies) * self.block_size * self.kv_bytes_per_token

    # --- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is owned once (or, with prefix caching, counted once
        per table holding it) and free + used = capacity."""
        if self.cached_states is not None:
            self.cached_states.check()
        if self.prefix_cache is not None:
            self.prefix_cache.check(list(self.block_tables.values()))
            # NOTE: blocks owed to reservations are in the pool, none of them still cached (reserve_blocks)
            assert len(self._gpu_free) >= self._owed_blocks >= 0, "owed blocks are not all in the pool"
            assert all(n <= len(self.block_tables[r]) for r, n in self._num_registered.items()), "registered > held"
        for pool, tables, where in (
            (self.gpu, self.block_tables, "GPU"),
            (self.cpu, self.cpu_tables, "CPU"),
        ):
            owned = [b for table in tables.values() for b in table]
            if pool is self.gpu and self.prefix_cache is not None:
                owned = list(set(owned) | set(self._evictable.blocks()))  # shared once; cached ones are held
            free = pool.free_ids()
            assert len(set(owned)) == len(owned), f"{where}: a block is owned by two requests"
            assert len(set(free)) == len(free), f"{where}: a block is free twice"
            assert not set(owned) & set(free), f"{where}: a block is both free and owned"
            assert len(owned) + len(free) == pool.num_blocks, f"{where}: free + used != capacity"
            if self.prefix_cache is None:
                assert pool is self.cpu or len(free) >= self._owed_blocks >= 0, "owed blocks exceed free ones"
            assert all(0 <= b < pool.num_blocks for b in owned + free), f"{where}: block id out of range"
        assert not set(self.block_tables) & set(self.cpu_tables), "a request is on GPU and CPU at once"
        self._block_arrays.check(self.block_tables)


def expand_block_ids(ids: np.ndarray, block_size: int) -> np.ndarray:
    """``(B, n * block_size)`` slot tables from ``(B, n)`` block ids (``block_id_tables``)."""
    if block_size == 1:
        return ids
    return (ids[:, :, None] * block_size + np.arange(block_size)).reshape(ids.shape[0], ids.shape[1] * block_size)


class PagedKVManager(KVCacheManager):
    """vLLM block allocation: a request holds ceil(tokens / block_size) blocks, one more block every
    ``block_size`` tokens as it grows."""

    name = "paged"


class MaxAllocationKVManager(KVCacheManager):
    """ORCA: at its first allocation a request takes slots for prompt + max_tokens and never grows."""

    name = "max"
    periodic_growth = False

    def target_slots(self, request: Request, num_tokens: int) -> int:
        return max(num_tokens, request.num_prompt_tokens + request.max_tokens)


class ExactReservationKVManager(KVCacheManager):
    """Reserve a policy-chosen number of tokens per request (EconoServe's predicted length + padding,
    InferMax's eviction-free I + O - 1). Growth past the reservation is paged."""

    name = "exact"
    periodic_growth = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reservation: dict[Request, int] = {}

    def set_reservation(self, request: Request, num_tokens: int) -> None:
        self._reservation[request] = num_tokens

    def target_slots(self, request: Request, num_tokens: int) -> int:
        return max(num_tokens, self._reservation.get(request, 0))

    def free(self, request: Request) -> None:
        super().free(request)
        self._reservation.pop(request, None)

"""KV cache managers: where every token of every request lives.

Layering as in vLLM: a ``BlockPool`` (GPU) and an optional CPU ``BlockPool`` (swap space) under a
manager; the scheduler asks the manager for slots and never touches blocks itself.

The managers differ only in how many slots they hold for a request once it asks for ``n`` tokens:

    PagedKVManager           ceil(n / block_size) blocks (vLLM)
    MaxAllocationKVManager   prompt + max_tokens, taken at the first allocation (ORCA)
    ExactReservationKVManager  a reservation set by the policy, e.g. I + O - 1 or predicted + padding
"""

from __future__ import annotations

import numpy as np

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import BlockCopy
from sloserve.core.request import Request
from sloserve.kv.array_mirror import ArrayMirror
from sloserve.kv.block_pool import BlockPool


class KVCacheManager:
    """Paged block allocation; subclasses change how many slots a request holds (``target_slots``).

    Args:
        num_blocks: GPU blocks (capacity = num_blocks * block_size token slots).
        block_size: token slots per block.
        kv_bytes_per_token: bytes of K and V per token over all layers (for swap traffic).
        num_cpu_blocks: blocks of CPU swap space (0: swapping is unavailable).
    """

    name = "paged"
    # True when a decoding request needs one new block every block_size tokens (paged growth).
    periodic_growth = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        kv_bytes_per_token: int = 0,
        num_cpu_blocks: int = 0,
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

    # --- capacity ----------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.gpu.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._gpu_free) - self._owed_blocks

    @property
    def allocated_tokens(self) -> int:
        """Token slots held by requests (whole blocks, owed ones included)."""
        return (self.gpu.num_blocks - len(self._gpu_free) + self._owed_blocks) * self.block_size

    def _take(self, num_blocks: int) -> list[int] | None:
        """Blocks from the free pool, leaving the owed ones alone; None (counted) if too few."""
        if num_blocks > self.num_free_blocks:
            self.num_allocation_failures += 1
            return None
        return self.gpu.allocate(num_blocks)

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

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """New blocks ``allocate_slots(request, num_tokens)`` would take."""
        target = self.target_slots(request, num_tokens)
        have = len(self.block_tables.get(request, ()))
        need = -(-target // self.block_size) - have
        return need if need > 0 else 0

    def can_allocate(self, request: Request, num_tokens: int, reserve_blocks: int = 0) -> bool:
        return self.blocks_needed(request, num_tokens) + reserve_blocks <= self.num_free_blocks

    # --- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_tokens: int) -> bool:
        """Make ``request`` hold slots for its first ``num_tokens`` tokens. All or nothing: on failure
        nothing changes and the failure is counted."""
        need = self.blocks_needed(request, num_tokens)
        if need == 0:
            return True
        blocks = self._take(need)
        if blocks is None:
            return False
        table = self.block_tables.get(request)
        if table is None:
            self.block_tables[request] = blocks
        else:
            table.extend(blocks)
        return True

    def reserve_blocks(self, num_blocks: int) -> bool:
        """Reserve ``num_blocks`` blocks by count, their ids assigned later by ``settle_blocks`` (the
        decode cohort's growth). All or nothing."""
        if num_blocks > self.num_free_blocks:
            self.num_allocation_failures += 1
            return False
        self._owed_blocks += num_blocks
        return True

    def settle_blocks(self, request: Request, num_blocks: int) -> None:
        """Assign ``num_blocks`` of the reserved blocks to ``request`` (appended to its table)."""
        self.release_owed_blocks(num_blocks)
        if num_blocks:
            blocks = self.gpu.allocate(num_blocks)
            assert blocks is not None
            self.block_tables[request].extend(blocks)

    def release_owed_blocks(self, num_blocks: int) -> None:
        """Give back ``num_blocks`` blocks reserved by count and never assigned (a cohort member that
        leaves with its KV freed)."""
        assert 0 <= num_blocks <= self._owed_blocks, (num_blocks, self._owed_blocks)
        self._owed_blocks -= num_blocks

    def free(self, request: Request) -> None:
        """Release everything ``request`` holds, on the GPU and in swap space."""
        table = self.block_tables.pop(request, None)
        self._block_arrays.drop(request)
        if table:
            self.gpu.release(table)
        cpu = self.cpu_tables.pop(request, None)
        if cpu:
            self.cpu.release(cpu)

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
        del self.block_tables[request]
        self._block_arrays.drop(request)
        self.gpu.release(table)
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
        """Raise AssertionError unless every block is owned once and free + used = capacity."""
        for pool, tables, where in (
            (self.gpu, self.block_tables, "GPU"),
            (self.cpu, self.cpu_tables, "CPU"),
        ):
            owned = [b for table in tables.values() for b in table]
            free = pool.free_ids()
            assert len(set(owned)) == len(owned), f"{where}: a block is owned by two requests"
            assert len(set(free)) == len(free), f"{where}: a block is free twice"
            assert not set(owned) & set(free), f"{where}: a block is both free and owned"
            assert len(owned) + len(free) == pool.num_blocks, f"{where}: free + used != capacity"
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

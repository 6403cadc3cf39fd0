"""Prefix caching for the managers that keep a slot list per request (kv/token_slots.py): BROS's
bidirectional blocks and EconoServe's pipelined regions.

Their blocks are not whole tables: a bidirectional block holds an RT and a BE request, a pipelined
region nests hosted requests in its slots. So a block is shared only once it leaves all that: a block
that one request filled whole with a block-aligned run of its own prompt tokens (tokens j*S to j*S+S-1,
S the block size) becomes a *shared* block of the prefix cache (kv/prefix_cache.py) when the request
registers it, reference-counted like the paged managers' blocks and found by later prompts that start
alike. A request's slot list then starts with its shared blocks (``prefix_blocks``, in token order),
and its own slots follow.

The rule: a shared block is nobody's own block, so no growth, overwrite, eviction or region writes
into it; a request that gives up its KV (dropped, evicted, finished) copies or drops its own tokens and
lets go of its shared blocks, which stay for their other users, or stay cached (free, evictable) when
it was the last.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from sloserve.core.request import Request
from sloserve.kv.prefix_cache import NOT_CACHED, PrefixCache
from sloserve.kv.token_slots import CHECKPOINTED


class SharedPrefixBlocks:
    """Mixin for a ``TokenSlotTable`` manager with a ``prefix_cache`` (None: caching off).

    The manager provides ``num_slots(request)`` (its GPU slots, shared ones included),
    ``_whole_block(request, j)`` (the block that holds the request's tokens j*S .. j*S+S-1 and nothing
    else, as its own; else None) and ``_give_up_block(request, block)`` (the request no longer holds
    that block as its own, which becomes shared; returns whether the block holds its tokens right to
    left).
    """

    prefix_cache: PrefixCache | None
    block_size: int
    token_slots: dict[Request, list[int]]

    def _init_shared_prefix(self, num_blocks: int) -> None:
        self.prefix_blocks: dict[Request, list[int]] = {}  # each request's shared blocks, in token order
        # A block written right to left (a BE request's, kv/bidirectional.py): token k at slot S-1-k.
        self._right_to_left = np.zeros(num_blocks, dtype=bool)
        self.num_shared_blocks_used = 0  # shared blocks some request holds

    def _shared_slots(self, blocks: Sequence[int]) -> list[int]:
        """The slots of the tokens the shared ``blocks`` hold, in token order."""
        S = self.block_size
        ids = np.asarray(blocks, dtype=np.int64)
        offsets = np.where(self._right_to_left[ids][:, None], np.arange(S - 1, -1, -1), np.arange(S))  # (n, S)
        return (ids[:, None] * S + offsets).ravel().tolist()

    def _share_prefix(self, request: Request, cached: Sequence[int]) -> None:
        """``request``, holding nothing, starts with the shared ``cached`` blocks (``find_cached_prefix``)."""
        cache = self.prefix_cache
        assert cache is not None and request not in self.token_slots
        self.num_shared_blocks_used += cache.num_evictable(cached)
        cache.share(cached)
        self.prefix_blocks[request] = list(cached)
        self.token_slots[request] = self._shared_slots(cached)

    def _release_shared(self, request: Request, keep: int = 0) -> None:
        """``request`` lets go of its shared blocks past its first ``keep`` (their slots are the caller's)."""
        blocks = self.prefix_blocks.get(request)
        if blocks is None:
            return
        gone = blocks[keep:]
        del blocks[keep:]
        if not blocks:
            del self.prefix_blocks[request]
        if gone:
            self.prefix_cache.release(gone)
            self.num_shared_blocks_used -= self.prefix_cache.num_evictable(gone)

    def num_slots_released(self, requests: Collection[Request]) -> int:
        """GPU slots that giving up every one of ``requests``' KV would free: their own slots, and the
        slots of the shared blocks no other request holds (a block they share counted once)."""
        S = self.block_size
        own = sum(self.num_slots(r) - S * len(self.prefix_blocks.get(r, ())) for r in requests)
        if self.prefix_cache is None:
            return own
        shared = [self.prefix_blocks[r] for r in requests if r in self.prefix_blocks]
        return own + S * self.prefix_cache.num_released(shared)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register ``request``'s full prompt blocks among its first ``num_tokens`` tokens, in order,
        while each is a block it holds whole (``_whole_block``): the block becomes shared. One that is
        not (its tokens span two blocks, some are in CPU memory) ends the run: no later one could be
        found."""
        prompt = request.prompt_blocks
        if self.prefix_cache is None or prompt is None:
            return
        S = self.block_size
        index, slots = prompt.block_index(S), self.token_slots.get(request, ())
        shared = self.prefix_blocks.setdefault(request, [])
        first = len(shared)
        for j in range(first, min(num_tokens // S, index.num_blocks, len(slots) // S)):
            block = self._whole_block(request, j) if slots[j * S] != CHECKPOINTED else None
            if block is None:
                break
            self._right_to_left[block] = self._give_up_block(request, block)
            shared.append(block)
        if len(shared) > first:  # NOTE: each block's one reference carries over
            self.prefix_cache.register(shared[first:], index, first)
            self.num_shared_blocks_used += len(shared) - first
        if not shared:
            del self.prefix_blocks[request]

    def _whole_block(self, request: Request, j: int) -> int | None:
        raise NotImplementedError

    def _give_up_block(self, request: Request, block: int) -> bool:
        raise NotImplementedError

    def _check_shared_prefix(self, own_blocks: list[int]) -> set[int]:
        """Raise AssertionError unless reference counts match the shared blocks and ``own_blocks`` (every
        block some request holds as its own, once each), and each request's slots start with its
        shared blocks'. Returns the blocks the cache holds (shared, and cached with no user)."""
        shared = {b for blocks in self.prefix_blocks.values() for b in blocks}
        assert self.num_shared_blocks_used == len(shared), "shared blocks in use miscounted"
        if self.prefix_cache is None:
            assert not shared, "shared blocks without prefix caching"
            return set()
        self.prefix_cache.check([*self.prefix_blocks.values(), *([b] for b in own_blocks)])
        assert (self.prefix_cache.place_of[list(shared)] != NOT_CACHED).all(), "a shared block is not cached"
        for request, blocks in self.prefix_blocks.items():
            slots = self.token_slots[request]
            n = len(blocks) * self.block_size
            assert slots[0] == CHECKPOINTED or slots[:n] == self._shared_slots(blocks), "shared slots"
        return shared | set(self.prefix_cache.evictable.blocks())

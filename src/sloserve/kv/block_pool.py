"""A fixed pool of KV blocks. Token slot ids are ``block_id * block_size + offset``."""

from __future__ import annotations

from collections.abc import Iterable


class BlockPool:
    """Free list of ``num_blocks`` blocks of ``block_size`` token slots each.

    NOTE: allocation is all-or-nothing: ``allocate`` returns the blocks or ``None`` and never takes
    part of a request.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the lowest block ids are handed out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def free_list(self) -> list[int]:
        """The free block ids, bottom of the stack first. NOTE: the pool's own list, changed in place
        by ``allocate`` and ``release`` (its len() is the free count); read it, never change it."""
        return self._free

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks, or none at all when fewer are free."""
        free = self._free
        if num_blocks > len(free):
            return None
        if num_blocks == 1:
            return [free.pop()]
        taken = free[len(free) - num_blocks :]
        del free[len(free) - num_blocks :]
        taken.reverse()
        return taken

    def release(self, blocks: Iterable[int]) -> None:
        """Return blocks to the pool; they are reused first (LIFO)."""
        self._free.extend(blocks)

    def free_ids(self) -> list[int]:
        return list(self._free)

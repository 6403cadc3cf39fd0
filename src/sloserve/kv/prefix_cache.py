"""Automatic prefix caching (vLLM v1's scheme) over a pool of GPU blocks.

A full block whose tokens are computed is registered under its chained key (``core/prefix.py``); a
later request whose prompt starts with the same blocks finds them (``match``) and uses them instead of
computing them again. Blocks are reference-counted: a block is shared by every request whose table
holds it, and goes back only when the last one lets go. A registered block that nobody uses stays
cached in ``evictable`` and still counts as free: an allocation takes never-used blocks from the pool
first, then evicts cached ones, least recently released first. A request releases its blocks last to
first, so the tail of a prompt is evicted before its head, which more requests share (vLLM v1's
order; SGLang's radix tree evicts leaves first too).

The index finds blocks a group at a time (``core/prefix.py``'s ``BlockIndex``: a trace segment's
blocks, or each block alone when the content is known by tokens): ``group_base`` maps a group's key to
its first place in ``slots``, an array of the blocks cached there, in the group's order. A 512-token
segment's 32 blocks are found, and registered, through one dict entry and a few array operations.

NOTE: the index is cleaned lazily: a place counts only while the block there is cached under the key
the prompt expects (``is_cached`` and ``key_of`` agree), so evicting a block, or registering a key again
under a newer block (two requests computed the same content side by side), is an array store, not a
deletion; the index is rebuilt from the cached blocks when its places outgrow the pool four times over.

NOTE: a block is registered when the step that computes its KV is scheduled (``KVCacheManager.
cache_blocks``, as vLLM v1), not when it is allocated: a prompt allocated whole and computed in chunks
registers chunk by chunk, and one preempted before computing a block never leaves it to be found.
Partial blocks are never registered, so a request never writes into a block another one reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from sloserve.core.prefix import BlockIndex
from sloserve.kv.block_pool import BlockPool

_NO_BLOCKS = np.zeros(0, dtype=np.int64)  # a miss's blocks, shared by every miss
_NO_BLOCKS.flags.writeable = False


def block_ids(blocks: Sequence[int] | np.ndarray) -> np.ndarray:
    """``blocks`` as an int64 array. NOTE: from a list, ``np.fromiter`` takes half of ``np.asarray``'s
    time (a table of 375 blocks: 10 us against 20 us)."""
    if isinstance(blocks, np.ndarray):
        return blocks
    return np.fromiter(blocks, dtype=np.int64, count=len(blocks))


class EvictionQueue:
    """Cached blocks nobody uses, least recently released first (LRU), a release at a time.

    Each release appends one run of blocks (its table's, tail first); ``pop`` takes blocks from the
    oldest runs. A block that leaves the queue otherwise (used again: ``remove``) stays in its run as a
    stale entry, told apart by its stamp, and is skipped when reached.

    NOTE: runs, not one entry per block: the simulator frees a long prompt's 750 blocks with a few
    array operations. Stale entries are dropped when the runs hold more than twice the pool's blocks.
    """

    def __init__(self, num_blocks: int) -> None:
        self.runs: deque[tuple[int, np.ndarray]] = deque()  # (stamp, blocks), oldest first
        self.stamp_of = np.full(num_blocks, -1, dtype=np.int64)  # the run a queued block is in; -1: none
        self._next_stamp = 0
        self._num_entries = 0  # entries in the runs, stale ones included
        self.count = 0  # blocks in the queue

    def __len__(self) -> int:
        return self.count

    def push(self, blocks: np.ndarray) -> None:
        """Queue ``blocks`` as the most recently released, the first of them to be evicted first."""
        if not len(blocks):
            return
        self.stamp_of[blocks] = self._next_stamp
        self.runs.append((self._next_stamp, blocks))
        self._next_stamp += 1
        self._num_entries += len(blocks)
        self.count += len(blocks)
        if self._num_entries > 2 * len(self.stamp_of) + 1024:
            self._compact()

    def remove(self, blocks: np.ndarray) -> None:
        """``blocks`` (all queued) leave the queue: a request uses them again."""
        self.stamp_of[blocks] = -1
        self.count -= len(blocks)

    def pop(self, num_blocks: int) -> np.ndarray:
        """The ``num_blocks`` least recently released blocks, out of the queue (``num_blocks`` <= len)."""
        taken = []
        while num_blocks > 0:
            stamp, blocks = self.runs[0]
            head = blocks[:num_blocks]
            if len(head) == num_blocks and np.count_nonzero(self.stamp_of[head] == stamp) == num_blocks:
                # NOTE: the common case (a decode's one block): the run's head is live, and the rest of
                # the run is not filtered now (its stale entries are skipped when reached)
                self.runs[0] = (stamp, blocks[num_blocks:])
                self._num_entries -= num_blocks
                taken.append(head)
                break
            live = self._live(stamp, blocks)
            if len(live) <= num_blocks:
                self.runs.popleft()
                self._num_entries -= len(blocks)
            else:
                self.runs[0] = (stamp, live[num_blocks:])
                self._num_entries -= len(blocks) - len(live) + num_blocks
                live = live[:num_blocks]
            taken.append(live)
            num_blocks -= len(live)
        out = taken[0] if len(taken) == 1 else np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
        self.stamp_of[out] = -1
        self.count -= len(out)
        return out

    def blocks(self) -> list[int]:
        """The queued blocks, least recently released first."""
        return [b for stamp, run in self.runs for b in self._live(stamp, run).tolist()]

    def _live(self, stamp: int, run: np.ndarray) -> np.ndarray:
        """The blocks of a run still queued in it (not used again, nor released again since)."""
        return run[self.stamp_of[run] == stamp]

    def _compact(self) -> None:
        runs = [(stamp, self._live(stamp, run)) for stamp, run in self.runs]
        self.runs = deque((stamp, run) for stamp, run in runs if len(run))
        self._num_entries = sum(len(run) for _, run in self.runs)


class PrefixCache:
    """Reference counts and content keys of one pool's blocks, and the cached blocks nobody uses.

    Attributes:
        evictable: cached blocks with no user, least recently released first (``EvictionQueue``).
        num_queried_tokens: prompt tokens looked up on admission (vLLM's ``prefix_cache_queries``).
        num_hit_tokens: of those, tokens found cached (vLLM's ``prefix_cache_hits``).

    NOTE: per-block state is in arrays and changed a table at a time (numpy, ``dict.update``, ``map``):
    a loop over a long prompt's blocks in Python made a simulation with caching 10x slower than without.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.ref_counts = np.zeros(pool.num_blocks, dtype=np.int32)  # tables holding each block
        self.is_cached = np.zeros(pool.num_blocks, dtype=bool)  # registered under a key
        self.key_of = np.zeros(pool.num_blocks, dtype=np.int64)  # its key, where is_cached
        # The index (see the module docstring): group key -> first place in slots; per place, the block
        # cached there (-1: none; lazily cleaned); per cached block, its place. The groups in the order
        # of their places (what rebuilding the index needs): their keys, first places and sizes.
        self.group_base: dict[int, int] = {}
        self.slots = np.full(1024, -1, dtype=np.int64)
        self.place_of = np.zeros(pool.num_blocks, dtype=np.int64)
        self.num_places = 0
        self._placed: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.evictable = EvictionQueue(pool.num_blocks)
        self._last_match: tuple[list[int], np.ndarray] = ([], _NO_BLOCKS)  # see ``_ids``
        # What ``match`` found for each prompt since the cached content last changed (a block registered
        # or evicted): a policy that looks its whole queue up every step looks each prompt up once
        # while nothing is registered or evicted (FastServe's and SRTF's steps between admissions).
        self._matches: dict[BlockIndex, tuple[int, tuple[list[int], np.ndarray]]] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted_blocks = 0
        # Table entries beyond a block's first holder: sum of (ref count - 1) over used blocks. A
        # shared block holds its tokens' KV once, so the tokens in use are the requests' minus these.
        self.num_extra_refs = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: never-used ones and cached ones nobody uses."""
        return self.pool.num_free + len(self.evictable)

    def match(self, index: BlockIndex, limit: int) -> list[int]:
        """The cached blocks of the longest prefix of the prompt ``index`` describes, at most ``limit``."""
        limit = min(limit, len(index.keys))
        if limit <= 0:
            return []
        known = self._matches.get(index)
        if known is None or known[0] != limit:
            known = self._matches[index] = (limit, self._find(index, limit))
        self._last_match = known[1]
        return known[1][0]

    def _find(self, index: BlockIndex, limit: int) -> tuple[list[int], np.ndarray]:
        """``match``'s blocks, as a list and as an array."""
        get, group_keys = self.group_base.get, index.group_keys
        bases = []
        for g in range(int(index.group_of_block[limit - 1]) + 1):
            base = get(group_keys[g])
            if base is None:
                break
            bases.append(base)
        if not bases:
            return [], _NO_BLOCKS  # the common miss, after one lookup
        if len(bases) < len(group_keys):
            limit = min(limit, int(index.group_starts[len(bases)]))
        blocks = self.slots[np.array(bases)[index.group_of_block[:limit]] + index.offsets[:limit]]
        # NOTE: a place no block was put in holds -1, which indexes the last block: the first test masks it
        live = (blocks >= 0) & self.is_cached[blocks] & (self.key_of[blocks] == index.keys[:limit])
        found = limit if np.count_nonzero(live) == limit else int(live.argmin())
        return blocks[:found].tolist(), blocks[:found]

    def _ids(self, blocks: Sequence[int] | np.ndarray) -> np.ndarray:
        """``block_ids(blocks)``; for the list the last ``match`` returned, its array, kept from the match:
        a hit is checked (``num_evictable``) and shared with no conversion. NOTE: right while that list is
        unchanged; callers copy it before changing it (a table starts as ``[*cached, *new]``)."""
        last_list, last_array = self._last_match
        if blocks is last_list and len(blocks) == len(last_array):
            return last_array
        return block_ids(blocks)

    def cached_keys(self) -> np.ndarray:
        """The keys of the blocks cached now, sorted (int64): what a fleet's router matches prompts against,
        by binary search. NOTE: an array, not a list or a set: a GPU's cache holds ~30k blocks, reported every
        100 ms (what each costs: benchmarks/RESULTS.md)."""
        return np.sort(self.key_of[self.is_cached])

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` nobody uses (taking them lowers the free count)."""
        return int(np.count_nonzero(self.ref_counts[self._ids(blocks)] == 0))

    def num_released(self, tables: Sequence[Sequence[int] | np.ndarray]) -> int:
        """How many blocks would be free (or cached with no user) once every one of ``tables`` let go:
        those no other table holds. A block several of them share counts once."""
        tables = [t for t in tables if len(t)]
        if not tables:
            return 0
        if len(tables) == 1:
            return int(np.count_nonzero(self.ref_counts[self._ids(tables[0])] == 1))
        blocks, holders = np.unique(np.concatenate([self._ids(t) for t in tables]), return_counts=True)
        return int(np.count_nonzero(self.ref_counts[blocks] == holders))

    def share(self, blocks: Sequence[int]) -> None:
        """One more request uses ``blocks`` (found by ``match``)."""
        if not blocks:
            return
        idx = self._ids(blocks)
        held = self.ref_counts[idx] > 0
        self.evictable.remove(idx[~held])
        self.num_extra_refs += int(np.count_nonzero(held))
        self.ref_counts[idx] += 1  # NOTE: no block twice in one table, so no index repeats

    def allocate(self, num_blocks: int, keep_free: int = 0) -> list[int] | None:
        """``num_blocks`` blocks for one request, never-used first (leaving ``keep_free`` of them in the
        pool), then evicting cached ones; None (nothing taken) when fewer are free."""
        pool, evictable = self.pool, self.evictable
        if num_blocks + keep_free > pool.num_free + len(evictable):
            return None
        fresh = min(num_blocks, max(pool.num_free - keep_free, 0))
        blocks = pool.allocate(fresh) if fresh else []
        assert blocks is not None
        if fresh == 1:
            self.ref_counts[blocks[0]] = 1  # NOTE: a decode's growth: a scalar store, not an array op
        elif fresh:
            self.ref_counts[block_ids(blocks)] = 1
        if num_blocks > fresh:
            evicted = self._evict(num_blocks - fresh)
            self.ref_counts[evicted] = 1
            blocks += evicted.tolist()
        return blocks

    def evict_to_pool(self, num_blocks: int) -> None:
        """Evict the ``num_blocks`` least recently released cached blocks into the pool: blocks
        reserved by count must be in the pool, as they would be gone from the cache once taken."""
        self.pool.release(self._evict(num_blocks).tolist())

    def _evict(self, num_blocks: int) -> np.ndarray:
        """The ``num_blocks`` least recently released cached blocks, no longer cached."""
        evicted = self.evictable.pop(num_blocks)
        self.is_cached[evicted] = False  # NOTE: their places in the index are now stale
        if len(evicted):
            self._matches.clear()
        self.num_evicted_blocks += len(evicted)
        return evicted

    def release(self, blocks: Sequence[int]) -> None:
        """A request lets go of its table ``blocks``: each block whose last user this was goes back to
        the pool, or, when cached, to the end of ``evictable`` (the table's tail first)."""
        idx = block_ids(blocks)[::-1]
        counts = self.ref_counts[idx] - 1
        self.ref_counts[idx] = counts
        num_held = int(np.count_nonzero(counts))  # still held by another request
        self.num_extra_refs -= num_held
        unused = idx[counts == 0] if num_held else idx
        cached = self.is_cached[unused]
        self.evictable.push(unused[cached])
        self.pool.release(unused[~cached].tolist())

    def register(self, blocks: Sequence[int], index: BlockIndex, start: int) -> None:
        """``blocks`` now hold the computed KV of the prompt's blocks ``start``, ``start + 1``, ... that
        ``index`` describes. A key cached before under another block (two requests computed it side by
        side) now names the new block; the older one stays cached, found by no one, until evicted."""
        end = start + len(blocks)
        if end == start:
            return
        self._matches.clear()
        if self.num_places > 4 * self.pool.num_blocks + 4096:
            self._rebuild_index()
        first, last = int(index.group_of_block[start]), int(index.group_of_block[end - 1]) + 1
        bases = list(map(self.group_base.get, index.group_keys[first:last]))
        if None in bases:
            self._place_groups(index.group_keys[first:last], index.group_sizes[first:last], bases)
        idx = block_ids(blocks)
        places = np.array(bases)[index.group_of_block[start:end] - first] + index.offsets[start:end]
        self.slots[places] = idx
        self.place_of[idx] = places
        self.key_of[idx] = index.keys[start:end]
        self.is_cached[idx] = True

    def _place_groups(self, keys: list[int], sizes: list[int], bases: list[int | None]) -> None:
        """New places for the groups of ``keys`` that have none (None in ``bases``, set here)."""
        placed_keys, placed_bases, placed_sizes = self._placed
        for i, base in enumerate(bases):
            if base is None:
                bases[i] = self.group_base[keys[i]] = self.num_places
                placed_keys.append(keys[i])
                placed_bases.append(self.num_places)
                placed_sizes.append(sizes[i])
                self.num_places += sizes[i]
        if self.num_places > len(self.slots):
            grown = np.full(max(2 * len(self.slots), self.num_places), -1, dtype=np.int64)
            grown[: len(self.slots)] = self.slots
            self.slots = grown

    def _rebuild_index(self) -> None:
        """The index of the blocks it finds now alone: groups none of whose blocks is found drop out. A
        block cached under a key registered again since (``register``) stays out, found by no one."""
        cached = np.flatnonzero(self.is_cached)
        places = self.place_of[cached]
        found = (places >= 0) & (self.slots[places] == cached)
        self.place_of[cached[~found]] = -1  # NOTE: out of the index for good (until registered again)
        cached, places = cached[found], places[found]
        keys, bases, sizes = (np.array(column, dtype=np.int64) for column in self._placed)
        group = np.searchsorted(bases, places, side="right") - 1  # of each cached block
        kept = np.unique(group)
        new_bases = np.cumsum(sizes[kept]) - sizes[kept]
        new_places = new_bases[np.searchsorted(kept, group)] + places - bases[group]
        self.num_places = int(sizes[kept].sum())
        self.slots = np.full(max(2 * self.num_places, 1024), -1, dtype=np.int64)
        self.slots[new_places] = cached
        self.place_of[cached] = new_places
        self._placed = (keys[kept].tolist(), new_bases.tolist(), sizes[kept].tolist())
        self.group_base = dict(zip(self._placed[0], self._placed[1]))

    def check(self, tables: Sequence[Sequence[int]]) -> None:
        """Raise AssertionError unless the counts match ``tables`` (every block table on this pool)."""
        counts = np.zeros(self.pool.num_blocks, dtype=np.int32)
        for table in tables:
            assert len(set(table)) == len(table), "a table holds a block twice"
            counts[list(table)] += 1
        assert np.array_equal(counts, self.ref_counts), "reference counts differ from the block tables"
        assert self.num_extra_refs == int(np.maximum(counts - 1, 0).sum()), "shared references miscounted"
        free = set(self.pool.free_ids())
        cached = set(np.flatnonzero(self.is_cached).tolist())
        evictable = self.evictable.blocks()
        assert len(evictable) == len(set(evictable)) == len(self.evictable), "the eviction queue miscounts"
        assert not free & set(evictable), "a block is both free and cached-evictable"
        assert all(counts[b] == 0 and b in cached for b in evictable), "an evictable block is used or unkeyed"
        assert not free & cached, "a free block is still cached"
        # (-1: a duplicate of a key registered again since, found by no one)
        assert (self.place_of[sorted(cached)] < self.num_places).all(), "a cached block has no place"
        assert list(self.group_base.values()) == self._placed[1], "the index's groups miscounted"
        used = int(np.count_nonzero(counts))
        assert used + len(free) + len(self.evictable) == self.pool.num_blocks, "used + free + evictable != capacity"

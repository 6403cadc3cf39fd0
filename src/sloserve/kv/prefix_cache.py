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
segment's 32 blocks are found, and registered, through one dict entry and a few array operations;
the places of groups that sit side by side (placed together) are one range.

NOTE: the index is cleaned lazily: a place counts only while the block there is cached at that place
(``place_of``), so evicting a block, or registering a group's content again under newer blocks (two
requests computed it side by side), is an array store, not a deletion; the index is rebuilt from the
cached blocks when its places outgrow the pool eight times over (or its groups twice).

NOTE: a block is registered when the step that computes its KV is scheduled (``KVCacheManager.
cache_blocks``, as vLLM v1), not when it is allocated: a prompt allocated whole and computed in chunks
registers chunk by chunk, and one preempted before computing a block never leaves it to be found.
Partial blocks are never registered, so a request never writes into a block another one reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from sloserve.core.prefix import BlockIndex, mix_block_keys
from sloserve.kv.block_pool import BlockPool

# ``PrefixCache.place_of`` of a block not cached, and of one cached but in no place of the index.
NOT_CACHED, UNINDEXED = -1, -2
# The index is rebuilt when its places outgrow eight times the pool's blocks, or its groups twice, by this.
INDEX_SLACK = 4096
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
    stale entry, told apart by its stamp, and is skipped when reached; only the runs it left are
    filtered (most runs are taken whole or in slices, with no look at their stamps).

    NOTE: runs, not one entry per block: the simulator frees a long prompt's 750 blocks with a few
    array operations. Stale entries are dropped when the runs hold more than twice the pool's blocks.
    """

    def __init__(self, num_blocks: int) -> None:
        self.runs: deque[tuple[int, np.ndarray]] = deque()  # (stamp, blocks), oldest first
        self.stamp_of = np.full(num_blocks, -1, dtype=np.int64)  # the run a block was last queued in; -1: none
        self._next_stamp = 0
        self._num_entries = 0  # entries in the runs, stale ones included
        self._dirty: set[int] = set()  # the stamps of runs that may hold stale entries
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
        self._dirty.update(self.stamp_of[blocks].tolist())
        self.stamp_of[blocks] = -1
        self.count -= len(blocks)

    def pop(self, num_blocks: int) -> np.ndarray:
        """The ``num_blocks`` least recently released blocks, out of the queue (``num_blocks`` <= len)."""
        taken = []
        while num_blocks > 0:
            stamp, run = self.runs[0]
            live = run
            if stamp in self._dirty:  # filtered once: what is left of it is live
                live = self._live(stamp, run)
                self._dirty.discard(stamp)
            if len(live) <= num_blocks:
                self.runs.popleft()
                self._num_entries -= len(run)
            else:
                self.runs[0] = (stamp, live[num_blocks:])
                self._num_entries -= len(run) - len(live) + num_blocks
                live = live[:num_blocks]
            taken.append(live)
            num_blocks -= len(live)
        out = taken[0] if len(taken) == 1 else np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
        # NOTE: their stamps stay: no run holds them now (taken off the oldest runs, which hold no stale
        # entry of a block queued later), and a block comes back only by ``push``, with a new stamp
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
        self._dirty.clear()
        self.runs = deque((stamp, run) for stamp, run in runs if len(run))
        self._num_entries = sum(len(run) for _, run in self.runs)


class PrefixCache:
    """Reference counts and index places of one pool's blocks, and the cached blocks nobody uses.

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
        # The index (see the module docstring): group key -> first place in slots; per place, the block
        # cached there (-1: none; lazily cleaned); per block, its place (NOT_CACHED, or UNINDEXED: cached
        # but found by no one). The groups in the order of their places (what rebuilding the index and
        # ``cached_keys`` need): their keys, first places, sizes and first blocks in a prompt.
        self.group_base: dict[int, int] = {}
        self.slots = np.full(1024, -1, dtype=np.int64)
        self.place_of = np.full(pool.num_blocks, NOT_CACHED, dtype=np.int64)
        self.num_places = 0
        self._placed: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        self.evictable = EvictionQueue(pool.num_blocks)
        self._last_match: tuple[list[int], np.ndarray] = ([], _NO_BLOCKS)  # see ``ids``
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
        limit = min(limit, index.num_blocks)
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
        for g in range(index.group_of(limit - 1) + 1):
            base = get(group_keys[g])
            if base is None:
                break
            bases.append(base)
        if not bases:
            return [], _NO_BLOCKS  # the common miss, after one lookup
        if len(bases) < len(group_keys):
            limit = min(limit, index.group_starts[len(bases)])
        places = self._places(index, bases, 0, 0, limit)
        blocks = self.slots[places]
        # NOTE: a place no block was put in holds -1, which indexes the last block, whose place is not this
        # one (a block's place is set with the slot, and a slot never goes back to -1 but in a rebuild)
        live = self.place_of[blocks] == places
        found = limit if np.count_nonzero(live) == limit else int(live.argmin())
        return blocks[:found].tolist(), blocks[:found]

    @staticmethod
    def _places(index: BlockIndex, bases: list[int], first: int, start: int, end: int) -> np.ndarray:
        """(end - start,) int64: the places of the prompt's blocks ``start`` to ``end - 1``, held by its
        groups ``first``, ``first + 1``, ... whose first places are ``bases``."""
        last = first + len(bases)
        starts = index.group_starts[first:last]
        shifts = [base - group_start for base, group_start in zip(bases, starts)]  # place - block, per group
        if shifts.count(shifts[0]) == len(shifts):
            # NOTE: the common case: groups placed together (a prompt's new groups, or those it finds, placed
            # by one earlier prompt) sit side by side, as they do in the prompt (its groups tile its blocks)
            return np.arange(start + shifts[0], end + shifts[0], dtype=np.int64)
        counts = index.group_sizes[first:last]
        counts[0] -= start - starts[0]  # (the range may begin and end inside a group)
        counts[-1] = end - max(start, starts[-1])
        return np.array(shifts, dtype=np.int64).repeat(counts) + np.arange(start, end, dtype=np.int64)

    def ids(self, blocks: Sequence[int] | np.ndarray) -> np.ndarray:
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
        _, places, group = self._indexed()
        keys, bases, starts = (np.array(self._placed[i], dtype=np.int64) for i in (0, 1, 3))
        return np.sort(mix_block_keys(keys[group], starts[group] + places - bases[group], self.pool.block_size))

    def _indexed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The cached blocks the index finds, their places, and the group (in ``_placed``'s order) each
        place is in. Not among them: a block whose place a newer block of its content took since."""
        cached = np.flatnonzero(self.place_of >= 0)
        places = self.place_of[cached]
        found = self.slots[places] == cached
        cached, places = cached[found], places[found]
        sizes = self._placed[2]
        return cached, places, np.arange(len(sizes)).repeat(sizes)[places]  # (groups tile the places)

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` nobody uses (taking them lowers the free count)."""
        return int(np.count_nonzero(self.ref_counts[self.ids(blocks)] == 0))

    def num_released(self, tables: Sequence[Sequence[int] | np.ndarray], taken: Sequence[int] = ()) -> int:
        """How many blocks would be free (or cached with no user) once every one of ``tables`` let go:
        those no other table holds, but those in ``taken`` (blocks found for requests about to take them).
        A block several of them share counts once."""
        tables = [t for t in tables if len(t)]
        if not tables:
            return 0
        if len(tables) == 1 and not len(taken):
            return int(np.count_nonzero(self.ref_counts[self.ids(tables[0])] == 1))
        blocks, holders = np.unique(np.concatenate([self.ids(t) for t in tables]), return_counts=True)
        released = blocks[self.ref_counts[blocks] == holders]
        if len(taken):
            released = np.setdiff1d(released, block_ids(taken))
        return len(released)

    def share(self, blocks: Sequence[int]) -> None:
        """One more request uses ``blocks`` (found by ``match``)."""
        if not blocks:
            return
        idx = self.ids(blocks)
        held = self.ref_counts[idx] > 0
        self.evictable.remove(idx[~held])
        self.num_extra_refs += int(np.count_nonzero(held))
        self.ref_counts[idx] += 1  # NOTE: no block twice in one table, so no index repeats

    def allocate(self, num_blocks: int, keep_free: int = 0) -> list[int] | None:
        """``num_blocks`` blocks for one request, never-used first (leaving ``keep_free`` of them in the
        pool), then evicting cached ones; None (nothing taken) when fewer are free."""
        fresh = self._num_fresh(num_blocks, keep_free)
        if fresh is None:
            return None
        blocks = self.pool.allocate(fresh) if fresh else []
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

    def allocate_ids(self, num_blocks: int, keep_free: int = 0) -> np.ndarray | None:
        """``allocate``'s blocks as an int64 array (a new table's: no list converted back and forth)."""
        fresh = self._num_fresh(num_blocks, keep_free)
        if fresh is None:
            return None
        ids = block_ids(self.pool.allocate(fresh)) if fresh else _NO_BLOCKS
        if num_blocks > fresh:
            evicted = self._evict(num_blocks - fresh)
            ids = np.concatenate((ids, evicted)) if fresh else evicted
        self.ref_counts[ids] = 1
        return ids

    def _num_fresh(self, num_blocks: int, keep_free: int) -> int | None:
        """How many of ``num_blocks`` blocks come from the pool (never used), the rest evicted; None when
        fewer than ``num_blocks`` are free beyond ``keep_free`` never-used ones."""
        num_free = self.pool.num_free
        if num_blocks + keep_free > num_free + len(self.evictable):
            return None
        return min(num_blocks, max(num_free - keep_free, 0))

    def evict_to_pool(self, num_blocks: int) -> None:
        """Evict the ``num_blocks`` least recently released cached blocks into the pool: blocks
        reserved by count must be in the pool, as they would be gone from the cache once taken."""
        self.pool.release(self._evict(num_blocks).tolist())

    def reset(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): the cached blocks nobody uses go back
        to the pool, counted as evicted (a policy that remembers its lookups sees the cache changed), and
        no prompt finds them again. False, and nothing changed, while a request holds a block."""
        if self.ref_counts.any():
            return False
        self.evict_to_pool(len(self.evictable))
        # NOTE: every block is in the pool now, none cached: what is left of the index are stale places
        self.group_base.clear()
        self.slots.fill(-1)
        self.num_places = 0
        self._placed = ([], [], [], [])
        self._matches.clear()
        self._last_match = ([], _NO_BLOCKS)
        return True

    def _evict(self, num_blocks: int) -> np.ndarray:
        """The ``num_blocks`` least recently released cached blocks, no longer cached."""
        evicted = self.evictable.pop(num_blocks)
        self.place_of[evicted] = NOT_CACHED  # NOTE: their places in the index are now stale
        if len(evicted):
            self._matches.clear()
        self.num_evicted_blocks += len(evicted)
        return evicted

    def release(self, blocks: Sequence[int], num_cached: int | None = None) -> None:
        """A request lets go of its table ``blocks``: each block whose last user this was goes back to
        the pool, or, when cached, to the end of ``evictable`` (the table's tail first). ``num_cached``,
        where the caller knows it: the table's first ``num_cached`` blocks are cached, the rest not."""
        ids = block_ids(blocks)
        idx = ids[::-1]
        counts = self.ref_counts[idx] - 1
        self.ref_counts[idx] = counts
        num_held = int(np.count_nonzero(counts))  # still held by another request
        self.num_extra_refs -= num_held
        if num_cached is not None:  # (no lookup of which are cached)
            cached = ids[:num_cached][::-1]
            if num_held:  # NOTE: only cached blocks are shared (found by a lookup): the rest have one user
                cached = cached[self.ref_counts[cached] == 0]
            self.evictable.push(cached)
            self.pool.release(ids[num_cached:][::-1].tolist())
            return
        unused = idx[counts == 0] if num_held else idx
        cached = self.place_of[unused] != NOT_CACHED
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
        pool = self.pool.num_blocks
        if self.num_places > 8 * pool + INDEX_SLACK or len(self.group_base) > 2 * pool + INDEX_SLACK:
            # NOTE: a place costs 8 bytes, a group a dict entry and four list items (~100x): a trace's
            # groups of 32 blocks wait for the first bound, an engine's one-block groups for the second
            self._rebuild_index()
        assert index.block_size == self.pool.block_size, (index.block_size, self.pool.block_size)
        first, last = index.group_of(start), index.group_of(end - 1) + 1
        bases = list(map(self.group_base.get, index.group_keys[first:last]))
        if None in bases:
            self._place_groups(index, first, bases)
        idx = block_ids(blocks)
        places = self._places(index, bases, first, start, end)
        self.slots[places] = idx
        self.place_of[idx] = places

    def _place_groups(self, index: BlockIndex, first: int, bases: list[int | None]) -> None:
        """New places for the groups ``first``, ``first + 1``, ... of ``index`` that have none (None in
        ``bases``, set here)."""
        placed_keys, placed_bases, placed_sizes, placed_starts = self._placed
        for i, base in enumerate(bases):
            if base is None:
                key, size = index.group_keys[first + i], index.group_sizes[first + i]
                bases[i] = self.group_base[key] = self.num_places
                placed_keys.append(key)
                placed_bases.append(self.num_places)
                placed_sizes.append(size)
                placed_starts.append(index.group_starts[first + i])
                self.num_places += size
        if self.num_places > len(self.slots):
            grown = np.full(max(2 * len(self.slots), self.num_places), -1, dtype=np.int64)
            grown[: len(self.slots)] = self.slots
            self.slots = grown

    def _rebuild_index(self) -> None:
        """The index of the blocks it finds now alone: groups none of whose blocks is found drop out. A
        block cached under a key registered again since (``register``) stays out, found by no one."""
        cached, places, group = self._indexed()
        # NOTE: the blocks not found are out of the index for good (until registered again); the found
        # ones get their new places below
        self.place_of[self.place_of >= 0] = UNINDEXED
        keys, bases, sizes, starts = (np.array(column, dtype=np.int64) for column in self._placed)
        is_kept = np.zeros(len(bases), dtype=bool)
        is_kept[group] = True
        kept = np.flatnonzero(is_kept)  # the groups some block is found in (np.unique's, without a sort)
        new_bases = np.cumsum(sizes[kept]) - sizes[kept]
        new_places = new_bases[(np.cumsum(is_kept) - 1)[group]] + places - bases[group]
        self.num_places = int(sizes[kept].sum())
        self.slots.fill(-1)  # NOTE: not shrunk: it would only grow again, a copy each doubling
        self.slots[new_places] = cached
        self.place_of[cached] = new_places
        self._placed = (keys[kept].tolist(), new_bases.tolist(), sizes[kept].tolist(), starts[kept].tolist())
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
        cached = set(np.flatnonzero(self.place_of != NOT_CACHED).tolist())
        evictable = self.evictable.blocks()
        assert len(evictable) == len(set(evictable)) == len(self.evictable), "the eviction queue miscounts"
        assert not free & set(evictable), "a block is both free and cached-evictable"
        assert all(counts[b] == 0 and b in cached for b in evictable), "an evictable block is used or unkeyed"
        assert not free & cached, "a free block is still cached"
        places = self.place_of[sorted(cached)]  # (UNINDEXED: registered again since, found by no one)
        assert ((places == UNINDEXED) | ((places >= 0) & (places < self.num_places))).all(), "a cached block's place"
        assert list(self.group_base.values()) == self._placed[1], "the index's groups miscounted"
        used = int(np.count_nonzero(counts))
        assert used + len(free) + len(self.evictable) == self.pool.num_blocks, "used + free + evictable != capacity"

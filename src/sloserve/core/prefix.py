"""What a prompt's KV blocks hold, for prefix caching: one key per full block, chained as vLLM v1's
block hashes are (a block's key hashes its parent's key with its own content), so two blocks share a
key only when their tokens and every token before them are the same.

A prompt is known by its tokens (``TokenPrompt``: the engine) or, in a simulation, by the content ids
of its segments (``SegmentedPrompt``: a trace's ``hash_ids``, where Mooncake's 512-token segment k
of two requests holds the same tokens when their ids agree up to k; a conversation's system prompt,
turns and answers).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

# The parent key of a prompt's first block. NOTE: any fixed int: Python hashes tuples of ints the same
# in every process (PYTHONHASHSEED applies to str and bytes only), so keys are reproducible.
ROOT_KEY = 0
_MIX = np.int64(0x9E3779B97F4A7C15 - (1 << 64))  # odd (2^64 / golden ratio), as a signed 64-bit int


def chain_keys(contents: Iterable[Hashable], parent: int = ROOT_KEY) -> list[int]:
    """Chained keys of consecutive blocks: key_j = hash((key_{j-1}, content_j))."""
    keys = []
    for content in contents:
        parent = hash((parent, content))
        keys.append(parent)
    return keys


@dataclass(frozen=True, eq=False)
class BlockIndex:
    """A prompt's full blocks as the prefix cache indexes them: each block's key, and the groups of
    consecutive blocks the cache finds through one entry of its table (a trace segment's blocks; each
    block alone when the content is known by its tokens).

    NOTE: a group's key names its content and everything before it, as a block's key does, so the
    blocks of a group sit at the same places (``offsets``) in every prompt that holds the group.
    """

    keys: np.ndarray  # (num_blocks,) int64: block j's key
    group_keys: list[int]  # (num_groups,) the key of each group, in order
    group_starts: np.ndarray  # (num_groups,) int64: its first block in the prompt
    group_sizes: list[int]  # (num_groups,) blocks in its full extent (a clipped prompt may hold fewer)
    group_of_block: np.ndarray  # (num_blocks,) int64: the group block j is in
    offsets: np.ndarray  # (num_blocks,) int64: block j's place in its group

    @classmethod
    def one_block_per_group(cls, keys: list[int]) -> BlockIndex:
        blocks = np.arange(len(keys), dtype=np.int64)
        return cls(np.array(keys, dtype=np.int64), keys, blocks, [1] * len(keys), blocks, np.zeros_like(blocks))


@dataclass(eq=False)
class SegmentedPrompt:
    """A prompt of ``num_tokens`` tokens known by the content ids of consecutive segments: segment k
    holds tokens ``[segment_ends[k - 1], segment_ends[k])`` (from 0) and has id ``segment_ids[k]``;
    equal ids mean equal tokens there and before. The last segment may reach past ``num_tokens`` (a
    prompt clipped to the model's context keeps its first segments' ids)."""

    segment_ids: tuple[int, ...]
    segment_ends: tuple[int, ...]
    num_tokens: int
    namespace: int = ROOT_KEY  # the first segment's parent key: ids of two traces never match
    _index: dict[int, BlockIndex] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        ends = self.segment_ends
        if len(ends) != len(self.segment_ids) or not ends or ends[-1] < self.num_tokens:
            raise ValueError(f"segments ending at {ends[-3:]}... cannot cover {self.num_tokens} tokens")
        if any(b <= a for a, b in zip((0, *ends), ends)):
            raise ValueError("segment ends must increase")

    @classmethod
    def uniform(
        cls, segment_ids: tuple[int, ...], segment_tokens: int, num_tokens: int, namespace: int = ROOT_KEY
    ) -> SegmentedPrompt:
        """Segments of ``segment_tokens`` tokens each (a trace's ``hash_ids``: Mooncake's are 512)."""
        ends = tuple(range(segment_tokens, (len(segment_ids) + 1) * segment_tokens, segment_tokens))
        return cls(tuple(segment_ids), ends, num_tokens, namespace)

    def block_keys(self, block_size: int) -> list[int]:
        """The keys of the prompt's full blocks of ``block_size`` tokens (a partial last block has none)."""
        return self.block_index(block_size).keys.tolist()

    def block_index(self, block_size: int) -> BlockIndex:
        """The prompt's full blocks of ``block_size`` tokens, grouped by the segment that holds each
        block's last token.

        NOTE: keys are chained by segment, not by block: block j's key mixes the chained key of the
        segment holding its last token with its start, ``segment_key * MIX + start`` in 64-bit
        arithmetic (MIX odd: for two different segment keys, a collision has probability 2^-64). Two
        blocks share it exactly when their tokens and all before them do, as with a per-block chain,
        for one array operation per prompt (a 12k-token prompt has 750 blocks of 16); a group's key is
        that segment's chained key, so the cache finds a 512-token segment's 32 blocks by one entry."""
        index = self._index.get(block_size)
        if index is None:
            num_blocks = self.num_tokens // block_size
            # Segment k's group: the blocks whose last token is in it, [lo // block_size, hi // block_size)
            # for its tokens [lo, hi) (none when it ends inside the block it starts in).
            group_keys, group_starts, group_sizes, num_held = [], [], [], []
            lo = 0
            for key, hi in zip(chain_keys(self.segment_ids, self.namespace), self.segment_ends):
                first, end = lo // block_size, hi // block_size
                if first >= num_blocks:
                    break
                if end > first:
                    group_keys.append(key)
                    group_starts.append(first)
                    group_sizes.append(end - first)
                    num_held.append(min(end, num_blocks) - first)  # (a clipped prompt holds fewer)
                lo = hi
            starts = np.array(group_starts, dtype=np.int64)
            group_of_block = np.repeat(np.arange(len(starts), dtype=np.int64), num_held)  # (num_blocks,)
            block_starts = np.arange(num_blocks, dtype=np.int64) * block_size  # first token of each block
            keys = np.array(group_keys, dtype=np.int64)[group_of_block] * _MIX + block_starts  # wraps around 2^64
            index = self._index[block_size] = BlockIndex(
                keys,
                group_keys,
                starts,
                group_sizes,
                group_of_block,
                np.arange(num_blocks, dtype=np.int64) - starts[group_of_block],
            )
        return index

    def token_ids(self, vocab_size: int) -> list[int]:
        """Token ids for the ``num_tokens`` tokens: each segment's drawn from a generator seeded by its
        chained key, so equal content (the same ids up to a segment) is the same tokens wherever it
        appears, and a real engine caching by tokens finds the blocks a simulation finds by ids."""
        tokens: list[int] = []
        start = 0
        for key, end in zip(chain_keys(self.segment_ids, self.namespace), self.segment_ends, strict=True):
            if start >= self.num_tokens:
                break
            rng = np.random.default_rng(key % (1 << 64))
            tokens += rng.integers(0, vocab_size, size=end - start).tolist()[: self.num_tokens - start]
            start = end
        return tokens


@dataclass(eq=False)
class TokenPrompt:
    """A request's tokens, by their ids. ``token_ids`` may grow (the engine appends each token it
    samples to the same list): the keys of the full blocks it gains follow, so an answer's blocks are
    cached for the next turn that resends it."""

    token_ids: Sequence[int]
    _keys: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _index: dict[int, BlockIndex] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def block_keys(self, block_size: int) -> list[int]:
        """The keys of the full blocks of ``block_size`` tokens so far (a partial last block has none)."""
        keys = self._keys.setdefault(block_size, [])
        full = len(self.token_ids) // block_size
        if len(keys) < full:  # NOTE: a full block's tokens never change: only new blocks are keyed
            ids = self.token_ids
            new = (tuple(ids[j * block_size : (j + 1) * block_size]) for j in range(len(keys), full))
            keys += chain_keys(new, keys[-1] if keys else ROOT_KEY)
        return keys

    def block_index(self, block_size: int) -> BlockIndex:
        """The full blocks so far, each its own group (the engine knows every block by its tokens)."""
        keys = self.block_keys(block_size)
        index = self._index.get(block_size)
        if index is None or len(index.keys) != len(keys):
            index = self._index[block_size] = BlockIndex.one_block_per_group(list(keys))
        return index


PromptBlocks = SegmentedPrompt | TokenPrompt


def segment_hash_ids(token_ids: Sequence[int], segment_tokens: int = 512) -> list[int]:
    """A prompt's prefix structure in Mooncake's trace format: one id per segment of
    ``segment_tokens`` tokens (the last may be partial), chained so that equal ids mean equal tokens
    there and before; non-negative (a trace's ``hash_ids``). A served request's log line carries them,
    so a served day replays with its real sharing."""
    segments = (tuple(token_ids[i : i + segment_tokens]) for i in range(0, len(token_ids), segment_tokens))
    return [key & ((1 << 63) - 1) for key in chain_keys(segments)]

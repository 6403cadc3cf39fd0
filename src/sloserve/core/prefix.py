"""What a prompt's KV blocks hold, for prefix caching: one key per full block, chained as vLLM v1's
block hashes are (a block's key hashes its parent's key with its own content), so two blocks share a
key only when their tokens and every token before them are the same.

A prompt is known by its tokens (``TokenPrompt``: the engine) or, in a simulation, by the content ids
of its segments (``SegmentedPrompt``: a trace's ``hash_ids``, where Mooncake's 512-token segment k
of two requests holds the same tokens when their ids agree up to k; a conversation's system prompt,
turns and answers). A request's ``cache_salt`` (vLLM's) is the parent key of its first block
(``salted_root_key``): prompts of different salts share no block.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

# The parent key of a prompt's first block. NOTE: any fixed int: Python hashes tuples of ints the same
# in every process (PYTHONHASHSEED applies to str and bytes only), so keys are reproducible.
ROOT_KEY = 0
_MIX = np.int64(0x9E3779B97F4A7C15 - (1 << 64))  # odd (2^64 / golden ratio), as a signed 64-bit int


def salted_root_key(cache_salt: str | None) -> int:
    """The parent key of the first block of a prompt salted with ``cache_salt`` (None: ``ROOT_KEY``), the
    same in every process (the engine's, a fleet's router)."""
    if cache_salt is None:
        return ROOT_KEY
    digest = hashlib.sha256(cache_salt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def chain_keys(contents: Iterable[Hashable], parent: int = ROOT_KEY) -> list[int]:
    """Chained keys of consecutive blocks: key_j = hash((key_{j-1}, content_j))."""
    keys = []
    for content in contents:
        parent = hash((parent, content))
        keys.append(parent)
    return keys


def mix_block_keys(group_keys: np.ndarray, blocks: np.ndarray, block_size: int) -> np.ndarray:
    """The keys of blocks from their groups' keys and their places in the prompt: ``group_key * MIX +
    block * block_size`` in 64-bit arithmetic (wrapping; MIX odd: two different group keys collide with
    probability 2^-64)."""
    return group_keys * _MIX + blocks * block_size


@dataclass(frozen=True, eq=False)
class BlockIndex:
    """A prompt's full blocks as the prefix cache indexes them: groups of consecutive blocks the cache
    finds through one entry of its table (a trace segment's blocks; each block alone when the content
    is known by its tokens).

    A block's key is its group's key mixed with its place (``mix_block_keys``): two blocks share it
    exactly when their tokens and all before them do. NOTE: a group's key names its content and
    everything before it, so a group starts at the same block, and holds the same blocks, in every
    prompt that holds it. The index is kept per group, not per block (a 12k-token prompt has 750
    blocks of 16 but 24 segments): the cache turns the range of blocks it needs into places with a few
    array operations, and ``keys`` are computed only when asked for (a fleet's router).
    """

    block_size: int
    num_blocks: int  # full blocks of the prompt
    group_keys: list[int]  # (num_groups,) the key of each group, in order
    group_starts: list[int]  # (num_groups,) its first block in the prompt
    group_sizes: list[int]  # (num_groups,) blocks in its full extent (a clipped prompt's last holds fewer)

    @classmethod
    def one_block_per_group(cls, keys: list[int], block_size: int) -> BlockIndex:
        return cls(block_size, len(keys), keys, list(range(len(keys))), [1] * len(keys))

    def group_of(self, block: int) -> int:
        """The group that holds block ``block`` (0 <= block < num_blocks)."""
        return bisect_right(self.group_starts, block) - 1

    @cached_property
    def keys(self) -> np.ndarray:
        """(num_blocks,) int64: block j's key."""
        held = [*self.group_sizes[:-1], self.num_blocks - self.group_starts[-1]] if self.num_blocks else []
        group_keys = np.array(self.group_keys, dtype=np.int64).repeat(held)
        return mix_block_keys(group_keys, np.arange(self.num_blocks, dtype=np.int64), self.block_size)


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
    segment_tokens: int = 0  # every segment's tokens, where they are all alike (``uniform``); else 0
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
        return cls(tuple(segment_ids), ends, num_tokens, namespace, segment_tokens)

    def block_keys(self, block_size: int) -> list[int]:
        """The keys of the prompt's full blocks of ``block_size`` tokens (a partial last block has none)."""
        return self.block_index(block_size).keys.tolist()

    def block_index(self, block_size: int) -> BlockIndex:
        """The prompt's full blocks of ``block_size`` tokens, grouped by the segment that holds each
        block's last token. NOTE: keys are chained by segment, not by block (``BlockIndex``): one hash
        per segment, and a 512-token segment's 32 blocks are found through one entry of the cache."""
        index = self._index.get(block_size)
        if index is None:
            index = self._index[block_size] = self._build_index(block_size)
        return index

    def _build_index(self, block_size: int) -> BlockIndex:
        num_blocks = self.num_tokens // block_size
        per_segment = self.segment_tokens // block_size
        if per_segment and self.segment_tokens % block_size == 0:
            # Uniform segments of whole blocks (a trace's hash_ids): segment k is group k, whole
            num_groups = -(-num_blocks // per_segment)
            starts = list(range(0, num_groups * per_segment, per_segment))
            keys = chain_keys(self.segment_ids[:num_groups], self.namespace)
            return BlockIndex(block_size, num_blocks, keys, starts, [per_segment] * num_groups)
        # Segment k's group: the blocks whose last token is in it, [lo // block_size, hi // block_size)
        # for its tokens [lo, hi) (none when it ends inside the block it starts in).
        group_keys, group_starts, group_sizes = [], [], []
        lo, key = 0, self.namespace
        for segment_id, hi in zip(self.segment_ids, self.segment_ends):
            first, end = lo // block_size, hi // block_size
            if first >= num_blocks:
                break  # (the segments past the clipped prompt are not hashed)
            key = hash((key, segment_id))  # chain_keys, a segment at a time
            if end > first:
                group_keys.append(key)
                group_starts.append(first)
                group_sizes.append(end - first)
            lo = hi
        return BlockIndex(block_size, num_blocks, group_keys, group_starts, group_sizes)

    def token_ids(self, vocab_size: int, num_tokens: int | None = None) -> list[int]:
        """Token ids for the first ``num_tokens`` tokens (default: all ``self.num_tokens``; a conversation
        turn's content reaches past its prompt, over the answer it gets): each segment's drawn from a
        generator seeded by its chained key, so equal content (the same ids up to a segment) is the same
        tokens wherever it appears, and a real engine caching by tokens finds the blocks a simulation
        finds by ids."""
        num_tokens = self.num_tokens if num_tokens is None else min(num_tokens, self.num_tokens)
        tokens: list[int] = []
        start = 0
        for key, end in zip(chain_keys(self.segment_ids, self.namespace), self.segment_ends, strict=True):
            if start >= num_tokens:
                break
            rng = np.random.default_rng(key % (1 << 64))
            tokens += rng.integers(0, vocab_size, size=end - start).tolist()[: num_tokens - start]
            start = end
        return tokens


@dataclass(eq=False)
class TokenPrompt:
    """A request's tokens, by their ids. ``token_ids`` may grow (the engine appends each token it
    samples to the same list): the keys of the full blocks it gains follow, so an answer's blocks are
    cached for the next turn that resends it."""

    token_ids: Sequence[int]
    root_key: int = ROOT_KEY  # the first block's parent key (``salted_root_key``)
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
            keys += chain_keys(new, keys[-1] if keys else self.root_key)
        return keys

    def block_index(self, block_size: int) -> BlockIndex:
        """The full blocks so far, each its own group (the engine knows every block by its tokens)."""
        keys = self.block_keys(block_size)
        index = self._index.get(block_size)
        if index is None or index.num_blocks != len(keys):
            index = self._index[block_size] = BlockIndex.one_block_per_group(list(keys), block_size)
        return index


PromptBlocks = SegmentedPrompt | TokenPrompt


def segment_hash_ids(token_ids: Sequence[int], segment_tokens: int = 512, root_key: int = ROOT_KEY) -> list[int]:
    """A prompt's prefix structure in Mooncake's trace format: one id per segment of
    ``segment_tokens`` tokens (the last may be partial), chained so that equal ids mean equal tokens
    there and before; non-negative (a trace's ``hash_ids``). A served request's log line carries them,
    so a served day replays with its real sharing (``root_key``: its salt's, which no other salt shares)."""
    segments = (tuple(token_ids[i : i + segment_tokens]) for i in range(0, len(token_ids), segment_tokens))
    return [key & ((1 << 63) - 1) for key in chain_keys(segments, root_key)]

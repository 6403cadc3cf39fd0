"""Prefix caching for models with state layers (Mamba-2 mixers, short convolutions: ``engine/state_cache.py``).

A cached prefix's KV is not enough for such a model: its state layers carry a state from token to token, and a
request that skips computing a prefix must start from the states at the prefix's end. Those states exist only
where they were saved, so a prefix is found only up to a point that has its states here: the KV manager's
``find_cached_prefix`` keeps the longest run of cached blocks whose last block ends at a saved state.

Which states are saved: each admitted prompt's at the end of its last full block before its last token (its
block ``(L - 1) // block_size``), once per content: the point the next turn of a conversation (which resends
this prompt and its answer) and a resent prompt find. (vLLM keeps states at every block of a prefix, or at the
ends of large blocks; one point a prompt holds one state where a prompt's KV takes a block per 16 tokens.)

The states live in ``num_entries`` entries (the engine's ``StateCache`` holds them beside the requests' slots),
least recently used evicted first. The engine copies an entry into a request's slot before the request's first
chunk (``loads``) and writes one in the forward pass of the step that computes its point (``pending``); the
simulator keeps the same books, so both find the same prefixes.

NOTE: an entry is written by the forward pass that computes its point, after the step's loads were copied (at
the step's start, on the same stream): a save may take an entry a request admitted in the same step loads
from (``evicted`` keeps it findable until the step ends), and a saved entry is findable from the next step on
(``end_step``: the step's chunks counted, its pending states become entries).
"""

from __future__ import annotations

from collections import OrderedDict

from sloserve.core.request import Request


class CachedStates:
    """The books of ``num_entries`` saved states: which block key each holds, which are being written, which
    each newly admitted request starts from."""

    def __init__(self, num_entries: int) -> None:
        self.num_entries = num_entries
        self.entry_of: OrderedDict[int, int] = OrderedDict()  # block key -> entry; least recently used first
        self.pending: dict[Request, tuple[int, int, int]] = {}  # owner -> (block key, position, entry) to write
        self._pending_keys: set[int] = set()
        self.evicted: dict[int, int] = {}  # block key -> entry taken for a save this step (its states still hold)
        self.loads: dict[Request, int] = {}  # a request admitted this step with a hit -> the entry it starts from
        self._free = list(range(num_entries - 1, -1, -1))
        self.num_saved = self.num_loaded = 0

    def longest(self, keys, num_blocks: int) -> int:
        """The most leading blocks, at most ``num_blocks`` of the prompt whose block keys are ``keys``, whose
        last block ends at a saved state (0: none)."""
        for n in range(num_blocks, 0, -1):
            key = int(keys[n - 1])
            if key in self.entry_of or key in self.evicted:
                return n
        return 0

    def use(self, request: Request, key: int) -> None:
        """``request`` starts from the states saved at the block ``key`` (``longest`` found them this step)."""
        entry = self.entry_of.get(key)
        if entry is None:
            entry = self.evicted[key]
        else:
            self.entry_of.move_to_end(key)
        self.loads[request] = entry
        self.num_loaded += 1

    def reserve(self, owner: Request, key: int, position: int) -> None:
        """Save ``owner``'s states at ``position`` (the end of the block ``key``) in an entry, unless they are
        saved or being saved: a free entry, else the least recently used one's."""
        if key in self.entry_of or key in self._pending_keys or owner in self.pending:
            return
        if self._free:
            entry = self._free.pop()
        elif self.entry_of:
            old_key, entry = self.entry_of.popitem(last=False)
            self.evicted[old_key] = entry
        else:
            return  # every entry is being written
        self.pending[owner] = (key, position, entry)
        self._pending_keys.add(key)

    def release(self, owner: Request) -> None:
        """``owner`` leaves the GPU (finished, preempted, aborted): its pending save becomes an entry if its
        point was computed, else its entry is free again."""
        held = self.pending.pop(owner, None)
        if held is None:
            return
        key, position, entry = held
        self._pending_keys.discard(key)
        if owner.num_computed_tokens >= position:
            self._add(key, entry)
        else:
            self._free.append(entry)

    def end_step(self) -> None:
        """The step ran and its chunks were counted: the states it saved are entries from now on."""
        for owner in [r for r, (_, position, _) in self.pending.items() if r.num_computed_tokens >= position]:
            key, _, entry = self.pending.pop(owner)
            self._pending_keys.discard(key)
            self._add(key, entry)
        self.evicted.clear()
        self.loads.clear()

    def clear(self) -> None:
        """Forget every saved state (the prefix cache was reset); no request may be saving or loading one."""
        assert not self.pending and not self.loads, "states are being saved or loaded"
        self.entry_of.clear()
        self.evicted.clear()
        self._free = list(range(self.num_entries - 1, -1, -1))

    def _add(self, key: int, entry: int) -> None:
        self.entry_of[key] = entry
        self.num_saved += 1

    def check(self) -> None:
        """Raise AssertionError unless every entry is free, saved or being written, once."""
        held = [*self._free, *self.entry_of.values(), *(e for _, _, e in self.pending.values())]
        assert sorted(held) == list(range(self.num_entries)), held
        assert self._pending_keys == {key for key, _, _ in self.pending.values()}

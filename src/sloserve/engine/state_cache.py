"""The states a model's recurrent layers keep for each request (Mamba-2 mixers, ``models/mamba2.py``; short
convolutions, ``models/short_conv.py``; gated DeltaNets, ``models/gated_delta_net.py``), beside the KV cache of its attention layers: a request's states take
one slot of ``StateCache`` from its first chunk until it finishes or is preempted by recompute (``StateSlots``).
The KV manager admits at most as many requests as there are slots (``KVCacheManager.max_requests``), so a
request that starts always finds one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.core.request import Request


class StateCache:
    """Every state layer's states of ``num_slots`` requests: ``conv`` (layers, slots, conv_dim, width - 1), its
    convolution's last inputs, in the model's dtype; ``ssm`` (layers, slots, *``state_recurrence_shape``) float32,
    the recurrent ones (a Mamba-2 mixer's h, a gated DeltaNet's S; None for short convolutions alone). A slot's states are overwritten by its request's first
    chunk (or copied from a saved entry), never read before. One more slot, ``pad_slot``, belongs to no request:
    a decode graph's padding rows read and write it (``cuda_graphs.DecodeGraphs``). Then ``num_entries`` slots of
    states saved for prefix caching (``entry_slot``: ``kv/cached_states.py``'s entries)."""

    def __init__(
        self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device, num_entries: int = 0
    ) -> None:
        layers, total = config.num_state_layers, num_slots + 1 + num_entries
        shape = (layers, total, config.state_conv_dim, config.state_conv_width - 1)
        self.conv = torch.zeros(shape, dtype=dtype, device=device)
        self.ssm = None
        if config.state_recurrence_shape is not None:
            self.ssm = torch.zeros((layers, total, *config.state_recurrence_shape), dtype=torch.float32, device=device)
        self.num_slots = self.pad_slot = num_slots
        self.num_entries = num_entries

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        """The states of one request, every state layer's."""
        return config.request_state_bytes(dtype.itemsize)

    def entry_slot(self, entry: int) -> int:
        """The slot of saved entry ``entry``."""
        return self.num_slots + 1 + entry

    def copy(self, source: int, dest: int) -> None:
        """Slot ``dest``'s states := slot ``source``'s (every layer's)."""
        self.conv[:, dest] = self.conv[:, source]
        if self.ssm is not None:
            self.ssm[:, dest] = self.ssm[:, source]

    def clear(self, slot: int) -> None:
        """Zero ``slot``'s states (a request whose first token runs as a decode reads them)."""
        self.conv[:, slot] = 0
        if self.ssm is not None:
            self.ssm[:, slot] = 0


@dataclass
class StateMetadata:
    """A step's requests' states: each prefill's (query_start, query_len, state slot, whether it goes on from a
    state an earlier chunk left), each decode's flat token and slot; the cache that holds them."""

    prefills: list[tuple[int, int, int, bool]]
    decode_rows: torch.Tensor  # (num_decodes,) int64: AttentionMetadata.decode_token_index
    decode_slots: torch.Tensor  # (num_decodes,) int64
    cache: StateCache
    # prefix caching: a prefill's query_start -> (k, slot): the states after its first k tokens (0 < k < its length)
    # saved in that slot too (a save at a chunk's end is the executor's copy after the forward pass)
    saves: dict[int, tuple[int, int]] = field(default_factory=dict)

    def scan_prefills(self, states: torch.Tensor, scan: Callable[[slice, torch.Tensor | None], torch.Tensor]) -> None:
        """Run each prefill's recurrence (a Mamba-2 scan, the delta rule) through ``scan(rows, the state before
        them or None for zeros) -> the state after them``, which writes those rows' outputs: from its slot's state
        where it goes on from an earlier chunk, in two runs where prefix caching saves the state after its first k
        tokens (``saves``: that state copied to the saved slot). ``states``: a layer's recurrent states (slots,
        ...), each prefill's slot left holding its last."""
        for start, length, slot, goes_on in self.prefills:
            state = states[slot] if goes_on else None
            save = self.saves.get(start)
            if save is not None:
                k, saved = save
                state = states[saved] = scan(slice(start, start + k), state)
                start, length = start + k, length - k
            states[slot] = scan(slice(start, start + length), state)


class StateSlots:
    """Which slot each request's states take (``of``), the others free."""

    def __init__(self, cache: StateCache) -> None:
        self.cache = cache
        self.of: dict[Request, int] = {}
        self._free = list(range(cache.num_slots - 1, -1, -1))

    def slot(self, request: Request) -> int:
        """``request``'s slot, taken now if it has none. NOTE: one is free: the KV manager holds at most
        ``num_slots`` requests (``max_requests``), and a request holds its slot only while it holds KV blocks."""
        slot = self.of.get(request)
        if slot is None:
            slot = self.of[request] = self._free.pop()
        return slot

    def keep_only(self, holders: Collection[Request]) -> None:
        """Free the slots of the requests not among ``holders`` (those holding KV blocks now): finished,
        aborted, or preempted by recompute (their states go with their KV)."""
        for request in [r for r in self.of if r not in holders]:
            self._free.append(self.of.pop(request))

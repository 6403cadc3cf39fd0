"""CUDA graphs of decode steps: a decode-only step replays one captured graph of the forward pass
instead of launching each layer's kernels one by one from Python (vLLM's CUDA graph runner).

Why: a decode step of a 32-layer model launches about 20 kernels a layer. At a few microseconds of
Python and launch time each, the host needs as long as the GPU takes to read the weights, so an eager
decode step is bound by the host, not by memory bandwidth. A replay is one launch.

How: a graph replays fixed kernels on fixed addresses, so each graph is captured for one batch size
(``batch_sizes``: 1, 2, 4, then every multiple of 8, as vLLM) on static input buffers, and a step of
``b`` decodes runs the graph of the smallest captured size ``>= b``: its ``b`` rows are copied into
the buffers and the other rows are padding. A padding row is token 0 at position 0 whose K/V is
written to, and read from, the KV cache's ``pad_slot`` only, so it never touches a request's cache.

Each row's context comes as block ids (the KV manager's ``block_id_tables``, ``table_block_size``
tokens an entry), and the graph expands them to the slot table the attention reads: with a block
manager the host builds and copies a block-size share of the slot table (a batch of 256 x 1k
contexts: 128 KiB, not 2 MiB); the token-slot managers' entries are single slots.
The tables are as wide as the longest context (``max_context``); a row's entries past its context
length are never read. NOTE: the expanded table takes 8 bytes x largest size x ``max_context`` of
device memory (16 MiB at 256 x 8k; 256 MiB at 256 x 128k), in the graphs' memory pool, taken after
the KV cache from the share of memory the engine leaves free (``GPU_MEMORY_UTILIZATION``); the host keeps
two pinned buffers to copy the block-id tables from, each as large as the largest table yet (``InputStaging``:
at most 2 x 8 bytes x largest size x ``max_context`` / g, 2 MiB at 256 x 8k with blocks of 16).

A model with state layers (Mamba-2's, short convolutions': ``state_cache.py``) takes each row's state slot as
one more input; a padding row reads and writes the state cache's ``pad_slot``.

Only decode-only steps are replayed; a step with a prefill chunk runs eagerly. Capturing needs the
Triton attention backend: the PyTorch reference groups decodes by length on the host
(``AttentionMetadata.decode_groups``), which a graph cannot replay.

``capture=False`` runs the same padded static-buffer path eagerly, without a graph: that is how the CPU
tests check the padding, which is everything here that does not need a GPU.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from sloserve.engine.async_scheduling import InputStaging
from sloserve.engine.attention import AttentionMetadata
from sloserve.engine.kv_cache import KVCacheTensor, expand_block_ids
from sloserve.engine.state_cache import StateCache, StateMetadata

# vLLM's capture sizes: 1, 2, 4, then every multiple of 8 (up to the largest batch).
CAPTURE_SIZE_STEP = 8
DEFAULT_MAX_BATCH_SIZE = 256  # vLLM's default max_num_seqs; larger decode batches run eagerly
WARMUP_RUNS = 2  # eager runs before each capture: Triton compiles, cuBLAS picks its kernels

# Rows of DecodeGraphs.inputs.
TOKEN_IDS, POSITIONS, SLOT_WRITTEN, CONTEXT_LEN, STATE_SLOT = range(5)


def padded_sizes(first: tuple[int, ...], step: int, largest: int) -> list[int]:
    """Sizes that get graphs: ``first`` (those below ``largest``), every multiple of ``step``, and
    ``largest`` itself."""
    return [*(n for n in first if n < largest), *range(step, largest, step), largest]


def capture_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ... and ``max_batch_size`` itself."""
    return padded_sizes((1, 2, 4), CAPTURE_SIZE_STEP, max_batch_size)


def capture_graph(run: Callable[[], Any], pool: Any, device: torch.device) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``run`` captured in a CUDA graph sharing ``pool``, after ``WARMUP_RUNS`` eager runs; (the graph,
    what the captured run returned: the tensors a replay writes)."""
    for _ in range(WARMUP_RUNS):
        run()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output


class DecodeGraphs:
    """The decode-step graphs of one model on one KV cache, and their static input buffers."""

    def __init__(
        self,
        model: nn.Module,
        cache: KVCacheTensor,
        max_context: int,
        table_block_size: int,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        *,
        capture: bool = True,
        batch_sizes: list[int] | None = None,
        states: StateCache | None = None,
    ) -> None:
        """``table_block_size``: tokens per block id of the KV manager's ``block_id_tables``;
        ``batch_sizes``: the sizes captured (a benchmark's few), by default ``capture_sizes(max_batch_size)``;
        ``states``: a model's requests' states (state layers': None without them)."""
        self.model, self.cache, self.max_context, self.states = model, cache, max_context, states
        self.table_block_size = g = table_block_size
        assert cache.pad_slot % g == 0 and g <= cache.block_size, "the pad block is a whole table block"
        self.pad_block = cache.pad_slot // g  # expands to pad_slot, pad_slot + 1, ... (the cache's pad block)
        self.batch_sizes = sorted(batch_sizes) if batch_sizes else capture_sizes(max_batch_size)
        self.capture = capture
        device = cache.gpu.device
        n = self.batch_sizes[-1]
        # NOTE: a replay reads whatever these buffers hold, so a step copies its batch into them and
        # fills the remaining rows of its graph's size with padding (``_padding``).
        self.inputs = torch.from_numpy(self._padding(n)).to(device)  # (5, n) rows: TOKEN_IDS ... STATE_SLOT
        width = -(-max_context // g)
        self.block_ids = torch.full((n, width), self.pad_block, dtype=torch.int64, device=device)  # (n, L / g)
        self._staged_inputs, self._staged_tables = InputStaging(device), InputStaging(device)
        self.token_index = torch.arange(n, dtype=torch.int64, device=device)  # (n,) decode i is flat token i
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> (size, H) hidden states a replay writes
        if capture:
            self._capture_all()

    def _padding(self, size: int) -> np.ndarray:
        """(5, size) input rows of padding: token 0 at position 0, writing and reading the pad slot (and the state
        cache's)."""
        rows = np.empty((5, size), dtype=np.int64)
        rows[TOKEN_IDS], rows[POSITIONS], rows[SLOT_WRITTEN], rows[CONTEXT_LEN] = 0, 0, self.cache.pad_slot, 1
        rows[STATE_SLOT] = 0 if self.states is None else self.states.pad_slot
        return rows

    def _metadata(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.inputs[SLOT_WRITTEN, :size],
            prefills=[],
            decode_token_index=self.token_index[:size],
            decode_slots=expand_block_ids(self.block_ids[:size], self.table_block_size),  # (size, >= L)
            decode_context_lens=self.inputs[CONTEXT_LEN, :size],
        )
        if self.states is not None:
            meta.states = StateMetadata([], self.token_index[:size], self.inputs[STATE_SLOT, :size], self.states)
        return meta

    def _forward(self, size: int) -> torch.Tensor:  # (size, H)
        return self.model(
            self.inputs[TOKEN_IDS, :size], self.inputs[POSITIONS, :size], self.cache.gpu, self._metadata(size)
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # NOTE: the buffers hold padding only, so the warm-up runs and the capture write nothing but
        # the pad slot. Largest size first: the smaller graphs then fit in the memory pool it made.
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):
            run = functools.partial(self._forward, size)
            self.graphs[size], self.outputs[size] = capture_graph(run, pool, self.cache.gpu.device)
        torch.cuda.synchronize(self.cache.gpu.device)

    def fits(self, num_decodes: int, longest_context: int) -> bool:
        """Whether a decode-only step of this shape runs here (else it runs eagerly)."""
        return 0 < num_decodes <= self.batch_sizes[-1] and longest_context <= self.max_context

    def forward(
        self,
        token_ids: list[int],  # (b,) each decode's new token
        positions: list[int],  # (b,)
        context_lens: np.ndarray,  # (b,) context tokens, the new one included
        slots_written: np.ndarray,  # (b,) slot of each new token
        block_ids: np.ndarray,  # (b, >= max(context_lens) / g) block_id_tables of the contexts
        late_tokens: tuple[torch.Tensor, torch.Tensor] | None = None,  # (P,) decodes, (P,) their tokens
        state_slots: list[int] | None = None,  # (b,) each decode's slot of the state cache (state layers)
    ) -> torch.Tensor:  # (b, H) hidden states
        """Run a decode-only step of ``b`` decodes (decode ``i`` is flat token ``i``) on the graph of
        the smallest captured size that holds it. ``late_tokens``: the new tokens of those decodes, on
        the device (async scheduling)."""
        b, width = block_ids.shape
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
        host = self._padding(self.batch_sizes[-1])  # (5, n): all of the buffer, so its copy is one piece
        host[TOKEN_IDS, :b] = token_ids
        host[POSITIONS, :b] = positions
        host[SLOT_WRITTEN, :b] = slots_written
        host[CONTEXT_LEN, :b] = context_lens
        if state_slots is not None:
            host[STATE_SLOT, :b] = state_slots
        self._staged_inputs.copy(self.inputs, host)
        self._staged_tables.copy(self.block_ids[:b, :width], block_ids)
        self.block_ids[b:size, 0] = self.pad_block  # a padding row reads the pad slot only
        if late_tokens is not None:
            self.inputs[TOKEN_IDS][late_tokens[0]] = late_tokens[1]
        if not self.capture:
            return self._forward(size)[:b]
        self.graphs[size].replay()
        return self.outputs[size][:b]

"""Piecewise CUDA graphs: a step with a prefill replays captured graphs of everything between two
attention calls, and runs attention itself eagerly between them (vLLM's piecewise CUDA graphs).

Why: decode-only steps replay one graph each (``cuda_graphs.DecodeGraphs``), but a step with a prefill
ran eagerly, launching about 20 kernels a layer from Python: on the H200 (2026-11-26) such a step
took a flat 12.8-14.2 ms up to 256 tokens, the host's launch time, where a graphed decode step took
6.3 ms. Attention cannot be captured for every shape (its metadata, the prefills' lengths and
contexts, change every step), but everything else in a layer is per token: its kernels depend only
on the step's token count.

How: the forward pass of a model with ``supports_piecewise_graphs`` is cut at its attention calls into
L + 1 pieces: the embeddings, the rotary tables and layer 0's half before attention; layer i - 1's
half after attention with layer i's before it; the last layer's after half and the final norm. Each
piece reads and writes static buffers (the step's tokens and positions, q, k and v, the residual
stream, the attention's output, the hidden states), so it is captured once per token count
(``token_sizes``: 8, 16, then every multiple of 32 up to ``max_num_tokens``) and a step of ``T`` tokens
runs on the smallest size ``S >= T``: its tokens are copied in and the other ``S - T`` rows are padding
(token 0 at position 0) whose K/V is written to the KV cache's ``pad_slot`` only and which no
prefill or decode reads. Attention runs eagerly on the first ``S`` rows between the pieces, with the
step's own metadata (its slot mapping padded with ``pad_slot``).

NOTE: a step replays L + 1 graphs and launches each layer's attention kernels (the KV write, the
kernels, a copy of their output into the static buffer): about 5 launches a layer, not 20; the
padding rows cost their share of every matmul (at most 31 tokens past 32).

``capture=False`` runs the same pieces on the same padded buffers eagerly, without graphs: that is how
the CPU tests check everything but the capture. Off unless ``SLOSERVE_PIECEWISE_GRAPHS=1`` is in the
environment (written without a GPU, 2026-11-28: ``benchmarks/gpu_session.sh`` turns it on and times it).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
from torch import nn

from sloserve.engine.async_scheduling import copy_to_device
from sloserve.engine.attention import AttentionMetadata
from sloserve.engine.cuda_graphs import capture_graph, padded_sizes
from sloserve.engine.kv_cache import KVCacheTensor
from sloserve.engine.switches import switch

# Steps of more tokens run eagerly: their matmuls outlast the host's launches (vLLM's largest capture
# size is 512 too).
DEFAULT_MAX_NUM_TOKENS = 512
TOKEN_SIZE_STEP = 32


def token_sizes(max_num_tokens: int) -> list[int]:
    """Token counts that get graphs: 8, 16, then every multiple of 32, and ``max_num_tokens`` itself."""
    return padded_sizes((8, 16), TOKEN_SIZE_STEP, max_num_tokens)


class PiecewiseGraphs:
    """The piecewise graphs of one model on one KV cache, and their static buffers."""

    def __init__(
        self,
        model: nn.Module,
        cache: KVCacheTensor,
        max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS,
        *,
        capture: bool = True,
        sizes: list[int] | None = None,
    ) -> None:
        assert model.supports_piecewise_graphs, f"{type(model).__name__} has no pieces"
        self.model, self.cache, self.capture = model, cache, capture
        self.sizes = sorted(sizes) if sizes else token_sizes(max_num_tokens)
        self.layers = model.model.layers
        config, n = model.config, self.sizes[-1]
        nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        device, dtype = cache.gpu.device, cache.gpu.dtype

        def buffer(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=kind, device=device)

        # NOTE: every piece reads and writes these, so a replay finds its inputs where the capture did.
        self.token_ids, self.positions = buffer(n, kind=torch.int64), buffer(n, kind=torch.int64)  # (n,) each
        self.cos, self.sin = buffer(n, 1, hd), buffer(n, 1, hd)  # (n, 1, hd) rotary tables of the positions
        self.q, self.k, self.v = buffer(n, nh, hd), buffer(n, nkv, hd), buffer(n, nkv, hd)
        self.residual = buffer(n, config.hidden_size)  # (n, H) the stream with the last layer's output in it
        self.attended = buffer(n, nh, hd)  # (n, nh, hd) the attention's output, copied in
        self.hidden = buffer(n, config.hidden_size)  # (n, H) the final hidden states
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (size, piece) -> graph
        if capture:
            self._capture_all()

    # --- the pieces, over the first ``size`` rows of the buffers ------------------------------------
    def _piece(self, size: int, piece: int) -> Callable[[], None]:
        """Piece 0: embeddings, rotary tables, layer 0 up to attention; piece i (1..L-1): layer i - 1
        after attention, layer i up to it; piece L: the last layer after attention, the final norm."""
        rows = slice(0, size)
        num_layers = len(self.layers)

        def store_attention_inputs(q, k, v, residual) -> None:
            self.q[rows].copy_(q)
            self.k[rows].copy_(k)
            self.v[rows].copy_(v)
            self.residual[rows].copy_(residual)

        def first() -> None:
            x, cos, sin = self.model.embed(self.token_ids[rows], self.positions[rows])
            self.cos[rows].copy_(cos)
            self.sin[rows].copy_(sin)
            store_attention_inputs(*self.layers[0].before_attention(x, None, self.cos[rows], self.sin[rows]))

        def between() -> None:
            x, residual = self.layers[piece - 1].after_attention(self.attended[rows], self.residual[rows])
            layer = self.layers[piece]
            store_attention_inputs(*layer.before_attention(x, residual, self.cos[rows], self.sin[rows]))

        def last() -> None:
            x, residual = self.layers[-1].after_attention(self.attended[rows], self.residual[rows])
            self.hidden[rows].copy_(self.model.model.norm.add_and_norm(x, residual)[0])

        return first if piece == 0 else last if piece == num_layers else between

    def _run(self, size: int, piece: int) -> None:
        if self.capture:
            self.graphs[size, piece].replay()
        else:
            self._piece(size, piece)()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # NOTE: the buffers hold zeros, which the warm-up runs and the captures read; nothing here touches
        # the KV cache (attention is not in a piece). Largest size first: the smaller graphs then fit in
        # the memory pool it made.
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            for piece in range(len(self.layers) + 1):
                self.graphs[size, piece], _ = capture_graph(self._piece(size, piece), pool, self.cache.gpu.device)
        torch.cuda.synchronize(self.cache.gpu.device)

    # --- a step ------------------------------------------------------------------------------------------
    def fits(self, num_tokens: int) -> bool:
        """Whether a step of this many tokens runs here (else it runs eagerly)."""
        return 0 < num_tokens <= self.sizes[-1]

    def size_for(self, num_tokens: int) -> int:
        """The token count of the graphs a step of ``num_tokens`` tokens runs on."""
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def forward(
        self,
        token_ids: list[int],  # (T,)
        positions: list[int],  # (T,)
        meta: AttentionMetadata,  # the step's, its slot_mapping padded to size_for(T) with the pad slot
        late_tokens: tuple[torch.Tensor, torch.Tensor] | None = None,  # (P,) flat indices, (P,) their tokens
    ) -> torch.Tensor:  # (T, H) hidden states
        """Run a step of ``T`` tokens: the pieces of the smallest size that holds it, attention between.
        ``late_tokens``: the tokens at those flat indices, on the device (async scheduling)."""
        t = len(token_ids)
        size = self.size_for(t)
        assert meta.slot_mapping.numel() == size, "the slot mapping covers the padding rows"
        copy_to_device(self.token_ids[:size], torch.tensor(token_ids + [0] * (size - t), dtype=torch.int64))
        copy_to_device(self.positions[:size], torch.tensor(positions + [0] * (size - t), dtype=torch.int64))
        if late_tokens is not None:
            self.token_ids[late_tokens[0]] = late_tokens[1]
        rows = slice(0, size)
        kv = self.cache.gpu  # (2, layers, num_slots, nkv, hd)
        self._run(size, 0)
        for i, layer in enumerate(self.layers):
            attended = layer.self_attn.backend.forward(
                self.q[rows], self.k[rows], self.v[rows], kv[0, i], kv[1, i], meta
            )  # (size, nh, hd)
            self.attended[rows].copy_(attended)
            self._run(size, i + 1)
        return self.hidden[:t]


def piecewise_graphs_for(model: nn.Module, cache: KVCacheTensor, cuda_graphs: bool) -> PiecewiseGraphs | None:
    """The engine's piecewise graphs: with CUDA graphs on, ``SLOSERVE_PIECEWISE_GRAPHS=1`` and a model
    that has the pieces; else None (steps with a prefill run eagerly)."""
    if not (switch("SLOSERVE_PIECEWISE_GRAPHS") and cuda_graphs and getattr(model, "supports_piecewise_graphs", False)):
        return None
    return PiecewiseGraphs(model, cache)

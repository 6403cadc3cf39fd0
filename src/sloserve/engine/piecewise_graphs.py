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
the CPU tests check everything but the capture. On with CUDA graphs unless ``SLOSERVE_PIECEWISE_GRAPHS=0``
is in the environment (written without a GPU, 2026-11-28; on an H200, 2026-12-04, a 64-token prompt's step
took 6.6 ms on the pieces against 15.8 eagerly, a 256-token one 8.8 against 16.9, and the engine on them gave
the eager engine's tokens: ``benchmarks/RESULTS.md``).
``SLOSERVE_COMPILE_PIECES=1`` runs the pieces compiled by ``torch.compile`` (``compiled_pieces``; written
without a GPU too, 2026-11-29: ``gpu_session.sh compile`` times it).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from sloserve.engine.async_scheduling import InputStaging
from sloserve.engine.attention import AttentionMetadata
from sloserve.engine.cuda_graphs import capture_graph, padded_sizes
from sloserve.engine.kv_cache import KVCacheTensor, layer_caches
from sloserve.engine.switches import switch

# Steps of more tokens run eagerly: their matmuls outlast the host's launches (vLLM's largest capture
# size is 512 too).
DEFAULT_MAX_NUM_TOKENS = 512
TOKEN_SIZE_STEP = 32


def token_sizes(max_num_tokens: int) -> list[int]:
    """Token counts that get graphs: 8, 16, then every multiple of 32, and ``max_num_tokens`` itself."""
    return padded_sizes((8, 16), TOKEN_SIZE_STEP, max_num_tokens)


# The pieces, as functions of the modules and buffers they use (rows of the static buffers, each of the
# step's S rows): each writes its outputs into the buffers given, the next piece's or attention's inputs.
def first_piece(
    model: nn.Module,
    token_ids: torch.Tensor,  # (S,)
    positions: torch.Tensor,  # (S,)
    cos: torch.Tensor,  # (S, 1, rotary_dim) written: the rotary tables of the positions
    sin: torch.Tensor,  # (S, 1, rotary_dim) written
    q: torch.Tensor,  # (S, nh, hd) written: layer 0's attention inputs
    k: torch.Tensor,  # (S, nkv, hd) written
    v: torch.Tensor | None,  # (S, nkv, hd) written (None: a keys-only cache's)
    residual: torch.Tensor,  # (S, H) written: the residual stream
) -> None:
    """The embeddings, the rotary tables and layer 0 up to attention."""
    x, step_cos, step_sin = model.embed(token_ids, positions)
    cos.copy_(step_cos)
    sin.copy_(step_sin)
    _store(model.model.layers[0].before_attention(x, None, step_cos, step_sin), q, k, v, residual)


def between_pieces(
    prev: nn.Module,  # layer i - 1
    layer: nn.Module,  # layer i
    attended: torch.Tensor,  # (S, nh, vd) layer i - 1's attention output
    cos: torch.Tensor,  # (S, 1, rotary_dim)
    sin: torch.Tensor,  # (S, 1, rotary_dim)
    q: torch.Tensor,  # (S, nh, hd) written: layer i's attention inputs
    k: torch.Tensor,  # (S, nkv, hd) written
    v: torch.Tensor | None,  # (S, nkv, hd) written (None: a keys-only cache's)
    residual: torch.Tensor,  # (S, H) read, then written: the residual stream
) -> None:
    """Layer i - 1 after attention, layer i up to it."""
    x, stream = prev.after_attention(attended, residual)
    _store(layer.before_attention(x, stream, cos, sin), q, k, v, residual)


def last_piece(
    prev: nn.Module,  # the last layer
    norm: nn.Module,  # the final norm
    attended: torch.Tensor,  # (S, nh, vd) the last layer's attention output
    residual: torch.Tensor,  # (S, H)
    hidden: torch.Tensor,  # (S, H) written: the final hidden states
) -> None:
    """The last layer after attention and the final norm."""
    x, stream = prev.after_attention(attended, residual)
    hidden.copy_(norm.add_and_norm(x, stream)[0])


def _store(attention_inputs: tuple[torch.Tensor | None, ...], *buffers: torch.Tensor | None) -> None:
    for buffer, value in zip(buffers, attention_inputs, strict=True):
        if buffer is not None:  # (v of a keys-only cache: None, as its value)
            buffer.copy_(value)


@functools.cache
def compiled_pieces() -> tuple[Callable[..., None], Callable[..., None], Callable[..., None]]:
    """``first_piece``, ``between_pieces`` and ``last_piece`` compiled by ``torch.compile`` (inductor),
    once per process: the pieces then run inductor's kernels, which fuse the elementwise work between
    the matmuls and the copies into the buffers (the matmuls stay cuBLAS calls).

    NOTE: ``dynamic=True`` and the modules passed as arguments: their parameters are graph inputs, so one
    graph serves every layer and every token count (``between_pieces`` compiles once for all L - 1
    middle pieces). ``emulate_precision_casts`` rounds intermediates to the dtype where the eager
    kernels round (inductor otherwise keeps a fused chain in float32): the outputs are the uncompiled
    pieces' within a rounding (sums in another order), in 16-bit dtypes as in float32. Inside a
    compiled piece ``fused_ops`` gives inductor the PyTorch forms to fuse, not its own Triton kernels."""
    options = {"emulate_precision_casts": True}
    return tuple(torch.compile(f, dynamic=True, options=options) for f in (first_piece, between_pieces, last_piece))


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
        compile: bool = False,
    ) -> None:
        """``compile``: the pieces run ``compiled_pieces`` (compiled at the first size's warm-up run)."""
        assert model.supports_piecewise_graphs, f"{type(model).__name__} has no pieces"
        self.model, self.cache, self.capture, self.compile = model, cache, capture, compile
        self.sizes = sorted(sizes) if sizes else token_sizes(max_num_tokens)
        self.layers = model.model.layers
        config, n = model.config, self.sizes[-1]
        # (a key's numbers; MLA's keys-only cache: one 576-number key a token, its queries 192 a head, no V)
        nh, nkv, hd = config.num_attention_heads, config.kv_cache_heads, config.kv_cache_head_dim
        keys_only = config.kv_cache_value_dim is not None
        device, dtype = cache.gpu.device, cache.gpu.dtype

        def buffer(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=kind, device=device)

        # NOTE: every piece reads and writes these, so a replay finds its inputs where the capture did.
        self.token_ids, self.positions = buffer(n, kind=torch.int64), buffer(n, kind=torch.int64)  # (n,) each
        self._staged_ids, self._staged_positions = InputStaging(device), InputStaging(device)
        rd, tables, kind = config.rotary_dim, config.rotary_table_rows, model.rotary.table_dtype or dtype
        self.cos, self.sin = buffer(n, tables, rd, kind=kind), buffer(n, tables, rd, kind=kind)  # (n, 1 | 2, rd) tables
        self.q, self.k = buffer(n, nh, config.head_dim), buffer(n, nkv, hd)
        self.v = None if keys_only else buffer(n, nkv, hd)
        self.residual = buffer(n, config.hidden_size)  # (n, H) the stream with the last layer's output in it
        self.attended = buffer(n, nh, config.attention_value_dim)  # (n, nh, vd) the attention's output, copied in
        self.hidden = buffer(n, config.hidden_size)  # (n, H) the final hidden states
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (size, piece) -> graph
        model.rotary.tables(device)  # NOTE: built now, not inside the first piece's first run (or its graph)
        if capture:
            self._capture_all()

    # --- the pieces, over the first ``size`` rows of the buffers ------------------------------------
    def _piece(self, size: int, piece: int) -> Callable[[], None]:
        """Piece 0: embeddings, rotary tables, layer 0 up to attention; piece i (1..L-1): layer i - 1
        after attention, layer i up to it; piece L: the last layer after attention, the final norm."""
        r = slice(0, size)
        first, between, last = compiled_pieces() if self.compile else (first_piece, between_pieces, last_piece)
        if piece == 0:
            return lambda: first(
                self.model, self.token_ids[r], self.positions[r], self.cos[r], self.sin[r], *self._attention_inputs(r)
            )
        if piece < len(self.layers):
            prev, layer = self.layers[piece - 1], self.layers[piece]
            return lambda: between(prev, layer, self.attended[r], self.cos[r], self.sin[r], *self._attention_inputs(r))
        return lambda: last(self.layers[-1], self.model.model.norm, self.attended[r], self.residual[r], self.hidden[r])

    def _attention_inputs(self, rows: slice) -> tuple[torch.Tensor, ...]:
        """The buffers a piece leaves the next attention's inputs in: q, k, v (None: keys only) and the
        residual stream."""
        return self.q[rows], self.k[rows], None if self.v is None else self.v[rows], self.residual[rows]

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
        padding = [0] * (size - t)  # (the padding rows: token 0 at position 0)
        self._staged_ids.copy(self.token_ids[:size], np.array(token_ids + padding, dtype=np.int64))
        self._staged_positions.copy(self.positions[:size], np.array(positions + padding, dtype=np.int64))
        if late_tokens is not None:
            self.token_ids[late_tokens[0]] = late_tokens[1]
        rows = slice(0, size)
        kv = self.cache.gpu  # (2, layers, num_slots, nkv, hd)
        self._run(size, 0)
        for i, layer in enumerate(self.layers):
            attended = layer.self_attn.attend(*self._attention_inputs(rows)[:3], *layer_caches(kv, i), meta)
            self.attended[rows].copy_(attended)
            self._run(size, i + 1)
        return self.hidden[:t]


def piecewise_graphs_for(model: nn.Module, cache: KVCacheTensor, cuda_graphs: bool) -> PiecewiseGraphs | None:
    """The engine's piecewise graphs: with CUDA graphs on, a model that has the pieces and unless
    ``SLOSERVE_PIECEWISE_GRAPHS=0``; else None (steps with a prefill run eagerly). Their pieces are compiled with
    ``SLOSERVE_COMPILE_PIECES=1`` too."""
    compile = switch("SLOSERVE_COMPILE_PIECES")  # (read first: a bad value is an error either way)
    pieces = switch("SLOSERVE_PIECEWISE_GRAPHS", default=True)
    if not (pieces and cuda_graphs and getattr(model, "supports_piecewise_graphs", False)):
        return None
    return PiecewiseGraphs(model, cache, compile=compile)

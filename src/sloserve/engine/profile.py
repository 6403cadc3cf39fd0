"""Profile the engine's batch times over a grid of shapes and fit InferMax's linear cost model.

Each grid point is one forward pass (the engine's step without scheduling) of a batch built from
random tokens at contiguous slots: prefill chunks of c tokens after m cached ones, and decode batches
of B requests with m cached tokens each. Every 4th point is held out of the fit and reports the
error a simulation with the fitted preset makes on shapes it was not fitted to.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from sloserve.core.errors import ConfigError
from sloserve.cost import BatchShape, LinearCostModel, LinearFit, fit_linear_shapes
from sloserve.cost.fit import FEATURE_ORDER
from sloserve.engine.attention import AttentionMetadata, PrefillSeq
from sloserve.engine.loader import LoadedModel

HOLD_OUT_EVERY = 4


@dataclass(frozen=True)
class ProfileGrid:
    """The shapes measured: prefill chunks x cached tokens, decode batch sizes x cached tokens each,
    and mixed batches (each decode batch with the middle prefill chunk)."""

    prefill_chunks: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    context_lens: tuple[int, ...] = (0, 512, 2048)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    decode_kv_lens: tuple[int, ...] = (128, 512, 2048)

    def shapes(self, max_model_len: int, max_slots: int) -> list[tuple[list[tuple[int, int]], int, int]]:
        """(prefills as (c, m) pairs, decode batch size, cached tokens per decode) that fit."""
        points = []
        for c in self.prefill_chunks:
            for m in self.context_lens:
                if c + m <= max_model_len and c + m <= max_slots:
                    points.append(([(c, m)], 0, 0))
        for b in self.batch_sizes:
            for m in self.decode_kv_lens:
                if m + 1 <= max_model_len and b * (m + 1) <= max_slots:
                    points.append(([], b, m))
        chunks = [c for c in self.prefill_chunks if c <= max_model_len]
        if chunks:
            c = chunks[len(chunks) // 2]
            for b in self.batch_sizes:
                m = self.decode_kv_lens[len(self.decode_kv_lens) // 2]
                if m + 1 <= max_model_len and b * (m + 1) + c <= max_slots:
                    points.append(([(c, 0)], b, m))
        return points


def _shape(prefills: list[tuple[int, int]], num_decode: int, decode_kv: int) -> BatchShape:
    return BatchShape(
        num_decode=num_decode,
        decode_kv_tokens=num_decode * decode_kv,
        num_prefill=len(prefills),
        prefill_tokens=sum(c for c, _ in prefills),
        prefill_attention_work=sum(c * c + 2 * m * c for c, m in prefills),
        prefill_context_tokens=sum(m for _, m in prefills),
    )


@torch.inference_mode()
def time_batch(
    loaded: LoadedModel,
    kv_cache: torch.Tensor,  # (2, layers, num_slots, nkv, hd)
    prefills: list[tuple[int, int]],
    num_decode: int,
    decode_kv: int,
    *,
    repeats: int = 3,
    generator: torch.Generator | None = None,
) -> float:
    """Median seconds of the forward pass (with logits of each sequence's last token) of this batch."""
    device = loaded.device
    tokens = 0
    pos_parts, slot_parts = [], []
    metas: list[PrefillSeq] = []
    next_slot = 0
    last_rows = []
    for c, m in prefills:
        context = torch.arange(next_slot, next_slot + m + c, device=device)
        metas.append(PrefillSeq(tokens, c, context))
        pos_parts.append(torch.arange(m, m + c, device=device))
        slot_parts.append(context[m:])
        next_slot += m + c
        tokens += c
        last_rows.append(tokens - 1)
    decode_index = torch.arange(tokens, tokens + num_decode, device=device)
    table = (torch.arange(num_decode, device=device)[:, None] * (decode_kv + 1) + next_slot
             + torch.arange(decode_kv + 1, device=device))  # fmt: skip  # (B, m + 1)
    if num_decode:
        pos_parts.append(torch.full((num_decode,), decode_kv, device=device))
        slot_parts.append(table[:, -1])
        last_rows.extend(range(tokens, tokens + num_decode))
    tokens += num_decode
    positions = torch.cat(pos_parts).long()
    ids = torch.randint(0, loaded.config.vocab_size, (tokens,), device=device, generator=generator)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slot_parts).long(),
        prefills=metas,
        decode_token_index=decode_index,
        decode_slots=table if num_decode else torch.zeros((0, 1), dtype=torch.int64, device=device),
        decode_context_lens=torch.full((num_decode,), decode_kv + 1, device=device),
    )
    rows = torch.tensor(last_rows, device=device)
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        hidden = loaded.model(ids, positions, kv_cache, meta)
        loaded.model.compute_logits(hidden[rows]).float().argmax(-1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


@dataclass
class ProfileResult:
    fit: LinearFit
    shapes: list[BatchShape]
    times_s: list[float]
    held_out: list[int]  # indices of the points not used for fitting
    held_out_mean_rel_error: float
    held_out_max_rel_error: float


def profile(
    loaded: LoadedModel,
    grid: ProfileGrid,
    *,
    max_model_len: int,
    max_slots: int,
    name: str,
    repeats: int = 3,
    on_point: Callable[[int, int], None] | None = None,
) -> ProfileResult:
    """Measure every grid point that fits in ``max_slots`` KV slots and fit the linear model on 3 of
    every 4 points; the 4th are held out for the reported error."""
    points = grid.shapes(max_model_len, max_slots)
    if len(points) < 2 * len(FEATURE_ORDER):
        raise ConfigError(
            f"profile: the grid has {len(points)} points within a context of {max_model_len} and "
            f"{max_slots} KV slots; need at least {2 * len(FEATURE_ORDER)} (two per coefficient): add "
            f"prefill chunks, context lengths, batch sizes or decode KV lengths"
        )
    c = loaded.config
    slots = max(sum(cc + m for cc, m in p) + b * (m_d + 1) for p, b, m_d in points)
    cache = torch.zeros((2, c.num_hidden_layers, slots, c.num_key_value_heads, c.head_dim), dtype=loaded.dtype,
                        device=loaded.device)  # fmt: skip
    generator = torch.Generator(device=loaded.device).manual_seed(0)
    shapes, times = [], []
    for i, (prefills, b, m) in enumerate(points):
        shapes.append(_shape(prefills, b, m))
        times.append(time_batch(loaded, cache, prefills, b, m, repeats=repeats, generator=generator))
        if on_point is not None:
            on_point(i + 1, len(points))
    held_out = [i for i in range(len(points)) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    train = [i for i in range(len(points)) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    fit = fit_linear_shapes([shapes[i] for i in train], [times[i] for i in train], num_layers=c.num_hidden_layers,
                            name=name)  # fmt: skip
    model = LinearCostModel(fit.coefficients)
    rel = np.array([abs(model.batch_time(shapes[i]).total_s - times[i]) / times[i] for i in held_out])
    return ProfileResult(fit, shapes, times, held_out, float(rel.mean()), float(rel.max()))


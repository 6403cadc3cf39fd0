"""The cost-model interface: a batch's shape in, its time with a breakdown out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from sloserve.core.outputs import SchedulerOutput


class BatchShape(NamedTuple):
    """Everything a cost model may use about one step (InferMax §3.2 symbols in comments).

    A "prefill" request here is any request processing more than one token or a chunk that does not
    emit (prefill, chunked prefill, refill); a "decode" request processes exactly one token.
    """

    num_decode: int = 0  # B: decode requests in the batch
    decode_kv_tokens: int = 0  # sum of m over decode requests (KV read by decode attention)
    num_prefill: int = 0  # n_p: prefill/chunk/refill requests
    prefill_tokens: int = 0  # sum of c over prefill requests
    prefill_attention_work: int = 0  # sum of c^2 + 2*m*c over prefill requests
    prefill_context_tokens: int = 0  # sum of m over prefill requests (KV read by chunks)
    swap_bytes: int = 0  # KV bytes moved between GPU and CPU memory this step
    # The copies run on their own stream beside the forward pass (BROS §4.1): the step takes the
    # longer of the two instead of their sum.
    swap_overlapped: bool = False
    # The longest m among decode requests (0: unknown, or no decodes). Ours: a decode attention kernel
    # walks each request's context in one program per KV head, so a small batch waits for its longest walk.
    decode_max_kv_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Forward size: sum of c over the batch."""
        return self.num_decode + self.prefill_tokens

    @classmethod
    def of(cls, prefills: Sequence[tuple[int, int]], decode_lens: Sequence[int]) -> BatchShape:
        """The shape of a batch of prefill chunks given as (c, m) (c tokens after m cached) and of
        decodes given by their cached tokens m."""
        return cls(
            num_decode=len(decode_lens),
            decode_kv_tokens=sum(decode_lens),
            num_prefill=len(prefills),
            prefill_tokens=sum(c for c, _ in prefills),
            prefill_attention_work=sum(c * c + 2 * m * c for c, m in prefills),
            prefill_context_tokens=sum(m for _, m in prefills),
            decode_max_kv_tokens=max(decode_lens, default=0),
        )


def batch_shape(output: SchedulerOutput) -> BatchShape:
    """The cost-model view of a step (its first step when ``num_steps`` > 1)."""
    decode = output.decode
    if decode is None:
        num_decode = decode_kv = longest = 0
    else:
        num_decode, decode_kv, longest = decode.size, decode.kv_tokens, decode.max_kv_tokens
    num_prefill = prefill_tokens = attention_work = context = 0
    for request, c in output.chunks:
        m = request.num_computed_tokens
        if c == 1 and request.num_tokens_to_process == 1:  # a decode scheduled outside a cohort
            num_decode += 1
            decode_kv += m
            if m > longest:
                longest = m
        else:
            num_prefill += 1
            prefill_tokens += c
            attention_work += c * c + 2 * m * c
            context += m
    # NOTE: tuple.__new__ builds the named tuple without the Python-level __new__ (a third of the cost).
    return tuple.__new__(
        BatchShape,
        (
            num_decode,
            decode_kv,
            num_prefill,
            prefill_tokens,
            attention_work,
            context,
            output.swap_bytes,
            output.swap_overlapped,
            longest,
        ),
    )


class CostBreakdown(NamedTuple):
    """Seconds spent by one step, by part. ``total_s`` is what the simulator's clock advances by: the
    sum of the parts, or with ``swap_overlapped`` the longer of the compute parts' sum and ``swap_s``."""

    total_s: float
    non_attention_s: float  # linear layers, MLP, norms, sampling, TP communication
    decode_attention_s: float
    prefill_attention_s: float
    swap_s: float


def step_total(compute_s: float, swap_s: float, overlapped: bool) -> float:
    """A step's seconds from its compute and swap parts: their sum, or the longer when the copies
    overlap the forward pass."""
    return max(compute_s, swap_s) if overlapped else compute_s + swap_s


class CostModel(ABC):
    """Predicts batch execution time. Implementations must be pure functions of the shape."""

    name: str = "cost-model"

    @abstractmethod
    def batch_time(self, shape: BatchShape) -> CostBreakdown:
        """Time of one step with this shape."""

    def step_seconds(self, shape: BatchShape) -> float:
        """``batch_time(shape).total_s``, exactly: what the simulator's clock advances by. Models
        override it to skip building the breakdown (the simulator asks once per step)."""
        return self.batch_time(shape).total_s

    def step_seconds_with_decodes(
        self, shape: BatchShape, num_decode: np.ndarray, decode_kv_tokens: np.ndarray
    ) -> np.ndarray:
        """``step_seconds`` of ``shape`` with its ``num_decode`` and ``decode_kv_tokens`` replaced by
        each pair of the two int64 arrays (same length n): shape ``(n,)``, float64. A policy that adds
        decodes to a batch one by one (BROS's packing) prices all the prefixes at once.

        NOTE: element i equals ``step_seconds(shape._replace(num_decode=num_decode[i],
        decode_kv_tokens=decode_kv_tokens[i]))`` exactly, bit for bit: a policy's decisions must not
        depend on which of the two it asked. This default loops; models override it with the same
        arithmetic, in the same order, on arrays.
        """
        return np.fromiter(
            (
                self.step_seconds(shape._replace(num_decode=int(n), decode_kv_tokens=int(kv)))
                for n, kv in zip(num_decode, decode_kv_tokens, strict=True)
            ),
            np.float64,
            len(num_decode),
        )

    def decode_times(
        self, num_decode: int, decode_kv_tokens: int, num_steps: int, decode_max_kv_tokens: int = 0
    ) -> np.ndarray:
        """Durations (seconds, float64, shape ``(num_steps,)``) of ``num_steps`` consecutive
        decode-only steps of ``num_decode`` requests whose summed KV starts at ``decode_kv_tokens``
        and grows by ``num_decode`` per step (the longest, ``decode_max_kv_tokens``, by one).

        NOTE: element k must equal ``batch_time(advance_shape(BatchShape(num_decode,
        decode_kv_tokens, decode_max_kv_tokens=decode_max_kv_tokens), k)).total_s`` to 1e-12
        relative; the simulator's fast path relies on it. This default loops; linear models
        override it with a vectorized arithmetic series.
        """
        shape = BatchShape(num_decode, decode_kv_tokens, decode_max_kv_tokens=decode_max_kv_tokens)
        return np.array([self.batch_time(advance_shape(shape, k)).total_s for k in range(num_steps)], dtype=np.float64)

    def step_times(self, shape: BatchShape, num_steps: int) -> np.ndarray:
        """Durations (seconds, ``(num_steps,)``) of ``num_steps`` consecutive steps of ``shape`` in
        which every request advances: step k has the shape ``advance_shape(shape, k)``.

        NOTE: element k equals ``batch_time(advance_shape(shape, k)).total_s`` to 1e-12 relative.
        """
        if shape.num_prefill == 0 and not shape.swap_bytes:
            return self.decode_times(shape.num_decode, shape.decode_kv_tokens, num_steps, shape.decode_max_kv_tokens)
        return np.array([self.batch_time(advance_shape(shape, k)).total_s for k in range(num_steps)], dtype=np.float64)

    def step_increment(self, shape: BatchShape) -> float | None:
        """The constant by which each of the ``step_times`` of ``shape`` exceeds the one before
        (to 1e-12 relative), when they form an arithmetic series as in linear models. None (the
        default) when they do not; the simulator then times stretches with ``step_times``."""
        return None


def advance_shape(shape: BatchShape, num_steps: int) -> BatchShape:
    """``shape`` ``num_steps`` steps later, every request having advanced by its tokens each step:
    each decode reads one more KV token per step (the longest one too), and the prefill chunk (at
    most one) of c tokens starts c tokens further, so its context grows by c and its attention work
    by 2c^2 per step."""
    if shape.num_prefill > 1 or shape.swap_bytes:
        raise ValueError(f"only steps with at most one prefill chunk and no swap repeat, got {shape}")
    c = shape.prefill_tokens
    return shape._replace(
        decode_kv_tokens=shape.decode_kv_tokens + num_steps * shape.num_decode,
        decode_max_kv_tokens=shape.decode_max_kv_tokens + num_steps if shape.num_decode else 0,
        prefill_attention_work=shape.prefill_attention_work + num_steps * 2 * c * c,
        prefill_context_tokens=shape.prefill_context_tokens + num_steps * c,
    )

"""A roofline batch-time model from a ModelSpec and a HardwareSpec (no profiling needed).

Each part of a step takes max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth):

- non-attention (projections, MLP, LM head): FLOPs = 2 * layer_params * tokens + 2 * vocab * hidden
  * sequences (logits for one token per request); bytes = every weight read once per step
  (embedding rows gathered are negligible). Plus, with tensor parallelism, 2 all-reduces per layer
  of tokens * hidden * dtype bytes each, and a fixed per-step overhead. A mixture of experts: a token's
  FLOPs are its active parameters' (``ModelSpec.active_layer_params``: k of E experts a layer), and a step
  reads the experts its tokens reach (``ModelSpec.layer_params_read``: E (1 - (1 - k / E)^tokens) of them,
  uniform routing), not every expert: a decode step of Qwen3-30B-A3B at batch 1 reads 3.3B parameters'
  weights, not 30.5B.
- decode attention: each decode reads m + 1 keys/values (its cache plus its new token):
  bytes = sum(m + 1) * kv_bytes_per_token; FLOPs = 4 * layers * heads * head_dim per key (QK^T, PV). A model
  with per-request states (Mamba-2 layers, short convolutions: ``ModelSpec.state_bytes_per_sequence``) reads
  and writes each decode's and each prefill's states once more a step, in the same memory-bound term.
- prefill attention: sum(c^2 + 2mc) (InferMax's prefill work) is twice the causal query-key pairs, so
  FLOPs = 2 * layers * heads * head_dim * sum(c^2 + 2mc); bytes = KV of the context read plus KV of
  the new tokens written, plus Q and O of the new tokens. A model with a second form
  (``ModelSpec.prefill_head_dim``: MLA's prefills by head) takes the cheaper of the two on the step's
  totals, as the engine takes it prefill by prefill: 2 * layers * heads * prefill_head_dim * sum(c^2 + 2mc)
  plus ``prefill_kv_flops_per_token`` * sum(m + c).
- windowed layers (``ModelSpec.window_layers``: a sliding window or a chunk of W = ``window_tokens`` positions)
  read at most W keys a query. A step's shape holds sums, not each request's context, so they are priced at the
  bound the sums give: a decode step's sum(min(m + 1, W)) at min(sum(m + 1), B W); a prefill's work at
  min(sum(c^2 + 2mc), (2W - 1) sum(c)) and its keys read at min(sum(m), n_p (W - 1)) + sum(c). For a sliding window
  each bound is exact when every request is past its window (m >= W - 1) or every one within it, and above the
  truth in between; for a chunked layer it is above the truth past the first chunk (a decode there reads
  m mod W + 1 keys: W at most).
- swap: swap_bytes / swap_bandwidth.

Tensor parallelism over ``num_gpus`` divides FLOPs and bytes evenly (KV heads are split over
min(num_gpus, num_kv_heads) GPUs; beyond that they are replicated).
"""

from __future__ import annotations

import math

import numpy as np

from sloserve.core.errors import ConfigError

from .base import BatchShape, CostBreakdown, CostModel, step_total
from .specs import HardwareSpec, ModelSpec, check_tensor_parallel

# Achieved fractions of peak (our choice, typical of vLLM-era kernels): large BF16 GEMMs and
# FlashAttention-2 reach ~50-75% of peak FLOP/s; memory-bound GEMV and paged-attention kernels reach
# ~75-85% of peak HBM bandwidth.
DEFAULT_COMPUTE_EFFICIENCY = 0.6
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8
# Kernel launches, sampling and per-step engine work not hidden by CUDA graphs: ~1 ms per step.
DEFAULT_STEP_OVERHEAD_S = 1e-3
# Latency of one small NCCL all-reduce over NVLink (~10 us); paid 2 * layers times per TP step.
DEFAULT_ALLREDUCE_LATENCY_S = 10e-6
# Host<->GPU copies of pinned memory reach ~80% of the PCIe per-direction peak (A100: 25.6 GB/s).
SWAP_EFFICIENCY = 0.8


def _fraction(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"roofline cost model: {name} must be in (0, 1], got {value!r}")
    return float(value)


def _non_negative(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"roofline cost model: {name} must be a non-negative number, got {value!r}")
    return float(value)


class RooflineCostModel(CostModel):
    """Batch time from published peak numbers scaled by efficiency factors; seconds.

    Non-linear (each part is a max of a compute and a memory bound). ``swap_bandwidth`` defaults to
    ``SWAP_EFFICIENCY`` times the GPU's per-direction PCIe bandwidth, times ``num_gpus``.
    """

    def __init__(
        self,
        model: ModelSpec,
        gpu: HardwareSpec,
        *,
        num_gpus: int = 1,
        compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY,
        bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY,
        step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
        allreduce_latency_s: float = DEFAULT_ALLREDUCE_LATENCY_S,
        swap_bandwidth: float | None = None,
    ) -> None:
        check_tensor_parallel(model, num_gpus)
        self.model, self.gpu, self.num_gpus = model, gpu, num_gpus
        self.compute_efficiency = _fraction("compute_efficiency", compute_efficiency)
        self.bandwidth_efficiency = _fraction("bandwidth_efficiency", bandwidth_efficiency)
        self.step_overhead_s = _non_negative("step_overhead_s", step_overhead_s)
        self.allreduce_latency_s = _non_negative("allreduce_latency_s", allreduce_latency_s)
        if swap_bandwidth is None:
            # NOTE: with tensor parallelism each GPU holds 1/num_gpus of every token's KV and copies
            # it over its own PCIe link, all at once.
            swap_bandwidth = gpu.pcie_bandwidth * SWAP_EFFICIENCY * num_gpus
        if _non_negative("swap_bandwidth", swap_bandwidth) == 0:
            raise ConfigError("roofline cost model: swap_bandwidth must be positive")
        self.swap_bandwidth = float(swap_bandwidth)
        self.name = f"roofline-{model.name}-{num_gpus}x{gpu.name}"

        m = model
        dtype = m.dtype_bytes
        attn_width = m.attention_layers * m.num_attention_heads * m.head_dim  # L * H * d (a hybrid's attention layers)
        # Achievable rates of the whole TP group.
        self._flops_rate = gpu.peak_flops * self.compute_efficiency * num_gpus
        self._bytes_rate = gpu.hbm_bandwidth * self.bandwidth_efficiency * num_gpus
        self._kv_bytes_rate = gpu.hbm_bandwidth * self.bandwidth_efficiency * min(num_gpus, m.num_kv_heads)
        # Non-attention.
        self._flops_per_token = 2.0 * m.active_layer_params
        self._flops_per_sequence = 2.0 * m.vocab_size * m.hidden_size  # LM head, one token each
        if num_gpus > 1:
            num_allreduces = 2 * m.num_layers
            ring = 2.0 * (num_gpus - 1) / num_gpus  # bytes each GPU sends per byte all-reduced
            self._allreduce_fixed_s = num_allreduces * self.allreduce_latency_s
            self._allreduce_s_per_token = num_allreduces * ring * m.hidden_size * dtype / gpu.interconnect_bandwidth
        else:
            self._allreduce_fixed_s = 0.0
            self._allreduce_s_per_token = 0.0
        # Attention.
        self._kv_bytes_per_token = float(m.kv_bytes_per_token)
        self._state_bytes_per_sequence = 2.0 * m.state_bytes_per_sequence  # (read and written)
        self._attn_flops_per_key = 4.0 * attn_width  # decode: QK^T and PV, 2 FLOPs per MAC
        self._attn_flops_per_work = 2.0 * attn_width  # prefill: work = 2 x causal pairs
        # (MLA's prefills by head: narrower heads, after each context token's keys and values are expanded)
        self._by_head_flops_per_work = 2.0 * m.attention_layers * m.num_attention_heads * m.prefill_head_dim
        self._by_head_flops_per_key = float(m.prefill_kv_flops_per_token)
        self._qo_bytes_per_token = 2.0 * attn_width * dtype  # Q read and O written by prefill
        # Windowed layers: their share of every attention layer's keys, and W.
        self._window_tokens = m.window_tokens
        self._window_share = m.window_layers / m.attention_layers if m.window_layers else 0.0
        self._full_share = 1.0 - self._window_share

    def __repr__(self) -> str:
        return (
            f"RooflineCostModel({self.model.name}, {self.gpu.name}, num_gpus={self.num_gpus}, "
            f"compute_efficiency={self.compute_efficiency}, "
            f"bandwidth_efficiency={self.bandwidth_efficiency}, "
            f"step_overhead_s={self.step_overhead_s})"
        )

    def _weight_read_bytes(self, tokens):
        """Bytes of the weights a step of ``tokens`` tokens (an int or an array, > 0) reads: the layers' (a
        mixture of experts': those its tokens reach) and the LM head's."""
        m = self.model
        return (m.layer_params_read(tokens) + m.vocab_size * m.hidden_size) * m.dtype_bytes

    def _non_attention_s(self, tokens: int, sequences: int) -> float:
        flops = self._flops_per_token * tokens + self._flops_per_sequence * sequences
        compute_s = max(flops / self._flops_rate, self._weight_read_bytes(tokens) / self._bytes_rate)
        comm_s = self._allreduce_fixed_s + self._allreduce_s_per_token * tokens
        return compute_s + comm_s + self.step_overhead_s

    def _decode_attention_s(self, num_decode, decode_kv_tokens):
        """Seconds of the attention of ``num_decode`` (> 0) decodes of ``decode_kv_tokens`` cached tokens in all: ints,
        or int64 arrays of one shape (then an array), by the same arithmetic in the same order."""
        minimum, maximum = (np.minimum, np.maximum) if isinstance(decode_kv_tokens, np.ndarray) else (min, max)
        keys = decode_kv_tokens + num_decode  # (each reads its cache and its new token's)
        if self._window_tokens:  # a windowed layer's sum(min(m + 1, W)), at most B W
            keys = self._full_share * keys + self._window_share * minimum(keys, num_decode * self._window_tokens)
        return maximum(
            self._attn_flops_per_key * keys / self._flops_rate,
            (self._kv_bytes_per_token * keys + self._state_bytes_per_sequence * num_decode) / self._kv_bytes_rate,
        )

    def batch_time(self, shape: BatchShape) -> CostBreakdown:
        """Time of one step with this shape (see the module docstring for the formula)."""
        num_decode = shape.num_decode
        num_prefill = shape.num_prefill
        tokens = num_decode + shape.prefill_tokens
        other_s = self._non_attention_s(tokens, num_decode + num_prefill) if tokens > 0 else 0.0
        decode_s = self._decode_attention_s(num_decode, shape.decode_kv_tokens) if num_decode > 0 else 0.0
        prefill_s = 0.0
        if num_prefill > 0:
            keys = shape.prefill_context_tokens + shape.prefill_tokens
            work = shape.prefill_attention_work
            if self._window_tokens:  # a windowed layer's keys and work, at most W a query (the bounds above)
                w = self._window_tokens
                local_keys = min(shape.prefill_context_tokens, num_prefill * (w - 1)) + shape.prefill_tokens
                keys = self._full_share * keys + self._window_share * local_keys
                work = self._full_share * work + self._window_share * min(work, (2 * w - 1) * shape.prefill_tokens)
            kv_bytes = self._kv_bytes_per_token * keys + self._state_bytes_per_sequence * num_prefill
            qo_bytes = self._qo_bytes_per_token * shape.prefill_tokens
            flops = self._attn_flops_per_work * work
            if self._by_head_flops_per_key:
                by_head = self._by_head_flops_per_work * work + self._by_head_flops_per_key * keys
                flops = min(flops, by_head)
            prefill_s = max(
                flops / self._flops_rate,
                kv_bytes / self._kv_bytes_rate + qo_bytes / self._bytes_rate,
            )
        swap_s = shape.swap_bytes / self.swap_bandwidth if shape.swap_bytes else 0.0
        total = step_total(other_s + decode_s + prefill_s, swap_s, shape.swap_overlapped)
        return CostBreakdown(total, other_s, decode_s, prefill_s, swap_s)

    def step_seconds_with_decodes(
        self, shape: BatchShape, num_decode: np.ndarray, decode_kv_tokens: np.ndarray
    ) -> np.ndarray:
        """``batch_time``'s total on arrays: the same arithmetic, in the same order."""
        num_prefill, prefill_tokens = shape.num_prefill, shape.prefill_tokens
        tokens = num_decode + prefill_tokens
        flops = self._flops_per_token * tokens + self._flops_per_sequence * (num_decode + num_prefill)
        compute_s = np.maximum(flops / self._flops_rate, self._weight_read_bytes(tokens) / self._bytes_rate)
        other_s = compute_s + (self._allreduce_fixed_s + self._allreduce_s_per_token * tokens) + self.step_overhead_s
        decode_s = self._decode_attention_s(num_decode, decode_kv_tokens)
        if not (num_decode > 0).all():  # (a part with nothing to do costs nothing)
            other_s = np.where(tokens > 0, other_s, 0.0)
            decode_s = np.where(num_decode > 0, decode_s, 0.0)
        prefill_s = self.batch_time(shape._replace(num_decode=0)).prefill_attention_s if num_prefill else 0.0
        swap_s = shape.swap_bytes / self.swap_bandwidth if shape.swap_bytes else 0.0
        total = other_s + decode_s + prefill_s
        return np.maximum(total, swap_s) if shape.swap_overlapped else total + swap_s

    def decode_times(
        self, num_decode: int, decode_kv_tokens: int, num_steps: int, decode_max_kv_tokens: int = 0
    ) -> np.ndarray:
        """Vectorized decode-only steps; same arithmetic, in the same order, as ``batch_time`` (which
        prices the bytes and FLOPs: the longest context does not enter)."""
        if num_steps <= 0:
            return np.zeros(0, dtype=np.float64)
        if num_decode <= 0:
            return np.zeros(num_steps, dtype=np.float64)
        other_s = self._non_attention_s(num_decode, num_decode)
        kv = decode_kv_tokens + num_decode * np.arange(num_steps, dtype=np.int64)
        return other_s + self._decode_attention_s(num_decode, kv) + 0.0 + 0.0

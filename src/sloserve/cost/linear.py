"""InferMax's linear batch-time model (papers/infermax.md §3.2).

Per layer, in milliseconds (c: tokens a request processes this step, m: tokens already in its KV,
B: decode requests, n_p: prefill/chunk requests, tokens = sum of c over the batch):

    decode attention  = a_d * sum(m over decodes) + w_d * max(m) + b_d + s_d * B  (only if B > 0)
    prefill attention = a_p * sum(c^2 + 2mc) + b_p + s_p * n_p + m_p * sum(m)    (only if n_p > 0)
    other             = a_o * max(tokens, knee_tokens) + b_o                       (only if tokens > 0)
    step              = max(floor, decode attention + prefill attention + other) + host
                        floor = floor_p if n_p > 0 else floor_d
    host              = h_s + h_r * (B + n_p)                                        (only if tokens > 0)
    (with host_overlapped: step = max(floor, host, decode attention + prefill attention + other))

``knee_tokens`` is ours, not InferMax's (whose form is knee_tokens = 0, the bundled presets). On a GPU
the projections and MLP read every weight once per step whatever the batch, so below some number of
tokens they are memory-bound and take the same time; above it they are compute-bound and grow with
the tokens: a roofline's max of the two. One straight line through both regimes overstates small
prefills and understates large ones (per prompt token, a 256-token prefill costs about twice what a
4k one does), so a fit made on whole prompts (vLLM) and one made on chunks (Sarathi) disagree. With
the knee one fit serves both (``benchmarks/cost_forms.py``).

``w_d`` is ours too (0 in InferMax's form), from the same profile. The Triton decode kernel walks each
request's context in one program per KV head, so a small batch waits for its longest walk, not for
the bytes it reads: on the H200 one request with 2,048 cached tokens took 1.5 ms longer than one with 128,
where the bytes take 0.06 ms. ``w_d`` charges per token of the longest decode context. With it the
knee form simulated the engine's runs on that GPU within 3.3% on average, from 6.4% (docs/simulator.md).

``floor_p`` and ``floor_d`` are ours too (0 in InferMax's form), from the first profile measured on a
GPU (an H200, benchmarks/RESULTS.md). The host launches a step's kernels, and the GPU cannot finish
before the last launch: an eager step (prefills run eagerly) takes at least the host's launch time,
about 13 ms for a 32-layer model there, whatever its tokens; a decode-only step replayed as a CUDA
graph takes at least the time to read the weights. So in the ``floor`` form a step takes the longer
of its floor and its work. On that profile it fits held-out batches within 2.1% on average (the knee
form 4.5%) and simulates the engine's runs within 3.6% (3.3%), and fits both schedulers within 5%: the
default fit since 2026-11-26.

``h_s`` and ``h_r`` are ours too (0 unless ``sloserve profile`` measured them): the engine loop's host
work beside the forward pass, per step and per scheduled request: scheduling, the update after the
step, and publishing each request's tokens (``engine.profile.measure_host``). The engine does not
overlap it with the GPU, so it adds to the step, after the floor. A run on the engine's virtual clock
(``run --virtual-clock``: the sum of the measured forward passes) has none of it (``profile
--no-host-share``). Stored per layer like the rest, although nothing in them scales with the layers.
An engine that schedules asynchronously on a GPU (``engine/async_scheduling.py``) does overlap it: the
host prepares step t+1 while the GPU runs step t, so a step takes the longer of the two, and with
``host_overlapped`` the host's share is one more floor instead of a sum.

A step takes the sum times ``num_layers``, plus ``swap_bytes / swap_bandwidth`` (or the longer of the
two when the copies overlap the forward pass, ``swap_overlapped``). Left out as
calibration details (as in the reference coefficients' notes): Vidur's decode-attention overhead
factor (1 + fraction when B > 1) and its rounding of KV lengths to a granularity.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from sloserve.core.errors import ConfigError

from .base import BatchShape, CostBreakdown, CostModel, step_total

COEFFICIENT_NAMES = ("a_p", "b_p", "a_d", "b_d", "a_o", "b_o", "s_p", "s_d", "m_p")
# Terms beyond InferMax's nine (ms per layer; see the module docstring), 0 unless fitted.
EXTRA_TERM_NAMES = ("w_d", "floor_p", "floor_d", "h_s", "h_r")

# What a cost model may predict for the smallest steps: from a nanosecond (far below any GPU's kernel launch)
# to an hour (far above any step's).
MIN_STEP_SECONDS, MAX_STEP_SECONDS = 1e-9, 3600.0
# PCIe 4.0 x16: 32 GB/s per direction theoretical, ~25 GB/s achieved by pinned-memory copies.
DEFAULT_SWAP_BANDWIDTH = 25e9


@dataclass(frozen=True)
class LinearCoefficients:
    """The nine InferMax coefficients, per model layer, in milliseconds (per unit of each feature).

    ``a_p``: per unit of sum(c^2 + 2mc) of prefills; ``b_p``: prefill-attention bias; ``s_p``: per
    prefill request; ``m_p``: per token of prefill context read (sum m of prefills); ``a_d``: per KV
    token read by decodes (sum m); ``b_d``: decode-attention bias; ``s_d``: per decode request;
    ``a_o``: per batch token; ``b_o``: non-attention bias. ``knee_tokens`` (tokens, not ms): a step
    of fewer tokens costs as many as this in the non-attention part (0: InferMax's linear form).
    ``w_d``: per token of the longest decode context (``decode_max_kv_tokens``); ``floor_p`` /
    ``floor_d``: the least a step with a prefill / a decode-only step takes (0: none); ``h_s`` /
    ``h_r``: the engine loop's host work per step / per scheduled request (0: none). All five are 0
    in InferMax's form. ``host_overlapped``: that host work runs during the device's (async
    scheduling), so it is a floor, not a sum (False: InferMax's form and a synchronous engine).
    """

    a_p: float
    b_p: float
    a_d: float
    b_d: float
    a_o: float
    b_o: float
    s_p: float
    s_d: float
    m_p: float
    num_layers: int
    name: str = "linear"
    knee_tokens: float = 0.0
    w_d: float = 0.0
    floor_p: float = 0.0
    floor_d: float = 0.0
    h_s: float = 0.0
    h_r: float = 0.0
    host_overlapped: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.host_overlapped, bool):
            raise ConfigError(
                f"cost model {self.name!r}: host_overlapped must be true or false, got {self.host_overlapped!r}"
            )
        for key in (*COEFFICIENT_NAMES, *EXTRA_TERM_NAMES):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(
                    f"cost model {self.name!r}: coefficient {key} must be a non-negative finite number, got {value!r}"
                )
        knee = self.knee_tokens
        if isinstance(knee, bool) or not isinstance(knee, (int, float)) or not math.isfinite(knee) or knee < 0:
            raise ConfigError(
                f"cost model {self.name!r}: knee_tokens must be a non-negative finite number, got {knee!r}"
            )
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ConfigError(
                f"cost model {self.name!r}: num_layers must be a positive integer, got {self.num_layers!r}"
            )

    def check_steps_take_time(self) -> None:
        """A ConfigError unless a step of one decode and one of a one-token prefill each take from
        ``MIN_STEP_SECONDS`` to ``MAX_STEP_SECONDS``: a simulator waits a step's time for the next event (a
        model fitted on steps of 1e-300 s, or all zeros, once divided by zero mid-run). A fit on decodes
        alone leaves the prefill terms at 0 and fails it."""
        model = LinearCostModel(self)
        for what, shape in (
            ("a decode step of one request", BatchShape(num_decode=1, decode_kv_tokens=1, decode_max_kv_tokens=1)),
            ("a prefill step of one token", BatchShape(num_prefill=1, prefill_tokens=1, prefill_attention_work=1)),
        ):
            seconds = model.step_seconds(shape)
            if not MIN_STEP_SECONDS <= seconds <= MAX_STEP_SECONDS:
                raise ConfigError(
                    f"cost model {self.name!r}: {what} takes {seconds:.3g} s, not from {MIN_STEP_SECONDS:g} to "
                    f"{MAX_STEP_SECONDS:g} s as a GPU's step does (coefficients are milliseconds per layer; a fit "
                    "leaves those of steps its profile lacks at 0)"
                )

    def as_dict(self) -> dict[str, float | int | str]:
        """Plain dict of all fields (for JSON)."""
        return asdict(self)

    def beyond_infermax(self) -> list[str]:
        """The terms set that InferMax's linear form lacks (``knee_tokens`` and ``EXTRA_TERM_NAMES``)."""
        # NOTE: host_overlapped changes nothing without a host's share (h_s, h_r), which is listed
        return [f"{key} {getattr(self, key):g}" for key in ("knee_tokens", *EXTRA_TERM_NAMES) if getattr(self, key)]


class LinearCostModel(CostModel):
    """InferMax's linear cost model; ``batch_time`` returns seconds.

    ``swap_bandwidth``: host<->GPU bytes per second for KV swaps (default 25e9, PCIe 4 x16 achieved).
    """

    def __init__(self, coefficients: LinearCoefficients, *, swap_bandwidth: float = DEFAULT_SWAP_BANDWIDTH) -> None:
        if not (isinstance(swap_bandwidth, (int, float)) and math.isfinite(swap_bandwidth) and swap_bandwidth > 0):
            raise ConfigError(f"swap_bandwidth must be a positive number of B/s, got {swap_bandwidth!r}")
        self.coefficients = coefficients
        self.swap_bandwidth = float(swap_bandwidth)
        self.name = coefficients.name
        c = coefficients
        # per-layer ms -> seconds for the whole model
        self._scale = c.num_layers / 1000.0
        self._a_d, self._b_d, self._s_d = float(c.a_d), float(c.b_d), float(c.s_d)
        self._a_p, self._b_p, self._s_p, self._m_p = float(c.a_p), float(c.b_p), float(c.s_p), float(c.m_p)
        self._a_o, self._b_o = float(c.a_o), float(c.b_o)
        self._knee = float(c.knee_tokens)
        self._w_d = float(c.w_d)
        self._floor_p, self._floor_d = float(c.floor_p) * self._scale, float(c.floor_d) * self._scale
        self._h_s, self._h_r = float(c.h_s) * self._scale, float(c.h_r) * self._scale
        self._host_overlapped = c.host_overlapped

    def __repr__(self) -> str:
        return f"LinearCostModel({self.coefficients!r}, swap_bandwidth={self.swap_bandwidth!r})"

    def batch_time(self, shape: BatchShape) -> CostBreakdown:
        """Time of one step with this shape (see the module docstring for the formula)."""
        other_s, decode_s, prefill_s, swap_s = self._parts(shape)
        total = step_total(other_s + decode_s + prefill_s, swap_s, shape.swap_overlapped)
        return CostBreakdown(total, other_s, decode_s, prefill_s, swap_s)

    def step_seconds(self, shape: BatchShape) -> float:
        other_s, decode_s, prefill_s, swap_s = self._parts(shape)
        return step_total(other_s + decode_s + prefill_s, swap_s, shape.swap_overlapped)

    def _parts(self, shape: BatchShape, floored: bool = True) -> tuple[float, float, float, float]:
        """(non-attention, decode attention, prefill attention, swap) seconds of one step. The time a
        step waits below its floor counts as non-attention, so the parts still sum to the compute
        (``floored=False``: the work alone, without the floor and the host's share)."""
        num_decode, decode_kv_tokens, num_prefill, prefill_tokens, attention_work, context, swap_bytes, _, longest = (
            shape
        )
        scale = self._scale
        decode_s = 0.0
        if num_decode > 0:
            # a_d * B * avgKV + w_d * maxKV + b_d + s_d * B
            decode_s = (self._a_d * decode_kv_tokens + self._w_d * longest + self._b_d + self._s_d * num_decode) * scale
        prefill_s = 0.0
        if num_prefill > 0:
            # a_p * sum(c^2 + 2mc) + b_p + s_p * n_p + m_p * sum(m)
            prefill_s = (self._a_p * attention_work + self._b_p + self._s_p * num_prefill + self._m_p * context) * scale
        tokens = num_decode + prefill_tokens
        other_s = (self._a_o * max(tokens, self._knee) + self._b_o) * scale if tokens > 0 else 0.0
        if floored and tokens > 0:  # an empty step costs nothing
            floor, host = self._floor_and_host(num_prefill, num_decode + num_prefill)
            if floor > other_s + decode_s + prefill_s:
                other_s = floor - decode_s - prefill_s
            # NOTE: the host's share counts as non-attention, after the floor (the GPU waits for it)
            other_s += host
        swap_s = swap_bytes / self.swap_bandwidth if swap_bytes else 0.0
        return other_s, decode_s, prefill_s, swap_s

    def _floor_and_host(self, num_prefill: int, num_requests: int) -> tuple[float, float]:
        """(the least a step's work takes, the host's share added after it) for a step of
        ``num_requests`` requests, ``num_prefill`` of them prefills: with ``host_overlapped`` the host's
        share is one more floor, and nothing is added after it."""
        floor = self._floor_p if num_prefill > 0 else self._floor_d
        host = self._h_s + self._h_r * num_requests
        return (max(floor, host), 0.0) if self._host_overlapped else (floor, host)

    def step_seconds_with_decodes(
        self, shape: BatchShape, num_decode: np.ndarray, decode_kv_tokens: np.ndarray
    ) -> np.ndarray:
        """``_parts`` and ``step_total`` on arrays: the same arithmetic, in the same order."""
        _, _, num_prefill, prefill_tokens, attention_work, context, swap_bytes, overlapped, longest = shape
        scale = self._scale
        decode_s = (self._a_d * decode_kv_tokens + self._w_d * longest + self._b_d + self._s_d * num_decode) * scale
        if not (num_decode > 0).all():
            decode_s = np.where(num_decode > 0, decode_s, 0.0)
        prefill_s = 0.0
        if num_prefill > 0:
            prefill_s = (self._a_p * attention_work + self._b_p + self._s_p * num_prefill + self._m_p * context) * scale
        tokens = num_decode + prefill_tokens
        other_s = (self._a_o * np.maximum(tokens, self._knee) + self._b_o) * scale
        floor = self._floor_p if num_prefill > 0 else self._floor_d
        host = self._h_s + self._h_r * (num_decode + num_prefill)
        if self._host_overlapped:
            floor, host = np.maximum(floor, host), 0.0
        if np.any(floor):  # (NOTE: every part is >= 0, so none is under a zero floor)
            other_s = np.where(floor > other_s + decode_s + prefill_s, floor - decode_s - prefill_s, other_s)
        other_s = other_s + host
        compute_s = other_s + decode_s + prefill_s
        if not (tokens > 0).all():  # an empty step costs nothing (no floor, no host's share)
            compute_s = np.where(tokens > 0, compute_s, 0.0 + 0.0 + prefill_s)
        swap_s = swap_bytes / self.swap_bandwidth if swap_bytes else 0.0
        return np.maximum(compute_s, swap_s) if overlapped else compute_s + swap_s

    def decode_times(
        self, num_decode: int, decode_kv_tokens: int, num_steps: int, decode_max_kv_tokens: int = 0
    ) -> np.ndarray:
        """Vectorized decode-only steps; same arithmetic, in the same order, as ``batch_time``."""
        if num_steps <= 0:
            return np.zeros(0, dtype=np.float64)
        if num_decode <= 0:
            return np.zeros(num_steps, dtype=np.float64)
        scale = self._scale
        steps = np.arange(num_steps, dtype=np.int64)
        kv = decode_kv_tokens + num_decode * steps
        longest = decode_max_kv_tokens + steps
        decode_s = (self._a_d * kv + self._w_d * longest + self._b_d + self._s_d * num_decode) * scale
        other_s = (self._a_o * max(num_decode, self._knee) + self._b_o) * scale  # a scalar: no prefill tokens
        # NOTE: below the floor, _parts raises other_s to floor - decode_s, whose sum with decode_s may
        # differ from the floor in the last bit; the 1e-12 contract allows it.
        floor, host = self._floor_and_host(0, num_decode)
        return np.maximum(other_s + decode_s + 0.0 + 0.0, floor) + host

    def step_increment(self, shape: BatchShape) -> float | None:
        """Repeated steps form an arithmetic series: per step the decodes' summed KV grows by B (the
        longest by 1) and a chunk of c tokens reads c more context tokens and does 2c^2 more attention
        work, so a step takes a_d * B + w_d + a_p * 2c^2 + m_p * c (per layer) longer than the one
        before. Not while the step is below its floor (None then)."""
        # NOTE: unpacked, as in _parts: a named tuple's fields by name are Python-level lookups.
        num_decode, _, num_prefill, c, _, _, swap_bytes, _, _ = shape
        if num_prefill > 1 or swap_bytes:
            return None
        if self._floor_p or self._floor_d or self._host_overlapped:
            # Every term grows step by step (coefficients are >= 0), so once above its floor a step
            # stays above it; below, the series is not arithmetic.
            other_s, decode_s, prefill_s, _ = self._parts(shape, floored=False)
            # NOTE: a stretch's requests are the same each step, and so is the host's share
            floor, _ = self._floor_and_host(num_prefill, num_decode + num_prefill)
            if other_s + decode_s + prefill_s <= floor:
                return None
        walk = self._w_d if num_decode > 0 else 0.0
        return (self._a_d * num_decode + walk + self._a_p * 2 * c * c + self._m_p * c) * self._scale

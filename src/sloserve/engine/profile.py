"""Profile the engine's batch times over a grid of shapes and fit the linear cost model to them.

Each grid point is one engine step (``EngineExecutor.execute``, what the engine's clock counts; no
scheduling) of a batch of requests with random tokens held in a paged KV manager: prefill chunks of c
tokens after m cached ones, batches of several prompts, decode batches of B requests with m cached
tokens on average, and mixed batches (``ProfileGrid``). Every 4th point is held out of the fit and
reports the error a simulation with the fitted preset makes on shapes it was not fitted to.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import numpy as np
import scipy.optimize

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import ScheduledChunk, SchedulerOutput
from sloserve.core.request import SLO, Request, RequestClass
from sloserve.cost import BatchShape, LinearCostModel, LinearFit, fit_linear_shapes
from sloserve.cost.fit import DEFAULT_FORM, FEATURE_ORDER
from sloserve.cost.profile_grid import ProfileGrid
from sloserve.engine.executor import EngineExecutor
from sloserve.engine.kv_cache import KVCacheTensor
from sloserve.engine.llm_engine import LLMEngine, default_async_scheduling
from sloserve.engine.loader import LoadedModel
from sloserve.engine.sampler import SamplingParams
from sloserve.kv.manager import PagedKVManager

HOLD_OUT_EVERY = 4
# The host calibration (``measure_host``): this many requests run together, whose batch shrinks to one
# as they finish (their outputs differ), so the fit sees every batch size up to it.
HOST_REQUESTS = 32
# Reads the calibration's messages one at a time and drops them, as the server's thread that reads the engine's
# pipe does (each message wakes it: the cost a served step's publishing pays).
_READER = """
from multiprocessing.connection import Connection
conn = Connection(0, writable=False)
while True:
    try:
        conn.recv_bytes()
    except EOFError:
        break
"""


class StepTimer:
    """Times batches of a given shape as the engine's clock counts them: ``EngineExecutor.execute``
    on requests held in a paged KV manager (slot tables, attention metadata, forward pass, logits and
    sampling), not the forward pass alone.

    NOTE: the engine's step time (what ``run`` reports and a fitted preset must predict) includes
    building the step's slot tables and sampling. Timing the forward pass alone left that out: about
    2.4 ms a step at ~100 decodes on a CPU, more than the 5% fidelity goal on a GPU's 15-30 ms steps.

    ``async_scheduling`` (None: ``default_async_scheduling``, on CUDA): time decode-only batches as an
    engine that schedules asynchronously runs a run of them, each step launched before the step
    before's tokens are on the host (``async_scheduling.py``), its time from its start to their return,
    as that engine's clock counts it: its host work hidden behind the step before's device work where
    that is longer. Timed one by one, a step also holds the host's work before its launch and after its
    tokens, with the device idle: on an H200 async scheduling gave 1.09-1.15x the output tokens/s of
    decode batches of 64-256 (2026-11-29), which a preset fitted to steps timed one by one charges the
    engine too. Steps with a prefill are timed so too (since 2026-12-04): each step's chunks are of requests of
    their own (the same chunk again would be a refill of a request in flight, which waits for its token), each
    freed once the step after has taken its tokens. One by one, the host's work had cost an H200's mixed step
    (a 512-token chunk beside 128 decodes) 3.6 ms of its 22.6, beside 19.0 of kernels.
    """

    BLOCK_SIZE = 16  # the engine's default (vLLM's)

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        *,
        max_context: int,
        seed: int = 0,
        async_scheduling: bool | None = None,
    ) -> None:
        """``num_blocks`` KV blocks of ``BLOCK_SIZE`` tokens; ``max_context``: the longest context a
        batch will hold (the width of the CUDA graphs' slot table, when ``loaded.cuda_graphs``)."""
        self.loaded = loaded
        self.max_context = max_context
        self.async_scheduling = default_async_scheduling(loaded) if async_scheduling is None else async_scheduling
        self.kv = PagedKVManager(num_blocks, self.BLOCK_SIZE)
        cache = KVCacheTensor(loaded.config, self.kv.capacity_tokens, 0, self.BLOCK_SIZE, loaded.dtype, loaded.device)
        self.executor = EngineExecutor.for_model(loaded, self.kv, cache, max_context)
        self._rng = np.random.default_rng(seed)
        self._next_id = 0

    @classmethod
    def blocks_needed(cls, prefills: list[tuple[int, int]], decode_lens: list[int]) -> int:
        """KV blocks the timing of a batch of this shape holds: its prefills' twice (two steps' requests in
        flight, ``time``)."""
        bs = cls.BLOCK_SIZE
        return 2 * sum(-(-(c + m) // bs) for c, m in prefills) + sum(-(-(m + 1) // bs) for m in decode_lens)

    def _request(self, num_cached: int, num_new: int) -> Request:
        """A request whose first ``num_cached`` tokens are in the cache and ``num_new`` are to process."""
        n = num_cached + num_new
        request = Request(self._next_id, 0.0, n, 1, 1)
        self._next_id += 1
        request.add_computed(num_cached)
        if not self.kv.allocate_slots(request, n):
            raise ConfigError(f"profile: {self.kv.capacity_tokens} KV slots cannot hold this batch")
        tokens = self._rng.integers(0, self.loaded.config.vocab_size, size=n).tolist()
        # NOTE: a profile step never updates its requests, so each repeat runs the same tokens again.
        self.executor.add(request, tokens, SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True))
        return request

    def time(
        self, prefills: list[tuple[int, int]], decode_lens: list[int], *, repeats: int = 3, warmup: int = 1
    ) -> float:
        """Median seconds of one engine step running ``prefills`` ((c, m): c tokens after m cached)
        and one decode per entry of ``decode_lens`` (its cached tokens), over ``repeats`` runs after
        ``warmup`` untimed ones (and, timed as an asynchronous engine runs them, after one more: the
        first launches with nothing in flight, so it waits for no step before it)."""
        pipelined = self.async_scheduling
        self.executor.async_scheduling = pipelined
        decodes = [ScheduledChunk(self._request(m, 1), 1) for m in decode_lens]
        # (pipelined: a step's prefills are new requests, those of two steps held: see the class's NOTE)
        held: list[list[ScheduledChunk]] = []
        steps = warmup + repeats + pipelined
        times = []
        try:
            for _ in range(steps):
                if not held or pipelined:
                    held.append([ScheduledChunk(self._request(m, c), c) for c, m in prefills])
                output = SchedulerOutput(chunks=held[-1] + decodes)
                times.append(self.executor.execute(output, 0.0).step_end_times[0])
                if len(held) > 1:  # (this step took the step before's tokens: that one's requests are done)
                    self._free(held.pop(0))
        finally:
            self.executor.resolve()  # (pipelined: the last step's tokens, not timed)
            for chunks in [*held, decodes]:
                self._free(chunks)
        return statistics.median(times[steps - repeats :])

    def _free(self, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            self.kv.free(chunk.request)
            del self.executor.sequences[chunk.request]


@dataclass(frozen=True)
class HostShare:
    """The engine loop's host work beside the forward pass (``measure_host``)."""

    per_step_s: float
    per_request_s: float  # per request scheduled in the step
    num_steps: int  # steps it was fitted on
    mean_rel_error: float  # of the fit, over those steps


def measure_host(loaded: LoadedModel, *, max_model_len: int, max_slots: int, seed: int = 0) -> HostShare:
    """What a served step costs the host beside the executor: the served loop's step (``EngineCore.run_step``:
    vLLM's schedule, the executor, the update, then each request's tokens packed and sent over a pipe
    to a process that reads them, on a GPU during the next step's forward pass; the server's process
    detokenizes them), minus the executor's own measured time, fitted as
    ``per_step_s + per_request_s * requests`` over the steps of ``HOST_REQUESTS`` requests run together.

    NOTE: it is vLLM's policy's scheduling cost; a policy that scans more per step costs more."""
    from sloserve.engine.engine_core import AddRequest, EngineCore

    rng = np.random.default_rng(seed)
    prompt_len = max(1, min(128, max_model_len // 4))
    longest_output = max(2, min(128, max_model_len - prompt_len))
    # NOTE: steps one by one: the step log then holds each execute's own time on the host, which is
    # taken off the loop's (an engine launched early logs its device time, ``EngineExecutor``)
    engine = LLMEngine(
        loaded, "vllm", kv_capacity_tokens=max_slots, max_model_len=max_model_len, seed=seed, async_scheduling=False
    )
    engine.executor.step_log = []
    reader = subprocess.Popen([sys.executable, "-c", _READER], stdin=subprocess.PIPE)
    _beside_this_process(reader.pid)
    conn = Connection(os.dup(reader.stdin.fileno()), readable=False)
    reader.stdin.close()
    try:
        core = EngineCore(engine, time.perf_counter(), conn)
        for i, output_len in enumerate(np.linspace(2, longest_output, HOST_REQUESTS).astype(int)):
            prompt = rng.integers(0, loaded.config.vocab_size, size=prompt_len).tolist()
            params = SamplingParams(max_tokens=int(output_len), temperature=0.0, ignore_eos=True)
            core.apply(("add", AddRequest(i, prompt, params, RequestClass.BE, SLO(), core.clock())))
        sizes, host = [], []
        while engine.has_unfinished():
            start = time.perf_counter()
            core.run_step()
            elapsed = time.perf_counter() - start
            shape, executed = engine.executor.step_log[-1]
            sizes.append(shape.num_decode + shape.num_prefill)
            # NOTE: on a GPU the step before is published during this one's forward pass; the part of
            # that the forward pass did not hide is in its measured time, and is the host's
            host.append(elapsed - executed + engine.executor.during_forward_exposed_s)
    finally:
        conn.close()
        reader.wait(timeout=60)
    sizes, host = np.array(sizes, dtype=np.float64), np.array(host)  # (S,) each
    per_step, per_request = fit_host_share(sizes, host)
    error = float(np.mean(np.abs(per_step + per_request * sizes - host) / host))
    return HostShare(per_step, per_request, len(sizes), error)


def _beside_this_process(pid: int) -> None:
    """Put process ``pid`` on the cores this process is not held to, if it is held to some (pinned, as a profile
    for a pinned server's engine is: ``benchmarks/serve_fidelity.py``), where the server's process runs beside
    its engine. NOTE: a message that wakes a reader on another core costs the writer more than one on its own
    core: 0.03 ms a step more in this calibration on a 2-core VM (2026-12-05), whose served engine paid 0.18 ms
    a step publishing."""
    if not hasattr(os, "sched_getaffinity"):
        return
    others = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
    if others:
        try:
            os.sched_setaffinity(pid, others)
        except OSError:  # (cores this process may not use: the reader stays where it started)
            pass


def fit_host_share(
    sizes: np.ndarray,  # (S,) requests in each step
    host_s: np.ndarray,  # (S,) each step's host seconds
) -> tuple[float, float]:
    """(per step, per request) seconds of the line through ``measure_host``'s steps, both >= 0 (host work
    takes no negative time).

    NOTE: robust (soft L1 beyond a tenth of the median step): on a shared machine a few steps the OS
    descheduled take 20-40x the median. Tiny-llama on the 2-core VM beside a busy process, ten runs: a
    least-squares line gave 0.06-1.26 ms a step, this fit 0.14-0.30 (0.13-0.14 with the machine idle)."""
    design = np.column_stack([np.ones(len(sizes)), sizes])  # (S, 2)
    scale = max(float(np.median(host_s)), 1e-6)  # NOTE: > 0: the residuals are in its units
    start = np.array([scale, 0.0])
    fit = scipy.optimize.least_squares(
        lambda x: (design @ x - host_s) / scale, start, bounds=(0.0, np.inf), loss="soft_l1", f_scale=0.1
    )
    return float(fit.x[0]), float(fit.x[1])


@dataclass
class ProfileResult:
    fit: LinearFit
    shapes: list[BatchShape]
    times_s: list[float]
    held_out: list[int]  # indices of the points not used for fitting
    held_out_mean_rel_error: float
    held_out_max_rel_error: float
    host: HostShare | None = None  # the engine loop's host work, priced in the fit's h_s and h_r


def profile(
    loaded: LoadedModel,
    grid: ProfileGrid,
    *,
    max_model_len: int,
    max_slots: int,
    name: str,
    repeats: int = 3,
    on_point: Callable[[int, int], None] | None = None,
    form: str = DEFAULT_FORM,
    host_share: bool = True,
    host_overlapped: bool | None = None,
) -> ProfileResult:
    """Measure every grid point that fits in ``max_slots`` KV slots and fit the linear model (of
    ``form``, see ``cost.fit``) on 3 of every 4 points; the 4th are held out for the reported error
    (of the batch times: the forward pass, as ``StepTimer`` times it). With ``host_share``, the
    engine loop's host work is measured too (``measure_host``) and priced in the fit's ``h_s`` and
    ``h_r``, so that the preset predicts served and wall-clock runs: added to each step, or with
    ``host_overlapped`` as a floor under it. ``host_overlapped``: the preset is for an engine that
    schedules asynchronously (None: where the engine does by default, ``default_async_scheduling``),
    which does that work during the device's; its decode batches are then timed as such an engine
    runs them too (``StepTimer``'s ``async_scheduling``), with the executor's own host work hidden
    where the device's is longer."""
    points = grid.shapes(max_model_len, max_slots)
    if len(points) < 2 * len(FEATURE_ORDER):
        raise ConfigError(
            f"profile: the grid has {len(points)} points within a context of {max_model_len} and "
            f"{max_slots} KV slots; need at least {2 * len(FEATURE_ORDER)} (two per coefficient): add "
            f"prefill chunks, context lengths, batch sizes or decode KV lengths"
        )
    c = loaded.config
    if host_overlapped is None:
        host_overlapped = default_async_scheduling(loaded)
    blocks = max(StepTimer.blocks_needed(*point) for point in points)
    timer = StepTimer(loaded, blocks, max_context=max_model_len, async_scheduling=host_overlapped)
    shapes = [BatchShape.of(prefills, decode_lens) for prefills, decode_lens in points]
    # NOTE: each pass times every point once (the first pass warms up), and a point's time is its
    # median over the passes: a slow spell on a shared machine then lands on all points alike
    # instead of on a run of neighbours (one batch size, say), which would bend the fit.
    # NOTE: and each time is of a batch's second step: a request's first step computes what it keeps for the
    # steps after (its sampling controls' cached properties), once in its life in a run, but for every request
    # at once in a freshly built batch: the first of tiny-llama's decode steps of 16-100 requests took 4-12%
    # (0.3-0.5 ms) longer than the next on the 2-core VM (2026-12-05), and a preset fitted to first steps
    # priced a run's decode steps 9-28% over their time by batch size (16% over all). (A pipelined
    # timing's first step is already untimed: ``StepTimer.time``.)
    warmup = 0 if timer.async_scheduling else 1
    samples: list[list[float]] = [[] for _ in points]
    for rep in range(repeats + 1):
        for i, (prefills, decode_lens) in enumerate(points):
            t = timer.time(prefills, decode_lens, repeats=1, warmup=warmup)
            if rep:
                samples[i].append(t)
            if on_point is not None:
                on_point(rep * len(points) + i + 1, (repeats + 1) * len(points))
    times = [statistics.median(ts) for ts in samples]
    held_out = [i for i in range(len(points)) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    train = [i for i in range(len(points)) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    fit = fit_linear_shapes(
        [shapes[i] for i in train], [times[i] for i in train], num_layers=c.num_hidden_layers, name=name, form=form
    )
    model = LinearCostModel(fit.coefficients)
    rel = np.array([abs(model.batch_time(shapes[i]).total_s - times[i]) / times[i] for i in held_out])
    host = None
    if host_share:
        del timer  # its KV cache: the calibration's engine takes its own
        if loaded.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        host = measure_host(loaded, max_model_len=max_model_len, max_slots=max_slots)
        per_layer_ms = 1000 / c.num_hidden_layers  # the preset's unit
        coefficients = replace(
            fit.coefficients,
            h_s=host.per_step_s * per_layer_ms,
            h_r=host.per_request_s * per_layer_ms,
            host_overlapped=host_overlapped,
        )
        fit = fit._replace(coefficients=coefficients)
    return ProfileResult(fit, shapes, times, held_out, float(rel.mean()), float(rel.max()), host)

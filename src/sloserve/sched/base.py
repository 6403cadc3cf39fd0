"""The ``Scheduler`` contract and the bookkeeping every policy shares.

A policy implements ``schedule(now) -> SchedulerOutput``; ``update(output, result, now)`` applies what
the executor did. Nothing else crosses between policy and execution. Schedulers never read the clock
(``now`` is passed in) and never read ``Request.true_output_tokens``.

Every running request here is scheduled by name each step (a chunk of one token for a decode). A
policy that runs all its decodes every step derives from ``CohortScheduler`` (sched/cohort.py)
instead, which advances them as one cohort in O(1) per step. How to write a policy:
docs/schedulers.md.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import (
    PreemptionMode,
    SchedulerOutput,
    StepResult,
)
from sloserve.core.request import Request, RequestStatus
from sloserve.kv.manager import KVCacheManager
from sloserve.predict import LengthPredictor


def require_whole_prompts(field: str, budget: int, max_model_len: int) -> None:
    """Raise ConfigError when a per-step token ``budget`` (config field ``field``) cannot hold a whole
    prompt of the model's length: for policies that never chunk prompts."""
    if budget < max_model_len:
        raise ConfigError(f"{field}={budget} is below the model length {max_model_len}: prompts are processed whole")


def check_fits_alone(kv: KVCacheManager, request: Request, max_kv_tokens: int, keep_free_blocks: int = 0) -> None:
    """Raise ConfigError when ``request``, needing ``max_kv_tokens`` of KV at its peak (its max
    allocation under ``max``), would not fit in the whole KV cache with ``keep_free_blocks`` left free
    (a policy's watermark): a policy's ``check_fits``, so that a run refuses it up front instead of
    stalling on it."""
    target = kv.target_slots(request, max_kv_tokens)
    if -(-target // kv.block_size) + keep_free_blocks > kv.gpu.num_blocks:
        what = (
            f"prompt {request.num_prompt_tokens} + max_tokens {request.max_tokens} (max allocation)"
            if target > max_kv_tokens
            else f"prompt {request.num_prompt_tokens} + output {max_kv_tokens - request.num_prompt_tokens + 1} - 1"
        )
        kept = f", {keep_free_blocks} kept free" if keep_free_blocks else ""
        raise ConfigError(
            f"KV capacity {kv.capacity_tokens} tokens ({kv.gpu.num_blocks} blocks of {kv.block_size}{kept}) "
            f"cannot hold request {request.request_id}: {what} = {target} tokens"
        )


class Scheduler(ABC):
    """Base policy: the queues, admission, preemption and the post-step update.

    Queues: ``waiting`` (no KV; new or evicted by recompute), ``running`` (holds GPU KV; insertion
    order is priority order, the last entry is the first victim), ``swapped`` (KV in CPU memory).
    """

    name: str = "scheduler"
    # The policy may run over a KV manager with prefix caching on: it looks the cache up when it admits
    # a waiting request (``_skip_cached_prefix``) and registers the blocks each chunk it schedules
    # will fill (``kv.cache_blocks``).
    supports_prefix_caching: bool = False
    # The policy runs disaggregated (``simulate --disaggregate``, DistServe): with its ``role`` option it
    # hands each request off after its first token (prefill) or takes requests with their KV (decode).
    supports_disaggregation: bool = False
    # The simulator may repeat a step of one-token decodes named as chunks (no cohort) for as many
    # steps as ``decode_horizon`` allows (sim/stretch.py; ``repeat`` is then ``_named_decode_repeat``,
    # and never with prefix caching); else only cohort steps repeat.
    named_decode_stretches: bool = False

    def __init__(self, kv: KVCacheManager, predictor: LengthPredictor | None = None) -> None:
        self.kv = kv
        self.predictor = predictor  # sets predicted_output_tokens at arrival when given
        self.waiting: deque[Request] = deque()
        self.running: dict[Request, None] = {}
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        self.num_swap_fallbacks = 0  # swap preemptions that recomputed: the swap space was full
        # Disaggregated serving: requests whose prefill is done here and whose KV must move to a
        # decode replica (prefill role), and requests arrived with their KV (decode role).
        self.handoff: list[Request] = []
        self.incoming: deque[Request] = deque()

    # --- interface ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """A request arrived; it waits until ``schedule`` admits it. A request that arrives with KV
        computed elsewhere (disaggregated serving) waits in ``incoming`` for slots."""
        if request.status is RequestStatus.TRANSFERRING:
            self.incoming.append(request)
            return
        request.status = RequestStatus.WAITING
        if self.predictor is not None:
            request.predicted_output_tokens = self.predictor.predict(request)
        self.waiting.append(request)

    def check_fits(self, request: Request, max_kv_tokens: int) -> None:
        """Raise ConfigError when ``request``, needing ``max_kv_tokens`` of KV at its peak, could never
        finish alone in this KV cache. Default: no check."""

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.incoming)

    def take_handoff(self) -> list[Request]:
        """Requests to move to a decode replica (their KV is freed here)."""
        handoff, self.handoff = self.handoff, []
        return handoff

    @abstractmethod
    def schedule(self, now: float) -> SchedulerOutput:
        """Decide the next step."""

    def update(self, output: SchedulerOutput, result: StepResult, now: float) -> list[Request]:
        """Apply an executed step: progress counters, token times, finished requests. Returns the
        requests that finished."""
        ended_before = result.ended_before
        for request in ended_before:  # (the engine's; rarely any) out of the cohort before its tick counts
            self._finish(request, now)
        if output.decode is not None:
            output.decode.cohort.advance(result.step_end_times)
        emitted: list[Request] = []
        num_steps = output.num_steps
        run_gap = None  # a stretch's largest gap between consecutive step ends (worked out once)
        for request, num_tokens in output.chunks:
            if ended_before and request in ended_before:
                continue
            if num_steps > 1 and num_tokens == 1 and request.num_tokens_to_process == 1:
                # A named decode repeated (``named_decode_stretches``): a token at each step's end
                ends = result.step_end_times
                if run_gap is None:
                    run_gap = float(np.diff(np.asarray(ends, dtype=np.float64)).max())
                request.add_computed(num_steps)
                request.add_output_run(ends, run_gap)
                emitted.extend(itertools.repeat(request, num_steps))
                continue
            request.add_computed(num_tokens * num_steps)
            if request.num_tokens_to_process == 0:
                request.add_output_token(now)
                emitted.append(request)
        for request in result.finished:
            self._finish(request, now)
        if self.kv.cached_states is not None:  # (a model with state layers: the states the step saved)
            self.kv.cached_states.end_step()
        for request in emitted:
            if request.status is RequestStatus.RUNNING:
                self.on_token_emitted(request)
        return [*ended_before, *result.finished] if ended_before else result.finished

    # --- the simulator's fast path (optional; sim/stretch.py) -----------------------------------
    def decode_horizon(self, output: SchedulerOutput, limit: int) -> int:
        """Steps (>= 1, <= limit) for which repeating the decode-only ``output`` gives the same
        decision, assuming no arrival and no completion. Default: 1 (no fast path).

        NOTE: the caller checks that ``output`` is decode-only: the cohort's step
        (``SchedulerOutput.is_decode_only``) or, for a policy with ``named_decode_stretches``, one of
        decodes named as chunks (``is_named_decode_only``; ``on_token_emitted`` then runs once per
        token of the stretch, after all of them are recorded)."""
        return 1

    def stretch_deadline(self) -> float:
        """The earliest time at which this policy's step may decide differently of itself, with no
        arrival, completion or memory event (its queues' order moving with the clock): every step of a
        decode stretch starts before it. Default: never. (A ``chunk_horizon`` accounts for it itself.)"""
        return math.inf

    def clock_horizon(self, output: SchedulerOutput, end_times: Sequence[float]) -> int:
        """Steps (>= 1, <= len(end_times)) of a planned decode stretch of ``output``, whose steps end
        at ``end_times`` (each later one starts when the one before ends), through which this policy
        decides the same at each step's start: for a policy whose decision moves with the clock step
        by step (BROS's deadlines against its iteration estimate). Called after ``decode_horizon``
        and before ``repeat``. Default: all of them."""
        return len(end_times)

    def _named_decode_memory_horizon(self, output: SchedulerOutput, limit: int) -> int:
        """Steps (>= 1, <= limit) from the scheduled ``output``, one-token decodes named as chunks whose
        first step's slots are allocated, through which their growth fits the free KV: the
        ``decode_horizon`` of a policy whose step of decodes changes only on a completion, an arrival or
        a memory event (a decode that finds no block). Step j (from 1) writes each decode's token at
        position ``num_computed_tokens + j - 1``."""
        kv, bs = self.kv, self.kv.block_size
        held = np.fromiter((kv.num_slots(r) for r, _ in output.chunks), np.int64, len(output.chunks))
        computed = np.fromiter((r.num_computed_tokens for r, _ in output.chunks), np.int64, len(output.chunks))
        free = kv.num_free_blocks

        def blocks_through(step: int) -> int:
            return int(np.maximum(-((held - computed - step) // bs), 0).sum())

        if blocks_through(limit) <= free:
            return limit
        lo, hi = 1, limit  # blocks_through(lo) <= free (0: the first step's slots are held), > at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if blocks_through(mid) <= free else (lo, mid)
        return lo

    def _named_decode_repeat(self, output: SchedulerOutput, num_steps: int) -> SchedulerOutput:
        """``repeat`` for named decodes within their ``_named_decode_memory_horizon``: each one's slots
        for the later steps allocated at once (no prefix cache: which blocks it gets matters to no
        one), and the blocks taken before each step for the timeline."""
        kv, bs = self.kv, self.kv.block_size
        new_blocks = np.zeros(num_steps + 1, dtype=np.int64)  # by the step they are taken before
        for request, _ in output.chunks:
            held, computed = kv.num_slots(request), request.num_computed_tokens
            first = held - computed + 1  # the first step that needs a slot past those held
            if first <= num_steps:
                np.add.at(new_blocks, np.arange(first, num_steps + 1, bs), 1)
                done = kv.allocate_slots(request, computed + num_steps)
                assert done, request
        return output.repeated(num_steps, (new_blocks[1:] * bs).tolist())

    def chunk_horizon(self, output: SchedulerOutput, limit: int) -> int:
        """Steps (>= 1, <= limit) for which ``output``, the cohort's decodes and one prompt chunk,
        repeats with the chunk advancing by its tokens each step, assuming no completion, whatever
        arrives meanwhile. Default: 1 (no fast path)."""
        return 1

    def repeat(self, output: SchedulerOutput, num_steps: int) -> SchedulerOutput:
        """``output`` standing for ``num_steps`` steps (``num_steps`` <= its decode or chunk horizon):
        allocates the KV the later steps need. Default: named decodes' (``named_decode_stretches``)."""
        if self.named_decode_stretches:
            return self._named_decode_repeat(output, num_steps)
        raise NotImplementedError(f"{self.name} has no fast path")

    # --- hooks and shared mechanics -----------------------------------------------------------
    def on_token_emitted(self, request: Request) -> None:
        """A running request scheduled by a chunk sampled a token and goes on. Default: nothing (it
        stays running, and the policy schedules its next token by name)."""

    def _skip_cached_prefix(self, request: Request, cached: list[int], out: SchedulerOutput) -> None:
        """``request`` was just allocated its slots with the ``cached`` blocks ``kv.find_cached_prefix``
        found: its computation starts past them (the first admission's count is kept, as vLLM's
        ``num_cached_tokens``), and they count among the step's cached tokens (``out``, the timeline).
        Counted as one lookup of its prompt (vLLM's prefix cache queries and hits)."""
        num_tokens = len(cached) * self.kv.block_size
        out.num_cached_tokens += num_tokens
        request.add_computed(num_tokens)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_tokens
        if request.prompt_blocks is not None:
            cache = self.kv.prefix_cache
            cache.num_queried_tokens += request.num_tokens
            cache.num_hit_tokens += num_tokens

    def _admit(self, request: Request) -> None:
        """Move a request that now holds KV into ``running``."""
        request.status = RequestStatus.RUNNING
        self.running[request] = None

    def _leave_running(self, request: Request, *, drop_kv: bool = False) -> None:
        """``request`` stops running here (finish, preemption or hand-off). ``drop_kv``: its KV is
        freed right after. A policy with more places a running request can be extends this."""
        self.running.pop(request, None)

    def _hand_off(self, request: Request) -> None:
        """Prefill role: the request sampled its first token; its KV leaves for a decode replica."""
        self._leave_running(request, drop_kv=True)
        self.kv.free(request)
        request.status = RequestStatus.TRANSFERRING
        self.handoff.append(request)

    def _finish(self, request: Request, now: float) -> None:
        self._leave_running(request, drop_kv=True)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_time = now
        if self.predictor is not None and not request.aborted:
            self.predictor.observe(request)

    def _preempt(self, request: Request, mode: PreemptionMode, output: SchedulerOutput, *, front: bool = True) -> None:
        """Evict ``request`` from the GPU (recompute: drop its KV; swap: move it to CPU memory).
        When the swap space is full it recomputes instead, counted in ``num_swap_fallbacks`` (vLLM v0
        aborts the run there; a simulation goes on and reports it). A recomputed request waits at
        the front of the queue (vLLM v0), or with ``front=False`` at its back (InferMax Algorithm 1:
        "appended to R_w")."""
        assert request in self.running, request
        self._leave_running(request)
        request.num_preemptions += 1
        request.num_allocation_failures += 1  # NOTE: every policy preempts only when KV runs short
        self.num_preemptions += 1
        if mode is PreemptionMode.SWAP:
            copies = self.kv.swap_out(request)
            if copies is not None:
                output.swap_out = [*output.swap_out, *copies]
                output.swap_bytes += self.kv.swap_bytes(copies)
                request.status = RequestStatus.SWAPPED
                self.swapped.append(request)
                output.add_preemption(request, mode)
                return
            mode = PreemptionMode.RECOMPUTE
            self.num_swap_fallbacks += 1
        self.kv.free(request)
        request.reset_computed()
        request.status = RequestStatus.WAITING
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)
        output.add_preemption(request, mode)

    # --- metrics -------------------------------------------------------------------------------
    def policy_metrics(self) -> dict[str, Any]:
        """What this policy's paper reports beyond the common metrics, JSON-ready: ``num_*`` counters
        and ``*_s`` accumulated seconds (summed over replicas), lists of samples (concatenated;
        summarized as distributions) and settings (kept when every replica agrees). Default: with
        prefix caching, the prompt tokens looked up and found (vLLM's prefix_cache_queries and
        prefix_cache_hits) and the cached blocks evicted; else none."""
        cache = self.kv.prefix_cache
        if cache is None:
            return {}
        return {
            "num_prefix_cache_queries": cache.num_queried_tokens,
            "num_prefix_cache_hits": cache.num_hit_tokens,
            "num_prefix_cache_evicted_blocks": cache.num_evicted_blocks,
        }

    def kv_used_tokens(self) -> int:
        """Tokens holding KV on the GPU (a block that several requests share counted once)."""
        used = 0
        for request in self.running:  # NOTE: a loop: read every step, and a generator costs more
            used += request.num_computed_tokens
        return used - self.kv.num_shared_tokens if self.kv.prefix_cache is not None else used

    def check_integrity(self) -> None:
        """Invariants across queues and the KV manager (for tests)."""
        self.kv.check_integrity()
        queues = [set(self.waiting), set(self.running), set(self.swapped), set(self.incoming)]
        for i, a in enumerate(queues):
            for b in queues[i + 1 :]:
                assert not a & b, "a request is in two queues"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING, r
            assert self._granted_slots(r) >= r.num_computed_tokens, f"{r} has KV beyond its slots"
        for r in self.waiting:
            assert r.num_computed_tokens == 0 and self.kv.num_slots(r) == 0, r

    def _granted_slots(self, request: Request) -> int:
        """Slots ``request`` holds (with growth reserved for it but not yet given block ids)."""
        return self.kv.num_tracked_tokens(request)

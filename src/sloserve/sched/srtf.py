"""SRTF, one of EconoServe's baselines (papers/econoserve.md §2.1): iteration-level
shortest-remaining-time-first with ORCA's max allocation.

Also the mechanics the §2.1 baselines share (FastServe, MultiRes import them from here):

    IterationScheduler       decodes stay explicit chunks, prompts are processed whole, a request
                             takes its KV when admitted
    PriorityBatchScheduler   every iteration, all requests (holding KV or waiting) in a policy's
                             priority order, taken while the batch size, prompt budget and KV allow

The paper "assumed that the RL of each request is preknown in our first measurement": the remaining
time is the predicted output length (the ``oracle`` predictor by default) minus the tokens generated.
"""

from __future__ import annotations

import bisect
import itertools
from abc import abstractmethod
from dataclasses import dataclass
from operator import itemgetter
from typing import Literal

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import ScheduledChunk, SchedulerOutput
from sloserve.core.request import Request, RequestStatus
from sloserve.kv.manager import KVCacheManager
from sloserve.predict import LengthPredictor
from sloserve.sched.base import Scheduler, check_fits_alone, require_whole_prompts


@dataclass
class PriorityConfig:
    """Knobs shared by SRTF and FastServe. Validated by ``resolve``."""

    # Requests per batch. EconoServe §2.1: "The batch size of ORCA and FastServe was set to 8"; the
    # paper does not give SRTF's, so it gets ORCA's too.
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # prompt tokens per batch (None: max(model length, 2048))
    kv_manager: Literal["max"] = "max"  # ORCA max allocation: prompt + max_tokens slots at admission
    block_size: int = 16

    def resolve(self, max_model_len: int) -> None:
        """Fill defaults that depend on the model and check every knob."""
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(max_model_len, 2048)
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        require_whole_prompts("max_num_batched_tokens", self.max_num_batched_tokens, max_model_len)
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_manager != "max":
            # NOTE: a request that is not chosen keeps its KV and must never need more when it runs
            # again; max allocation guarantees that, paged growth would need evictions.
            raise ConfigError(f"this scheduler uses kv_manager max (max allocation), got {self.kv_manager!r}")


@dataclass
class SrtfConfig(PriorityConfig):
    """SRTF: the shared knobs plus the predictor that supplies each request's output length."""

    predictor: Literal["oracle", "histogram"] = "oracle"
    histogram_quantile: float = 0.5  # the output-length quantile the histogram predicts
    # A trace (a served request log) whose prompt and output lengths the histogram starts from
    histogram_history: str | None = None

    def resolve(self, max_model_len: int) -> None:
        super().resolve(max_model_len)
        if self.predictor not in ("oracle", "histogram"):
            raise ConfigError(f"srtf needs a predictor, oracle or histogram, got {self.predictor!r}")


class IterationScheduler(Scheduler):
    """A policy that names every request it runs each iteration: no decode cohort, a prompt (or a
    refill) is one whole chunk, a decode is a one-token chunk.

    With prefix caching, a waiting request is admitted with the blocks of its prompt found cached
    (``_try_admit``): its prompt chunk is only what it does not find, and each chunk registers the
    full blocks it fills (``_run``)."""

    supports_prefix_caching = True

    def __init__(self, kv: KVCacheManager, config, predictor: LengthPredictor | None = None) -> None:
        super().__init__(kv, predictor)
        self.config = config
        self._caching = kv.prefix_cache is not None

    def check_fits(self, request: Request, max_kv_tokens: int) -> None:
        check_fits_alone(self.kv, request, max_kv_tokens)

    def _run(self, request: Request, out: SchedulerOutput) -> int:
        """Put a request holding its KV in the batch; returns the tokens it adds to the forward."""
        num_tokens = request.num_tokens_to_process
        out.chunks.append(ScheduledChunk(request, num_tokens))
        if self._caching:
            self.kv.cache_blocks(request, request.num_computed_tokens + num_tokens)
        return num_tokens

    def _try_admit(
        self, request: Request, hold_tokens: int, out: SchedulerOutput, cached: list[int] | tuple = ()
    ) -> bool:
        """Admit a waiting request if slots for ``hold_tokens`` tokens (stretched by the manager's
        target, e.g. max allocation) fit in the free KV, starting with the ``cached`` blocks
        ``kv.find_cached_prefix`` found; all or nothing."""
        if not self.kv.can_allocate(request, hold_tokens, cached=cached):
            return False
        done = self.kv.allocate_slots(request, hold_tokens, cached)
        assert done
        self.waiting.remove(request)
        if self._caching:
            self._skip_cached_prefix(request, cached, out)
        self._admit(request)
        return True

    def _uncached_need(self, request: Request, num_tokens: int) -> tuple[int, int, list[int]]:
        """With prefix caching: (prompt tokens left to compute, free blocks its admission with
        ``num_tokens`` slots takes, the cached blocks it starts with) for a waiting ``request``, with
        what the cache holds now."""
        cached = self.kv.find_cached_prefix(request)
        tokens = request.num_tokens_to_process - len(cached) * self.kv.block_size
        return tokens, self.kv.blocks_needed(request, num_tokens, cached), cached


class PriorityBatchScheduler(IterationScheduler):
    """Each iteration, every request (running, i.e. holding KV, and waiting) in ``priority`` order;
    take each one that fits until the batch holds ``max_num_seqs``. A waiting request fits when its
    prompt fits the prompt-token budget and its max allocation fits the free KV (one that does not
    is skipped, not waited for); a running one always fits (its allocation already covers every
    token it can produce).

    NOTE: a running request that is not taken is preempted in place: it keeps its KV (no eviction,
    no copy, nothing in ``output.preempted``) and resumes when it ranks high enough again.
    NOTE: waiting requests live in ``_queue`` sorted by their key, which does not change while they
    wait (nothing is generated); a policy that changes one calls ``_reorder_queue``. An iteration
    skips the queue once the free KV is below the smallest max allocation in it, so a saturated KV
    cache does not cost a scan of the whole queue every iteration. With prefix caching the queue
    keeps the least an admission can take (its max allocation less every prompt block but the last
    found cached), and a request's real need is looked up when the scan reaches it.
    """

    config: PriorityConfig

    def __init__(self, kv: KVCacheManager, config: PriorityConfig, predictor: LengthPredictor | None = None) -> None:
        super().__init__(kv, config, predictor)
        # (priority key, arrival sequence number, blocks of its max allocation, request), sorted.
        self._queue: list[tuple[tuple, int, int, Request]] = []
        self._arrivals = itertools.count()
        self._min_need: int | None = None  # smallest blocks entry in _queue (None: to recompute)

    @abstractmethod
    def priority(self, request: Request) -> tuple:
        """Sort key: smaller runs first."""

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if request.status is RequestStatus.WAITING:
            need = self.kv.blocks_needed(request, request.num_tokens)
            if self._caching:  # at least: every block of its prompt but the last may be found cached
                need = max(need - (request.num_tokens - 1) // self.kv.block_size, 0)
            bisect.insort(self._queue, (self.priority(request), next(self._arrivals), need, request))
            if self._min_need is not None:
                self._min_need = min(self._min_need, need)

    def _reorder_queue(self) -> None:
        """Re-key and re-sort the waiting queue (after a policy changed some waiting keys)."""
        self._queue = sorted((self.priority(r), seq, need, r) for _, seq, need, r in self._queue)

    def _smallest_need(self) -> int:
        if self._min_need is None:
            self._min_need = min((need for _, _, need, _ in self._queue), default=0)
        return self._min_need

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        cap = self.config.max_num_seqs
        running = sorted(((self.priority(r), r) for r in self.running), key=itemgetter(0))
        batch: list[Request] = []
        admitted: set[Request] = set()
        free, room = self.kv.num_free_blocks, self.config.max_num_batched_tokens or 0
        i = 0  # next running request
        for key, _, least_need, request in self._queue:
            if len(batch) >= cap or free < self._smallest_need():
                break
            while i < len(running) and running[i][0] < key and len(batch) < cap:
                batch.append(running[i][1])
                i += 1
            if len(batch) >= cap or least_need > free:
                continue
            tokens, need, cached = request.num_tokens, least_need, ()
            if self._caching:
                tokens, need, cached = self._uncached_need(request, request.num_tokens)
            if need <= free and tokens <= room:
                # NOTE: admitted (KV allocated) at once, so that a later candidate's lookup sees what
                # this allocation evicted from the cache
                done = self._try_admit(request, request.num_tokens, out, cached)
                assert done
                batch.append(request)
                admitted.add(request)
                free, room = self.kv.num_free_blocks, room - tokens
        batch.extend(r for _, r in running[i : i + cap - len(batch)])
        if admitted:
            self._queue = [entry for entry in self._queue if entry[3] not in admitted]
            self._min_need = None
        for request in batch:
            self._run(request, out)
        return out


class SrtfScheduler(PriorityBatchScheduler):
    """Shortest remaining time first, re-ranked every iteration (EconoServe §2.1 "SRTF").

    Remaining time = predicted output tokens - generated tokens; ties go to the earlier arrival.
    NOTE: a request that outlives its prediction (histogram predictor) counts as one token left, so
    it runs among the first and drains.
    """

    name = "srtf"
    named_decode_stretches = True

    def decode_horizon(self, output: SchedulerOutput, limit: int) -> int:
        """A step of decodes only repeats until an arrival or a completion (the simulator stops there):
        each batch member's remaining time only shrinks, every other request's key stays, and under
        max allocation the free KV (and so which waiting request fits) does not move, so each step
        picks the same batch."""
        return self._named_decode_memory_horizon(output, limit)

    def remaining_tokens(self, request: Request) -> int:
        predicted = request.predicted_output_tokens or 1
        return max(predicted - request.num_output_tokens, 1)

    def priority(self, request: Request) -> tuple:
        return (self.remaining_tokens(request), request.arrival_time, request.request_id)

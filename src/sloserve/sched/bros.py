"""BROS (papers/bros.md): real-time (RT) and best-effort (BE) requests on one GPU.

Each step picks a subset of the requests that hold KV ("pending") and of the waiting ones; the rest
wait. Prompts are processed whole; decodes take one token. KV is paged; a request that must give
up its blocks is evicted by recompute. With ``kv_manager=bidirectional`` (the ``bros`` preset) RT
requests share blocks with BE requests and overwrite their slots with lazy checkpointing, and a
request dropped for room is swapped out (§5); ``bros_nobicache`` is the paper's "No Bi-cache"
ablation (§7.3: recompute instead).

BROS's formulas were lost in the text; they are rebuilt here from the prose of §4:
    (2)-(5) iteration time: the cost model on the batch's shape (prefill and decode parts summed)
    (6)     the estimate may not exceed the residual time of the most urgent RT request
    (7)     at most B requests per batch, B from the adaptive batch size
    (8)     enough free (or preemptible) blocks for every scheduled request

With prefix caching (ours; BROS predates it) a waiting request's prompt blocks found in the cache are
neither computed nor charged: (3)-(5) count its uncached tokens (attention still reads the cached
ones), (8) its blocks not found and the found ones that nobody uses (they leave the free count), and
the prompt budget its uncached tokens. So an RT request that finds a BE request's prompt cached
shares those blocks and pays for none of them. See kv/bidirectional.py for how shared blocks live
beside the bidirectional ones.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import PreemptionMode, ScheduledChunk, SchedulerOutput
from sloserve.core.request import Request, RequestClass, RequestStatus
from sloserve.cost.base import BatchShape, CostModel
from sloserve.kv.bidirectional import BidirectionalKVManager
from sloserve.kv.manager import KVCacheManager
from sloserve.predict import LengthPredictor
from sloserve.sched.base import Scheduler, check_fits_alone, require_whole_prompts
from sloserve.sched.bros_stretch import BrosStretches


@dataclass
class BrosConfig:
    """Knobs of the BROS scheduler and its RR baseline. Validated by ``resolve``."""

    initial_batch_size: int = 8  # B_0: the conservative start and the reset value (TCP-like)
    batch_size_step: int = 4  # additive increase per step without an estimated violation
    max_batch_size: int = 256
    max_num_batched_tokens: int | None = None  # prompt tokens per batch (None: max(model length, 2048))
    # An RT request in the batch may give its place to a BE request when its residual time exceeds
    # this many estimated iterations (it can still run in the next one).
    replace_slack_iterations: float = 2.0
    default_ttft_s: float = 0.4  # SLOs for RT requests without their own (BROS §7.1)
    default_tpot_s: float = 0.2
    # When an RT request's next token is due. "per_token": token k at first token + (k - 1) x TPOT,
    # so a request ahead of schedule banks the slack. "token_group": (6) as Table 1's inputs describe
    # it: the current group of ``token_group_size`` tokens is due group x TPOT after the previous group
    # came, and its next token early enough for the rest to follow one per (moving-average) iteration
    # (metrics/token_groups.py measures the same groups).
    deadlines: str = "per_token"
    token_group_size: int = 5  # as metrics/token_groups.py's default
    block_size: int = 16
    kv_manager: str = "paged"
    # Where an RT request that filled its last block grows (bidirectional blocks): over the BE tokens
    # facing it there ("facing_first", lazy checkpointing as in §5.2's Fig. 9), or into a free block
    # first ("free_block_first", BE slots preempted only "if no GPU blocks are available"). §5.2
    # reads both ways; see kv/bidirectional.py for why facing first is the default.
    rt_growth: str = "facing_first"
    # Progressive dropping (§5, when an RT request finds neither free nor preemptible blocks): drop
    # the victim's KV and recompute it later ("recompute", paged KV), or swap its cache blocks out
    # to CPU memory as §5 says ("swap", bidirectional blocks only: the ``bros`` preset). §5 gives no
    # rule for when a swapped-out request returns; ours (see _make_room and _may_admit): an RT one
    # may drop BE requests to come back, never RT ones; a BE one takes free blocks, and no new BE
    # request is admitted meanwhile.
    dropping: str = "recompute"
    watermark: float = 0.0
    # The anti-thrash rule (ours; §5 leaves re-admission open): a request dropped before comes back
    # only when what it needs is free beyond the RT requests' growth over this many steps (each RT
    # request on the GPU grows a token a step), and a dropped RT request drops no other RT request
    # to come back. 0: no re-admission rule at all (dropped requests come back as soon as they fit,
    # a dropped RT request drops RT ones too). Why and what it changes: docs/reproduction.md.
    readmit_horizon_steps: int = 16

    def resolve(self, max_model_len: int) -> None:
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(max_model_len, 2048)
        if not 1 <= self.initial_batch_size <= self.max_batch_size:
            raise ConfigError(
                f"batch size range needs 1 <= initial_batch_size <= max_batch_size, got "
                f"{self.initial_batch_size} > {self.max_batch_size}"
                if self.initial_batch_size > self.max_batch_size
                else f"initial_batch_size must be >= 1, got {self.initial_batch_size}"
            )
        if self.batch_size_step < 0:
            raise ConfigError(f"batch_size_step must be >= 0, got {self.batch_size_step}")
        require_whole_prompts("max_num_batched_tokens", self.max_num_batched_tokens, max_model_len)
        for name in ("default_ttft_s", "default_tpot_s", "replace_slack_iterations"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_manager not in ("paged", "bidirectional"):
            raise ConfigError(f"BROS schedulers use kv_manager paged or bidirectional, got {self.kv_manager!r}")
        if self.deadlines not in ("per_token", "token_group"):
            raise ConfigError(f"deadlines must be per_token or token_group, got {self.deadlines!r}")
        if self.readmit_horizon_steps < 0:
            raise ConfigError(f"readmit_horizon_steps must be >= 0, got {self.readmit_horizon_steps}")
        if self.token_group_size < 1:
            raise ConfigError(f"token_group_size must be >= 1, got {self.token_group_size}")
        if self.rt_growth not in ("facing_first", "free_block_first"):
            raise ConfigError(f"rt_growth must be facing_first or free_block_first, got {self.rt_growth!r}")
        if self.dropping not in ("recompute", "swap"):
            raise ConfigError(f"dropping must be recompute or swap, got {self.dropping!r}")
        if self.dropping == "swap" and self.kv_manager != "bidirectional":
            raise ConfigError("dropping=swap needs kv_manager=bidirectional (the swap-out is of its blocks)")
        if self.dropping == "swap" and self.rt_growth == "free_block_first":
            # NOTE: measured (docs/reproduction.md): RT requests then drop BE requests that come
            # straight back, about 17 swaps a step at OPT-30B, RT rate 10; a run takes hours.
            raise ConfigError(
                "rt_growth=free_block_first with dropping=swap swaps BE requests out and back every step; "
                "add --set dropping=recompute"
            )


class SubsetScheduler(Scheduler):
    """Common mechanics of policies that run a chosen subset each step (no decode cohort)."""

    supports_prefix_caching = True

    def __init__(
        self,
        kv: KVCacheManager,
        config: BrosConfig,
        predictor: LengthPredictor | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        super().__init__(kv, predictor)
        self.config = config
        self.cost_model = cost_model
        self._budget = config.max_num_batched_tokens or 0
        self._batch_blocks = 0  # new blocks the batch being built needs
        self._batch_prompt_tokens = 0
        self._group_start: dict[Request, float] = {}  # token-group deadlines: when the current group began
        # Bidirectional blocks (§5): slots are taken as requests join the batch, whose members are
        # protected from being overwritten; checkpoint and restore traffic is the step's swap.
        self._bicache = isinstance(kv, BidirectionalKVManager)
        if self._bicache:
            kv.rt_free_block_first = config.rt_growth == "free_block_first"
        self._batch_set: set[Request] = set()
        # What each member of the batch being built was charged: (new blocks, prompt tokens to compute).
        self._charged: dict[Request, tuple[int, int]] = {}
        # Prefix caching: the cached blocks of waiting requests' prompts, looked up once a step (again
        # after the cache evicts), and those a waiting member of the batch holds (bidirectional
        # blocks: allocated as it joins).
        self._caching = kv.prefix_cache is not None
        self._found: dict[Request, Sequence[int]] = {}
        self._found_at_eviction = 0
        self._batch_cached: dict[Request, Sequence[int]] = {}
        # dropping=swap: the requests whose KV is swapped out, by class.
        self._dropped: dict[RequestClass, set[Request]] = {RequestClass.RT: set(), RequestClass.BE: set()}
        self._sorted_dropped_rt: list[Request] | None = None  # BROS's order of _dropped[RT], while it holds
        # The waiting requests of each class in queue order, rebuilt when the queue changes (an arrival, an
        # admission, a recompute preemption), not every step: an overloaded queue holds hundreds.
        self._waiting_of: dict[RequestClass, list[Request]] | None = None
        # The running requests of each class (dropped ones too) in running order, rebuilt when one starts
        # or stops running: the packing, the BE phase and RR read them every step.
        self._running_of: dict[RequestClass, list[Request]] | None = None

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self._waiting_of = None

    def _admit(self, request: Request) -> None:
        super()._admit(request)
        self._waiting_of = self._running_of = None

    def _leave_running(self, request: Request, *, drop_kv: bool = False) -> None:
        super()._leave_running(request, drop_kv=drop_kv)
        self._running_of = None

    def _preempt(self, request: Request, mode: PreemptionMode, output: SchedulerOutput, **kwargs) -> None:
        super()._preempt(request, mode, output, **kwargs)
        self._waiting_of = None

    def _running(self, request_class: RequestClass) -> list[Request]:
        """The running requests of ``request_class`` (dropped ones too), in running order. NOTE: the list
        is kept until a request starts or stops running: callers must not change it."""
        if self._running_of is None:
            self._running_of = {RequestClass.RT: [], RequestClass.BE: []}
            for r in self.running:
                self._running_of[r.request_class].append(r)
        return self._running_of[request_class]

    def _waiting(self, request_class: RequestClass) -> list[Request]:
        """The waiting requests of ``request_class``, in queue order."""
        if self._waiting_of is None:
            self._waiting_of = {RequestClass.RT: [], RequestClass.BE: []}
            for r in self.waiting:
                self._waiting_of[r.request_class].append(r)
        return self._waiting_of[request_class]

    def check_fits(self, request: Request, max_kv_tokens: int) -> None:
        """Raise ConfigError when ``request`` could never run alone in this KV cache (progressive
        dropping would otherwise run out of requests to drop)."""
        check_fits_alone(self.kv, request, max_kv_tokens)

    # Moving average of the estimated iteration time ((6) with token groups), and its weight per step.
    iteration_ema_s = 0.0
    ITERATION_EMA_WEIGHT = 0.2  # our choice: the paper's window is not stated

    def on_token_emitted(self, request: Request) -> None:
        """Decodes stay explicit: the policy picks who runs every step. With token-group deadlines,
        a request whose token completed a group starts the next one now."""
        if (
            self.config.deadlines == "token_group"
            and (request.num_output_tokens - 1) % self.config.token_group_size == 0
        ):
            self._group_start[request] = request.last_token_time

    def _finish(self, request: Request, now: float) -> None:
        super()._finish(request, now)
        self._group_start.pop(request, None)

    def deadline(self, request: Request) -> float:
        """When the RT request's next token is due: arrival + TTFT for the first. After it, per token
        (``deadlines=per_token``), the k-th further token at first token + k x TPOT, so that TPOT as
        measured (the average gap, (last - first) / (output tokens - 1)) meets its SLO; or by token
        groups (``token_group``, see ``BrosConfig.deadlines``)."""
        slo = request.slo
        if math.isnan(request.first_token_time):
            return request.arrival_time + (slo.ttft_s or self.config.default_ttft_s)
        tpot = slo.tpot_s or self.config.default_tpot_s
        if self.config.deadlines == "per_token":
            return request.first_token_time + request.num_output_tokens * tpot
        g = self.config.token_group_size
        produced = (request.num_output_tokens - 1) % g  # tokens of the current group so far
        group_start = self._group_start.get(request, request.last_token_time)
        return group_start + g * tpot - (g - produced - 1) * self.iteration_ema_s

    def _tokens_needed(self, request: Request) -> int:
        return request.num_tokens if request.status is RequestStatus.WAITING else request.num_computed_tokens + 1

    def _cached_prefix(self, request: Request) -> Sequence[int]:
        """The cached blocks a waiting request's prompt starts with (none for a running request, or
        without prefix caching)."""
        if not self._caching or request.status is not RequestStatus.WAITING:
            return ()
        cached = self._batch_cached.get(request)
        if cached is not None:
            return cached
        evicted = self.kv.prefix_cache.num_evicted_blocks
        if evicted != self._found_at_eviction:  # NOTE: blocks found before may be gone
            self._found.clear()
            self._found_at_eviction = evicted
        cached = self._found.get(request)
        if cached is None:
            cached = self._found[request] = self.kv.find_cached_prefix(request)
        return cached

    def _prompt_tokens(self, request: Request) -> int:
        """Tokens of a waiting request's prompt to compute (those not cached); 0 for a running one."""
        if request.status is not RequestStatus.WAITING:
            return 0
        return request.num_tokens - len(self._cached_prefix(request)) * self.kv.block_size

    def _blocks(self, request: Request) -> int:
        return self.kv.blocks_needed(request, self._tokens_needed(request), self._cached_prefix(request))

    def _fits(self, request: Request) -> bool:
        """(8): the request's new blocks fit beside those of the batch being built."""
        if self._bicache:
            needed = self.kv.slots_needed(request, self._tokens_needed(request), self._cached_prefix(request))
            return self.kv.has_room(request, needed, self._batch_set)
        return self._blocks(request) + self._batch_blocks <= self.kv.num_free_blocks

    def _add(self, batch: list[Request], request: Request) -> None:
        blocks, prompt_tokens = 0, self._prompt_tokens(request)
        if self._bicache:
            t0 = time.perf_counter()
            done = self.kv.restore(request, self._batch_set)  # checkpointed slots come back first
            assert done
            if request in self._dropped[request.request_class]:  # swapped back in
                self._dropped[request.request_class].remove(request)
                self._sorted_dropped_rt = None
            cached = self._cached_prefix(request)
            done = self.kv.allocate_slots(request, self._tokens_needed(request), self._batch_set, cached)
            assert done
            if cached:
                self._batch_cached[request] = cached
            self.kv_time_s += time.perf_counter() - t0
        else:
            blocks = self._blocks(request)
        self._charged[request] = (blocks, prompt_tokens)
        self._batch_blocks += blocks
        self._batch_prompt_tokens += prompt_tokens
        batch.append(request)
        self._batch_set.add(request)

    def _add_decodes(
        self, batch: list[Request], requests: list[Request], new_blocks: list[int], computed: list[int]
    ) -> None:
        """``_add`` of running ``requests`` on the GPU, at once: each takes ``new_blocks`` (paged KV) or its
        next slot where it touches nobody (bidirectional blocks: ``free_blocks_to_grow``)."""
        if self._bicache:
            t0 = time.perf_counter()
            for r, m in zip(requests, computed, strict=True):
                done = self.kv.allocate_slots(r, m + 1)  # (nobody else's slot: nobody to protect)
                assert done
            self.kv_time_s += time.perf_counter() - t0
        self._charged.update(zip(requests, zip(new_blocks, itertools.repeat(0))))
        self._batch_blocks += sum(new_blocks)
        batch.extend(requests)
        self._batch_set.update(requests)

    def _remove(self, batch: list[Request], request: Request) -> None:
        batch.remove(request)
        self._batch_set.discard(request)
        if self._bicache:  # undo its growth (an RT request: never restored)
            self.kv.truncate(request, request.num_computed_tokens)
            self._batch_cached.pop(request, None)
        blocks, prompt_tokens = self._charged.pop(request)
        self._batch_blocks -= blocks
        self._batch_prompt_tokens -= prompt_tokens

    def _prompt_fits(self, request: Request) -> bool:
        return self._batch_prompt_tokens + self._prompt_tokens(request) <= self._budget

    # Wall time spent placing batch members' slots (bidirectional), for BROS's Figure 14.
    kv_time_s = 0.0

    def _start_batch(self) -> list[Request]:
        self._batch_blocks = 0
        self._batch_prompt_tokens = 0
        self._batch_set = set()
        self._charged = {}
        self._batch_cached = {}
        self._found.clear()  # NOTE: the cache changed since the last step
        return []

    def _take_batch(self, batch: list[Request], out: SchedulerOutput) -> None:
        """``_take`` each member, in order. Prefix caching, paged KV: first the cached blocks the waiting
        members found that nobody uses are held for them, each until it is taken (as vLLM v1 touches a
        request's cached blocks when it schedules it): an earlier member's new blocks could evict one, and
        with it every block its finder found after it (a prompt's blocks are found as a chain), leaving it
        more to allocate than (8) counted."""
        held: dict[Request, list[int]] = {}
        if self._caching and not self._bicache:
            cache = self.kv.prefix_cache
            for r in batch:
                if r.status is RequestStatus.WAITING:
                    found = self._cached_prefix(r)
                    unused = [b for b, refs in zip(found, cache.ref_counts[cache.ids(found)].tolist()) if not refs]
                    if unused:
                        cache.share(unused)
                        held[r] = unused
        for r in batch:
            if r in held:
                self.kv.prefix_cache.release(held.pop(r))  # (its lookup finds them, its allocation takes them)
            self._take(r, out)

    def _take(self, request: Request, out: SchedulerOutput) -> None:
        """Put ``request`` in the batch: allocate its slots, admit it if waiting, add its chunk; with
        prefix caching, skip the cached blocks of its prompt and register those its chunk computes."""
        waiting = request.status is RequestStatus.WAITING
        if self._bicache:  # allocated when it joined the batch
            cached = self._batch_cached.get(request, ())
        else:
            # NOTE: looked up again: a member taken before may have registered more; the blocks found
            # while packing are all there (``_take_batch`` held them), so it allocates no more than counted.
            cached = self.kv.find_cached_prefix(request) if self._caching and waiting else ()
            if waiting or self._charged[request][0]:  # (a decode with room in its last block takes none)
                done = self.kv.allocate_slots(request, self._tokens_needed(request), cached=cached)
                assert done
        if waiting:
            self.waiting.remove(request)
            self._admit(request)
            if self._caching:
                self._skip_cached_prefix(request, cached, out)
        chunk = request.num_tokens_to_process
        out.chunks.append(ScheduledChunk(request, chunk))
        if self._caching and waiting:  # (a decode's blocks are registered when the request ends)
            self.kv.cache_blocks(request, request.num_computed_tokens + chunk)

    def _recharge_waiting_members(self) -> None:
        """Prefix caching, paged KV: a waiting member is charged the cached blocks it found that nobody
        uses (taking them lowers the free count). An eviction while the batch is built can leave blocks a
        member found in nobody's use: its charge is worked out again, or (8) would count those blocks
        free for a later member too (and the member's allocation would then fail)."""
        for r, (blocks, prompt_tokens) in self._charged.items():
            if r.status is RequestStatus.WAITING:
                now = self._blocks(r)
                self._batch_blocks += now - blocks
                self._charged[r] = (now, prompt_tokens)

    def _evict(self, request: Request, out: SchedulerOutput) -> None:
        """Progressive dropping (§5): recompute the request later, or (``dropping=swap``) swap its KV
        out: it stays running, holding no GPU slot, and is restored when it runs again."""
        if self.config.dropping != "swap":
            self._preempt(request, PreemptionMode.RECOMPUTE, out)
            if self._caching and not self._bicache:
                self._recharge_waiting_members()
            return
        self.kv.drop_to_cpu(request)
        self._dropped[request.request_class].add(request)
        self._sorted_dropped_rt = None
        request.num_preemptions += 1
        request.num_allocation_failures += 1  # NOTE: dropping happens only when KV runs short
        self.num_preemptions += 1
        out.add_preemption(request, PreemptionMode.SWAP)

    def _on_gpu(self, request: Request) -> bool:
        """Whether ``request`` holds GPU slots (a dropped one holds none: dropping it again frees nothing)."""
        return request not in self._dropped[request.request_class]

    def _was_dropped(self, request: Request) -> bool:
        """Whether ``request`` holds no GPU KV because it was dropped for room: swapped out
        (``dropping=swap``), or waiting to be recomputed."""
        if request.status is RequestStatus.WAITING:
            return request.num_preemptions > 0
        return not self._on_gpu(request)

    def _needs_new_kv(self, request: Request) -> bool:
        """Whether running ``request`` takes GPU KV it does not hold (a waiting or dropped request)."""
        return request.status is RequestStatus.WAITING or not self._on_gpu(request)

    def _be_may_take_room(self, request: Request, num_rt_on_gpu: int, rt_short_of_room: bool) -> bool:
        """The anti-thrash rule (``readmit_horizon_steps``) for a BE request that needs new GPU KV (a
        new one, or one dropped before): none while an RT request is short of room this step (the
        free KV is its); a dropped one only with room left for the ``num_rt_on_gpu`` RT requests'
        growth over the horizon. NOTE: without it, the step that brings a dropped BE request back
        into the last free blocks is followed by one that drops it again (docs/reproduction.md)."""
        horizon = self.config.readmit_horizon_steps
        if not horizon or not self._needs_new_kv(request):
            return True  # the rule off, or a BE request running on the GPU (it grows by a slot)
        if rt_short_of_room:
            return False
        if not self._was_dropped(request):
            return True
        growth_tokens = num_rt_on_gpu * horizon
        if self._bicache:
            needed = self.kv.slots_needed(request, self._tokens_needed(request), self._cached_prefix(request))
            return self.kv.has_room(request, needed + growth_tokens, self._batch_set)
        growth_blocks = num_rt_on_gpu * -(-horizon // self.kv.block_size)  # at most this many new blocks each
        return self._blocks(request) + self._batch_blocks + growth_blocks <= self.kv.num_free_blocks

    def _may_admit(self, request: Request) -> bool:
        """The re-admission rule of ``dropping=swap`` for BE requests (vLLM's for swapped requests):
        no new BE request while BE requests wait swapped out, so that the free blocks they need to
        come back do not go to it. RT requests are admitted as ever (their TTFT comes first)."""
        return (
            request.request_class is RequestClass.RT
            or request.status is not RequestStatus.WAITING
            or not self._dropped[RequestClass.BE]
        )

    def check_integrity(self) -> None:
        """Also: the per-class waiting lists and the sorted dropped RT requests hold what they stand for."""
        super().check_integrity()
        if self._waiting_of is not None:
            for request_class, listed in self._waiting_of.items():
                assert set(listed) == {r for r in self.waiting if r.request_class is request_class}, request_class
        if self._running_of is not None:
            for request_class, listed in self._running_of.items():
                assert listed == [r for r in self.running if r.request_class is request_class], request_class
        for dropped in self._dropped.values():
            assert dropped <= self.running.keys(), "a dropped request is not running"
        if self._sorted_dropped_rt is not None:
            assert set(self._sorted_dropped_rt) == self._dropped[RequestClass.RT]

    def kv_used_tokens(self) -> int:
        if self._bicache:  # checkpointed and dropped tokens are in CPU memory
            return self.kv.allocated_tokens
        return super().kv_used_tokens()


class BrosScheduler(BrosStretches, SubsetScheduler):
    """Priority packing (BROS §4.2, Algorithm 1) with the adaptive batch size. The simulator repeats
    its steps of decodes while they stay the same (sched/bros_stretch.py)."""

    name = "bros"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.cost_model is None:
            raise ConfigError("the bros scheduler needs a cost model for its iteration-time estimate")
        self.batch_size = self.config.initial_batch_size  # B
        self._sorted_waiting_rt: list[Request] | None = None  # the waiting RT list last sorted by deadline
        self.last_estimate_s = 0.0  # for tests and metrics
        self.last_residual_s = math.inf
        # Figure 14: wall time of schedule() by part, and the cost-model queries it made.
        self.phase_s = {"rt_ordering": 0.0, "rt_packing": 0.0, "be_packing": 0.0, "kv_blocks": 0.0}
        self.num_cost_model_queries = 0
        self.num_schedule_calls = 0

    def policy_metrics(self) -> dict[str, Any]:
        """Scheduling time by part (Figure 14) and the cost-model queries behind it."""
        return {
            **super().policy_metrics(),
            **{f"sched_{part}_s": seconds for part, seconds in self.phase_s.items()},
            "num_cost_model_queries": self.num_cost_model_queries,
            "num_schedule_calls": self.num_schedule_calls,
        }

    def _rt_in_priority_order(self, stop_new_kv: Callable[[], bool]) -> Iterator[tuple[list[Request], list[float]]]:
        """RT requests by ascending residual time, as sorted lists merged (§4.2, request pulling
        optimization), with their deadlines: those on the GPU, and those that need new KV (swapped out
        or waiting) until ``stop_new_kv()`` (none of them can run this step). Yielded in runs: the
        requests on the GPU between two needing KV, then one of those (a tie goes to the one on the GPU)."""
        dropped = self._dropped[RequestClass.RT]
        on_gpu, deadlines = self._by_deadline([r for r in self._running(RequestClass.RT) if r not in dropped])
        needing_kv = heapq.merge(self._dropped_rt_by_deadline(), self._waiting_rt_by_deadline(), key=self.deadline)
        start = 0
        # NOTE: the next one needing KV is taken (and ``stop_new_kv`` asked) once the one before is packed
        for r in itertools.takewhile(lambda _: not stop_new_kv(), needing_kv):
            deadline = self.deadline(r)
            end = bisect.bisect_right(deadlines, deadline, start)
            if end > start:
                yield on_gpu[start:end], deadlines[start:end]
            start = end
            yield [r], [deadline]
        if start < len(on_gpu):
            yield on_gpu[start:], deadlines[start:]

    def _by_deadline(self, requests: list[Request]) -> tuple[list[Request], list[float]]:
        """``requests`` by deadline, stable (ties keep their order), and their deadlines: each one's
        worked out once."""
        keys = [self.deadline(r) for r in requests]
        order = sorted(range(len(requests)), key=keys.__getitem__)
        return [requests[i] for i in order], [keys[i] for i in order]

    def _dropped_rt_by_deadline(self) -> list[Request]:
        """The RT requests swapped out (``dropping=swap``) by deadline. NOTE: a swapped-out request
        emits no token, so its per-token deadline is fixed: sorted again only when one is dropped or
        comes back (``_sorted_dropped_rt`` is reset), or every step for token-group deadlines."""
        if self._sorted_dropped_rt is None or self.config.deadlines == "token_group":
            dropped = self._dropped[RequestClass.RT]
            self._sorted_dropped_rt = sorted((r for r in self.running if r in dropped), key=self.deadline)
        return self._sorted_dropped_rt

    def _waiting_rt_by_deadline(self) -> list[Request]:
        """The waiting RT requests by deadline. Their arrival order is deadline order when they share a
        TTFT SLO; mixed SLOs sort them. NOTE: a waiting request's per-token deadline is fixed, so the
        list, once sorted, stays sorted until the queue changes (``_waiting`` makes a new list); a
        token-group deadline moves with the iteration-time average: sorted again every step."""
        waiting = self._waiting(RequestClass.RT)
        if waiting is not self._sorted_waiting_rt or self.config.deadlines == "token_group":
            waiting[:] = self._by_deadline(waiting)[0]  # (in place: it is _waiting's list)
            self._sorted_waiting_rt = waiting
        return waiting

    def _contribution(self, r: Request) -> tuple[int, int, int, int, int, int, int]:
        """(decodes, decode KV, prefills, prefill tokens, prefill attention work, prefill context,
        bytes to restore) of one request: (3)-(5), the last from its checkpointed slots. A prompt's
        cached tokens are context its computed ones attend to."""
        restore = self.kv.num_checkpointed(r) * self.kv.kv_bytes_per_token if self._bicache else 0
        if r.status is RequestStatus.WAITING:
            c = self._prompt_tokens(r)
            m = r.num_tokens - c
            return 0, 0, 1, c, c * c + 2 * m * c, m, restore
        return 1, r.num_computed_tokens, 0, 0, 0, 0, restore

    def _estimate(self, batch: list[Request], extra: Request | None = None) -> float:
        """(2)-(5): the cost model's time for ``batch`` (plus ``extra``), its restores overlapping
        the forward pass (§4.1: the iteration takes the longer of the two); the batch's sums are
        kept in ``self._sums`` as requests are added, so this is O(1)."""
        assert len(batch) == self._sums_len, "batch changed outside _add/_remove"
        sums = self._sums if extra is None else [a + b for a, b in zip(self._sums, self._contribution(extra))]
        return self._batch_time(sums)

    def _batch_time(self, sums: Sequence[int]) -> float:
        """The cost model's time of a batch whose ``_contribution``s sum to ``sums``, restores beside
        the forward pass. NOTE: without the longest decode context (a running max cannot be taken back
        when a request leaves the batch): a preset's w_d is not in BROS's estimate. The bundled presets
        have none."""
        self.num_cost_model_queries += 1
        return self.cost_model.step_seconds(BatchShape(*sums, True))

    def _batch_times(self, sums: Sequence[int], num_decode: np.ndarray, decode_kv_tokens: np.ndarray) -> np.ndarray:
        """``_batch_time`` of ``sums`` with its decodes and their KV replaced by each pair of the arrays."""
        self.num_cost_model_queries += len(num_decode)
        return self.cost_model.step_seconds_with_decodes(BatchShape(*sums, True), num_decode, decode_kv_tokens)

    def _add(self, batch: list[Request], request: Request) -> None:
        contribution = self._contribution(request)  # before joining restores its checkpointed slots
        super()._add(batch, request)
        self._added[request] = contribution
        self._sums = [a + b for a, b in zip(self._sums, contribution)]
        self._sums_len = len(batch)

    def _add_decodes(
        self, batch: list[Request], requests: list[Request], new_blocks: list[int], computed: list[int]
    ) -> None:
        super()._add_decodes(batch, requests, new_blocks, computed)
        self._added.update(zip(requests, ((1, m, 0, 0, 0, 0, 0) for m in computed)))  # as _contribution
        self._sums = [self._sums[0] + len(requests), self._sums[1] + sum(computed), *self._sums[2:]]
        self._sums_len = len(batch)

    def _remove(self, batch: list[Request], request: Request) -> None:
        super()._remove(batch, request)
        self._sums = [a - b for a, b in zip(self._sums, self._added.pop(request))]
        self._sums_len = len(batch)

    def _start_batch(self) -> list[Request]:
        self._sums, self._sums_len, self._added = [0] * 7, 0, {}
        return super()._start_batch()

    def _be_in_order(self, rt_short_of_room: bool) -> Iterator[Request]:
        """The BE phase's candidates: the pending ones, fewest checkpointed slots first (least swap-in;
        without bidirectional blocks, none), then the waiting ones in queue order, unless none of these
        may take new KV (``_may_admit``, ``_be_may_take_room``; checked once the pending ones are placed)."""
        pending = self._running(RequestClass.BE)
        if self._bicache:
            pending = sorted(pending, key=self.kv.num_checkpointed)  # (stable: arrival order)
        yield from pending
        waiting = self._waiting(RequestClass.BE)
        if waiting and self._may_admit(waiting[0]) and not (rt_short_of_room and self.config.readmit_horizon_steps):
            yield from waiting

    def _make_room(self, request: Request, batch: list[Request], out: SchedulerOutput) -> bool:
        """(8) for an RT request: free blocks, else evict BE requests outside the batch (the one
        holding the most blocks first), else progressively drop RT requests outside the batch
        with the most remaining time. Nothing is evicted unless evicting all it may makes room."""
        if self._fits(request):
            return True
        be, rt = self._eviction_candidates(request, self._batch_set)
        if self.config.readmit_horizon_steps and not self._fits_after_evicting(request, be + rt):
            return False  # NOTE: dropping requests that leave it short anyway frees room for nothing
        while not self._fits(request):
            if be:
                victim = max(be, key=self.kv.num_slots)
                be.remove(victim)
            elif rt:
                victim = max(rt, key=self.deadline)
                rt.remove(victim)
            else:
                return False
            self._evict(victim, out)
        return True

    def _eviction_candidates(self, request: Request, batch: Collection[Request]) -> tuple[list[Request], list[Request]]:
        """Whom (8) may evict for the RT ``request``: the BE requests on the GPU outside ``batch``, and the
        RT ones there with later deadlines, in running order."""
        outside = [r for r in self.running if r not in batch and r is not request and self._on_gpu(r)]
        be = [r for r in outside if r.request_class is RequestClass.BE]
        if self._was_dropped(request) and self.config.readmit_horizon_steps:
            # The re-admission rule: a dropped RT request comes back by dropping BE requests only.
            # NOTE: else it would drop the RT request that dropped it, which is then the most
            # urgent: the two would trade places (and KV) every step.
            return be, []
        deadline = self.deadline(request)
        return be, [r for r in outside if r.request_class is RequestClass.RT and self.deadline(r) > deadline]

    def _fits_after_evicting(self, request: Request, victims: list[Request]) -> bool:
        """Whether ``request`` would fit (8) beside the batch being built once ``victims`` gave up their
        GPU slots (prefix caching: a block some other request shares is not freed)."""
        return self._shortfall_after_evicting(request, victims, self._batch_set, self._batch_blocks) <= 0

    def _shortfall_after_evicting(
        self, request: Request, victims: list[Request], protect: Collection[Request], batch_blocks: int
    ) -> int:
        """What ``request`` would lack (8) once ``victims`` gave up their GPU slots, beside the batch
        ``protect`` that takes ``batch_blocks`` new blocks (paged): slots or blocks, <= 0 when it fits.
        Bidirectional blocks: the batch's slots are protected. Paged with prefix caching: a victim's block
        that ``request`` or a waiting member found cached is taken by it, not freed
        (``_recharge_waiting_members``)."""
        kv = self.kv
        if self._bicache:
            needed = kv.slots_needed(request, self._tokens_needed(request), self._cached_prefix(request))
            return needed - kv.num_slots_released(victims) - kv.room(request, protect)
        taken: list[int] = []
        if self._caching:
            taken.extend(self._cached_prefix(request))
            for m in protect:
                if m.status is RequestStatus.WAITING:
                    taken.extend(self._cached_prefix(m))
        released = kv.num_blocks_released(victims, taken)
        return self._blocks(request) + batch_blocks - released - kv.num_free_blocks

    def _unblock(self, batch: list[Request], out: SchedulerOutput) -> None:
        """Liveness: running requests hold every block and none of them can grow (BE takes free
        blocks only), so nothing was scheduled. Progressive dropping (§5): drop BE requests, the
        latest admitted first, then RT requests with the most remaining time, until the earliest
        admitted running request fits; it runs alone. Bidirectional blocks: a request alone may still not
        grow, its tokens spread over blocks with empty slots it cannot take (a side grows in its last
        block only): it is dropped itself and comes back packed into free blocks (a swap out and in)."""
        head = next(iter(self.running))
        while not self._fits(head):
            others = [r for r in self.running if r is not head and self._on_gpu(r)]
            if not others:
                assert self._on_gpu(head), "a request alone fits the cache (check_fits)"
                self._evict(head, out)  # (its KV back from CPU memory, or recomputed, in empty blocks)
                continue
            be = [r for r in others if r.request_class is RequestClass.BE]
            self._evict(be[-1] if be else max(others, key=self.deadline), out)
        self._add(batch, head)

    # Runs of at least this many RT requests on the GPU are checked at once (``_pack_rt_decodes``). Below
    # it, the arrays cost more than the checks they save. ``pack_decode_runs`` False: request by request.
    MIN_DECODE_RUN = 8
    pack_decode_runs = True

    def schedule(self, now: float) -> SchedulerOutput:
        t0 = time.perf_counter()
        out = SchedulerOutput()
        cfg = self.config
        batch = self._start_batch()
        moved_before = self.kv.checkpointed_bytes + self.kv.restored_bytes if self._bicache else 0
        p = _Packing(now)
        # NOTE: once an RT request is short of room, no waiting one runs this step (nothing needing new KV
        # does): they are not even looked at, so a long queue costs nothing then.
        rt_order = self._rt_in_priority_order(lambda: p.rt_short_of_room)
        t1, kv1 = time.perf_counter(), self.kv_time_s
        for requests, deadlines in rt_order:  # Algorithm 1, RT phase
            if not self._pack_rt(requests, deadlines, batch, out, p):
                break
        if batch and self._estimate(batch) > p.residual:
            p.violated = True  # even the most urgent request alone misses its deadline
        t2, kv2 = time.perf_counter(), self.kv_time_s
        be = self._be_in_order(p.rt_short_of_room)
        num_rt_on_gpu = len(self._running(RequestClass.RT)) - len(self._dropped[RequestClass.RT])
        # The shortest waiting prompt that found no room (8) or prompt budget: a longer one finds none either
        # while requests join the batch (without prefix caching, a waiting request's need grows with its length).
        no_room_tokens = math.inf
        for r in be:
            waiting = r.status is RequestStatus.WAITING
            if waiting and r.num_tokens >= no_room_tokens:
                continue
            if not self._prompt_fits(r) or not self._fits(r):  # BE: free blocks only
                if waiting and not self._caching:
                    no_room_tokens = min(no_room_tokens, r.num_tokens)
                continue
            if not self._may_admit(r) or not self._be_may_take_room(r, num_rt_on_gpu, p.rt_short_of_room):
                continue
            if len(batch) < self.batch_size:
                if p.residual == math.inf or self._estimate(batch, r) <= p.residual:
                    self._add(batch, r)
                else:
                    p.held_back = True
                continue
            # Replace the least urgent RT request in the batch if it can afford to wait a step.
            p.held_back = True
            rts = [x for x in batch if x.request_class is RequestClass.RT]
            if len(rts) < 2:
                break
            least = max(rts, key=self.deadline)
            if self.deadline(least) - now <= cfg.replace_slack_iterations * self._estimate(batch):
                break
            self._remove(batch, least)
            no_room_tokens = math.inf  # (its KV and prompt tokens are free again)
            if self._fits(r) and (p.residual == math.inf or self._estimate(batch, r) <= p.residual):  # (8), (6)
                self._add(batch, r)
            else:
                break  # ``least`` had slack to wait a step (the replacement rule); stop replacing
        if not batch and self.running:
            self._unblock(batch, out)
            p.held_back = True
        self._note_step(p.refused, p.violated or p.held_back)
        self.last_estimate_s = self._estimate(batch) if batch else 0.0
        self.last_residual_s = p.residual
        if batch:
            self.iteration_ema_s += self.ITERATION_EMA_WEIGHT * (self.last_estimate_s - self.iteration_ema_s)
        # Adaptive batch size (TCP-like): reset on an estimated violation, grow otherwise.
        if p.violated:
            self.batch_size = cfg.initial_batch_size
        else:
            self.batch_size = min(self.batch_size + cfg.batch_size_step, cfg.max_batch_size)
        t3, kv3 = time.perf_counter(), self.kv_time_s
        self._take_batch(batch, out)
        if self._bicache:
            out.swap_bytes = self.kv.checkpointed_bytes + self.kv.restored_bytes - moved_before
            out.swap_overlapped = True  # §4.1: checkpoints and restores run asynchronously
            out.slot_copies = self.kv.take_copies()
        phase = self.phase_s
        phase["rt_ordering"] += t1 - t0
        # Slot placement while packing (bidirectional blocks) counts as KV block work.
        phase["rt_packing"] += t2 - t1 - (kv2 - kv1)
        phase["be_packing"] += t3 - t2 - (kv3 - kv2)
        phase["kv_blocks"] += time.perf_counter() - t3 + (kv3 - kv1)
        self.num_schedule_calls += 1
        return out

    def _pack_rt(
        self, requests: list[Request], deadlines: list[float], batch: list[Request], out: SchedulerOutput, p: _Packing
    ) -> bool:
        """Algorithm 1's RT phase over ``requests`` (next in priority order, with their deadlines): each
        joins the batch if (6), (7) and (8) let it. False when the phase ends there ((6) or (7), or a
        request short of room without the anti-thrash rule)."""
        i = 0
        while i < len(requests):
            if len(requests) - i >= self.MIN_DECODE_RUN and self.pack_decode_runs:
                if not self._needs_new_kv(requests[i]):  # a run of RT requests on the GPU
                    i += self._pack_rt_decodes(requests[i:], deadlines[i:], batch, p)
                    if i == len(requests):
                        break
            r, own = requests[i], deadlines[i] - p.now
            i += 1
            if len(batch) >= self.batch_size:  # (7)
                p.held_back = True
                return False
            if not self._prompt_fits(r) or (p.rt_short_of_room and self._needs_new_kv(r)):
                continue
            estimate = self._estimate(batch, r)
            if batch and estimate > p.residual:
                p.violated = True
                return False
            if not self._make_room(r, batch, out):  # (8)
                p.rt_short_of_room = True
                p.refused = r if p.refused is None else p.refused
                p.held_back = p.held_back or not self._needs_new_kv(r)  # a running one: it waits a step
                if self.config.readmit_horizon_steps:
                    # The anti-thrash rule: the RT requests holding KV still run (they need no new
                    # room); those needing it wait. NOTE: stopping here leaves the batch empty when
                    # the most urgent is a dropped request, and the liveness rule (_unblock) then
                    # trades it for another every step.
                    continue
                return False
            # (6) protects the most urgent RT request that can still meet its deadline; requests
            # already past theirs go first but cannot bound the batch.
            if p.residual == math.inf and own >= estimate:
                p.residual = own
            self._add(batch, r)
        return True

    def _pack_rt_decodes(self, run: list[Request], deadlines: list[float], batch: list[Request], p: _Packing) -> int:
        """``_pack_rt`` over ``run`` (RT requests on the GPU, in priority order) at once, as far as each
        joins the batch with free blocks (paged KV; bidirectional blocks: growing where it touches
        nobody, nothing to restore): how many joined. The first that does not is left to ``_pack_rt``,
        which then ends the phase, finds it room (evicting, overwriting) or refuses it, as it would have."""
        k = min(len(run), self.batch_size - len(batch))  # (7)
        kv = self.kv
        # Up to one evicted for room earlier in this step (it waits now or is dropped) or, with bidirectional
        # blocks, one whose slot may go over another request's tokens: those are _pack_rt's.
        if self._bicache:
            grow_blocks = []  # free blocks each takes
            for r in run[:k]:
                blocks = (
                    kv.free_blocks_to_grow(r, r.num_computed_tokens + 1) if r.status is RequestStatus.RUNNING else None
                )
                if blocks is None:
                    break
                grow_blocks.append(blocks)
            k = len(grow_blocks)
        else:
            k = next((i for i, r in enumerate(run[:k]) if r.status is not RequestStatus.RUNNING), k)
        if k <= 0:
            return 0
        run = run[:k]
        computed = np.fromiter((r.num_computed_tokens for r in run), np.int64, k)  # (k,)
        if self._bicache:
            fits = np.cumsum(grow_blocks) <= kv.num_free_blocks  # (a free block each, while one is left)
            charged = np.zeros(k, dtype=np.int64)  # (slots are placed as each joins, not counted)
        else:
            held = np.fromiter((len(kv.block_tables[r]) for r in run), np.int64, k)  # (k,) blocks each holds
            new_blocks = charged = np.maximum(-(-(computed + 1) // kv.block_size) - held, 0)  # (k,) one more token
            fits = self._batch_blocks + np.cumsum(new_blocks) <= kv.num_free_blocks  # (8) with free blocks only
        # (6): the batch's estimate as each joins, and the residual in force when each is checked (set by
        # the first with its estimate left, when none did before)
        sums = self._sums
        estimates = self._batch_times(sums, sums[0] + np.arange(1, k + 1), sums[1] + np.cumsum(computed))
        own = np.asarray(deadlines[:k]) - p.now
        residual = np.full(k, p.residual)
        first_met = np.flatnonzero(own >= estimates)[:1] if p.residual == math.inf else ()
        if len(first_met):
            residual[first_met[0] + 1 :] = own[first_met[0]]
        # NOTE: while the batch is empty the residual is unset, so (6) passes its first request as _pack_rt's
        passed = np.flatnonzero((estimates > residual) | ~fits)
        n = int(passed[0]) if len(passed) else k
        if len(first_met) and first_met[0] < n:
            p.residual = float(own[first_met[0]])
        self.num_cost_model_queries -= k - n  # (those not packed are estimated again by _pack_rt)
        self._add_decodes(batch, run[:n], charged[:n].tolist(), computed[:n].tolist())
        return n


@dataclass
class _Packing:
    """What BROS's packing of one step has found so far."""

    now: float
    residual: float = math.inf  # (6): the residual time of the most urgent RT request that can meet it
    violated: bool = False  # (6) bound the batch: the adaptive batch size resets
    rt_short_of_room: bool = False  # an RT request found no room (8): the anti-thrash rule holds BE back
    # For the simulator's fast path (_note_step): the first RT request that found no room, and whether a
    # request was left out by (6), (7), the replacement rule or the liveness rule.
    refused: Request | None = None
    held_back: bool = False


class RoundRobinScheduler(SubsetScheduler):
    """BROS's RR baseline (§2.2): RT and BE FCFS queues served in turn, one class per iteration."""

    name = "rr"
    named_decode_stretches = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._serve_rt = True

    def decode_horizon(self, output: SchedulerOutput, limit: int) -> int:
        """While the other class has nothing to run (none of it running, and no room for its first waiting
        request), every step serves this one, FCFS: a step of decodes only repeats while their growth
        fits the free KV (no eviction; a waiting request that found no room finds none later, as the
        free KV only shrinks; an arrival or a completion ends the stretch). Else the classes take turns:
        one step at a time; and with bidirectional blocks (slots placed per batch)."""
        if self._bicache:
            return 1
        served = output.chunks[0][0].request_class  # (one class a step)
        other = RequestClass.BE if served is RequestClass.RT else RequestClass.RT
        if self._running(other):
            return 1
        waiting = self._waiting(other)
        if waiting and self._blocks(waiting[0]) <= self.kv.num_free_blocks:
            return 1  # it would start the other class's batch (NOTE: a lone prompt is within the budget)
        return self._named_decode_memory_horizon(output, limit)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        classes = [RequestClass.RT, RequestClass.BE] if self._serve_rt else [RequestClass.BE, RequestClass.RT]
        for cls in classes:  # the class whose turn it is; the other if it has nothing to run
            batch = self._fcfs_batch(cls, out)
            if batch:
                self._serve_rt = cls is RequestClass.BE
                self._take_batch(batch, out)
                break
        return out

    def _fcfs_batch(self, cls: RequestClass, out: SchedulerOutput) -> list[Request]:
        batch = self._start_batch()
        running = self._running(cls)
        for r in itertools.chain(running, self._waiting(cls)):  # (the loop leaves _waiting's list unchanged)
            if len(batch) >= self.config.max_batch_size or not self._prompt_fits(r):
                break
            fits = self._fits(r)
            while not fits and r.status is RequestStatus.RUNNING:
                # vLLM-style: evict the latest-admitted request outside the batch (recompute).
                victims = [x for x in self.running if x not in batch and x is not r and self._on_gpu(x)]
                if not victims:
                    break
                self._evict(victims[-1], out)
                fits = self._fits(r)
            if not fits:
                break
            self._add(batch, r)
        return batch

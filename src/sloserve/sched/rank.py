"""InferMax §4.6 rank schedulers: Algorithm 1 with one group of all requests ordered by a rank.

    rank_org  arrival order (no prioritization by I or O)
    rank_i    smallest prompt first
    rank_o    smallest output first (hypothetical: the oracle predictor supplies O)

GROUPREQUESTS returns one group ordered by rank (1); batches are hybrid with chunked prefill (2);
CANALLOCATE checks C, P and M (3); on a memory failure a candidate evicts the lowest-ranked running
requests after it, and a running candidate with none left evicts itself (4). The paper does not state
P for these schedulers; the default here is P = C (like SARATHI_P=C), a knob like every other.

The anti-thrash rule (ours, ``readmit_horizon_steps``; 0 gives the paper's rule). When KV is scarce,
(4) makes every eviction a cascade: the evicted request, waiting, still outranks the requests admitted
after it and evicts them to come back, they evict the next, and so on, and a candidate that cannot
fit even alone evicts lower-ranked requests for nothing (on `benchmarks/overload.py`'s mixed RT/BE
case with 3,000 KV tokens, rank_org made 97 evictions per request). So: a candidate evicts only
when evicting every lower-ranked request outside the batch would make room, and a request evicted
before comes back into free KV only, with room left for the running requests' growth over the
horizon (one block per ``block_size`` steps each), evicting nobody. A new request still evicts
lower-ranked ones as §4.6 says: Rank_I's short prompts still go first.

Every running request is scheduled explicitly (no decode cohort): ranks reorder decodes too.

With prefix caching a waiting candidate is looked up when its turn comes: C, P and M count only the
tokens it does not find and the blocks it does not find (a found block nobody used counts as taken
from the free KV), and each chunk registers the full blocks it fills.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Literal

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import PreemptionMode, ScheduledChunk, SchedulerOutput
from sloserve.core.request import Request, RequestStatus
from sloserve.kv.manager import KVCacheManager
from sloserve.predict import LengthPredictor
from sloserve.sched.base import Scheduler, check_fits_alone
from sloserve.sched.unified import UnifiedConfig


@dataclass
class RankConfig(UnifiedConfig):
    """Algorithm 1 knobs plus the rank. ``priority`` is unused: the rank orders everything."""

    hybrid_batching: bool = True
    chunked_prefill: bool = True
    rank_by: Literal["arrival", "input", "output"] = "arrival"
    # The anti-thrash rule (ours, as BROS's; the paper's Algorithm 1 has none): a request evicted
    # before comes back into free KV only, with room left for the running requests' growth over this
    # many steps, and evicts nobody to come back. 0: the paper's rule (it evicts lower-ranked
    # requests like any candidate). Why: the module docstring.
    readmit_horizon_steps: int = 64

    def resolve(self, max_model_len: int) -> None:
        super().resolve(max_model_len)
        if self.rank_by not in ("arrival", "input", "output"):
            raise ConfigError(f"rank_by must be arrival, input or output, got {self.rank_by!r}")
        if self.rank_by == "output" and self.predictor == "none":
            raise ConfigError("rank_by=output needs a predictor (oracle or histogram)")
        if self.readmit_horizon_steps < 0:
            raise ConfigError(f"readmit_horizon_steps must be >= 0, got {self.readmit_horizon_steps}")
        if self.waiting_order != "fcfs":
            raise ConfigError(
                f"waiting_order={self.waiting_order} does not apply to the rank schedulers: their rank orders "
                "the waiting requests"
            )
        if self.role != "colocated":
            raise ConfigError(
                f"the rank schedulers run colocated only (no prefill/decode hand-off), got role={self.role!r}"
            )
        if self.preemption_mode != "recompute":
            # NOTE: Algorithm 1 evicts to R_w; a swapped-out request would wait for a swap-in that the
            # rank's one group never schedules (a run stalled with only swapped requests left)
            raise ConfigError(
                f"preemption_mode must be recompute for the rank schedulers (InferMax Algorithm 1 evicts "
                f"to the waiting queue), got {self.preemption_mode!r}"
            )


class RankScheduler(Scheduler):
    name = "rank"
    supports_prefix_caching = True
    named_decode_stretches = True

    def __init__(self, kv: KVCacheManager, config: RankConfig, predictor: LengthPredictor | None = None) -> None:
        super().__init__(kv, predictor)
        self.config = config
        self._budget = config.max_num_batched_tokens or 0  # C
        self._prefill_budget = config.prefill_token_budget or 0  # P
        self._watermark_blocks = int(config.watermark * kv.gpu.num_blocks)
        self._mode = PreemptionMode(config.preemption_mode)
        self._caching = kv.prefix_cache is not None
        # (1)'s one group, running and waiting requests by rank, and their positions: kept from step to
        # step (ranks do not change; admissions and evictions move a request between the two queues,
        # not out of the group), changed by arrivals and completions.
        self._group: list[Request] = []
        self._position: dict[Request, int] | None = None

    # The loop skips a waiting request no shorter than one that found no room (``no_room_tokens``,
    # ``no_readmit_tokens``): a shortcut that changes nothing (tests turn it off and compare).
    skip_longer_than_refused = True

    def check_fits(self, request: Request, max_kv_tokens: int) -> None:
        """Raise ConfigError when ``request`` could never run alone in this KV cache (its watermark kept)."""
        check_fits_alone(self.kv, request, max_kv_tokens, self._watermark_blocks)

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        bisect.insort(self._group, request, key=self._rank)
        self._position = None

    def _finish(self, request: Request, now: float) -> None:
        super()._finish(request, now)
        self._group.remove(request)
        self._position = None

    def check_integrity(self) -> None:
        """Also: the group kept between steps is the running and waiting requests by rank."""
        super().check_integrity()
        assert self._group == sorted([*self.running, *self.waiting], key=self._rank), "the kept group"

    def _ranked(self) -> tuple[list[Request], dict[Request, int]]:
        """(1): the running and waiting requests by rank, and each one's position."""
        if len(self._group) != len(self.running) + len(self.waiting):  # a request came or left otherwise
            self._group, self._position = sorted([*self.running, *self.waiting], key=self._rank), None
        if self._position is None:
            self._position = {r: i for i, r in enumerate(self._group)}
        return self._group, self._position

    def _rank(self, request: Request) -> tuple:
        by = self.config.rank_by
        if by == "input":
            key = request.num_prompt_tokens
        elif by == "output":
            key = request.predicted_output_tokens or 0
        else:
            key = 0
        return (key, request.arrival_time, request.request_id)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        kv, cfg = self.kv, self.config
        group, position = self._ranked()  # (1)
        lowest_running = max((position[r] for r in self.running), default=-1)  # past it, no victims (4)
        # The shortest waiting request that found no KV, even by evicting all it may: a longer one finds none
        # either (without prefix caching a waiting request's need grows with its length). NOTE: the free KV
        # plus the KV of the victims a candidate may have (running ones after it, outside the batch) only
        # shrinks along the loop: an allocation takes from the first, an eviction moves KV from the second
        # to the first, and a later candidate has fewer victims.
        no_room_tokens = math.inf
        no_readmit_tokens = math.inf  # the same for the requests evicted before (their rule reserves more)
        skip = self.skip_longer_than_refused
        in_batch: set[Request] = set()
        evicted: set[Request] = set()
        used = 0
        for cand in group:
            if cand in evicted:
                continue
            running = cand.status is RequestStatus.RUNNING
            # an evicted request coming back: the anti-thrash rule holds it to free KV
            readmit = not running and cand.num_preemptions and cfg.readmit_horizon_steps
            if not running:
                refused_tokens = min(no_room_tokens, no_readmit_tokens) if readmit else no_room_tokens
                if len(self.running) >= cfg.max_num_seqs or (skip and cand.num_tokens >= refused_tokens):
                    continue
            todo, cached = cand.num_tokens_to_process, ()
            if self._caching and not running:
                cached = kv.find_cached_prefix(cand)
                todo -= len(cached) * kv.block_size
            is_prefill = todo > 1
            room = self._budget - used
            if is_prefill:
                room = min(room, self._prefill_budget - used)
            num_tokens = min(todo, room)  # (3) C and P, chunked
            if num_tokens <= 0:
                continue
            # (3) M: a running request grows by its chunk; a new one reserves its whole prompt.
            target = cand.num_computed_tokens + num_tokens if running else cand.num_tokens
            reserve = 0 if running else self._watermark_blocks
            if readmit:
                # The anti-thrash rule: back into free KV only, beside the running requests' growth.
                reserve += len(self.running) * -(-cfg.readmit_horizon_steps // kv.block_size)
                if not kv.can_allocate(cand, target, reserve, cached):
                    if not self._caching:
                        no_readmit_tokens = cand.num_tokens
                    continue
            if position[cand] < lowest_running and not kv.can_allocate(cand, target, reserve, cached):
                victims = sorted(
                    (r for r in self.running if r not in in_batch and position[r] > position[cand]),
                    key=position.__getitem__,
                )
                if cfg.readmit_horizon_steps and not self._fits_after_evicting(cand, target, reserve, cached, victims):
                    victims = []  # NOTE: the anti-thrash rule: evicting them all would not make room
                while victims and not kv.can_allocate(cand, target, reserve, cached):
                    victim = victims.pop()  # (4) the lowest-ranked first
                    self._preempt(victim, self._mode, out)
                    evicted.add(victim)
                    no_readmit_tokens = math.inf  # (its KV is free again, and fewer run)
            if not kv.can_allocate(cand, target, reserve, cached):
                if running:
                    self._preempt(cand, self._mode, out)  # (4) self-eviction
                    evicted.add(cand)
                    no_readmit_tokens = math.inf
                elif not self._caching:  # (it found none even by evicting all it may)
                    no_room_tokens = min(no_room_tokens, cand.num_tokens)
                continue
            done = kv.allocate_slots(cand, target, cached)
            assert done
            if not running:
                self.waiting.remove(cand)
                if self._caching:
                    self._skip_cached_prefix(cand, cached, out)
                self._admit(cand)
            out.chunks.append(ScheduledChunk(cand, num_tokens))
            if self._caching:
                kv.cache_blocks(cand, cand.num_computed_tokens + num_tokens)
            in_batch.add(cand)
            used += num_tokens
        return out

    def decode_horizon(self, output: SchedulerOutput, limit: int) -> int:
        """A step of decodes only repeats while the running requests' growth fits the free KV: ranks
        do not change, the batch's budget holds the same decodes, and with the free KV only shrinking
        no waiting request that found no room (or would have evicted nobody) finds it later (the
        simulator stops at an arrival or a completion)."""
        return self._named_decode_memory_horizon(output, limit)

    def _fits_after_evicting(
        self, cand: Request, target: int, reserve: int, cached: list[int] | tuple, victims: list[Request]
    ) -> bool:
        """Whether ``cand``'s allocation (3) would fit once every one of ``victims`` gave up its KV (the
        ``cached`` blocks it found are its, not free, once their holders let go)."""
        freed = self.kv.num_blocks_released(victims, cached)
        return self.kv.blocks_needed(cand, target, cached) + reserve <= self.kv.num_free_blocks + freed

"""InferMax §4.6 rank schedulers: Algorithm 1 with one group of all requests ordered by a rank.

    rank_org  arrival order (no prioritization by I or O)
    rank_i    smallest prompt first
    rank_o    smallest output first (hypothetical: the oracle predictor supplies O)

GROUPREQUESTS returns one group ordered by rank (1); batches are hybrid with chunked prefill (2);
CANALLOCATE checks C, P and M (3); on a memory failure a candidate evicts the lowest-ranked running
requests after it, and a running candidate with none left evicts itself (4). The paper does not state
P for these schedulers; the default here is P = C (like SARATHI_P=C), a knob like every other.

Every running request is scheduled explicitly (no decode cohort): ranks reorder decodes too.

With prefix caching a waiting candidate is looked up when its turn comes: C, P and M count only the
tokens it does not find and the blocks it does not find (a found block nobody used counts as taken
from the free KV), and each chunk registers the full blocks it fills.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import PreemptionMode, ScheduledChunk, SchedulerOutput
from sloserve.core.request import Request, RequestStatus
from sloserve.kv.manager import KVCacheManager
from sloserve.predict import LengthPredictor
from sloserve.sched.base import Scheduler
from sloserve.sched.unified import UnifiedConfig


@dataclass
class RankConfig(UnifiedConfig):
    """Algorithm 1 knobs plus the rank. ``priority`` is unused: the rank orders everything."""

    hybrid_batching: bool = True
    chunked_prefill: bool = True
    rank_by: Literal["arrival", "input", "output"] = "arrival"

    def resolve(self, max_model_len: int) -> None:
        super().resolve(max_model_len)
        if self.rank_by not in ("arrival", "input", "output"):
            raise ConfigError(f"rank_by must be arrival, input or output, got {self.rank_by!r}")
        if self.rank_by == "output" and self.predictor == "none":
            raise ConfigError("rank_by=output needs a predictor (oracle or histogram)")


class RankScheduler(Scheduler):
    name = "rank"
    supports_prefix_caching = True

    def __init__(self, kv: KVCacheManager, config: RankConfig, predictor: LengthPredictor | None = None) -> None:
        super().__init__(kv, predictor)
        self.config = config
        self._budget = config.max_num_batched_tokens or 0  # C
        self._prefill_budget = config.prefill_token_budget or 0  # P
        self._watermark_blocks = int(config.watermark * kv.gpu.num_blocks)
        self._mode = PreemptionMode(config.preemption_mode)
        self._caching = kv.prefix_cache is not None

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
        group = sorted([*self.running, *self.waiting], key=self._rank)  # (1)
        position = {r: i for i, r in enumerate(group)}
        in_batch: set[Request] = set()
        evicted: set[Request] = set()
        used = 0
        for cand in group:
            if cand in evicted:
                continue
            running = cand.status is RequestStatus.RUNNING
            if not running and len(self.running) >= cfg.max_num_seqs:
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
            while not kv.can_allocate(cand, target, reserve, cached):
                victims = [r for r in self.running if r not in in_batch and position[r] > position[cand]]
                if not victims:  # (4) no lower-ranked request left
                    break
                victim = max(victims, key=position.__getitem__)
                self._preempt(victim, self._mode, out)
                evicted.add(victim)
            if not kv.can_allocate(cand, target, reserve, cached):
                if running:
                    self._preempt(cand, self._mode, out)  # (4) self-eviction
                    evicted.add(cand)
                continue
            done = kv.allocate_slots(cand, target, cached)
            assert done
            if not running:
                self.waiting.remove(cand)
                if self._caching:
                    self._skip_cached_prefix(cand, cached)
                    out.num_cached_tokens += len(cached) * kv.block_size
                self._admit(cand)
            out.chunks.append(ScheduledChunk(cand, num_tokens))
            if self._caching:
                kv.cache_blocks(cand, cand.num_computed_tokens + num_tokens)
            in_batch.add(cand)
            used += num_tokens
        return out

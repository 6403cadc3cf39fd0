"""MultiRes, the cloud multi-resource packer EconoServe adapts as a baseline (papers/econoserve.md
§2.1-2.2): "After each iteration, when there are available GPU and KVC resources, MultiRes calculates
the Euclidean distance between each request's demands on GPU and KVC and the available resources,
and chooses the request with the minimum distance, and repeats this process after each request
selection until no requests can be added to the batch. Its time complexity for scheduling is O(n^2)".

Resources are fractions of the GPU's two capacities (TFS: target forward size, tokens per iteration):

    available  ((TFS - tokens already in the batch) / TFS,  free KV / KV capacity)
    demand     (tokens the request adds this iteration / TFS, KV it must allocate / KV capacity)

KV is exact allocation: a request reserves prompt + predicted output - 1 tokens (the ``oracle``
predictor by default, as in the paper's first measurement) when admitted. With prefix caching a
request's demand counts only the prompt tokens it does not find cached and the blocks it does not
find (``IterationScheduler``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import PreemptionMode, SchedulerOutput
from sloserve.core.request import Request
from sloserve.kv.manager import ExactReservationKVManager
from sloserve.sched.base import require_whole_prompts
from sloserve.sched.srtf import IterationScheduler


@dataclass
class MultiResConfig:
    """Knobs of MultiRes. Validated by ``resolve``."""

    # TFS: tokens per iteration, decodes plus whole prompts (None: max(model length, 2048)). EconoServe
    # sets it to the forward size that saturates the GPU; the paper does not give the value.
    target_forward_size: int | None = None
    max_num_seqs: int = 256  # requests per batch (MultiRes itself has no such limit)
    kv_manager: Literal["exact"] = "exact"
    block_size: int = 16
    predictor: Literal["oracle", "histogram"] = "oracle"
    histogram_quantile: float = 0.5  # the output-length quantile the histogram predicts
    # A trace (a served request log) whose prompt and output lengths the histogram starts from
    histogram_history: str | None = None

    def resolve(self, max_model_len: int) -> None:
        """Fill defaults that depend on the model and check every knob."""
        if self.target_forward_size is None:
            self.target_forward_size = max(max_model_len, 2048)
        require_whole_prompts("target_forward_size", self.target_forward_size, max_model_len)
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_seqs > self.target_forward_size:
            raise ConfigError(
                f"max_num_seqs={self.max_num_seqs} exceeds target_forward_size={self.target_forward_size}: "
                "every running decode must fit in one iteration"
            )
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_manager != "exact":
            raise ConfigError(f"multires uses kv_manager exact (exact allocation), got {self.kv_manager!r}")
        if self.predictor not in ("oracle", "histogram"):
            raise ConfigError(f"multires needs a predictor, oracle or histogram, got {self.predictor!r}")


class MultiResScheduler(IterationScheduler):
    """Running requests keep decoding; the room left is packed by repeated nearest-demand picks
    among the waiting requests, O(n) per pick and O(n^2) per iteration on purpose (§2.2 measures
    this cost). Ties go to the earlier request in the waiting queue."""

    name = "multires"
    config: MultiResConfig
    kv: ExactReservationKVManager
    named_decode_stretches = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Without prefix caching a waiting request's demand is fixed until it is admitted: kept, not
        # recomputed every iteration for each request of an overloaded queue.
        self._demand_of: dict[Request, tuple[int, int, list[int]]] = {}

    def reservation(self, request: Request) -> int:
        """KV tokens to reserve at admission: I + predicted O - 1; on a refill the generated tokens are
        known and at least one more is to come.
        NOTE: capped at the KV capacity so that an over-predicted request can still run alone; it
        grows past its reservation (paged) if it outlives the prediction."""
        predicted = request.predicted_output_tokens or 1
        target = request.num_tokens + max(predicted - request.num_output_tokens, 1) - 1
        return min(target, self.kv.capacity_tokens)

    def demand_blocks(self, request: Request, cached: list[int] | tuple = ()) -> int:
        """KV blocks a waiting request must allocate to be admitted, starting with the ``cached``
        blocks of its prompt (with prefix caching: those nobody uses count, as they leave the free KV)."""
        need = -(-self.reservation(request) // self.kv.block_size)
        if cached:
            need -= len(cached) - self.kv.prefix_cache.num_evictable(cached)
        return need

    def _demands(self, candidates: list[Request]) -> dict[Request, tuple[int, int, list[int]]]:
        """Per waiting candidate: (tokens it adds to the iteration, KV blocks it takes, the cached
        blocks of its prompt it starts with; [] without prefix caching)."""
        demands = {}
        for request in candidates:
            demand = self._demand_of.get(request)
            if demand is None:
                cached = self.kv.find_cached_prefix(request) if self._caching else []
                tokens = request.num_tokens_to_process - len(cached) * self.kv.block_size
                demand = (tokens, self.demand_blocks(request, cached), cached)
                if not self._caching:
                    self._demand_of[request] = demand
            demands[request] = demand
        return demands

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        forward = 0  # tokens in the batch so far
        # Running requests hold their reservations and decode on. NOTE: only a request that outlives
        # its predicted length needs a new block; if none is free, the latest-admitted running request
        # not yet in the batch is evicted (recompute), possibly the request itself (vLLM's rule).
        batch: list[Request] = []
        for request in list(self.running):
            tokens = request.num_computed_tokens + 1
            while request in self.running and not self.kv.can_allocate(request, tokens):
                self._preempt(next(reversed(self.running)), PreemptionMode.RECOMPUTE, out)
            if request in self.running:  # (not evicted, for itself or an earlier request)
                done = self.kv.allocate_slots(request, tokens)
                assert done
                batch.append(request)
        for request in batch:
            forward += self._run(request, out)
        evicted = {p.request for p in out.preempted}  # they wait for a later iteration
        candidates = [r for r in self.waiting if r not in evicted]
        demands = self._demands(candidates)
        tfs, num_blocks = self.config.target_forward_size or 0, self.kv.gpu.num_blocks
        while candidates and len(self.running) < self.config.max_num_seqs:
            room_tokens, room_blocks = tfs - forward, self.kv.num_free_blocks
            best, best_distance = None, math.inf
            for request in candidates:  # O(n) per pick
                tokens, blocks, _ = demands[request]
                if tokens > room_tokens or blocks > room_blocks:
                    continue
                distance = math.hypot((room_tokens - tokens) / tfs, (room_blocks - blocks) / num_blocks)
                if distance < best_distance:
                    best, best_distance = request, distance
            if best is None:
                break  # nothing left fits either resource
            candidates.remove(best)
            cached = demands.pop(best)[2]
            self._demand_of.pop(best, None)  # (admitted: it may come back with another demand)
            evicted_before = self._num_evicted_blocks()
            self.kv.set_reservation(best, self.reservation(best))
            done = self._try_admit(best, best.num_tokens, out, cached)
            assert done
            forward += self._run(best, out)
            if cached or self._num_evicted_blocks() != evicted_before:
                # NOTE: the pick shared cached blocks (now used: no longer free to take) or evicted
                # some (perhaps found by others): look the rest up again
                demands = self._demands(candidates)
        return out

    def decode_horizon(self, output: SchedulerOutput, limit: int) -> int:
        """A step of decodes only (nothing admitted: no waiting request fit the room left) repeats
        while every running request's growth fits the free KV (within its reservation it takes no
        block): the forward's room stays and the free KV only shrinks, so no waiting request fits in
        later steps either, and no decode must evict (the simulator stops at an arrival or a
        completion)."""
        return self._named_decode_memory_horizon(output, limit)

    def _num_evicted_blocks(self) -> int:
        return self.kv.prefix_cache.num_evicted_blocks if self._caching else 0

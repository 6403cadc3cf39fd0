"""Replay a fixed schedule (the bound's, or a recorded one) through the simulator."""

from __future__ import annotations

from collections import deque

from sloserve.core.outputs import PreemptionMode, ScheduledChunk, SchedulerOutput
from sloserve.core.request import Request, RequestStatus
from sloserve.kv.manager import KVCacheManager
from sloserve.optimal.problem import BatchPlan
from sloserve.sched.base import Scheduler


class ScheduleViolation(RuntimeError):
    """The schedule asks for something the KV cache or the requests' state does not allow."""


class ReplayScheduler(Scheduler):
    """Emits the planned batches in order: the planned evictions (by recompute), then each request's
    planned tokens. Requests are indexed by ``request_id``. A batch waits until its requests have
    arrived. Every token is an explicit chunk (no cohort)."""

    name = "replay"

    def __init__(self, kv: KVCacheManager, plan: list[BatchPlan]) -> None:
        super().__init__(kv)
        self._plan = deque(plan)
        self._by_id: dict[int, Request] = {}

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self._by_id[request.request_id] = request

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self._plan or any(i not in self._by_id for i in self._plan[0].tokens):
            return out  # finished, or waiting for an arrival
        batch = self._plan.popleft()
        for i in batch.evicted:
            request = self._by_id[i]
            if request in self.running:
                self._preempt(request, PreemptionMode.RECOMPUTE, out)
        for i, num_tokens in batch.tokens.items():
            request = self._by_id[i]
            if request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
                self._admit(request)
            if num_tokens > request.num_tokens_to_process:
                raise ScheduleViolation(f"batch at {batch.start_s:.6f}s: {request} cannot process {num_tokens} tokens")
            if not self.kv.allocate_slots(request, request.num_computed_tokens + num_tokens):
                raise ScheduleViolation(f"batch at {batch.start_s:.6f}s: no KV for {num_tokens} tokens of {request}")
            out.chunks.append(ScheduledChunk(request, num_tokens))
        return out

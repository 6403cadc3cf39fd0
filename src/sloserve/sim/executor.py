"""The simulator's executor: runs a ``SchedulerOutput`` on a cost model instead of a GPU."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from sloserve.core.outputs import SchedulerOutput, StepResult
from sloserve.core.request import Request
from sloserve.cost.base import BatchShape, CostModel
from sloserve.sched.cohort import DecodeCohort


def batch_shape(output: SchedulerOutput) -> BatchShape:
    """The cost-model view of a step (its first step when ``num_steps`` > 1)."""
    num_decode, decode_kv = output.cohort_size, output.cohort_kv_tokens
    num_prefill = prefill_tokens = attention_work = context = 0
    for request, c in output.chunks:
        m = request.num_computed_tokens
        if c == 1 and request.num_tokens - m == 1:  # a decode scheduled outside a cohort
            num_decode += 1
            decode_kv += m
        else:
            num_prefill += 1
            prefill_tokens += c
            attention_work += c * c + 2 * m * c
            context += m
    return BatchShape(num_decode, decode_kv, num_prefill, prefill_tokens, attention_work, context, output.swap_bytes)


class SimExecutor:
    """Times steps with a cost model and ends requests when they reach their true output length.

    NOTE: this is the only place in the simulator that reads ``Request.true_output_tokens``.
    """

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        # (cohort tick at which the member samples its last token, seq, request, cohort epoch)
        self._finish_heap: list[tuple[int, int, Request, int]] = []
        self._seq = 0
        self._tracked: dict[Request, int] = {}  # request -> cohort epoch already in the heap

    def _track_joined(self, output: SchedulerOutput) -> None:
        for r in output.cohort_joined:
            cohort = r.cohort
            if cohort is None or self._tracked.get(r) == r.cohort_epoch:  # preempted, or tracked
                continue
            self._tracked[r] = r.cohort_epoch
            finish_tick = cohort.ticks + r.true_output_tokens - r.num_output_tokens
            heapq.heappush(self._finish_heap, (finish_tick, self._seq, r, r.cohort_epoch))
            self._seq += 1

    def _drop_stale(self, cohort: DecodeCohort) -> None:
        heap = self._finish_heap
        while heap and (heap[0][2].cohort is not cohort or heap[0][2].cohort_epoch != heap[0][3]):
            _, _, r, epoch = heapq.heappop(heap)
            if self._tracked.get(r) == epoch:
                del self._tracked[r]

    def steps_until_finish(self, output: SchedulerOutput) -> int:
        """Cohort steps until (and including) the next one in which a member finishes."""
        self._track_joined(output)
        cohort = output.cohort
        if cohort is None:
            return 1
        self._drop_stale(cohort)
        return self._finish_heap[0][0] - cohort.ticks if self._finish_heap else 1 << 30

    def step_time(self, output: SchedulerOutput) -> float:
        """Duration of one step of ``output``."""
        return self.cost_model.batch_time(batch_shape(output)).total_s

    def decode_durations(self, output: SchedulerOutput, num_steps: int) -> np.ndarray:
        """``(num_steps,)`` durations of the decode-only ``output`` repeated."""
        return self.cost_model.decode_times(output.cohort_size, output.cohort_kv_tokens, num_steps)

    def execute(self, output: SchedulerOutput, now: float, durations: np.ndarray | None = None) -> StepResult:
        """Run ``output`` starting at ``now``; ``durations`` may carry the decode times already
        computed for this stretch."""
        self._track_joined(output)
        k = output.num_steps
        if k == 1:
            first = self.step_time(output) if durations is None else float(durations[0])
            ends: Sequence[float] = (now + first,)
        else:
            if durations is None or len(durations) < k:
                durations = self.decode_durations(output, k)
            ends = now + np.add.accumulate(durations[:k])
        finished = [
            r
            for r, c in output.chunks
            if r.num_computed_tokens + c == r.num_tokens and r.num_output_tokens + 1 >= r.true_output_tokens
        ]
        cohort = output.cohort
        if cohort is not None:
            last_tick = cohort.ticks + k
            heap = self._finish_heap
            while heap and heap[0][0] <= last_tick:
                tick, _, r, epoch = heapq.heappop(heap)
                if self._tracked.get(r) == epoch:
                    del self._tracked[r]
                if r.cohort is cohort and r.cohort_epoch == epoch:
                    assert tick == last_tick, f"{r} finished inside a stretch"
                    finished.append(r)
        return StepResult(step_end_times=ends, finished=finished)

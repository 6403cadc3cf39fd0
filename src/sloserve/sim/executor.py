"""The simulator's executor: runs a ``SchedulerOutput`` on a cost model instead of a GPU."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from sloserve.core.outputs import DecodeGroup, SchedulerOutput, StepResult
from sloserve.core.request import Request
from sloserve.cost.base import BatchShape, CostModel, batch_shape

# Stretches of at most this many steps are timed by a loop when the cost model gives a series.
SHORT_STRETCH_STEPS = 64


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

    def _drop_stale(self, cohort: DecodeGroup) -> None:
        heap = self._finish_heap
        while heap and (heap[0][2].cohort is not cohort or heap[0][2].cohort_epoch != heap[0][3]):
            _, _, r, epoch = heapq.heappop(heap)
            if self._tracked.get(r) == epoch:
                del self._tracked[r]

    def steps_until_finish(self, output: SchedulerOutput) -> int:
        """Cohort steps until (and including) the next one in which a member finishes."""
        if output.cohort_joined:
            self._track_joined(output)
        decode = output.decode
        if decode is None:
            # Decodes named as chunks (the planner checked ``is_named_decode_only``): the first to sample
            # its last token
            return min(r.true_output_tokens - r.num_output_tokens for r, _ in output.chunks)
        cohort = decode.cohort
        self._drop_stale(cohort)
        return self._finish_heap[0][0] - cohort.ticks if self._finish_heap else 1 << 30

    def first_step(self, output: SchedulerOutput) -> tuple[BatchShape, float]:
        """The shape of ``output``'s step and its duration (``end_times`` takes both back)."""
        shape = batch_shape(output)
        return shape, self.cost_model.step_seconds(shape)

    def end_times(
        self,
        output: SchedulerOutput,
        now: float,
        num_steps: int,
        until: float = math.inf,
        first_step_s: float | None = None,
        shape: BatchShape | None = None,
    ) -> Sequence[float]:
        """End times of ``output``'s step and the ones repeating it (``CostModel.step_times``) from
        ``now``: ``num_steps`` of them, or fewer, through the first step that ends at or after
        ``until``. ``first_step_s`` and ``shape``: the first step's duration and shape, when already
        computed (``first_step``)."""
        if shape is None:
            shape = batch_shape(output)
        increment = self.cost_model.step_increment(shape) if num_steps <= SHORT_STRETCH_STEPS else None
        if increment is not None:
            # NOTE: the common case at load (a few steps before the next arrival): a plain loop over
            # the arithmetic series costs a fraction of the numpy calls below.
            first = self.cost_model.step_seconds(shape) if first_step_s is None else first_step_s
            ends: list[float] = []
            end = now
            for k in range(num_steps):
                end += first + k * increment
                ends.append(end)
                if end >= until:
                    break
            return ends
        times = self.cost_model.step_times(shape, num_steps)
        # NOTE: in place and in step order, so ends[i] = ((now + d0) + d1) + ... + di: the same
        # floating-point sums as running the steps one by one.
        times[0] += now
        ends_array = np.add.accumulate(times, out=times)
        if until < math.inf:
            # The ndarray method directly; the np.searchsorted wrapper costs more than the work.
            ends_array = ends_array[: int(ends_array.searchsorted(until, side="left")) + 1]
        return ends_array

    def execute(self, output: SchedulerOutput, now: float, end_times: Sequence[float] | None = None) -> StepResult:
        """Run ``output`` (all its ``num_steps`` steps) starting at ``now``; ``end_times`` may carry
        its steps' end times already computed (``end_times``)."""
        if output.cohort_joined:
            self._track_joined(output)
        k = output.num_steps
        if end_times is not None:
            assert len(end_times) == k, (len(end_times), k)
            ends = end_times
        elif k == 1:
            ends = (now + self.cost_model.step_seconds(batch_shape(output)),)
        else:
            ends = self.end_times(output, now, k)
        finished = []  # NOTE: a loop, not a list comprehension: Python 3.11 calls a function for one
        for r, c in output.chunks:
            if r.num_tokens_to_process == c * k and r.num_output_tokens + 1 >= r.true_output_tokens:
                finished.append(r)
            elif k > 1 and c == 1 and r.num_tokens_to_process == 1 and r.num_output_tokens + k >= r.true_output_tokens:
                finished.append(r)  # a named decode repeated k steps: a token each (at the last, its last)
        decode = output.decode
        if decode is not None:
            cohort = decode.cohort
            last_tick = cohort.ticks + k
            heap = self._finish_heap
            while heap and heap[0][0] <= last_tick:
                tick, _, r, epoch = heapq.heappop(heap)
                if self._tracked.get(r) == epoch:
                    del self._tracked[r]
                if r.cohort is cohort and r.cohort_epoch == epoch:
                    assert tick == last_tick, f"{r} finished inside a stretch"
                    finished.append(r)
        return StepResult(ends, finished)  # positional: half the cost of keywords

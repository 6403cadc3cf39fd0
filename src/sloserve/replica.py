"""The step loop of one model replica, shared by the simulator (``sim``: a cost-model executor) and
the real engine (``engine``: a PyTorch executor): ``schedule -> execute -> update``.

Fast path (simulator only): a step that would repeat with every request one step further is
executed as one stretch of k steps whose times come from the cost model's arithmetic series
(``CostModel.step_increment``, or ``step_times``):

- a decode-only step, until an arrival, a completion or a memory event (``Scheduler.decode_horizon``);
- a step of decodes and a prompt chunk that leaves no room for anyone else (Sarathi's middle
  chunks of a long prompt), until the prompt's last chunk, a completion or a memory event
  (``Scheduler.chunk_horizon``): arrivals cannot join such steps. It stops before a completion,
  except in a run of one replica (nothing routes arrivals by what has finished).

``fast_path=False`` runs the same steps one by one (the engine always does); tests check both give
the same per-request timestamps and the same timeline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from sloserve.core.outputs import SchedulerOutput, StepResult
from sloserve.core.request import Request
from sloserve.metrics.timeline import Timeline
from sloserve.sched.base import Scheduler

# Longest stretch advanced at once (bounds the arrays a stretch allocates).
MAX_STRETCH_STEPS = 4096
# A stretch is set up only when the next arrival is at least this many first-step times away:
# setting one up costs about as much as one or two single steps. Instructions executed for 10k
# requests near saturation (valgrind cachegrind) with 1 / 2 / 3 / 5: ShareGPT vLLM 3581 / 3613 /
# 3646 / 3943 M, Azure conv Sarathi 4700 / 4684 / 4737 M; 2 is within 1% of the best on both.
# NOTE: counted before numpy's BLAS threads were pinned (OPENBLAS_NUM_THREADS=1), which makes the
# count repeatable; unpinned, runs of one version differed by up to a few percent.
MIN_STRETCH_STEPS = 2


class SimulationStuckError(RuntimeError):
    """The scheduler has unfinished requests but schedules nothing (a policy bug)."""


class Replica:
    """One model replica: a scheduler, an executor and its own clock and timeline.

    The executor is the simulator's ``SimExecutor`` or the real engine's ``EngineExecutor`` (which has
    no decode fast path: run it with ``fast_path=False``).
    """

    def __init__(self, index: int, scheduler: Scheduler, executor: Any, fast_path: bool) -> None:
        self.index = index
        self.scheduler = scheduler
        self.executor = executor
        self.fast_path = fast_path
        self.now = 0.0  # time at which the next step starts
        self.timeline = Timeline()
        self.outstanding = 0  # routed and not finished
        # True when nothing outside this replica reads its state between its steps (the only
        # replica, no closed-loop batches): a stretch may then run past arrivals up to a completion.
        self.solo = False
        # Called with (replica, output) before each step runs (recording schedules; fast path off).
        self.on_step: Callable[[int, SchedulerOutput], None] | None = None

    def add(self, request: Request, available_at: float) -> None:
        """``request`` reaches this replica at ``available_at`` (its arrival, or its KV transfer's end)."""
        if not self.scheduler.has_unfinished():
            self.now = max(self.now, available_at)
        request.replica = self.index
        self.scheduler.add_request(request)
        self.outstanding += 1

    def step(self, next_arrival: float) -> list[Request]:
        """Run one step (or one decode stretch); returns the requests that finished."""
        sched, executor, now = self.scheduler, self.executor, self.now
        t0 = time.perf_counter()
        out = sched.schedule(now)
        chunks = out.chunks  # NOTE: tested first below: most steps have some, and the properties cost calls
        if not chunks and not out.cohort_size and out.is_empty:  # NOTE: cohort_size first: no call
            if next_arrival < math.inf:
                # Nothing to run until the next arrival (a policy may wait): idle until then.
                sched.update(out, StepResult(step_end_times=(now,)), now)
                self.now = next_arrival
                return []
            raise SimulationStuckError(
                f"replica {self.index}: {sched.name} scheduled nothing at t={now:.6f} with "
                f"{len(sched.waiting)} waiting, {len(sched.running)} running, {len(sched.swapped)} swapped"
            )
        if chunks or out.cohort_joined or out.preempted:
            _account_service(out, now)
        if self.on_step is not None:
            self.on_step(self.index, out)
        end_times = None
        if self.fast_path:
            if chunks:
                if out.cohort is not None:
                    out, end_times = self._chunk_stretch(out)
            elif out.is_decode_only:
                out, end_times = self._decode_stretch(out, next_arrival)
        sched_time = time.perf_counter() - t0
        result = executor.execute(out, now, end_times)
        ends = result.step_end_times
        end = float(ends[-1])
        if out.num_steps > 1:
            # KV before update: a stretch's earlier steps end before its finished requests free theirs.
            used_before, allocated_before = sched.kv_used_tokens(), sched.kv.allocated_tokens
            finished = sched.update(out, result, end)
            self._record_stretch(out, now, ends, sched_time, used_before, allocated_before)
        else:
            finished = sched.update(out, result, end)
            self._record_step(out, now, end, sched_time)
        self.now = end
        self.outstanding -= len(finished)
        return finished

    def run_until(self, next_event: float) -> tuple[int, int]:
        """Step until ``next_event`` is due or nothing is left to run: (requests finished, steps).

        NOTE: only for a ``solo`` replica, whose steps nothing else reacts to in between.
        """
        has_unfinished = self.scheduler.has_unfinished
        num_finished = num_steps = 0
        while True:
            finished = self.step(next_event)
            num_steps += 1
            # NOTE: a solo replica's requests leave only by finishing (no hand-off), so it can run
            # dry only in a step that finished some: has_unfinished() is asked only then.
            if finished:
                num_finished += len(finished)
                if not has_unfinished():
                    return num_finished, num_steps
            if self.now >= next_event:
                return num_finished, num_steps

    def _decode_stretch(
        self, out: SchedulerOutput, next_arrival: float
    ) -> tuple[SchedulerOutput, Sequence[float]]:
        """The decode-only ``out`` repeated for as many steps as nothing changes, with the end time of
        each step: through the first step that ends at or after ``next_arrival``, the next completion
        or the last step whose KV growth fits."""
        executor, now = self.executor, self.now
        # At load the arrival is often a step or two away: then a single step (always exact) costs
        # less than setting up a stretch, and one cost-model call decides that.
        shape, first = executor.first_step(out)
        if now + MIN_STRETCH_STEPS * first >= next_arrival:
            return out, (now + first,)
        limit = min(executor.steps_until_finish(out), MAX_STRETCH_STEPS)
        if next_arrival < math.inf:
            # Step times only grow along a stretch (KV grows), so the arrival is reached within
            # gap / first-step-time + 1 steps: no need to compute more of them.
            limit = min(limit, int((next_arrival - now) / first) + 2)
        if limit > 1:
            limit = self.scheduler.decode_horizon(out, limit)
        if limit <= 1:
            return out, (now + first,)
        ends = executor.end_times(out, now, limit, next_arrival, first, shape)
        if len(ends) == 1:
            return out, (float(ends[0]),)  # NOTE: a single step's end times are a tuple of a float
        return self.scheduler.repeat(out, len(ends)), ends

    def _chunk_stretch(self, out: SchedulerOutput) -> tuple[SchedulerOutput, Sequence[float] | None]:
        """``out`` (decodes and a prompt chunk) repeated for as many steps as the scheduler's
        ``chunk_horizon`` allows, up to the step before the next completion (through it when
        ``solo``), with their end times; ``(out, None)`` for a single step. Such steps leave no room
        for arrivals, so the stretch does not stop at them; a completion inside the stretch would
        be seen early by a router or a closed loop that acts on the arrivals it passed.
        """
        # The scheduler first: most such steps cannot repeat (the chunk ends a prompt, or leaves room).
        limit = self.scheduler.chunk_horizon(out, MAX_STRETCH_STEPS)
        if limit > 1:
            limit = min(limit, self.executor.steps_until_finish(out) - (0 if self.solo else 1))
        if limit <= 1:
            return out, None
        return self.scheduler.repeat(out, limit), self.executor.end_times(out, self.now, limit)

    def _record_step(self, out: SchedulerOutput, start: float, end: float, sched_time: float) -> None:
        num_prefill = num_decode = 0
        for request, c in out.chunks:
            num_prefill += c
            num_decode += c == 1 and not request.is_prefill
        self.timeline.append(
            start,
            end - start,
            num_prefill + out.cohort_size,
            num_prefill,
            out.cohort_size + num_decode,
            len(out.chunks) + out.cohort_size,
            self.scheduler.kv_used_tokens(),
            self.scheduler.kv.allocated_tokens,
            len(out.preempted),
            sched_time,
            self.index,
        )

    def _record_stretch(
        self,
        out: SchedulerOutput,
        start: float,
        ends: Sequence[float],
        sched_time: float,
        used_before: int,
        allocated_before: int,
    ) -> None:
        kv = self.scheduler.kv
        num_prefill = 0
        for _, c in out.chunks:  # NOTE: a loop: a generator costs more for the one chunk at most
            num_prefill += c
        self.timeline.append_stretch(
            start,
            ends,
            out.cohort_size,
            num_prefill,
            len(out.chunks),
            used_before,
            self.scheduler.kv_used_tokens(),
            allocated_before,
            kv.allocated_tokens,
            out.new_blocks_per_step,
            kv.block_size,
            sched_time,
            self.index,
        )


def _account_service(out: SchedulerOutput, now: float) -> None:
    """Keep the JCT decomposition of the requests ``out`` (starting at ``now``) touches: first
    scheduled time, preemption time (from the step that preempted a request to the step it runs in
    again: a refill chunk, a swap-in or a rejoin of the cohort) and GT queuing (from a token sampled
    outside the cohort to joining it)."""
    for preemption in out.preempted:
        preemption.request.paused_since = now
    for request, _ in out.chunks:
        if request.paused_since == request.paused_since:  # not NaN: resumes after a preemption
            request.preempted_s += now - request.paused_since
            request.paused_since = math.nan
        elif request.first_scheduled_time != request.first_scheduled_time:  # NaN: first time
            request.first_scheduled_time = now
    for request in out.cohort_joined:
        if request.cohort is None:
            continue  # joined after the last step, preempted while this one was built
        if request.paused_since == request.paused_since:
            request.preempted_s += now - request.paused_since
            request.paused_since = math.nan
        elif request.last_token_time == request.last_token_time:
            # NOTE: a request whose prompt ended in the previous step joins at its end: zero.
            request.gt_queued_s += now - request.last_token_time

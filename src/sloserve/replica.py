"""The step loop of one model replica, shared by the simulator (``sim``: a cost-model executor) and the
real engine (``engine``: a PyTorch executor): ``schedule -> execute -> update -> record``.

The simulator may pass a stretch planner (``Stretches``; sim/stretch.py's ``StretchPlanner``): it
turns a step that would repeat with every request one step further into one stretch of k steps,
timed by the cost model's arithmetic series. Without one (the engine, or ``fast_path=False``), every
step runs one by one; tests check both give the same per-request timestamps and the same timeline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sloserve.core.outputs import SchedulerOutput, StepResult
from sloserve.core.request import Request
from sloserve.metrics.timeline import Timeline
from sloserve.sched.base import Scheduler


class SimulationStuckError(RuntimeError):
    """The scheduler has unfinished requests but schedules nothing (a policy bug)."""


class Stretches(Protocol):
    """Turns an output into a stretch of steps (sim/stretch.py); the engine has none."""

    def plan(self, replica: Replica, output: SchedulerOutput, next_arrival: float) -> Sequence[float] | None:
        """``output`` repeated (``SchedulerOutput.repeated``) for as many steps as nothing changes;
        the end times of its steps, or None to run it as one step the executor times."""
        ...

    def record(
        self, replica: Replica, output: SchedulerOutput, start: float, end_times: Sequence[float], sched_time: float
    ) -> None:
        """Append the timeline rows of an executed stretch of ``output.num_steps`` > 1 steps."""
        ...


class Replica:
    """One model replica: a scheduler, an executor and its own clock and timeline.

    The executor is the simulator's ``SimExecutor`` or the real engine's ``EngineExecutor`` (which runs
    one step at a time: no ``stretches``).
    """

    def __init__(self, index: int, scheduler: Scheduler, executor: Any, stretches: Stretches | None = None) -> None:
        self.index = index
        self.scheduler = scheduler
        self.executor = executor
        self.stretches = stretches
        self.now = 0.0  # time at which the next step starts
        self.timeline = Timeline()
        self.outstanding = 0  # routed and not finished
        # Called with (replica, output) before each step runs (recording schedules; no stretches).
        self.on_step: Callable[[int, SchedulerOutput], None] | None = None

    def add(self, request: Request, available_at: float) -> None:
        """``request`` reaches this replica at ``available_at`` (its arrival, or its KV transfer's end)."""
        if not self.scheduler.has_unfinished():
            self.now = max(self.now, available_at)
        request.replica = self.index
        self.scheduler.add_request(request)
        self.outstanding += 1

    def step(self, next_arrival: float, stretch_until: float = math.inf) -> list[Request]:
        """Run one step (or one stretch of steps); returns the requests that finished. A stretch stops at
        ``next_arrival`` and at ``stretch_until`` (when another replica may send this one a request: a
        cluster's ``earliest_news``); a replica with nothing to run idles until ``next_arrival``."""
        start, t0 = self.now, time.perf_counter()
        out = self.scheduler.schedule(start)
        if not out.chunks and out.decode is None and out.is_empty:  # NOTE: the fields first: no call
            return self._wait(out, next_arrival)
        if out.chunks or out.cohort_joined or out.preempted:
            _account_service(out, start)
        if self.on_step is not None:
            self.on_step(self.index, out)
        end_times = None
        # NOTE: only cohort steps repeat, and named decodes of a policy that says they may
        if self.stretches is not None and (out.decode is not None or self.scheduler.named_decode_stretches):
            end_times = self.stretches.plan(self, out, min(next_arrival, stretch_until))
        sched_time = time.perf_counter() - t0
        result = self.executor.execute(out, start, end_times)
        self.now = float(result.step_end_times[-1])
        finished = self.scheduler.update(out, result, self.now)
        if out.num_steps > 1:
            self.stretches.record(self, out, start, result.step_end_times, sched_time)
        else:
            self._record_step(out, start, sched_time)
        self.outstanding -= len(finished)
        return finished

    # --- what it reports to a router (router.py's ReplicaLoad) -----------------------------------
    def queued_prompt_tokens(self) -> int:
        """Prompt tokens its scheduler has yet to compute: its waiting requests' and its prefills'."""
        sched = self.scheduler
        queued = sum(r.num_tokens_to_process for r in sched.waiting)
        return queued + sum(r.num_tokens_to_process for r in sched.running if r.is_prefill)

    def kv_free_tokens(self) -> int:
        kv = self.scheduler.kv
        return kv.num_free_blocks * kv.block_size

    def kv_empty_tokens(self) -> int:
        kv = self.scheduler.kv
        return kv.gpu.num_free * kv.block_size

    def cached_prefix_tokens(self, request: Request) -> int | None:
        kv = self.scheduler.kv
        if kv.prefix_cache is None:
            return None
        return len(kv.find_cached_prefix(request)) * kv.block_size

    def _wait(self, out: SchedulerOutput, next_arrival: float) -> list[Request]:
        """Nothing to run until the next arrival (a policy may wait): idle until then."""
        if next_arrival == math.inf:
            sched = self.scheduler
            raise SimulationStuckError(
                f"replica {self.index}: {sched.name} scheduled nothing at t={self.now:.6f} with "
                f"{len(sched.waiting)} waiting, {len(sched.running)} running, {len(sched.swapped)} swapped"
            )
        self.scheduler.update(out, StepResult(step_end_times=(self.now,)), self.now)
        self.now = next_arrival
        return []

    def _record_step(self, out: SchedulerOutput, start: float, sched_time: float) -> None:
        num_prefill, num_decode = chunk_counts(out)
        num_cohort = 0 if out.decode is None else out.decode.size
        self.timeline.append(
            start,
            self.now - start,
            num_prefill + num_decode + num_cohort,
            num_prefill,
            out.num_cached_tokens,
            num_cohort + num_decode,
            len(out.chunks) + num_cohort,
            self.scheduler.kv_used_tokens(),
            self.scheduler.kv.allocated_tokens,
            len(out.preempted),
            sched_time,
            self.index,
        )


def chunk_counts(out: SchedulerOutput) -> tuple[int, int]:
    """(prompt tokens, decodes named as chunks) of an executed step's chunks, for the timeline.
    NOTE: read after the step: a chunk of one token whose request is then not in prefill decoded."""
    num_prefill = num_decode = 0
    for request, c in out.chunks:  # NOTE: a loop: a generator costs more for the one chunk at most
        if c == 1 and not request.is_prefill:
            num_decode += 1
        else:
            num_prefill += c
    return num_prefill, num_decode


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

"""Discrete-event simulation of one replica or a cluster of replicas behind a router.

The step loop per replica is ``schedule -> execute -> update``. Events are ordered by time; ties go
to arrivals first, then to the replica with the lowest index, so a run is deterministic.

Fast path: a step that would repeat with every request one step further is executed as one stretch
of k steps whose times come from the cost model's arithmetic series (``CostModel.step_increment``, or
``step_times``):

- a decode-only step, until an arrival, a completion or a memory event (``Scheduler.decode_horizon``);
- a step of decodes and a prompt chunk that leaves no room for anyone else (Sarathi's middle
  chunks of a long prompt), until the prompt's last chunk, a completion or a memory event
  (``Scheduler.chunk_horizon``): arrivals cannot join such steps. It stops before a completion,
  except in a run of one replica (nothing routes arrivals by what has finished).

``fast_path=False`` runs the same steps one by one; tests check both give the same per-request
timestamps and the same timeline.
"""

from __future__ import annotations

import functools
import gc
import heapq
import math
import time
from bisect import insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sloserve.core.errors import UnknownNameError
from sloserve.core.outputs import SchedulerOutput, StepResult
from sloserve.core.request import Request
from sloserve.cost.base import CostModel
from sloserve.metrics.timeline import Timeline
from sloserve.sched.base import Scheduler
from sloserve.sim.executor import SimExecutor

# Longest stretch advanced at once (bounds the arrays a stretch allocates).
MAX_STRETCH_STEPS = 4096
# A stretch is set up only when the next arrival is at least this many first-step times away:
# setting one up costs about as much as one or two single steps. Instructions executed for 10k
# requests near saturation (valgrind cachegrind) with 1 / 2 / 3 / 5: ShareGPT vLLM 3581 / 3613 /
# 3646 / 3943 M, Azure conv Sarathi 4700 / 4684 / 4737 M; 2 is within 1% of the best on both.
# NOTE: counted before numpy's BLAS threads were pinned (OPENBLAS_NUM_THREADS=1), which makes the
# count repeatable; unpinned, runs of one version differed by up to a few percent.
MIN_STRETCH_STEPS = 2
# on_progress is called about this often (in steps run).
PROGRESS_EVERY_STEPS = 256


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


def _run_solo(
    replica: Replica, pending: list[tuple[float, int, Request]], on_progress: Callable[[int], None] | None
) -> tuple[int, int]:
    """Serve the ``pending`` arrivals (the next one last) on one replica with no chained batches:
    nothing but its own clock moves the next event, so after each arrival it steps on until the next
    one is due (or it runs dry) without choosing again. Returns (requests finished, steps)."""
    completed = steps = 0
    next_progress = PROGRESS_EVERY_STEPS
    while pending:
        arrival, _, request = pending.pop()
        replica.add(request, arrival)
        next_arrival = pending[-1][0] if pending else math.inf
        # NOTE: arrivals due by the replica's clock are all added before it steps (ties: arrivals
        # first), and it has unfinished requests here: the one just added at least.
        if replica.now < next_arrival:
            num_finished, num_steps = replica.run_until(next_arrival)
            completed += num_finished
            steps += num_steps
            if on_progress is not None and steps >= next_progress:
                on_progress(completed)
                next_progress = steps + PROGRESS_EVERY_STEPS
    return completed, steps


def _latest_first(arrival: tuple[float, int, Request]) -> tuple[float, int]:
    """Sort key of the pending arrivals: the earliest (ties: the lowest request id) sorts last."""
    return -arrival[0], -arrival[1]


def _route_round_robin(replicas: Sequence[Replica], seq: int) -> Replica:
    return replicas[seq % len(replicas)]


def _route_least_outstanding(replicas: Sequence[Replica], seq: int) -> Replica:
    return min(replicas, key=lambda r: (r.outstanding, r.index))


ROUTERS: dict[str, Callable[[Sequence[Replica], int], Replica]] = {
    "round-robin": _route_round_robin,
    "least-outstanding": _route_least_outstanding,
}


@dataclass
class SimResult:
    """Everything a run produced: the requests (with their timestamps) and the per-step timeline."""

    requests: list[Request]
    timeline: Timeline
    kv_capacity_tokens: int  # per replica
    num_replicas: int
    num_allocation_failures: int
    swapped_bytes: int
    num_preemptions: int
    sim_wall_s: float
    extra: dict = field(default_factory=dict)
    # Scheduler.policy_metrics of the replicas, merged (merge_policy_metrics).
    policy_metrics: dict = field(default_factory=dict)


def merge_policy_metrics(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``policy_metrics`` dict from several replicas': ``num_*`` counters and ``*_s`` times
    summed, lists concatenated, other values kept when all replicas that report them agree."""
    merged: dict[str, Any] = {}
    disagree: set[str] = set()
    for report in reports:
        for key, value in report.items():
            if key not in merged:
                merged[key] = list(value) if isinstance(value, (list, tuple)) else value
            elif isinstance(value, (list, tuple)):
                merged[key].extend(value)
            elif key.startswith("num_") or key.endswith("_s"):
                merged[key] += value
            elif merged[key] != value:
                disagree.add(key)
    return {k: v for k, v in merged.items() if k not in disagree}


def _cyclic_gc_paused(run: Callable[..., SimResult]) -> Callable[..., SimResult]:
    """Run ``run`` with Python's cyclic garbage collector paused, as ``timeit`` does, and restore it.

    NOTE: a simulation creates no reference cycles (a test checks it leaves no cyclic garbage), so
    the collector would only walk the live requests again and again: that cost about 3% of a 10k-
    request run's instructions, and pausing it leaks nothing.
    """

    @functools.wraps(run)
    def paused(*args: Any, **kwargs: Any) -> SimResult:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return run(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return paused


@_cyclic_gc_paused
def simulate(
    requests: Sequence[Request],
    make_scheduler: Callable[[], Scheduler],
    cost_model: CostModel,
    *,
    num_replicas: int = 1,
    router: str = "round-robin",
    fast_path: bool = True,
    on_progress: Callable[[int], None] | None = None,
    on_step: Callable[[int, SchedulerOutput], None] | None = None,
    make_decode_scheduler: Callable[[], Scheduler] | None = None,
    num_decode_replicas: int = 0,
    link_bandwidth: float = 100e9 / 8,
    chains: Sequence[Sequence[Sequence[Request]]] = (),
) -> SimResult:
    """Simulate ``requests`` (their arrival times set) on ``num_replicas`` replicas.

    ``make_scheduler`` builds one fresh scheduler per replica. Requests are mutated in place (their
    progress and timestamps) and returned in ``SimResult.requests``. ``on_step(replica, output)``
    sees every output before it runs (use ``fast_path=False`` to see every step).

    Disaggregated serving (DistServe): with ``num_decode_replicas`` > 0, the ``num_replicas``
    replicas only prefill (their schedulers have role ``prefill``) and hand each request off after
    its first token; its KV (prompt tokens x bytes per token) crosses the prefill replica's link, one
    transfer at a time at ``link_bandwidth`` bytes/s (default 100 Gb/s Ethernet), and the router
    gives it to one of the ``num_decode_replicas`` built by ``make_decode_scheduler``.

    Closed-loop batches: each chain is a list of batches of ``requests``; a batch after the first
    arrives (its ``arrival_time`` is set) when every request of the batch before it has finished.
    """
    if router not in ROUTERS:
        raise UnknownNameError("router", router, list(ROUTERS))
    if num_replicas < 1 or num_decode_replicas < 0:
        raise ValueError(f"need >= 1 replica and >= 0 decode replicas, got {num_replicas}, {num_decode_replicas}")
    if num_decode_replicas and (make_decode_scheduler is None or not link_bandwidth > 0):
        raise ValueError("disaggregated serving needs make_decode_scheduler and a link bandwidth > 0")
    wall0 = time.perf_counter()
    replicas = [Replica(i, make_scheduler(), SimExecutor(cost_model), fast_path) for i in range(num_replicas)]
    decoders = [
        Replica(num_replicas + i, make_decode_scheduler(), SimExecutor(cost_model), fast_path)  # type: ignore[misc]
        for i in range(num_decode_replicas)
    ]
    everyone = replicas + decoders
    for rep in everyone:
        rep.on_step = on_step
    for r in requests:
        everyone[-1].scheduler.check_fits(r, r.num_prompt_tokens + r.true_output_tokens - 1)
    # Arrivals not yet routed, (arrival time, request id, request), the next one last: a list popped
    # from its end costs O(1) (a heap's pops took 1-2% of a 30k-request run). Chained batches join
    # later, inserted in order.
    chained = {id(r) for chain in chains for batch in chain[1:] for r in batch}
    pending = sorted(
        ((r.arrival_time, r.request_id, r) for r in requests if id(r) not in chained), key=_latest_first
    )
    batch_of: dict[int, tuple[int, int]] = {}  # id(request) -> (chain, index of the batch it is in)
    left_in_batch: dict[tuple[int, int], int] = {}
    for c, chain in enumerate(chains):
        for b, batch in enumerate(chain):
            left_in_batch[(c, b)] = len(batch)
            for r in batch:
                batch_of[id(r)] = (c, b)
    route = ROUTERS[router]
    # KV transfers in flight: (time the KV has arrived, sequence, request).
    transfers: list[tuple[float, int, Request]] = []
    link_free = [0.0] * num_replicas  # when each prefill replica's link is idle again
    transferred_bytes = 0
    routed = routed_to_decode = completed = steps = 0
    next_progress = PROGRESS_EVERY_STEPS
    solo = len(everyone) == 1 and not chains
    everyone[0].solo = solo
    if solo:
        completed, steps = _run_solo(replicas[0], pending, on_progress)
    else:
        # A cluster, or chained batches: each turn the next event is routed or the replica furthest
        # behind steps once.
        while True:
            next_arrival = pending[-1][0] if pending else math.inf
            next_event = min(next_arrival, transfers[0][0]) if transfers else next_arrival
            busy = [rep for rep in everyone if rep.scheduler.has_unfinished()]
            replica = min(busy, key=lambda rep: (rep.now, rep.index)) if busy else None
            if replica is None and next_event == math.inf:
                break
            if replica is None or next_event <= replica.now:
                if transfers and transfers[0][0] <= next_arrival:
                    done, _, request = heapq.heappop(transfers)
                    route(decoders, routed_to_decode).add(request, done)
                    routed_to_decode += 1
                else:
                    arrival, _, request = pending.pop()
                    route(replicas, routed).add(request, arrival)
                    routed += 1
                continue
            finished = replica.step(next_event)
            completed += len(finished)
            steps += 1
            for request in finished if chains else ():
                key = batch_of.get(id(request))
                if key is None:
                    continue
                left_in_batch[key] -= 1
                c, b = key
                if left_in_batch[key] == 0 and b + 1 < len(chains[c]):
                    for r in chains[c][b + 1]:  # the next batch arrives now
                        r.arrival_time = request.finish_time
                        insort(pending, (r.arrival_time, r.request_id, r), key=_latest_first)
            for request in replica.scheduler.take_handoff() if replica.scheduler.handoff else ():
                replica.outstanding -= 1
                num_bytes = request.num_computed_tokens * replica.scheduler.kv.kv_bytes_per_token
                start = max(request.first_token_time, link_free[replica.index])
                link_free[replica.index] = start + num_bytes / link_bandwidth
                transferred_bytes += num_bytes
                heapq.heappush(transfers, (link_free[replica.index], request.request_id, request))
            if on_progress is not None and steps >= next_progress:
                on_progress(completed)
                next_progress = steps + PROGRESS_EVERY_STEPS
    if on_progress is not None:
        on_progress(completed)
    timeline = everyone[0].timeline if len(everyone) == 1 else Timeline.concat([r.timeline for r in everyone])
    kvs = [rep.scheduler.kv for rep in everyone]
    return SimResult(
        requests=list(requests),
        timeline=timeline,
        kv_capacity_tokens=kvs[0].capacity_tokens,
        num_replicas=len(everyone),
        num_allocation_failures=sum(kv.num_allocation_failures for kv in kvs),
        swapped_bytes=sum(kv.swapped_bytes for kv in kvs),
        num_preemptions=sum(rep.scheduler.num_preemptions for rep in everyone),
        sim_wall_s=time.perf_counter() - wall0,
        extra={"kv_transferred_bytes": transferred_bytes} if num_decode_replicas else {},
        policy_metrics=merge_policy_metrics([rep.scheduler.policy_metrics() for rep in everyone]),
    )

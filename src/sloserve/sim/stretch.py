"""The simulator's fast path: a step that would repeat with every request one step further runs as
one stretch of k steps whose times come from the cost model's arithmetic series
(``CostModel.step_increment``, or ``step_times``):

- a decode-only step, until an arrival (or the time another replica may send one: a prefill replica's
  hand-off, a conversation's next turn; ``_Cluster.earliest_news``), a completion, a memory event
  (``Scheduler.decode_horizon``) or the time the policy's own decision moves
  (``Scheduler.stretch_deadline``: EconoServe's ordered queues; ``Scheduler.clock_horizon`` when it
  moves step by step with the clock: BROS's deadlines):
  the cohort's step, or one of one-token decodes named as chunks by a policy that opts in
  (``Scheduler.named_decode_stretches``: SRTF, FastServe, MultiRes, the rank policies, RR with one class,
  BROS);
- a step of decodes and a prompt chunk that leaves no room for anyone else (Sarathi's middle
  chunks of a long prompt), until the prompt's last chunk, a completion or a memory event
  (``Scheduler.chunk_horizon``): arrivals cannot join such steps (not on a decode replica, whose
  arrivals join the cohort: none there). It stops before a completion,
  except in a run of one replica (nothing routes arrivals by what has finished).

A policy opts in by its horizons (``CohortScheduler`` gives ready ones); with the defaults every step
runs alone. ``simulate(..., fast_path=False)`` runs without a planner; tests check both give the
same per-request timestamps and the same timeline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sloserve.core.outputs import SchedulerOutput
from sloserve.replica import Replica, chunk_counts
from sloserve.sim.executor import SimExecutor

# Longest stretch advanced at once (bounds the arrays a stretch allocates).
MAX_STRETCH_STEPS = 4096
# A stretch is set up only when the next arrival is at least this many first-step times away:
# setting one up costs about as much as one or two single steps (measured: docs/performance.md).
MIN_STRETCH_STEPS = 2


class StretchPlanner:
    """Plans the stretches of one replica whose executor is a ``SimExecutor``.

    ``solo``: nothing outside the replica reads its state between its steps (the only replica, no
    closed-loop batches), so a chunk stretch may run through a completion.
    """

    def __init__(self, executor: SimExecutor, solo: bool = False) -> None:
        self.executor = executor
        self.solo = solo
        # KV in use and allocated before the planned stretch runs (for its timeline rows): a
        # stretch's earlier steps end before its finished requests free theirs.
        self._kv_used_before = self._kv_allocated_before = 0

    def plan(self, replica: Replica, output: SchedulerOutput, next_arrival: float) -> Sequence[float] | None:
        """``output``, a step of the decode cohort, made a stretch where it repeats, and its steps' end
        times; None (or a single end time) for a single step."""
        if output.decode is None:  # the policy names its decodes (named_decode_stretches)
            return self._decode_stretch(replica, output, next_arrival, named=True)
        if output.chunks:
            return self._chunk_stretch(replica, output)
        if output.is_decode_only:
            return self._decode_stretch(replica, output, next_arrival)
        return None

    def _decode_stretch(
        self, replica: Replica, out: SchedulerOutput, next_arrival: float, named: bool = False
    ) -> Sequence[float]:
        """The decode-only ``out`` repeated for as many steps as nothing changes, with the end time of
        each step: through the first step that ends at or after ``next_arrival``, the next completion
        or the last step whose KV growth fits. ``named``: ``out`` has no cohort, and repeats only if
        it is all one-token decodes named as chunks (else it runs as one step)."""
        executor, now = self.executor, replica.now
        # NOTE: a time at which the policy decides differently by itself is an arrival to a stretch
        next_arrival = min(next_arrival, replica.scheduler.stretch_deadline())
        # At load the arrival is often a step or two away: then a single step (always exact) costs
        # less than setting up a stretch, and one cost-model call decides that.
        shape, first = executor.first_step(out)
        # NOTE: named decodes repeat only without prefix caching: each step registers the blocks it
        # fills, which a waiting request's lookup may then find, and their slots are taken at once
        if now + MIN_STRETCH_STEPS * first >= next_arrival or (
            named and (not out.is_named_decode_only or replica.scheduler.kv.prefix_cache is not None)
        ):
            return (now + first,)
        limit = min(executor.steps_until_finish(out), MAX_STRETCH_STEPS)
        if next_arrival < math.inf:
            # Step times only grow along a stretch (KV grows), so the arrival is reached within
            # gap / first-step-time + 1 steps: no need to compute more of them.
            limit = min(limit, int((next_arrival - now) / first) + 2)
        if limit > 1:
            limit = replica.scheduler.decode_horizon(out, limit)
        if limit <= 1:
            return (now + first,)
        ends = executor.end_times(out, now, limit, next_arrival, first, shape)
        if named and len(ends) > 1:
            ends = ends[: replica.scheduler.clock_horizon(out, ends)]
        if len(ends) == 1:
            return (float(ends[0]),)  # NOTE: a single step's end times are a tuple of a float
        return self._repeat(replica, out, ends)

    def _chunk_stretch(self, replica: Replica, out: SchedulerOutput) -> Sequence[float] | None:
        """``out`` (decodes and a prompt chunk) repeated for as many steps as the scheduler's
        ``chunk_horizon`` allows, up to the step before the next completion (through it when
        ``solo``), with their end times; None for a single step. Such steps leave no room for
        arrivals, so the stretch does not stop at them; a completion inside the stretch would be
        seen early by a router or a closed loop that acts on the arrivals it passed.
        """
        # The scheduler first: most such steps cannot repeat (the chunk ends a prompt, or leaves room).
        limit = replica.scheduler.chunk_horizon(out, MAX_STRETCH_STEPS)
        if limit > 1:
            limit = min(limit, self.executor.steps_until_finish(out) - (0 if self.solo else 1))
        if limit <= 1:
            return None
        return self._repeat(replica, out, self.executor.end_times(out, replica.now, limit))

    def _repeat(self, replica: Replica, out: SchedulerOutput, ends: Sequence[float]) -> Sequence[float]:
        """``out`` made to stand for ``len(ends)`` steps, which end at ``ends``."""
        sched = replica.scheduler
        sched.repeat(out, len(ends))
        self._kv_used_before, self._kv_allocated_before = sched.kv_used_tokens(), sched.kv.allocated_tokens
        return ends

    def record(
        self, replica: Replica, out: SchedulerOutput, start: float, end_times: Sequence[float], sched_time: float
    ) -> None:
        """The timeline rows of an executed stretch."""
        kv = replica.scheduler.kv
        num_prefill, num_named = chunk_counts(out)
        replica.timeline.append_stretch(
            start,
            end_times,
            num_named + (0 if out.decode is None else out.decode.size),
            num_prefill,
            out.num_cached_tokens,
            len(out.chunks) - num_named,
            self._kv_used_before,
            replica.scheduler.kv_used_tokens(),
            self._kv_allocated_before,
            kv.allocated_tokens,
            out.new_slots_per_step,
            sched_time,
            replica.index,
        )

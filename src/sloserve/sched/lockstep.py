"""Requests in lockstep: a cohort's members each process one token per tick of a shared counter.

vLLM, Sarathi-Serve and ORCA put every running decode request into every decode step, so those
requests advance as a whole. Instead of touching every member each step, a member's counters are
stored relative to the cohort's ``ticks`` (``Request.enter_cohort``): advancing the cohort by k ticks
costs O(1), whatever its size, and a member's token times are the end times of the ticks it was in.

This module holds only that counting. How the members' KV grows each tick is added by
``DecodeCohort`` (sched/decode_cohort.py); the policies that use one derive from ``CohortScheduler``
(sched/cohort.py).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections.abc import Sequence
from operator import sub
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sloserve.core.request import Request


class Cohort:
    """Members advance together: ``advance`` gives each one output token per tick."""

    def __init__(self) -> None:
        self.ticks = 0
        # member -> the tick at which it joined (insertion-ordered)
        self.members: dict[Request, int] = {}
        # Sum of members' num_computed_tokens: the KV decode attention reads next tick.
        # NOTE: kept up to date by add, remove and advance (an attribute: read every step).
        self.kv_tokens = 0
        # A max-heap of (-(num_computed_tokens - ticks), id, member, its cohort_epoch) as each joined:
        # every member gains one per tick, so their order holds while they stay, and the longest is
        # the top plus ticks (max_kv_tokens). NOTE: a leaving member's entry stays until it reaches
        # the top (then dropped: its epoch or cohort no longer match), or until the heap holds twice
        # the members (then rebuilt).
        self._longest: list[tuple[int, int, Request, int]] = []
        self._times = TickTimes()

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, request: Request) -> bool:
        return request.cohort is self

    def add(self, request: Request) -> None:
        """Join: from the next tick on, ``request`` processes one token per tick."""
        assert request.cohort is None and not request.is_prefill, request
        computed, t = request.computed_offset, self.ticks  # outside a cohort: its num_computed_tokens
        self.kv_tokens += computed
        request.enter_cohort(self)
        heapq.heappush(self._longest, (t - computed, id(request), request, request.cohort_epoch))
        self.members[request] = t

    def remove(self, request: Request) -> None:
        """Leave (finish or preemption): record the tokens produced while a member."""
        assert request.cohort is self, request
        joined, now = self.members.pop(request), self.ticks
        self.kv_tokens -= request.computed_offset + now  # its num_computed_tokens
        if len(self._longest) > 2 * len(self.members) + 32:
            self._longest = [(-r.computed_offset, id(r), r, r.cohort_epoch) for r in self.members]
            heapq.heapify(self._longest)
        if now > joined:
            times = self._times.ends(joined + 1) if request.token_times is not None else None
            request.record_token_run(*self._times.run(joined + 1), times)
        request.leave_cohort()

    def advance(self, end_times: Sequence[float]) -> None:
        """Advance ``len(end_times)`` ticks that ended at those times."""
        k = len(end_times)
        self._times.extend(end_times)
        self.ticks += k
        self.kv_tokens += len(self.members) * k

    @property
    def max_kv_tokens(self) -> int:
        """The longest member's num_computed_tokens (0 without members): the KV of the longest
        context that decode attention walks next tick."""
        heap = self._longest
        while heap:
            negative_offset, _, request, epoch = heap[0]
            # NOTE: a member that left, or left and joined again (at another offset), is stale.
            if request.cohort is self and request.cohort_epoch == epoch:
                return self.ticks - negative_offset
            heapq.heappop(heap)
        return 0

    def check_integrity(self) -> None:
        """The members' KV adds up to ``kv_tokens``; the longest is ``max_kv_tokens``."""
        assert self.kv_tokens == sum(r.num_computed_tokens for r in self.members), self.kv_tokens
        assert self.max_kv_tokens == max((r.num_computed_tokens for r in self.members), default=0)


class TickTimes:
    """End times of a cohort's ticks 1, 2, ..., and the largest gap between consecutive ticks from any
    tick to the latest, in O(log n): what a member leaving needs to record its run of tokens."""

    def __init__(self) -> None:
        # (ticks + 1,) end time of tick k at index k. NOTE: a list, not an array("d"): appending a
        # float to an array parses it as an argument, which cost more than the list's extra memory.
        self._end: list[float] = [math.nan]
        # The gaps (end of tick k minus end of tick k - 1, k >= 2) that no later gap reaches: ticks
        # ascending, gaps strictly descending, so the largest gap from tick a to the latest tick is
        # the first entry at or after a (a monotonic stack; each tick is pushed and popped once).
        self._peak_ticks: list[int] = []
        self._peak_gaps: list[float] = []

    def __len__(self) -> int:
        return len(self._end) - 1

    def extend(self, end_times: Sequence[float]) -> None:
        """Ticks that ended at ``end_times`` follow the latest."""
        ends = self._end
        t, k = len(ends) - 1, len(end_times)
        if k == 1:  # a single step (its end times are a tuple of a float): the common case
            end = end_times[0]
            ends.append(end)
            if t:  # tick 1 has no gap
                self._push_gap(t + 1, end - ends[t])
            return
        if k <= 64:
            # NOTE: element by element: for a few ticks numpy costs more than the work.
            if isinstance(end_times, np.ndarray):
                end_times = end_times.tolist()  # Python floats in the list, as from the other path
            previous = ends[t]
            ends.extend(end_times)
            last_gap = end_times[-1] - end_times[-2]
            # Gaps of ticks t+2 .. t+k are b - a (in C). When the last is the largest (a stretch's
            # step times grow), it pops every other gap of the run: pushing it alone leaves the
            # same stack. So does the first gap (tick t+1's; tick 1 has none) unless it is larger.
            if max(map(sub, end_times[1:], end_times)) <= last_gap:
                if t >= 1 and end_times[0] - previous > last_gap:
                    self._push_gap(t + 1, end_times[0] - previous)
                self._push_gap(t + k, last_gap)
            else:
                if t >= 1:
                    self._push_gap(t + 1, end_times[0] - previous)
                for tick, gap in enumerate(map(sub, end_times[1:], end_times), t + 2):
                    self._push_gap(tick, gap)
            return
        run = np.asarray(end_times, dtype=np.float64)  # (k,)
        gaps = np.empty(k)  # (k,) gaps of ticks t+1 .. t+k: the same subtractions as above
        gaps[0] = run[0] - ends[t]
        np.subtract(run[1:], run[:-1], out=gaps[1:])
        ends.extend(run.tolist())
        peak_ticks, peak_gaps = self._peak_ticks, self._peak_gaps
        first = 1 if t == 0 else 0  # tick 1 has no gap
        gaps = gaps[first:]
        # The run's gaps that no later gap of the run reaches (strictly above the largest after them).
        after = np.maximum.accumulate(gaps[::-1])[::-1]  # (k - first,) largest gap from i on
        keep = np.flatnonzero(np.append(gaps[:-1] > after[1:], True))
        while peak_gaps and peak_gaps[-1] <= after[0]:
            peak_gaps.pop()
            peak_ticks.pop()
        peak_ticks.extend((keep + (t + 1 + first)).tolist())
        peak_gaps.extend(gaps[keep].tolist())

    def _push_gap(self, tick: int, gap: float) -> None:
        peak_ticks, peak_gaps = self._peak_ticks, self._peak_gaps
        while peak_gaps and peak_gaps[-1] <= gap:
            peak_gaps.pop()
            peak_ticks.pop()
        peak_ticks.append(tick)
        peak_gaps.append(gap)

    def ends(self, first_tick: int) -> list[float]:
        """End times of ``first_tick`` .. the latest tick."""
        return self._end[first_tick:]

    def run(self, first_tick: int) -> tuple[float, float, float]:
        """(end of ``first_tick``, end of the latest tick, largest gap between consecutive ticks of
        that run, NaN for a run of one tick)."""
        last_tick = len(self._end) - 1
        gap = math.nan
        if last_tick > first_tick:
            gap = float(self._peak_gaps[bisect_left(self._peak_ticks, first_tick + 1)])
        return self._end[first_tick], self._end[last_tick], gap

"""The decode cohort: running decode requests that all process one token per cohort step.

vLLM, Sarathi-Serve and ORCA put every running decode request into every decode step, so the
cohort advances as a whole. Its members' counters are derived lazily from ``ticks`` (see
core/request.py) and token times are the ticks' end times. KV growth costs O(1) per tick:

- paged managers (one block every block_size tokens): a member needs a new block every block_size
  ticks, at ticks of one residue class modulo block_size, so the cohort keeps only how many members
  are in each class and reserves blocks by count; a member's block ids are assigned when it leaves
  or when its slots are read (``settle``).
- other managers (reservations): a calendar of the tick at which each member outgrows its
  reservation, grown through ``KVCacheManager.allocate_slots``.

One step therefore costs O(1), not O(batch): this is what lets the simulator run thousands of
requests per wall second.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from operator import sub

import numpy as np

from sloserve.core.request import Request
from sloserve.kv.manager import KVCacheManager


class DecodeCohort:
    """Members advance together: ``advance`` gives each one output token per tick."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.ticks = 0
        # member -> first tick at which it needs a new block (insertion-ordered)
        self.members: dict[Request, int] = {}
        # Sum of members' num_computed_tokens: the KV decode attention reads next tick.
        # NOTE: kept up to date by add, remove and advance (an attribute: read every step).
        self.kv_tokens = 0
        self._times = TickTimes()
        self._grown_through = 0  # last tick whose KV growth has been reserved
        self._period = kv.growth_period
        # Paged: members due at ticks t with t % period == r, per residue r.
        self._due_count = [0] * (self._period or 1)
        # Other managers: tick -> (member, epoch) pairs that outgrow their slots at that tick.
        # NOTE: entries of members that left (epoch changed) are stale and skipped.
        self._due: dict[int, list[tuple[Request, int]]] = {}

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, request: Request) -> bool:
        return request.cohort is self

    # --- membership ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Join: from the next tick on, ``request`` processes one token per tick.

        NOTE: a request added while a step is being scheduled must already hold a slot for its next
        token (that tick's growth has been reserved).
        """
        assert request.cohort is None and not request.is_prefill, request
        t = self.ticks
        self.kv_tokens += request._computed_offset  # its num_computed_tokens
        request._computed_offset -= t
        request._output_offset -= t
        request.cohort = self
        request.cohort_join_tick = t
        request.cohort_epoch += 1
        # At tick u a member processes the token at position offset + u - 1, so it needs
        # num_slots >= offset + u: it is first due at the first tick where that fails.
        first_due = self.kv.num_slots(request) - request._computed_offset + 1
        # NOTE: residue counting needs the first due tick within one period after the growth mark.
        assert 0 < first_due - self._grown_through <= (self._period or first_due), request
        self.members[request] = first_due
        if self._period is not None:
            self._due_count[first_due % self._period] += 1
        else:
            self._due.setdefault(first_due, []).append((request, request.cohort_epoch))

    def remove(self, request: Request, *, drop_kv: bool = False) -> None:
        """Leave (finish or preemption): record the tokens produced while a member, and take the
        block ids of its reserved growth, or with ``drop_kv`` (its KV is about to be freed) give the
        reserved growth back by count."""
        assert request.cohort is self, request
        if drop_kv and self._period is not None:
            self.kv.release_owed_blocks(self._owed_slots(request) // self.kv.block_size)
        else:
            self.settle(request)
        first_due = self.members.pop(request)
        if self._period is not None:
            self._due_count[first_due % self._period] -= 1
        joined, now = request.cohort_join_tick, self.ticks
        self.kv_tokens -= request._computed_offset + now  # its num_computed_tokens
        if now > joined:
            times = self._times.ends(joined + 1) if request.token_times is not None else None
            request.record_token_run(*self._times.run(joined + 1), times)
        request._computed_offset += now
        request._output_offset += now
        request.cohort = None

    def granted_slots(self, request: Request) -> int:
        """Slots a member holds, counting growth reserved for it but not yet given block ids."""
        return self.kv.num_slots(request) + self._owed_slots(request)

    def _owed_slots(self, request: Request) -> int:
        """Slots of the growth reserved for a member and not yet given block ids (paged; else 0)."""
        first_due = self.members[request]
        if self._period is None or self._grown_through < first_due:
            return 0
        entitled = (self._grown_through - first_due) // self._period + 1
        granted = first_due - 1 + request._computed_offset + entitled * self._period
        return granted - self.kv.num_slots(request)

    def settle(self, request: Request) -> None:
        """Give a member the block ids of the growth reserved for it so far (paged), so that every
        token it has been granted has a physical slot."""
        if self._period is not None:
            self.kv.settle_blocks(request, self._owed_slots(request) // self.kv.block_size)

    # --- KV growth -----------------------------------------------------------------------------
    def blocks_due(self, tick: int) -> int:
        """New blocks the members need to process their token at ``tick``."""
        if self._period is not None:
            return self._due_count[tick % self._period]
        return sum(self.kv.blocks_needed(r, r._computed_offset + tick) for r in self._due_members(tick))

    def due_members(self, tick: int) -> list[Request]:
        """Members that outgrow their slots at ``tick`` (managers without periodic growth only)."""
        assert self._period is None, "paged growth is counted, not listed"
        return self._due_members(tick)

    def _due_members(self, tick: int) -> list[Request]:
        return [r for r, epoch in self._due.get(tick, ()) if r.cohort is self and r.cohort_epoch == epoch]

    def try_grow(self, tick: int) -> bool:
        """Reserve the KV the members need at ``tick``, or change nothing and return False when the
        free blocks are too few."""
        if tick <= self._grown_through:
            return True
        if self._period is not None:
            due = self._due_count[tick % self._period]
            if due and not self.kv.reserve_blocks(due):  # most ticks need no new block
                return False
        else:
            if self.blocks_due(tick) > self.kv.num_free_blocks:
                return False
            self._grow_calendar(tick)
        self._grown_through = tick
        return True

    def skip_growth(self) -> None:
        """The scheduled step did not advance the cohort: drop the growth mark of its tick.

        NOTE: only an empty cohort's (zero-block) reservation is dropped: a non-empty cohort that
        reserved growth is always advanced.
        """
        if self._grown_through > self.ticks:
            assert not self.members or self.blocks_due(self._grown_through) == 0
            self._grown_through = self.ticks

    def grow_through(self, last_tick: int) -> list[int]:
        """Reserve the growth of every tick after the last grown one up to ``last_tick``; returns the
        blocks reserved per tick (``last_tick - previous`` of them).

        NOTE: the caller has proved the room exists (``memory_horizon``).
        """
        first = self._grown_through + 1
        if self._period is not None:
            counts, period = self._due_count, self._period
            # Tick t needs counts[t % period]: the counts from first's residue on, cycled (list
            # operations in C rather than a Python loop per tick).
            start, num_ticks = first % period, last_tick + 1 - first
            per_tick = ((counts[start:] + counts[:start]) * -(-num_ticks // period))[:num_ticks]
            done = self.kv.reserve_blocks(sum(per_tick))
            assert done, "no room to grow the cohort"
        else:
            per_tick = [self._grow_calendar(tick) for tick in range(first, last_tick + 1)]
        self._grown_through = max(self._grown_through, last_tick)
        return per_tick

    def _grow_calendar(self, tick: int) -> int:
        members = self._due_members(tick)
        self._due.pop(tick, None)
        before = self.kv.num_free_blocks
        for r in members:
            done = self.kv.allocate_slots(r, r._computed_offset + tick)
            assert done, f"no room to grow {r}"
            due = self.kv.num_slots(r) - r._computed_offset + 1
            self._due.setdefault(due, []).append((r, r.cohort_epoch))
        return before - self.kv.num_free_blocks

    def memory_horizon(self, first_tick: int, free_blocks: int, limit: int) -> int:
        """How many consecutive ticks from ``first_tick`` can grow within ``free_blocks`` (<= limit).

        Paged growth is periodic: the need over k ticks follows from one period of residue counts.
        Other managers stop before the first tick at which a member outgrows its reservation.
        """
        period = self._period
        if period is None:
            upcoming = [t for t in self._due if t >= first_tick]
            return min(limit, min(upcoming) - first_tick) if upcoming else limit
        # NOTE: every member is in exactly one residue class, so a period needs len(members) blocks.
        per_period = len(self.members)
        if per_period * -(-limit // period) <= free_blocks:
            return limit  # the common case: room for whole periods covering the limit
        counts = [self._due_count[(first_tick + i) % period] for i in range(period)]
        full, remaining = divmod(free_blocks, per_period)
        extra = 0
        for count in counts:
            if count > remaining:
                break
            remaining -= count
            extra += 1
        return min(limit, full * period + extra)

    # --- time ------------------------------------------------------------------------------------
    def advance(self, end_times: Sequence[float]) -> None:
        """Advance ``len(end_times)`` ticks that ended at those times."""
        k = len(end_times)
        assert self._grown_through >= self.ticks + k, "ticks advanced without reserving their growth"
        self._times.extend(end_times)
        self.ticks += k
        self.kv_tokens += len(self.members) * k

    def check_integrity(self) -> None:
        """The members' KV adds up to ``kv_tokens``; owed blocks equal the growth reserved for members
        and not yet given block ids."""
        assert self.kv_tokens == sum(r.num_computed_tokens for r in self.members), self.kv_tokens
        if self._period is None:
            return
        owed = sum(self._owed_slots(r) for r in self.members) // self.kv.block_size
        assert owed == self.kv._owed_blocks, (owed, self.kv._owed_blocks)
        assert sum(self._due_count) == len(self.members)


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

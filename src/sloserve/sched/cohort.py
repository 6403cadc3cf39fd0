"""The decode cohort: running decode requests that all process one token per cohort step.

vLLM, Sarathi-Serve and ORCA put every running decode request into every decode step, so the
cohort advances as a whole. Its members' counters are derived lazily from ``ticks`` (see
core/request.py), KV growth is a calendar of the ticks at which a member needs a new block, and token
times are the ticks' end times. One step therefore costs O(1) plus O(members that need a block),
not O(batch): this is what lets the simulator run 10k+ requests per second.
"""

from __future__ import annotations

import math

import numpy as np

from sloserve.core.request import Request
from sloserve.kv.manager import KVCacheManager


class DecodeCohort:
    """Members advance together: ``advance`` gives each one output token per tick."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.ticks = 0
        self.members: dict[Request, None] = {}  # insertion-ordered
        self._offset_sum = 0  # sum of members' _computed_offset
        self._tick_end = np.full(1024, math.nan)  # (ticks,) end time of tick k at index k
        self._tick_gap = np.full(1024, math.nan)  # (ticks,) end of tick k minus end of tick k - 1
        # tick -> (member, epoch) pairs that need more KV slots to process their token at that tick.
        # NOTE: entries of members that left (epoch changed) are stale and skipped.
        self._due: dict[int, list[tuple[Request, int]]] = {}

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, request: Request) -> bool:
        return request.cohort is self

    @property
    def kv_tokens(self) -> int:
        """Sum of members' num_computed_tokens: the KV decode attention reads next tick."""
        return self._offset_sum + len(self.members) * self.ticks

    # --- membership ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Join: from the next tick on, ``request`` processes one token per tick.

        NOTE: a request added while a step is being scheduled must already hold a slot for its next
        token (the calendar for that tick has been processed).
        """
        assert request.cohort is None and not request.is_prefill, request
        t = self.ticks
        request._computed_offset -= t
        request._output_offset -= t
        request.cohort = self
        request.cohort_join_tick = t
        request.cohort_epoch += 1
        self.members[request] = None
        self._offset_sum += request._computed_offset
        self._register_due(request)

    def remove(self, request: Request) -> None:
        """Leave (finish or preemption): record the tokens produced while a member."""
        assert request.cohort is self, request
        del self.members[request]
        self._offset_sum -= request._computed_offset
        joined, now = request.cohort_join_tick, self.ticks
        if now > joined:
            # Its tokens came at the end of ticks joined+1..now; the gaps inside the run are the
            # tick gaps of ticks joined+2..now.
            inner_gap = float(self._tick_gap[joined + 2 : now + 1].max()) if now - joined >= 2 else math.nan
            request.record_token_run(float(self._tick_end[joined + 1]), float(self._tick_end[now]), inner_gap)
        request._computed_offset += now
        request._output_offset += now
        request.cohort = None

    # --- KV growth calendar ----------------------------------------------------------------------
    def _register_due(self, request: Request) -> None:
        # At tick t a member processes the token at position offset + t - 1, so it needs
        # num_slots >= offset + t: it is due at the first tick where that fails.
        due_tick = self.kv.num_slots(request) - request._computed_offset + 1
        self._due.setdefault(due_tick, []).append((request, request.cohort_epoch))

    def due_members(self, tick: int) -> list[Request]:
        """Members that need more slots to process their token at ``tick``."""
        return [
            r for r, epoch in self._due.get(tick, ()) if r.cohort is self and r.cohort_epoch == epoch
        ]

    def try_grow(self, tick: int) -> bool:
        """Allocate the slots the members due at ``tick`` need, or change nothing and return False
        when the free blocks are too few."""
        members = self.due_members(tick)
        if self.kv.growth_period is not None:  # paged: one block each
            need = len(members)
        else:
            need = sum(self.kv.blocks_needed(r, r._computed_offset + tick) for r in members)
        if need > self.kv.num_free_blocks:
            return False
        self._grow(tick, members)
        return True

    def grow_due(self, tick: int) -> int:
        """Allocate the slots the members due at ``tick`` need; returns blocks allocated.

        NOTE: the caller has proved the room exists (``memory_horizon``).
        """
        if tick not in self._due:
            return 0
        return self._grow(tick, self.due_members(tick))

    def _grow(self, tick: int, members: list[Request]) -> int:
        self._due.pop(tick, None)
        if not members:
            return 0
        period = self.kv.growth_period
        if period is not None:
            # Paged: one block each, and each is due again one period later.
            assert self.kv.append_block_each(members), f"no room to grow the cohort at tick {tick}"
            self._due.setdefault(tick + period, []).extend((r, r.cohort_epoch) for r in members)
            return len(members)
        before = self.kv.num_free_blocks
        for r in members:
            ok = self.kv.allocate_slots(r, r._computed_offset + tick)
            assert ok, f"no room to grow {r} at tick {tick}"
            self._register_due(r)
        return before - self.kv.num_free_blocks

    def memory_horizon(self, first_tick: int, free_blocks: int, limit: int) -> int:
        """How many consecutive ticks from ``first_tick`` can grow within ``free_blocks`` (<= limit).

        Paged growth is periodic: a member due at tick t is due again at t + block_size, needing one
        block each time, so the need over k ticks is counted from one period of the calendar. Other
        managers stop before the first due tick. Stale calendar entries are counted as needs, which
        only makes the horizon shorter (safe).
        """
        period = self.kv.growth_period
        due = self._due
        if period is None:
            upcoming = [t for t in due if t >= first_tick]
            return min(limit, min(upcoming) - first_tick) if upcoming else limit
        counts = [len(due.get(first_tick + i, ())) for i in range(period)]
        per_period = sum(counts)
        if per_period == 0:
            return limit
        full, remaining = divmod(free_blocks, per_period)
        extra = 0
        for count in counts:
            if count > remaining:
                break
            remaining -= count
            extra += 1
        return min(limit, full * period + extra)

    # --- time ------------------------------------------------------------------------------------
    def advance(self, end_times: np.ndarray) -> None:
        """Advance ``len(end_times)`` ticks that ended at those times."""
        k, t = len(end_times), self.ticks
        if t + k + 1 > len(self._tick_end):
            size = max(t + k + 1, 2 * len(self._tick_end))
            for name in ("_tick_end", "_tick_gap"):
                grown = np.full(size, math.nan)
                grown[: t + 1] = getattr(self, name)[: t + 1]
                setattr(self, name, grown)
        ends = self._tick_end
        ends[t + 1 : t + 1 + k] = end_times
        self._tick_gap[t + 1 : t + 1 + k] = ends[t + 1 : t + 1 + k] - ends[t : t + k]
        self.ticks = t + k

"""The decode cohort's KV growth: running decodes that process one token per tick need new slots.

A ``Cohort`` (sched/lockstep.py) advances its members' counters in O(1) per tick. ``DecodeCohort`` adds
what the scheduler needs on top: reserving the KV its members grow into, also in O(1) per tick:

- paged managers (one block every block_size tokens): a member needs a new block every block_size
  ticks, at ticks of one residue class modulo block_size, so the cohort keeps the members of each
  class and reserves blocks by their count; a member's block ids are assigned when it leaves
  (``settle``) or when the engine reads the members' slots (``settle_all``: only the classes whose
  ticks were grown since it last did, about one member in block_size a step).
- other managers (reservations): a calendar of the tick at which each member outgrows its
  reservation, grown through ``KVCacheManager.allocate_slots``.

One step therefore costs O(1), not O(batch): this is what lets the simulator run thousands of
requests per wall second.
"""

from __future__ import annotations

from collections.abc import Sequence

from sloserve.core.request import Request
from sloserve.kv.manager import KVCacheManager
from sloserve.sched.lockstep import Cohort


class DecodeCohort(Cohort):
    """A cohort whose members' KV growth is reserved tick by tick from a ``KVCacheManager``."""

    def __init__(self, kv: KVCacheManager) -> None:
        super().__init__()
        self.kv = kv
        # member -> first tick at which it needs a new block
        self._first_due: dict[Request, int] = {}
        self._grown_through = 0  # last tick whose KV growth has been reserved
        self._period = kv.growth_period
        # Paged: the members due at ticks t with t % period == r, per residue r
        self._due_class: list[dict[Request, None]] = [{} for _ in range(self._period or 1)]
        # Paged: every member has the block ids of its growth through this tick (settle_all)
        # NOTE: <= _grown_through; a member owes blocks only for ticks of its class after it.
        self._settled_through = 0
        # Other managers: tick -> (member, epoch) pairs that outgrow their slots at that tick.
        # NOTE: entries of members that left (epoch changed) are stale and skipped.
        self._due: dict[int, list[tuple[Request, int]]] = {}

    # --- membership ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Join: from the next tick on, ``request`` processes one token per tick.

        NOTE: a request added while a step is being scheduled must already hold a slot for its next
        token (that tick's growth has been reserved).
        """
        super().add(request)
        # At tick u a member processes the token at position offset + u - 1, so it needs
        # num_slots >= offset + u: it is first due at the first tick where that fails.
        first_due = self.kv.num_slots(request) - request.computed_offset + 1
        # NOTE: residue counting needs the first due tick within one period after the growth mark.
        assert 0 < first_due - self._grown_through <= (self._period or first_due), request
        self._first_due[request] = first_due
        if self._period is not None:
            self._due_class[first_due % self._period][request] = None
        else:
            self._due.setdefault(first_due, []).append((request, request.cohort_epoch))

    def remove(self, request: Request, *, drop_kv: bool = False) -> None:
        """Leave (finish or preemption): record the tokens produced while a member, and take the
        block ids of its reserved growth, or with ``drop_kv`` (its KV is about to be freed, and no
        prefix cache keeps it) give the reserved growth back by count."""
        assert request.cohort is self, request
        # NOTE: with prefix caching the growth gets its block ids even when freed next: the blocks of
        # its answer are cached (a conversation's next turn resends them).
        if drop_kv and self._period is not None and self.kv.prefix_cache is None:
            self.kv.release_owed_blocks(self._owed_slots(request) // self.kv.block_size)
        else:
            self.settle(request)
        first_due = self._first_due.pop(request)
        if self._period is not None:
            del self._due_class[first_due % self._period][request]
        super().remove(request)

    def granted_slots(self, request: Request) -> int:
        """Slots a member holds, counting growth reserved for it but not yet given block ids."""
        return self.kv.num_slots(request) + self._owed_slots(request)

    def _owed_slots(self, request: Request) -> int:
        """Slots of the growth reserved for a member and not yet given block ids (paged; else 0)."""
        first_due = self._first_due[request]
        if self._period is None or self._grown_through < first_due:
            return 0
        entitled = (self._grown_through - first_due) // self._period + 1
        granted = first_due - 1 + request.computed_offset + entitled * self._period
        return granted - self.kv.num_slots(request)

    def settle(self, request: Request) -> None:
        """Give a member the block ids of the growth reserved for it so far (paged), so that every
        token it has been granted has a physical slot."""
        if self._period is not None:
            self.kv.settle_blocks(request, self._owed_slots(request) // self.kv.block_size)

    def settle_all(self) -> None:
        """``settle`` every member that owes blocks: those of the residue classes of the ticks grown
        since the last call (all of them after a period or more)."""
        period, grown = self._period, self._grown_through
        if period is None or grown <= self._settled_through:
            return
        ticks = range(self._settled_through + 1, grown + 1)
        for residue in range(period) if len(ticks) >= period else (t % period for t in ticks):
            for member in self._due_class[residue]:
                self.settle(member)
        self._settled_through = grown

    # --- KV growth -----------------------------------------------------------------------------
    def blocks_due(self, tick: int) -> int:
        """New blocks the members need to process their token at ``tick``."""
        if self._period is not None:
            return len(self._due_class[tick % self._period])
        return sum(self.kv.blocks_needed(r, r.computed_offset + tick) for r in self._due_members(tick))

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
            due = len(self._due_class[tick % self._period])
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
            self._settled_through = min(self._settled_through, self.ticks)

    def grow_through(self, last_tick: int) -> list[int]:
        """Reserve the growth of every tick after the last grown one up to ``last_tick``; returns the
        blocks reserved per tick (``last_tick - previous`` of them).

        NOTE: the caller has proved the room exists (``memory_horizon``).
        """
        first = self._grown_through + 1
        if self._period is not None:
            counts, period = [len(c) for c in self._due_class], self._period
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
            done = self.kv.allocate_slots(r, r.computed_offset + tick)
            assert done, f"no room to grow {r}"
            due = self.kv.num_slots(r) - r.computed_offset + 1
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
        counts = [len(self._due_class[(first_tick + i) % period]) for i in range(period)]
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
        assert self._grown_through >= self.ticks + len(end_times), "ticks advanced without reserving their growth"
        super().advance(end_times)

    def check_integrity(self) -> None:
        """As ``Cohort``'s, and owed blocks equal the growth reserved for members and not yet given
        block ids."""
        super().check_integrity()
        assert self._first_due.keys() == self.members.keys()
        if self._period is None:
            return
        owed = sum(self._owed_slots(r) for r in self.members) // self.kv.block_size
        assert owed == self.kv._owed_blocks, (owed, self.kv._owed_blocks)
        assert sum(len(c) for c in self._due_class) == len(self.members)
        assert all(r in self._due_class[due % self._period] for r, due in self._first_due.items())
        assert self._settled_through <= self._grown_through
        # a member owes blocks only for ticks of its class grown after the last settle_all
        for r, due in self._first_due.items():
            if self._owed_slots(r) >= self.kv.block_size:
                last_due = due + (self._grown_through - due) // self._period * self._period
                assert last_due > self._settled_through, (r, due, self._settled_through)

"""EconoServe §3.4 prompt and generation task ordering: the PT and GT waiting queues.

A task (a prompt task waiting for its prefill, or a generation task waiting for its KV region) is
ordered by three factors, each in magnitude ranges:

    1. deadline: ascending, by range of the time left (defaults: < 0.5 s, 0.5-2 s, > 2 s, the paper's
       example ranges; overdue tasks fall in the first),
    2. occupied KV: descending, by range (default width 128 tokens; the paper gives no ranges for it,
       we use the width of its example RL ranges), so tasks holding KV release it sooner (O5),
    3. length: descending (the predicted RL of a GT, the prompt length of a PT), so the queue yields
       long tasks first and a binary search finds one that fills what is left.

The deadline ranges move with the clock: a task moves to a more urgent range when its deadline comes
close (each task moves at most twice; ``advance``). Insertion, removal and the fitting search cost
O(log n), so a queue of 10,000 tasks costs a step microseconds, not a sort. A task waits for the
next bound it will pass on a timing wheel (slots of 1/32 s of deadline): a step reads the slots
the bound passed since the last step, so a move costs O(1) to find. A moved task's old entry is
left behind, stale, and skipped (or dropped) when a selection meets it; a range read when more than
half stale (or left unread until 7/8 stale) is rebuilt (O(n) on presorted entries). The moved
task's sorted insertion waits in the range's pending list until a selection reads the range:
selections rarely get past the most urgent range, so a task that moves on before its middle range
is read never costs a sorted insertion there, and a lower bound on each range's lengths lets
``first_fit`` pass over a range holding nothing short enough unread.

An entry is one integer that sorts as its key tuple would (fields in fixed-width bit ranges), so
the sorted lists compare machine integers, not tuples. After 10,000 arrivals at once most tasks
move within seconds (benchmarks/econoserve_sched.py's first window), and what a move costs is
then most of what scheduling costs.

Without ordering (the -D and -SD variants) a queue is FCFS, or grouped: tasks of equal length form a
group, groups in the order they formed (time-synced GT groups, §3.3.2).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from typing import Literal

from sortedcontainers import SortedList

from sloserve.core.request import Request

QueueOrder = Literal["ordered", "grouped", "fcfs"]

# Entry layout: [field 2][field 1][seq], SEQ_BITS each for seq and field 1. Ordered queues: field 2 =
# BIAS - occupied-KV range, field 1 = BIAS - length (both descending); grouped: field 1 = the group's
# seq; FCFS: seq alone. seq, unique per add, names the task (entry & SEQ_MASK).
SEQ_BITS = 40
SEQ_MASK = (1 << SEQ_BITS) - 1
BIAS = 1 << (SEQ_BITS - 1)  # lengths and KV ranges below this keep the fields non-negative
# Width of a slot of the timing wheels on which tasks wait to pass a deadline-range bound: narrower
# slots mean more slots read per step, wider ones more tasks rechecked in the slot a bound is in.
# Replaying the queue operations of benchmarks/econoserve_sched.py's burst (instructions per step,
# cachegrind), 1/8 .. 1/256 s: 376k, 361k, 357k, 361k, 374k, 389k; a power of 2 keeps the slot of a
# deadline exact.
WHEEL_SLOT_S = 1 / 32


class TaskQueue:
    """A PT or GT queue. ``add(request, deadline, occupied_kv_tokens, length)``; ``first()`` and
    iteration follow the queue's order; ``first_fit(room)`` is the first task, in order of deadline
    and occupied-KV range, whose length is at most ``room``; ``largest_at_most(n)`` is the task of
    largest length <= n (KV-cache pipelining looks up hosted GTs with it; ``lookup_by_length=False``
    saves keeping the index it needs).
    """

    def __init__(
        self,
        order: QueueOrder = "ordered",
        deadline_ranges_s: tuple[float, ...] = (0.5, 2.0),
        kv_range_tokens: int = 128,
        lookup_by_length: bool = True,
    ) -> None:
        self.order = order
        self.deadline_ranges_s = deadline_ranges_s if order == "ordered" else ()
        self.kv_range_tokens = kv_range_tokens
        # One sorted list of entries per deadline range.
        self._buckets = [SortedList() for _ in range(len(self.deadline_ranges_s) + 1)]
        self._entries: dict[Request, int] = {}  # request -> its entry
        self._task: dict[int, Request] = {}  # seq -> request
        # NOTE: an entry in bucket b is live iff _range[its seq] == b; the others (left behind by
        # advance) are counted in _stale and never returned.
        self._range: list[int] = []  # seq -> the deadline range it is in (-1: removed)
        # Entries moved into a range by advance, not yet inserted in its sorted list (_merge).
        self._pending: list[list[tuple[float, int, int, int]]] = [[] for _ in self._buckets]  # wheel items
        # NOTE: _stale[b] counts the stale entries of range b, in its sorted list and pending list.
        self._stale = [0] * len(self._buckets)
        # A lower bound on the length of every live task in each range (exact after a rebuild),
        # the first _pending_folded[b] pending entries of range b included.
        self._min_length = [BIAS] * len(self._buckets)
        self._pending_folded = [0] * len(self._buckets)
        self._length: dict[Request, int] = {}
        # Per range bound r, the tasks of range r + 1 (the bound they pass next) on a timing wheel:
        # slot k holds the (deadline, seq, entry, length) of those with deadline // WHEEL_SLOT_S == k,
        # and a min-heap the slots that hold any. NOTE: an item whose task was removed is dropped when
        # its slot is read; each task has at most one live item.
        self._wheel: list[dict[int, list[tuple[float, int, int, int]]]] = [{} for _ in self.deadline_ranges_s]
        self._wheel_slots: list[list[int]] = [[] for _ in self.deadline_ranges_s]
        self._by_length = SortedList() if lookup_by_length else None  # length << SEQ_BITS | seq
        self._groups: dict[int, list[int]] = {}  # length -> [group seq, members] (grouped order)
        self._seq = 0
        self._now = -math.inf

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, request: Request) -> bool:
        return request in self._entries

    def __iter__(self) -> Iterator[Request]:
        """Tasks in queue order (do not add or remove while iterating)."""
        where, task = self._range, self._task
        for b in range(len(self._buckets)):
            bucket = self._merge(b)
            for entry in bucket:
                if where[entry & SEQ_MASK] == b:
                    yield task[entry & SEQ_MASK]

    def _drop_stale(self, bucket: int, index: int) -> None:
        del self._buckets[bucket][index]
        self._stale[bucket] -= 1

    def _merge(self, bucket: int) -> SortedList:
        """Range ``bucket``'s sorted list, ready to read: its live pending entries inserted, or rebuilt
        when more than half of it is stale."""
        pending, stale = self._pending[bucket], self._stale[bucket]
        if stale > 64 and 2 * stale > len(self._buckets[bucket]) + len(pending):
            self._rebuild(bucket)
        elif pending:
            where = self._range
            live = [item[2] for item in pending if where[item[1]] == bucket]
            self._stale[bucket] -= len(pending) - len(live)
            self._pending_lengths_bound(bucket)
            self._pending[bucket] = []
            self._pending_folded[bucket] = 0
            self._buckets[bucket].update(live)
        return self._buckets[bucket]

    def _pending_lengths_bound(self, bucket: int) -> int:
        """A lower bound on the lengths of range ``bucket``'s live tasks, pending ones included."""
        pending, folded = self._pending[bucket], self._pending_folded[bucket]
        if folded < len(pending):
            shortest = min([item[3] for item in pending[folded:]])
            self._min_length[bucket] = min(self._min_length[bucket], shortest)
            self._pending_folded[bucket] = len(pending)
        return self._min_length[bucket]

    def _rebuild(self, bucket: int) -> None:
        """Drop every stale entry of ``bucket`` (O(n)); its length bound becomes exact."""
        where = self._range
        live = [e for e in self._buckets[bucket] if where[e & SEQ_MASK] == bucket]
        live += [item[2] for item in self._pending[bucket] if where[item[1]] == bucket]
        self._buckets[bucket] = SortedList(live)
        self._pending[bucket] = []
        self._pending_folded[bucket] = 0
        self._stale[bucket] = 0
        # NOTE: only ordered queues have several ranges (and stale entries): lengths are in the entries.
        self._min_length[bucket] = BIAS - max((e >> SEQ_BITS & SEQ_MASK for e in live), default=0)

    def length(self, request: Request) -> int:
        return self._length[request]

    # --- membership ----------------------------------------------------------------------------
    def _bucket_of(self, deadline: float) -> int:
        left = deadline - self._now
        for i, bound in enumerate(self.deadline_ranges_s):
            if left < bound:
                return i
        return len(self.deadline_ranges_s)

    def _entry(self, occupied_kv_tokens: int, length: int, seq: int) -> int:
        if self.order == "ordered":
            kv_range = occupied_kv_tokens // self.kv_range_tokens
            return (BIAS - kv_range) << (2 * SEQ_BITS) | (BIAS - length) << SEQ_BITS | seq
        if self.order == "grouped":
            group = self._groups.setdefault(length, [seq, 0])
            group[1] += 1
            return group[0] << SEQ_BITS | seq
        return seq

    def add(self, request: Request, deadline: float, occupied_kv_tokens: int, length: int) -> None:
        """Queue ``request``: ``deadline`` absolute (seconds), ``occupied_kv_tokens`` the KV it holds,
        ``length`` its predicted RL (GT) or prompt length (PT)."""
        assert request not in self._entries, f"{request} is queued twice"
        assert 0 <= length < BIAS and 0 <= occupied_kv_tokens < BIAS * self.kv_range_tokens, request
        seq = self._seq
        self._seq += 1
        entry = self._entry(occupied_kv_tokens, length, seq)
        bucket = self._bucket_of(deadline)
        self._buckets[bucket].add(entry)
        self._entries[request] = entry
        self._task[seq] = request
        self._range.append(bucket)  # NOTE: at index seq: seqs are 0, 1, 2, ...
        self._length[request] = length
        if length < self._min_length[bucket]:
            self._min_length[bucket] = length
        if self._by_length is not None:
            self._by_length.add(length << SEQ_BITS | seq)
        if bucket > 0:
            self._on_wheel(bucket - 1, int(deadline // WHEEL_SLOT_S), [(deadline, seq, entry, length)])

    def remove(self, request: Request) -> None:
        entry = self._entries.pop(request)
        seq = entry & SEQ_MASK
        del self._task[seq]
        bucket = self._range[seq]
        self._range[seq] = -1
        if self._pending[bucket]:
            self._stale[bucket] += 1  # it may be pending: left to _merge (or a rebuild) to drop
        else:
            self._buckets[bucket].remove(entry)
        length = self._length.pop(request)
        if self._by_length is not None:
            self._by_length.remove(length << SEQ_BITS | seq)
        if self.order == "grouped":
            group = self._groups[length]
            group[1] -= 1
            if group[1] == 0 and group[0] == entry >> SEQ_BITS:
                del self._groups[length]

    def _on_wheel(self, bound: int, slot: int, items: list[tuple[float, int, int, int]]) -> None:
        """Put ``items`` (deadline, seq, entry, length), all of ``slot``, on the wheel of range bound
        ``bound``."""
        wheel = self._wheel[bound]
        tasks = wheel.get(slot)
        if tasks is None:
            wheel[slot] = items
            heapq.heappush(self._wheel_slots[bound], slot)
        else:
            tasks.extend(items)

    def advance(self, now: float) -> None:
        """Move tasks whose deadline came close to their more urgent range."""
        if now <= self._now:
            return
        self._now = now
        where, stale = self._range, self._stale
        # Least urgent bound first: a task that passed two bounds since the last step moves twice.
        for r in range(len(self.deadline_ranges_s) - 1, -1, -1):
            bound, wheel, slots = self.deadline_ranges_s[r], self._wheel[r], self._wheel_slots[r]
            # Slots up to the one of now + bound. NOTE: the test below (the one of _bucket_of,
            # monotone in the deadline) may differ from deadline < now + bound by a rounding: when
            # now + bound is that close to the next slot, that slot is read too. (A slot holds
            # deadlines d with floor(d / WHEEL_SLOT_S) == slot, exactly: the width is a power of 2.)
            limit = now + bound
            last = int(limit // WHEEL_SLOT_S)
            if (last + 1) * WHEEL_SLOT_S - limit <= 4 * math.ulp(limit):
                last += 1
            if not slots or slots[0] > last:
                continue
            pending, source = self._pending[r], r + 1
            num_moved = len(pending)
            # Slots before the last one lie wholly before now + bound - (a margin for roundings):
            # every task in them passed.
            whole = last - 1 if limit - last * WHEEL_SLOT_S <= 4 * math.ulp(limit) else last
            while slots and slots[0] <= last:
                slot = slots[0]
                items = wheel[slot]
                waiting: list[tuple[float, int, int, int]] = []
                if slot < whole:
                    moved = [item for item in items if where[item[1]] == source]  # else removed
                else:
                    moved = []
                    for item in items:
                        if not item[0] - now < bound:
                            waiting.append(item)
                        elif where[item[1]] == source:
                            moved.append(item)
                for item in moved:
                    where[item[1]] = r
                pending.extend(moved)
                if r > 0 and moved:
                    self._on_wheel(r - 1, slot, moved)  # the same slot: it is the deadline's
                if waiting:
                    wheel[slot] = waiting
                    break  # later slots hold later deadlines: none passes
                del wheel[slot]
                heapq.heappop(slots)
            stale[source] += len(pending) - num_moved  # their entries stay in the source range, stale
        # NOTE: ranges are rebuilt when read more than half stale (_merge); one that is not read
        # (the least urgent, after a burst) is rebuilt when 7/8 stale, which bounds its memory.
        for b, count in enumerate(stale):
            if count > 64 and 8 * count > 7 * (len(self._buckets[b]) + len(self._pending[b])):
                self._rebuild(b)

    def next_move_time(self) -> float:
        """The earliest step start at which ``advance`` may move a task to a more urgent range (inf: no
        task will move): before it the queue's order changes only by adds and removes. Each wheel's
        first slot holds its earliest deadline (stale items of removed tasks only make this earlier)."""
        soonest = math.inf
        for bound, wheel, slots in zip(self.deadline_ranges_s, self._wheel, self._wheel_slots, strict=True):
            if slots:
                deadline = min(item[0] for item in wheel[slots[0]])
                # NOTE: a task moves once deadline - now < bound; the margin covers that test's rounding
                soonest = min(soonest, deadline - bound - 8 * math.ulp(deadline))
        return soonest

    # --- selection -------------------------------------------------------------------------------
    def first(self) -> Request | None:
        where = self._range
        for b in range(len(self._buckets)):
            bucket = self._merge(b)
            while bucket:
                seq = bucket[0] & SEQ_MASK
                if where[seq] == b:
                    return self._task[seq]
                self._drop_stale(b, 0)
        return None

    def first_fit(self, room: int) -> Request | None:
        """The first task, in queue order of deadline range and then occupied-KV range, whose length
        is at most ``room``: within a range of both, the longest that fits (binary search)."""
        if self.order != "ordered":
            return next((r for r in self if self._length[r] <= room), None)
        if room < 0:
            return None
        where, length_field = self._range, max(BIAS - room, 0) << SEQ_BITS
        for b in range(len(self._buckets)):
            if self._pending_lengths_bound(b) > room:
                continue  # nothing in range b is short enough
            bucket = self._merge(b)
            # NOTE: by value (irange), not by position: positional access makes the sorted lists
            # keep a positional index up to date on every insertion and deletion.
            head = bucket[0] if bucket else None
            while head is not None:
                # Entries of one occupied-KV range lie in [start, end), longest first.
                start = head >> (2 * SEQ_BITS) << (2 * SEQ_BITS)
                end = start + (1 << (2 * SEQ_BITS))
                stale = []
                for entry in bucket.irange(start | length_field, end, inclusive=(True, False)):
                    seq = entry & SEQ_MASK
                    if where[seq] == b:
                        break
                    stale.append(entry)
                else:
                    seq = -1
                for entry in stale:
                    bucket.remove(entry)
                self._stale[b] -= len(stale)
                if seq >= 0:
                    return self._task[seq]
                head = next(bucket.irange(end), None)  # the next (smaller) occupied-KV range
        return None

    def largest_at_most(self, length: int) -> Request | None:
        """The queued task of largest length <= ``length`` (the earliest queued among equals)."""
        by_length = self._by_length
        assert by_length is not None, "a queue made with lookup_by_length=False"
        below = next(by_length.irange(maximum=(length + 1) << SEQ_BITS, inclusive=(True, False), reverse=True), None)
        if below is None:
            return None
        best = below >> SEQ_BITS
        return self._task[next(by_length.irange(best << SEQ_BITS)) & SEQ_MASK]

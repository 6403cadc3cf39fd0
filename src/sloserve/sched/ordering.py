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
O(log n), so a queue of 10,000 tasks costs a step microseconds, not a sort. The ranges are
consecutive slices of one deadline-sorted list, so the tasks a step moves are the slice from
where a range's bound fell at the last step to where it falls now. A moved task's old entry is
left behind, stale, and skipped (or dropped) when a selection meets it; a range that is more than
half stale is rebuilt at once (O(n) on presorted entries), so moves cost one insertion each.

An entry is one integer that sorts as its key tuple would (fields in fixed-width bit ranges), so
the sorted lists compare machine integers, not tuples. After 10,000 arrivals at once most tasks
move within seconds (benchmarks/econoserve_sched.py's first window), and what a move costs is
then most of what scheduling costs.

Without ordering (the -D and -SD variants) a queue is FCFS, or grouped: tasks of equal length form a
group, groups in the order they formed (time-synced GT groups, §3.3.2).
"""

from __future__ import annotations

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


class TaskQueue:
    """A PT or GT queue. ``add(request, deadline, occupied_kv_tokens, length)``; ``first()`` and
    iteration follow the queue's order; ``first_fit(room)`` is the first task, in order of deadline
    and occupied-KV range, whose length is at most ``room``; ``largest_at_most(n)`` is the task of
    largest length <= n (KV-cache pipelining looks up hosted GTs with it).
    """

    def __init__(self, order: QueueOrder = "ordered", deadline_ranges_s: tuple[float, ...] = (0.5, 2.0),
                 kv_range_tokens: int = 128) -> None:  # fmt: skip
        self.order = order
        self.deadline_ranges_s = deadline_ranges_s if order == "ordered" else ()
        self.kv_range_tokens = kv_range_tokens
        # One sorted list of entries per deadline range.
        self._buckets = [SortedList() for _ in range(len(self.deadline_ranges_s) + 1)]
        self._entries: dict[Request, int] = {}  # request -> its entry
        self._task: dict[int, Request] = {}  # seq -> request
        # NOTE: an entry in bucket b is live iff _range[its seq] == b; the others (left behind by
        # advance) are counted in _stale and never returned.
        self._range: dict[int, int] = {}  # seq -> the deadline range it is in
        self._stale = [0] * len(self._buckets)
        self._length: dict[Request, int] = {}
        # (deadline, entry) of every task, by deadline. NOTE: every task's range is classified
        # against _now and the test is monotone in the deadline, so the ranges are consecutive
        # slices of this list, the most urgent first.
        self._by_deadline = SortedList()
        self._deadline: dict[Request, float] = {}
        # Per range bound: the last (deadline, entry) found under it (tasks up to it were checked).
        self._passed: list[tuple[float, int] | None] = [None] * len(self.deadline_ranges_s)
        self._by_length = SortedList()  # length << SEQ_BITS | seq
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
        for b, bucket in enumerate(self._buckets):
            for entry in bucket:
                if where.get(entry & SEQ_MASK) == b:
                    yield task[entry & SEQ_MASK]

    def _drop_stale(self, bucket: int, index: int) -> None:
        del self._buckets[bucket][index]
        self._stale[bucket] -= 1

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
        self._range[seq] = bucket
        self._length[request] = length
        self._by_length.add(length << SEQ_BITS | seq)
        if self.deadline_ranges_s:
            self._by_deadline.add((deadline, entry))
            self._deadline[request] = deadline

    def remove(self, request: Request) -> None:
        entry = self._entries.pop(request)
        seq = entry & SEQ_MASK
        del self._task[seq]
        self._buckets[self._range.pop(seq)].remove(entry)
        length = self._length.pop(request)
        self._by_length.remove(length << SEQ_BITS | seq)
        if self.deadline_ranges_s:
            self._by_deadline.remove((self._deadline.pop(request), entry))
        if self.order == "grouped":
            group = self._groups[length]
            group[1] -= 1
            if group[1] == 0 and group[0] == entry >> SEQ_BITS:
                del self._groups[length]

    def advance(self, now: float) -> None:
        """Move tasks whose deadline came close to their more urgent range."""
        if now <= self._now:
            return
        self._now = now
        where, buckets, by_deadline, passed = self._range, self._buckets, self._by_deadline, self._passed
        moved: dict[int, list[int]] = {}
        for r, bound in enumerate(self.deadline_ranges_s):
            # Tasks after the last one found under range r's bound: those now under it (the test of
            # _bucket_of) that are in a less urgent range move to r, or to a more urgent range whose
            # bound they also passed (found first).
            start = by_deadline.bisect_right(passed[r]) if passed[r] is not None else 0
            for item in by_deadline.islice(start):
                if not item[0] - now < bound:
                    break
                passed[r] = item
                seq = item[1] & SEQ_MASK
                source = where[seq]
                if source > r:
                    self._stale[source] += 1  # its entry stays in source, stale
                    where[seq] = r
                    moved.setdefault(r, []).append(item[1])
        for target, moving in moved.items():
            buckets[target].update(moving)
        for b, stale in enumerate(self._stale):
            if stale > 64 and 2 * stale > len(buckets[b]):
                buckets[b] = SortedList([e for e in buckets[b] if where.get(e & SEQ_MASK) == b])
                self._stale[b] = 0

    # --- selection -------------------------------------------------------------------------------
    def first(self) -> Request | None:
        where = self._range
        for b, bucket in enumerate(self._buckets):
            while bucket:
                seq = bucket[0] & SEQ_MASK
                if where.get(seq) == b:
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
        for b, bucket in enumerate(self._buckets):
            i = 0
            while i < len(bucket):
                # Entries of one occupied-KV range lie in [start, end), longest first.
                start = bucket[i] >> (2 * SEQ_BITS) << (2 * SEQ_BITS)
                end = start + (1 << (2 * SEQ_BITS))
                j = bucket.bisect_left(start | length_field)
                while j < len(bucket) and bucket[j] < end:
                    seq = bucket[j] & SEQ_MASK
                    if where.get(seq) == b:
                        return self._task[seq]
                    self._drop_stale(b, j)
                i = bucket.bisect_left(end)  # the next (smaller) occupied-KV range
        return None

    def largest_at_most(self, length: int) -> Request | None:
        """The queued task of largest length <= ``length`` (the earliest queued among equals)."""
        by_length = self._by_length
        i = by_length.bisect_left((length + 1) << SEQ_BITS)
        if i == 0:
            return None
        best = by_length[i - 1] >> SEQ_BITS
        return self._task[by_length[by_length.bisect_left(best << SEQ_BITS)] & SEQ_MASK]

    def max_length(self) -> int:
        """The largest queued length (0 when empty)."""
        return self._by_length[-1] >> SEQ_BITS if self._by_length else 0

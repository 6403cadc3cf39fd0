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
O(log n), so a queue of 10,000 tasks costs a step microseconds, not a sort. A moved task's old entry
is left behind, stale, and skipped (or dropped) when a selection meets it; a range that is more
than half stale is rebuilt at once (O(n) on presorted entries), so moves cost one insertion each.

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
        # One sorted list per deadline range: entries (*key, seq, request); seq is unique, so
        # requests are never compared.
        self._buckets = [SortedList() for _ in range(len(self.deadline_ranges_s) + 1)]
        self._entries: dict[Request, tuple[int, tuple]] = {}  # request -> (bucket, entry)
        # NOTE: an entry in bucket b is live iff _entries[its request] is (b, that entry); the others
        # (left behind by advance) are counted here and never returned.
        self._stale = [0] * len(self._buckets)
        self._deadline: dict[Request, float] = {}
        self._length: dict[Request, int] = {}
        # Per range after the first: (deadline, seq, request) of the tasks that will move (lazy).
        self._heaps: list[list[tuple[float, int, Request]]] = [[] for _ in self._buckets]
        self._by_length = SortedList()  # (length, seq, request)
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
        for b, bucket in enumerate(self._buckets):
            for entry in bucket:
                if self._live(b, entry):
                    yield entry[-1]

    def _live(self, bucket: int, entry: tuple) -> bool:
        placed = self._entries.get(entry[-1])
        return placed is not None and placed[0] == bucket and placed[1] is entry

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

    def _key(self, request: Request, occupied_kv_tokens: int, length: int, seq: int) -> tuple:
        if self.order == "ordered":
            return (-(occupied_kv_tokens // self.kv_range_tokens), -length, seq, request)
        if self.order == "grouped":
            group = self._groups.setdefault(length, [seq, 0])
            group[1] += 1
            return (group[0], seq, request)
        return (seq, request)

    def add(self, request: Request, deadline: float, occupied_kv_tokens: int, length: int) -> None:
        """Queue ``request``: ``deadline`` absolute (seconds), ``occupied_kv_tokens`` the KV it holds,
        ``length`` its predicted RL (GT) or prompt length (PT)."""
        assert request not in self._entries, f"{request} is queued twice"
        seq = self._seq
        self._seq += 1
        entry = self._key(request, occupied_kv_tokens, length, seq)
        bucket = self._bucket_of(deadline)
        self._buckets[bucket].add(entry)
        self._entries[request] = (bucket, entry)
        self._deadline[request] = deadline
        self._length[request] = length
        self._by_length.add((length, seq, request))
        if bucket > 0:
            heapq.heappush(self._heaps[bucket], (deadline, seq, request))

    def remove(self, request: Request) -> None:
        bucket, entry = self._entries.pop(request)
        self._buckets[bucket].remove(entry)
        length = self._length.pop(request)
        self._by_length.remove((length, entry[-2], request))
        del self._deadline[request]
        if self.order == "grouped":
            group = self._groups[length]
            group[1] -= 1
            if group[1] == 0 and group[0] == entry[0]:
                del self._groups[length]

    def advance(self, now: float) -> None:
        """Move tasks whose deadline came close to their more urgent range."""
        self._now = now
        entries, buckets, heaps = self._entries, self._buckets, self._heaps
        for bucket in range(len(buckets) - 1, 0, -1):
            heap = heaps[bucket]
            # NOTE: the same test as _bucket_of (deadline - now < bound), so a popped task always
            # leaves this range.
            bound = self.deadline_ranges_s[bucket - 1]
            if not heap or heap[0][0] - now >= bound:
                continue
            moved: dict[int, list[tuple]] = {}
            source = buckets[bucket]
            while heap and heap[0][0] - now < bound:
                deadline, seq, request = heapq.heappop(heap)
                placed = entries.get(request)
                if placed is None or placed[0] != bucket or placed[1][-2] != seq:
                    continue  # stale: removed or moved
                target = self._bucket_of(deadline)
                entry = placed[1]
                self._stale[bucket] += 1  # the entry stays in source, stale
                moved.setdefault(target, []).append(entry)
                entries[request] = (target, entry)
                if target > 0:
                    heapq.heappush(heaps[target], (deadline, seq, request))
            for target, moving in moved.items():
                buckets[target].update(moving)
            if self._stale[bucket] > 64 and 2 * self._stale[bucket] > len(source):
                buckets[bucket] = SortedList([e for e in source if self._live(bucket, e)])
                self._stale[bucket] = 0

    # --- selection -------------------------------------------------------------------------------
    def first(self) -> Request | None:
        for b, bucket in enumerate(self._buckets):
            while bucket:
                if self._live(b, bucket[0]):
                    return bucket[0][-1]
                self._drop_stale(b, 0)
        return None

    def first_fit(self, room: int) -> Request | None:
        """The first task, in queue order of deadline range and then occupied-KV range, whose length
        is at most ``room``: within a range of both, the longest that fits (binary search)."""
        if self.order != "ordered":
            return next((r for r in self if self._length[r] <= room), None)
        for b, bucket in enumerate(self._buckets):
            i = 0
            while i < len(bucket):
                kv_range = bucket[i][0]
                # Entries of this KV range run from i while entry[0] == kv_range, longest first.
                j = bucket.bisect_left((kv_range, -room))
                while j < len(bucket) and bucket[j][0] == kv_range:
                    if self._live(b, bucket[j]):
                        return bucket[j][-1]
                    self._drop_stale(b, j)
                i = bucket.bisect_left((kv_range + 1,))  # the next (smaller) occupied-KV range
        return None

    def largest_at_most(self, length: int) -> Request | None:
        """The queued task of largest length <= ``length`` (the earliest queued among equals)."""
        i = self._by_length.bisect_left((length + 1,))
        if i == 0:
            return None
        best = self._by_length[i - 1][0]
        return self._by_length[self._by_length.bisect_left((best,))][-1]

    def max_length(self) -> int:
        """The largest queued length (0 when empty)."""
        return self._by_length[-1][0] if self._by_length else 0

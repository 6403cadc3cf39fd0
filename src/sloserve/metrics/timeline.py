"""Per-step records of a run (one row per executed step)."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import numpy as np

# Column name -> dtype. One row per step.
TIMELINE_COLUMNS: dict[str, type] = {
    "start_s": np.float64,  # step start time
    "duration_s": np.float64,  # step execution time (cost model or measured)
    "num_tokens": np.int64,  # forward size: tokens processed
    "num_prefill_tokens": np.int64,  # of which prefill / chunk / refill tokens
    "num_cached_tokens": np.int64,  # prompt tokens found in the prefix cache by requests admitted
    "num_decode": np.int64,  # decode requests (one token each)
    "num_requests": np.int64,  # batch size
    "kv_used_tokens": np.int64,  # tokens holding KV after the step
    "kv_allocated_tokens": np.int64,  # token slots allocated (reserved) after the step
    "num_preempted": np.int64,  # requests preempted while forming this step
    "sched_time_s": np.float64,  # wall time spent in schedule() for this step
    "replica": np.int64,
}
# One appended row as packed bytes (native order, no padding), and the same layout as a numpy record.
_ROW_STRUCT = struct.Struct("=" + "".join("d" if dt is np.float64 else "q" for dt in TIMELINE_COLUMNS.values()))
_ROW_DTYPE = np.dtype([(name, dt) for name, dt in TIMELINE_COLUMNS.items()])
assert _ROW_DTYPE.itemsize == _ROW_STRUCT.size


class Timeline:
    """Append-only table of steps.

    ``append`` adds one row; ``extend`` adds rows given as arrays; ``append_stretch`` records a
    closed-form stretch of repeated steps by its parameters only, and all stretches are expanded into rows at
    once (vectorized) when the timeline is first read. Columns are stored in ``array.array``.
    """

    def __init__(self) -> None:
        self._cols = {name: array("d" if dt is np.float64 else "q") for name, dt in TIMELINE_COLUMNS.items()}
        # Appended rows not yet in the columns, packed (_ROW_STRUCT) one after another: one C call
        # per row converts its values exactly (appending to 11 arrays parsed each value as a call
        # argument, and buffering tuples cost their conversion later: about 2% of a run).
        self._buffer = bytearray()
        # Stretches not yet expanded, one list entry per stretch (see append_stretch).
        self._stretches: list[tuple] = []
        self._stretch_rows = 0

    def __len__(self) -> int:
        return len(self._cols["start_s"]) + len(self._buffer) // _ROW_STRUCT.size + self._stretch_rows

    def _flush_rows(self) -> None:
        """Move the appended rows into the columns."""
        if not self._buffer:
            return
        records = np.frombuffer(self._buffer, dtype=_ROW_DTYPE)
        for name, col in self._cols.items():
            col.frombytes(records[name].tobytes())
        self._buffer = bytearray()  # NOTE: a new one: `records` still views the old one

    def append(
        self,
        start_s: float,
        duration_s: float,
        num_tokens: int,
        num_prefill_tokens: int,
        num_cached_tokens: int,
        num_decode: int,
        num_requests: int,
        kv_used_tokens: int,
        kv_allocated_tokens: int,
        num_preempted: int,
        sched_time_s: float,
        replica: int = 0,
    ) -> None:
        self._buffer += _ROW_STRUCT.pack(
            start_s,
            duration_s,
            num_tokens,
            num_prefill_tokens,
            num_cached_tokens,
            num_decode,
            num_requests,
            kv_used_tokens,
            kv_allocated_tokens,
            num_preempted,
            sched_time_s,
            replica,
        )

    def append_stretch(
        self,
        start_s: float,
        end_times: Sequence[float],
        num_decode: int,
        num_prefill_tokens: int,
        num_cached_tokens: int,
        num_chunks: int,
        kv_used_before: int,
        kv_used_after: int,
        kv_allocated_before: int,
        kv_allocated_after: int,
        new_slots_per_step: Sequence[int],
        sched_time_s: float,
        replica: int = 0,
    ) -> None:
        """Record k = len(end_times) repeated steps, each of ``num_decode`` decodes and
        ``num_chunks`` prompt chunks of ``num_prefill_tokens`` tokens in all; the first step admitted
        requests that found ``num_cached_tokens`` in the prefix cache.

        Step i (0-based) ends at ``end_times[i]``; KV used after it is ``kv_used_before +
        (num_decode + num_prefill_tokens) * (i + 1)`` except after the last step (``kv_used_after``,
        when finished requests have been freed); allocated KV grows by ``new_slots_per_step`` slots
        (step 0's growth is already in ``kv_allocated_before``) and is ``kv_allocated_after`` after
        the last step.
        """
        k = len(end_times)
        self._stretches.append(
            (
                len(self),
                start_s,
                end_times,
                num_decode,
                num_prefill_tokens,
                num_cached_tokens,
                num_chunks,
                kv_used_before,
                kv_used_after,
                kv_allocated_before,
                kv_allocated_after,
                new_slots_per_step,
                sched_time_s,
                replica,
            )
        )
        self._stretch_rows += k

    def _stretch_columns(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Rows of all pending stretches: (their row positions, their columns)."""
        (
            positions,
            starts,
            ends,
            n,
            prefill,
            cached,
            chunks,
            used0,
            used1,
            alloc0,
            alloc1,
            new_slots,
            sched,
            replica,
        ) = zip(*self._stretches, strict=True)
        lengths = np.array([len(e) for e in ends], dtype=np.int64)
        total = int(lengths.sum())
        first = np.zeros(len(lengths), dtype=np.int64)  # index of each stretch's first row
        first[1:] = np.cumsum(lengths)[:-1]
        last = first + lengths - 1
        local = np.arange(total, dtype=np.int64) - np.repeat(first, lengths)  # step index in stretch

        end_s = np.concatenate(ends)
        start_s = np.empty(total)
        start_s[1:] = end_s[:-1]
        start_s[first] = starts
        num_decode = np.repeat(np.array(n, dtype=np.int64), lengths)
        num_prefill = np.repeat(np.array(prefill, dtype=np.int64), lengths)
        num_tokens = num_decode + num_prefill
        kv_used = np.repeat(np.array(used0, dtype=np.int64), lengths) + num_tokens * (local + 1)
        kv_used[last] = used1
        grown = np.cumsum(np.concatenate(new_slots).astype(np.int64))  # slots allocated so far
        grown_at_first = np.repeat(grown[first], lengths)
        grown_at_last = np.repeat(grown[last], lengths)
        # Allocated before a stretch's later steps = before-allocation minus what those steps add.
        kv_allocated = np.repeat(np.array(alloc0, dtype=np.int64), lengths) - (
            (grown_at_last - grown_at_first) - (grown - grown_at_first)
        )
        kv_allocated[last] = alloc1
        sched_time = np.zeros(total)
        sched_time[first] = sched
        num_cached = np.zeros(total, dtype=np.int64)
        num_cached[first] = cached
        row_positions = np.repeat(np.array(positions, dtype=np.int64), lengths) + local
        columns = {
            "start_s": start_s,
            "duration_s": end_s - start_s,
            "num_tokens": num_tokens,
            "num_prefill_tokens": num_prefill,
            "num_cached_tokens": num_cached,
            "num_decode": num_decode,
            "num_requests": num_decode + np.repeat(np.array(chunks, dtype=np.int64), lengths),
            "kv_used_tokens": kv_used,
            "kv_allocated_tokens": kv_allocated,
            "num_preempted": np.zeros(total, dtype=np.int64),
            "sched_time_s": sched_time,
            "replica": np.repeat(np.array(replica, dtype=np.int64), lengths),
        }
        return row_positions, columns

    def _expand(self) -> None:
        """Materialize pending stretches, interleaved with the appended rows in recording order."""
        self._flush_rows()
        if not self._stretches:
            return
        positions, stretch_cols = self._stretch_columns()
        self._stretches, self._stretch_rows = [], 0
        total = len(self._cols["start_s"]) + len(positions)
        is_stretch = np.zeros(total, dtype=bool)
        is_stretch[positions] = True
        for name, dtype in TIMELINE_COLUMNS.items():
            merged = np.empty(total, dtype=dtype)
            merged[is_stretch] = stretch_cols[name]
            merged[~is_stretch] = np.frombuffer(self._cols[name], dtype=dtype)
            col = array(self._cols[name].typecode)
            col.frombytes(merged.tobytes())
            self._cols[name] = col

    def extend(self, **columns: np.ndarray | float | int) -> None:
        """Append rows given as equal-length arrays (scalars broadcast; ``start_s`` must be an array).
        Every column is required."""
        if len(columns) != len(TIMELINE_COLUMNS):
            missing = set(TIMELINE_COLUMNS) - set(columns)
            raise ValueError(f"Timeline.extend: missing columns {sorted(missing)}")
        self._expand()
        length = len(columns["start_s"])
        for name, dtype in TIMELINE_COLUMNS.items():
            values, col = columns[name], self._cols[name]
            if isinstance(values, np.ndarray):
                if len(values) != length:
                    raise ValueError(f"Timeline.extend: column {name} has {len(values)} rows, not {length}")
                col.frombytes(np.ascontiguousarray(values, dtype=dtype).tobytes())
            else:
                col.extend([values] * length)

    def column(self, name: str) -> np.ndarray:
        """A read-only copy of one column, ``(num_steps,)``."""
        self._expand()
        dtype = TIMELINE_COLUMNS[name]
        col = self._cols[name]
        values = np.frombuffer(col, dtype=dtype).copy() if len(col) else np.zeros(0, dtype=dtype)
        values.flags.writeable = False
        return values

    def as_dict(self) -> dict[str, np.ndarray]:
        return {name: self.column(name) for name in TIMELINE_COLUMNS}

    @classmethod
    def concat(cls, timelines: list[Timeline]) -> Timeline:
        """Rows of several timelines (e.g. one per replica), sorted by start time (stable)."""
        parts = [t.as_dict() for t in timelines if len(t)]
        merged = cls()
        if not parts:
            return merged
        columns = {name: np.concatenate([p[name] for p in parts]) for name in TIMELINE_COLUMNS}
        order = np.argsort(columns["start_s"], kind="stable")
        merged.extend(**{name: col[order] for name, col in columns.items()})
        return merged

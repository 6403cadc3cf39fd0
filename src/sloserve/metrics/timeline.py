"""Per-step records of a run (one row per executed step), kept in growable numpy columns."""

from __future__ import annotations

import numpy as np

# Column name -> dtype. One row per step.
TIMELINE_COLUMNS: dict[str, type] = {
    "start_s": np.float64,  # step start time
    "duration_s": np.float64,  # step execution time (cost model or measured)
    "num_tokens": np.int64,  # forward size: tokens processed
    "num_prefill_tokens": np.int64,  # of which prefill / chunk / refill tokens
    "num_decode": np.int64,  # decode requests (one token each)
    "num_requests": np.int64,  # batch size
    "kv_used_tokens": np.int64,  # tokens holding KV after the step
    "kv_allocated_tokens": np.int64,  # token slots allocated (reserved) after the step
    "num_preempted": np.int64,  # requests preempted while forming this step
    "sched_time_s": np.float64,  # wall time spent in schedule() for this step
    "replica": np.int64,
}


class Timeline:
    """Append-only table of steps. ``append`` is O(1) amortized; ``extend`` adds many rows at once
    (the simulator's closed-form decode stretches)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._n = 0
        self._cols = {name: np.zeros(capacity, dtype=dt) for name, dt in TIMELINE_COLUMNS.items()}

    def __len__(self) -> int:
        return self._n

    def _reserve(self, extra: int) -> None:
        need = self._n + extra
        cap = len(self._cols["start_s"])
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        for name, col in self._cols.items():
            grown = np.zeros(new_cap, dtype=col.dtype)
            grown[: self._n] = col[: self._n]
            self._cols[name] = grown

    def append(
        self,
        start_s: float,
        duration_s: float,
        num_tokens: int,
        num_prefill_tokens: int,
        num_decode: int,
        num_requests: int,
        kv_used_tokens: int,
        kv_allocated_tokens: int,
        num_preempted: int,
        sched_time_s: float,
        replica: int = 0,
    ) -> None:
        if self._n == len(self._cols["start_s"]):
            self._reserve(1)
        i, c = self._n, self._cols
        c["start_s"][i] = start_s
        c["duration_s"][i] = duration_s
        c["num_tokens"][i] = num_tokens
        c["num_prefill_tokens"][i] = num_prefill_tokens
        c["num_decode"][i] = num_decode
        c["num_requests"][i] = num_requests
        c["kv_used_tokens"][i] = kv_used_tokens
        c["kv_allocated_tokens"][i] = kv_allocated_tokens
        c["num_preempted"][i] = num_preempted
        c["sched_time_s"][i] = sched_time_s
        c["replica"][i] = replica
        self._n = i + 1

    def extend(self, **columns: np.ndarray | float | int) -> None:
        """Append rows given as equal-length arrays (scalars broadcast; ``start_s`` must be an array).
        Every column is required."""
        if len(columns) != len(TIMELINE_COLUMNS):
            missing = set(TIMELINE_COLUMNS) - set(columns)
            raise ValueError(f"Timeline.extend: missing columns {sorted(missing)}")
        length = len(columns["start_s"])
        self._reserve(length)
        lo, hi = self._n, self._n + length
        for name, value in columns.items():
            self._cols[name][lo:hi] = value
        self._n = hi

    def column(self, name: str) -> np.ndarray:
        """A read-only view of one column, ``(num_steps,)``."""
        view = self._cols[name][: self._n]
        view.flags.writeable = False
        return view

    def as_dict(self) -> dict[str, np.ndarray]:
        return {name: self.column(name) for name in TIMELINE_COLUMNS}

    @classmethod
    def concat(cls, timelines: list[Timeline]) -> Timeline:
        """Rows of several timelines (e.g. one per replica), sorted by start time."""
        merged = cls(capacity=max(1, sum(len(t) for t in timelines)))
        for t in timelines:
            if len(t):
                merged.extend(**t.as_dict())
        order = np.argsort(merged._cols["start_s"][: merged._n], kind="stable")
        for name in TIMELINE_COLUMNS:
            merged._cols[name][: merged._n] = merged._cols[name][: merged._n][order]
        return merged

"""Seeded arrival processes. Each returns float64 arrival times in seconds, sorted, starting at 0
(``trace_replay`` with a quantum starts inside ``[0, quantum)``)."""

from __future__ import annotations

import math

import numpy as np

from sloserve.core.errors import ConfigError
from sloserve.workload.limits import MAX_ARRIVAL_CV


def poisson(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrivals of a Poisson process of ``rate`` requests/s; the first arrives at 0."""
    return gamma(n, rate, 1.0, rng)


def gamma(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrivals whose gaps are gamma distributed with mean ``1/rate`` and coefficient of
    variation ``cv`` (shape ``1/cv**2``). ``cv == 1`` is Poisson; ``cv > 1`` is burstier. The first
    request arrives at 0, so ``n`` arrivals span ``n - 1`` gaps."""
    _check_count(n)
    _check_positive("arrival rate", rate)
    _check_positive("arrival cv", cv)
    if cv > MAX_ARRIVAL_CV:
        raise ConfigError(f"arrival cv must be <= {MAX_ARRIVAL_CV:g}, got {cv}")
    if n == 0:
        return np.zeros(0, dtype=np.float64)
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, n - 1)
    else:
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n - 1)
    out = np.empty(n, dtype=np.float64)
    out[0] = 0.0
    np.cumsum(gaps, out=out[1:])
    return out


def offline(n: int) -> np.ndarray:
    """``n`` requests all present at time 0 (offline / batch inference)."""
    _check_count(n)
    return np.zeros(n, dtype=np.float64)


def jitter(times: np.ndarray, quantum_s: float, rng: np.random.Generator) -> np.ndarray:
    """Spread bucketed timestamps: each ``t`` becomes uniform in ``[t, t + quantum_s)``.

    Returns the jittered times in the input order (unsorted); sort them together with whatever
    rows they belong to (``trace_replay`` does). ``quantum_s == 0`` returns a copy.
    """
    if not quantum_s >= 0 or not math.isfinite(quantum_s):
        raise ConfigError(f"arrival quantum must be >= 0, got {quantum_s}")
    times = np.asarray(times, dtype=np.float64)
    if quantum_s == 0:
        return times.copy()
    return times + rng.uniform(0.0, quantum_s, len(times))


def trace_replay(
    times: np.ndarray, n: int, rng: np.random.Generator, quantum_s: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Replay ``n`` consecutive arrivals of a trace from a seeded random start row.

    Returns ``(arrivals, rows)``: sorted arrival times and, aligned with them, the trace row each
    arrival belongs to. Times are rebased so the first chosen row arrives at 0. When ``n`` fits,
    the start row is uniform in ``[0, len - n]`` (no wrap-around). When ``n`` exceeds the trace,
    it starts at a random row and wraps: the trace is repeated back to back, copy ``k`` shifted by
    ``k * (duration + mean gap)``, so the overall rate stays the trace's. With ``quantum_s > 0``
    the rebased times are jittered uniformly inside their bucket ``[t, t + quantum_s)`` and sorted
    (each arrival stays inside its own bucket).
    """
    _check_count(n)
    times = np.asarray(times, dtype=np.float64)
    rows_total = len(times)
    if rows_total == 0:
        raise ConfigError("cannot replay an empty trace")
    if n == 0:
        return np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.int64)
    if n <= rows_total:
        start = int(rng.integers(0, rows_total - n + 1))
        rows = np.arange(start, start + n, dtype=np.int64)
        arrivals = times[rows].copy()
    else:
        start = int(rng.integers(0, rows_total))
        idx = np.arange(start, start + n, dtype=np.int64)
        rows = idx % rows_total
        duration = float(times[-1] - times[0])
        period = duration + (duration / (rows_total - 1) if rows_total > 1 else 0.0)
        arrivals = times[rows] + (idx // rows_total) * period
    arrivals -= arrivals[0]
    if quantum_s > 0:
        arrivals = jitter(arrivals, quantum_s, rng)
        order = np.argsort(arrivals, kind="stable")
        arrivals, rows = arrivals[order], rows[order]
    return arrivals, rows


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ConfigError(f"number of requests must be an integer >= 0, got {n!r}")


def _check_positive(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise ConfigError(f"{what} must be a number > 0, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{what} must be > 0, got {value}")

"""Fit InferMax's linear coefficients to measured batch times (InferMax Figure 2, step 5).

The CSV has one row per measured step with the ``BatchShape`` fields and the measured seconds:
``num_decode, decode_kv_tokens, num_prefill, prefill_tokens, prefill_attention_work,
prefill_context_tokens, time_s``, and where known ``decode_max_kv_tokens`` (other columns are ignored;
steps must not include KV swaps).

Fitting is non-negative least squares (``scipy.optimize.nnls``) of the measured time on the nine
features, minimizing the squared *relative* error (each row weighted by 1 / time_s). The ``knee`` form
also fits ``knee_tokens`` (see ``linear.py``): for a given knee the model is linear, so
each candidate knee on a geometric grid (and 0) gets its own least-squares fit, the grid is refined
around the best, and the smallest knee within rounding of the best error wins (0 when a straight line
fits as well). Where the shapes give the longest decode context, the knee form also fits ``w_d`` (one
more linear feature). The ``infermax`` form keeps knee_tokens = 0 and fits the nine alone.

The ``floor`` form (the default, ``DEFAULT_FORM``) is the knee form under two floors, ``floor_p`` /
``floor_d`` (see ``linear.py``). A step is the larger of its floor and the knee form's sum, so for a
given knee the fit is not linear:
``scipy.optimize.least_squares`` (bounded at 0) minimizes the same relative errors from two starts,
the straight fit with no floor and the straight fit with each floor at its kind's shortest measured
step, and keeps the better; the knee is searched as above. A floor that no profiled step sits on is
set to 0 (it changes no prediction).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from sloserve.core.errors import ConfigError

from .base import BatchShape
from .linear import COEFFICIENT_NAMES, MAX_STEP_SECONDS, MIN_STEP_SECONDS, LinearCoefficients, LinearCostModel

CSV_COLUMNS = (
    "num_decode",
    "decode_kv_tokens",
    "num_prefill",
    "prefill_tokens",
    "prefill_attention_work",
    "prefill_context_tokens",
    "time_s",
)
# Read when present (files written before it existed lack it; w_d is then not fitted).
LONGEST_COLUMN = "decode_max_kv_tokens"
# The most one measured step may count of anything (10^300 once reached numpy as a Python int and failed in
# the fit). Its time is from MIN_STEP_SECONDS to MAX_STEP_SECONDS (1e300 s crashed LAPACK; 1e-300 s fitted
# a model whose steps take no time).
MAX_PROFILE_COUNT = 10**15
FORMS = ("knee", "floor", "infermax")
# NOTE: the floor form is the default since 2026-11-26. On the H200 profile (benchmarks/profiles/) it
# fits held-out batches within 2.1% (knee 4.5%) and simulates the engine's runs within 4.3% (vLLM)
# and 3.0% (Sarathi-Serve) on average, worst 11.0%; the knee form 5.6% and 1.0%, worst 17.9% (its
# prefill line takes the launch floor as a per-step constant and prices big prompt batches short).
# Issue 29 asks one fit within 5% for every scheduler. Where a profile shows no floor (a CPU's),
# both forms fit nearly the same line (held-out errors within a point on this VM's CPU profiles).
DEFAULT_FORM = "floor"
# Candidate knees: a geometric grid from 1 token to the largest batch, then a finer one between the
# best candidate's neighbours.
KNEE_GRID_POINTS = 48
KNEE_REFINE_POINTS = 24
# Of knees whose fits are this close (in the root of the summed squared relative errors), the smallest.
KNEE_TIE = 1e-9
# Column order of the design matrix (one per coefficient).
FEATURE_ORDER = ("a_d", "b_d", "s_d", "a_p", "b_p", "s_p", "m_p", "a_o", "b_o")
assert sorted(FEATURE_ORDER) == sorted(COEFFICIENT_NAMES)


class FitReport(NamedTuple):
    """How well the fitted model reproduces the rows it was fitted on.

    ``rank``: rank of the linear design matrix (9 when every coefficient is identifiable, 10 with
    ``w_d``); ``unidentified``: coefficients whose feature is zero in every row (set to 0; e.g.
    prefill terms from decode-only data, ``w_d`` from a profile without the longest contexts).
    Collinear features (rank below the number of identified coefficients; e.g. when every row has
    decodes b_d and b_o coincide, and with decodes only s_d and a_o too) still predict these rows
    but split the shared term between the coefficients arbitrarily.
    """

    mean_rel_error: float
    max_rel_error: float
    n_rows: int
    rank: int = len(FEATURE_ORDER)
    unidentified: tuple[str, ...] = ()


class LinearFit(NamedTuple):
    """Result of a fit: the coefficients (per layer, ms) and the report."""

    coefficients: LinearCoefficients
    report: FitReport


def feature_matrix(shapes: Sequence[BatchShape], knee_tokens: float = 0.0, longest: bool = False) -> np.ndarray:
    """Design matrix, one row per shape, columns in ``FEATURE_ORDER`` (whole-model seconds units), then
    with ``longest`` one for ``w_d`` (the longest decode context)."""
    rows = []
    for s in shapes:
        has_decode = 1.0 if s.num_decode > 0 else 0.0
        has_prefill = 1.0 if s.num_prefill > 0 else 0.0
        tokens = s.num_decode + s.prefill_tokens
        rows.append(
            [
                has_decode * s.decode_kv_tokens,  # a_d: sum m of decodes
                has_decode,  # b_d
                float(s.num_decode),  # s_d: B
                has_prefill * s.prefill_attention_work,  # a_p: sum(c^2 + 2mc)
                has_prefill,  # b_p
                float(s.num_prefill),  # s_p: n_p
                has_prefill * s.prefill_context_tokens,  # m_p: sum m of prefills
                float(max(tokens, knee_tokens)) if tokens > 0 else 0.0,  # a_o
                1.0 if tokens > 0 else 0.0,  # b_o
                *((has_decode * s.decode_max_kv_tokens,) if longest else ()),  # w_d: max m of decodes
            ]
        )
    return np.array(rows, dtype=np.float64).reshape(len(rows), len(FEATURE_ORDER) + longest)


def _nnls(
    shapes: Sequence[BatchShape],
    times: np.ndarray,
    knee_tokens: float,
    longest: bool = False,
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """(coefficients in whole-model seconds, columns used, rank, residual) of the least-squares fit of
    relative errors with the given knee (and ``w_d`` with ``longest``)."""
    import scipy.optimize  # NOTE: here, not at the top: `sloserve.cost` must not load scipy for every run

    x = feature_matrix(shapes, knee_tokens, longest)
    weighted = x / times[:, None]  # relative errors: (x @ c - t) / t
    norms = np.linalg.norm(weighted, axis=0)
    used = norms > 0
    coef = np.zeros(x.shape[1])
    scaled = weighted[:, used] / norms[used]
    solution, residual = scipy.optimize.nnls(scaled, np.ones(len(times)))  # min ||A c - 1||, c >= 0
    coef[used] = solution / norms[used]
    rank = int(np.linalg.matrix_rank(scaled)) if used.any() else 0
    return coef, used, rank, float(residual)


def _fit_floor(
    shapes: Sequence[BatchShape],
    times: np.ndarray,
    knee_tokens: float,
    longest: bool = False,
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """(the coefficients in whole-model seconds per unit, in ``FEATURE_ORDER``, then ``w_d`` with
    ``longest``, then the floors (floor_p, floor_d) in seconds; which of them the data identifies;
    the rank of the linear features; the residual) of the floor form with the given knee, as
    ``_nnls`` gives them for the others."""
    import scipy.optimize  # NOTE: as in _nnls

    x = feature_matrix(shapes, knee_tokens, longest)
    has_prefill = np.array([s.num_prefill > 0 for s in shapes])
    weighted = x / times[:, None]
    norms = np.linalg.norm(weighted, axis=0)
    used = norms > 0
    norms[~used] = 1.0  # a feature zero in every row: its coefficient stays 0
    scaled = weighted / norms  # columns of unit norm: the solver's variables are all of order 1
    unit = float(np.median(times))  # floors in units of a typical step

    def unpack(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.where(used, theta[:-2], 0.0), theta[-2:] * unit

    def residuals(theta: np.ndarray) -> np.ndarray:
        coef, (floor_p, floor_d) = unpack(theta)
        floor = np.where(has_prefill, floor_p, floor_d) / times
        return np.maximum(scaled @ coef, floor) - 1.0  # relative errors

    straight, _ = scipy.optimize.nnls(scaled[:, used], np.ones(len(times)))
    start = np.zeros(x.shape[1] + 2)
    start[:-2][used] = straight
    shortest = [
        times[has_prefill].min() if has_prefill.any() else 0.0,
        times[~has_prefill].min() if (~has_prefill).any() else 0.0,
    ]
    best = None
    for floors in ([0.0, 0.0], shortest):
        start[-2:] = np.asarray(floors) / unit
        result = scipy.optimize.least_squares(residuals, start, bounds=(0.0, np.inf), method="trf")
        if best is None or result.cost < best.cost:
            best = result
    coef, floors = unpack(best.x)
    coef = coef / norms
    # A floor under every step of its kind changes nothing: 0 says so.
    work = x @ coef
    for k, rows in enumerate((has_prefill, ~has_prefill)):
        if not rows.any() or np.all(work[rows] >= floors[k]):
            floors[k] = 0.0
    rank = int(np.linalg.matrix_rank(scaled[:, used])) if used.any() else 0
    identified = np.append(used, [has_prefill.any(), (~has_prefill).any()])
    # NOTE: least_squares's cost is half the summed squares; the residual is their root, as _nnls's.
    return np.concatenate([coef, floors]), identified, rank, math.sqrt(2 * best.cost)


def _best_knee(shapes: Sequence[BatchShape], times: np.ndarray, floors: bool = False, longest: bool = False) -> float:
    """The knee (tokens) whose fit (under floors, with ``floors``; with ``w_d``, with ``longest``) has
    the least squared relative error (see the module docstring)."""

    def fit(shapes: Sequence[BatchShape], times: np.ndarray, knee: float) -> tuple:
        return (_fit_floor if floors else _nnls)(shapes, times, knee, longest)

    largest = max(s.num_decode + s.prefill_tokens for s in shapes)
    grid = [0.0, *np.geomspace(1.0, max(largest, 2), KNEE_GRID_POINTS).tolist()]
    residuals = {knee: fit(shapes, times, knee)[3] for knee in grid}
    best = min(residuals, key=residuals.get)
    i = grid.index(best)
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    for knee in np.linspace(lo, hi, KNEE_REFINE_POINTS).tolist():
        residuals.setdefault(knee, fit(shapes, times, knee)[3])
    least = min(residuals.values())
    return min(knee for knee, r in residuals.items() if r <= least + KNEE_TIE)


def fit_linear_shapes(
    shapes: Sequence[BatchShape],
    times_s: Sequence[float],
    *,
    num_layers: int,
    name: str = "fitted",
    form: str = DEFAULT_FORM,
) -> LinearFit:
    """Fit coefficients to measured step times (seconds) of the given shapes; no file needed.
    ``form``: "knee" (also fits knee_tokens, and w_d where the shapes have ``decode_max_kv_tokens``),
    "floor" (the knee form and the floors) or "infermax" (InferMax's nine coefficients alone)."""
    if form not in FORMS:
        raise ConfigError(f"fit: form must be one of {', '.join(FORMS)}, got {form!r}")
    if len(shapes) != len(times_s):
        raise ConfigError(f"fit: {len(shapes)} shapes but {len(times_s)} times")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"fit: num_layers must be a positive integer, got {num_layers!r}")
    if len(shapes) < len(FEATURE_ORDER):
        raise ConfigError(f"fit: {len(shapes)} rows, need at least {len(FEATURE_ORDER)} (one per coefficient)")
    times = np.asarray(times_s, dtype=np.float64)
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ConfigError("fit: every measured time must be a positive finite number of seconds")
    # Our forms charge the longest decode context (w_d) where the data has it.
    longest = form != "infermax" and any(s.num_decode > 0 and s.decode_max_kv_tokens > 0 for s in shapes)
    knee = _best_knee(shapes, times, form == "floor", longest) if form in ("knee", "floor") else 0.0
    names = (*FEATURE_ORDER, "w_d") if longest else FEATURE_ORDER
    if form == "floor":
        coef, used, rank, _ = _fit_floor(shapes, times, knee, longest)
        names = (*names, "floor_p", "floor_d")
    else:
        coef, used, rank, _ = _nnls(shapes, times, knee, longest)
    if form != "infermax" and not longest:  # the data does not say how long the decodes' contexts were
        names, coef, used = (*names, "w_d"), np.append(coef, 0.0), np.append(used, False)
    # Whole-model seconds per unit -> per-layer milliseconds.
    per_layer_ms = {key: float(c) * 1000.0 / num_layers for key, c in zip(names, coef)}
    coefficients = LinearCoefficients(**per_layer_ms, num_layers=num_layers, name=name, knee_tokens=knee)
    model = LinearCostModel(coefficients)
    predicted = np.array([model.batch_time(s).total_s for s in shapes])
    rel = np.abs(predicted - times) / times
    report = FitReport(
        mean_rel_error=float(rel.mean()),
        max_rel_error=float(rel.max()),
        n_rows=len(times),
        rank=rank,
        unidentified=tuple(k for k, u in zip(names, used) if not u),
    )
    return LinearFit(coefficients, report)


def read_profile_csv(csv_path: str | Path) -> tuple[list[BatchShape], list[float]]:
    """Read a profile CSV into shapes and times; ``ConfigError`` naming file, line, column, value."""
    path = Path(csv_path)
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise ConfigError(f"profile {path}: cannot open ({exc.strerror or exc})") from None
    shapes: list[BatchShape] = []
    times: list[float] = []
    with handle:
        reader = csv.reader(handle)
        header: list[str] | None = None
        for row in reader:
            line = reader.line_num
            if not row or not any(cell.strip() for cell in row) or row[0].lstrip().startswith("#"):
                continue
            if header is None:
                header = [cell.strip() for cell in row]
                missing = [col for col in CSV_COLUMNS if col not in header]
                if missing:
                    raise ConfigError(
                        f"profile {path}, line {line}: missing column(s) {', '.join(missing)}; "
                        f"present: {', '.join(header)}"
                    )
                columns = (*CSV_COLUMNS, LONGEST_COLUMN) if LONGEST_COLUMN in header else CSV_COLUMNS
                index = {col: header.index(col) for col in columns}
                continue
            if len(row) != len(header):
                raise ConfigError(f"profile {path}, line {line}: {len(row)} fields, the header has {len(header)}")
            values: dict[str, float] = {}
            for col in columns:
                raw = row[index[col]].strip()
                try:
                    value = float(raw)
                except ValueError:
                    raise ConfigError(f"profile {path}, line {line}, column {col}: {raw!r} is not a number") from None
                if not math.isfinite(value) or value < 0:
                    raise ConfigError(
                        f"profile {path}, line {line}, column {col}: {raw!r} must be a non-negative finite number"
                    )
                values[col] = value
            if not MIN_STEP_SECONDS <= values["time_s"] <= MAX_STEP_SECONDS:
                raise ConfigError(
                    f"profile {path}, line {line}, column time_s: {row[index['time_s']].strip()!r} is not a "
                    f"measured step time (seconds, from {MIN_STEP_SECONDS:g} to {MAX_STEP_SECONDS:g})"
                )
            too_large = [col for col in columns if col != "time_s" and values[col] > MAX_PROFILE_COUNT]
            if too_large:
                raise ConfigError(
                    f"profile {path}, line {line}, column {too_large[0]}: {row[index[too_large[0]]].strip()!r} is "
                    f"over {MAX_PROFILE_COUNT:.0e}, more than any step holds"
                )
            if values["num_decode"] == 0 and values["decode_kv_tokens"] > 0:
                raise ConfigError(
                    f"profile {path}, line {line}, column decode_kv_tokens: "
                    f"{row[index['decode_kv_tokens']].strip()!r} with num_decode 0"
                )
            if values.get(LONGEST_COLUMN, 0) > values["decode_kv_tokens"]:
                raise ConfigError(
                    f"profile {path}, line {line}, column {LONGEST_COLUMN}: "
                    f"{row[index[LONGEST_COLUMN]].strip()!r} is more than decode_kv_tokens, their sum"
                )
            if values["num_prefill"] == 0:
                for col in ("prefill_tokens", "prefill_attention_work", "prefill_context_tokens"):
                    if values[col] > 0:
                        raise ConfigError(
                            f"profile {path}, line {line}, column {col}: {row[index[col]].strip()!r} with num_prefill 0"
                        )
            if values["num_decode"] + values["prefill_tokens"] == 0:
                raise ConfigError(f"profile {path}, line {line}: empty step (num_decode and prefill_tokens are 0)")
            shapes.append(BatchShape(**{col: _number(values[col]) for col in columns if col != "time_s"}))
            times.append(values["time_s"])
    if header is None:
        raise ConfigError(f"profile {path}: empty file; expected a header with {', '.join(CSV_COLUMNS)}")
    if len(shapes) < len(FEATURE_ORDER):
        raise ConfigError(
            f"profile {path}: {len(shapes)} data rows, need at least {len(FEATURE_ORDER)} (one per coefficient)"
        )
    return shapes, times


def write_profile_csv(shapes: Sequence[BatchShape], times_s: Sequence[float], path: str | Path) -> None:
    """Write measured steps in the format ``read_profile_csv`` (and ``sloserve fit-cost``) reads."""
    with Path(path).open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(PROFILE_HEADER)
        for shape, t in zip(shapes, times_s, strict=True):
            writer.writerow(profile_row(shape, t))


# A profile CSV's columns as written (``read_profile_csv`` reads them by name: other columns may follow)
PROFILE_HEADER = (*CSV_COLUMNS, LONGEST_COLUMN)


def profile_row(shape: BatchShape, time_s: float) -> list:
    """One measured step as a row under ``PROFILE_HEADER``."""
    return [getattr(shape, col) for col in CSV_COLUMNS[:-1]] + [repr(float(time_s)), shape.decode_max_kv_tokens]


def _number(value: float) -> int | float:
    """Counts come back as ints when integral (they usually are)."""
    return int(value) if value.is_integer() else value


def fit_linear(
    csv_path: str | Path, *, num_layers: int, name: str | None = None, form: str = DEFAULT_FORM
) -> LinearFit:
    """Fit InferMax's nine coefficients (and, in the "knee" form, ``knee_tokens``) to a profile CSV
    (see the module docstring).

    Returns ``LinearFit(coefficients, report)``; the coefficients are per layer in ms, named
    ``name`` (default: the file's stem). Save them with ``save_preset`` to use as ``--cost-model FILE``.
    """
    shapes, times = read_profile_csv(csv_path)
    return fit_linear_shapes(shapes, times, num_layers=num_layers, name=name or Path(csv_path).stem, form=form)

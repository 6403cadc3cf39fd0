"""rich tables comparing runs: one row per scheduler, or a rate x scheduler sweep."""

from __future__ import annotations

import math
from io import StringIO

from rich.console import Console
from rich.table import Table

from sloserve.metrics.summary import metric_value

# (header, metric, stat, scale) of the compare table's columns.
COMPARE_COLUMNS: tuple[tuple[str, str, str, float], ...] = (
    ("completed", "completed", "mean", 1.0),
    ("req/s", "throughput_rps", "mean", 1.0),
    ("tok/s", "throughput_tps", "mean", 1.0),
    ("TTFT mean\n(s)", "ttft_s", "mean", 1.0),
    ("TTFT p99\n(s)", "ttft_s", "p99", 1.0),
    ("TPOT mean\n(ms)", "tpot_s", "mean", 1e3),
    ("TPOT p99\n(ms)", "tpot_s", "p99", 1e3),
    ("norm. lat.\nmean (s/tok)", "normalized_latency_s", "mean", 1.0),
    ("JCT p50\n(s)", "jct_s", "p50", 1.0),
    ("SLO %", "slo_attainment", "mean", 100.0),
    ("KV util %", "kv_utilization_mean", "mean", 100.0),
    ("pre-\nemptions", "preemptions", "mean", 1.0),
    ("sim wall\n(s)", "sim_wall_s", "mean", 1.0),
)


def format_number(value: float) -> str:
    """A short human-readable number: ``-`` for NaN, whole numbers from 100 up with thousands
    separators, 3 significant digits below."""
    if not math.isfinite(value):
        return "-" if math.isnan(value) else str(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


# Narrower than this, the compare table is printed transposed (a row per metric): its 14 columns
# would otherwise be folded into unreadable cells.
WIDE_TABLE_COLUMNS = 150


def compare_table(summaries: dict[str, dict], title: str, width: int | None = None) -> Table:
    """One row per scheduler (``summaries`` maps its name to a ``summarize`` result); for a ``width``
    under ``WIDE_TABLE_COLUMNS`` characters, one row per metric and a column per scheduler."""
    if width is not None and width < WIDE_TABLE_COLUMNS:
        return _transposed_compare_table(summaries, title)
    table = Table(title=title)
    table.add_column("scheduler", style="bold", overflow="fold")
    for header, *_ in COMPARE_COLUMNS:
        widest = max(len(line) for line in header.splitlines())
        table.add_column(header, justify="right", min_width=widest)
    for name, summary in summaries.items():
        cells = [_cell(summary, metric, stat, scale) for _, metric, stat, scale in COMPARE_COLUMNS]
        table.add_row(name, *cells)
    return table


def _transposed_compare_table(summaries: dict[str, dict], title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    for name in summaries:
        table.add_column(name, justify="right", overflow="fold")
    for header, metric, stat, scale in COMPARE_COLUMNS:
        table.add_row(
            " ".join(header.replace("-\n", "").split()),
            *(_cell(summary, metric, stat, scale) for summary in summaries.values()),
        )
    return table


def _cell(summary: dict, metric: str, stat: str, scale: float) -> str:
    if metric == "slo_attainment" and summary.get("num_with_slo") == 0:
        return "-"  # NOTE: no request had an SLO: the attainment would only count completions
    return format_number(metric_value(summary, metric, stat) * scale)


def sweep_table(
    results: dict[str, list[tuple[float, dict]]],
    metric: str,
    stat: str = "mean",
    title: str | None = None,
) -> Table:
    """Rows = request rates, columns = schedulers, cells = ``metric``/``stat`` (see
    ``metric_value``; ``metric`` may be a dotted path like ``"classes.rt.ttft_s"``)."""
    by_rate: dict[float, dict[str, float]] = {}
    for name, points in results.items():
        for rate, summary in points:
            by_rate.setdefault(rate, {})[name] = metric_value(summary, metric, stat)
    table = Table(title=title or f"{metric} ({stat})")
    table.add_column("rate (req/s)", justify="right", style="bold")
    for name in results:
        table.add_column(name, justify="right", no_wrap=True)
    for rate in sorted(by_rate):
        row = by_rate[rate]
        table.add_row(format_number(rate), *(format_number(row.get(n, math.nan)) for n in results))
    return table


def render_table(table: Table, width: int = 160) -> str:
    """The table as plain text (no colour codes), for tests, logs and non-TTY output."""
    buffer = StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    console.print(table)
    return buffer.getvalue()

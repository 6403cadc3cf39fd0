"""Metrics: per-step timeline, per-request table, run summaries, output files, plots and tables.

``plots`` imports matplotlib only when a plot is drawn.
"""

from sloserve.metrics.outputs import summary_to_json, write_run_outputs
from sloserve.metrics.summary import (
    LATENCY_METRICS,
    REQUEST_COLUMNS,
    latency_stats,
    metric_value,
    request_table,
    summarize,
)
from sloserve.metrics.tables import compare_table, render_table, sweep_table
from sloserve.metrics.timeline import TIMELINE_COLUMNS, Timeline

__all__ = [
    "LATENCY_METRICS",
    "REQUEST_COLUMNS",
    "TIMELINE_COLUMNS",
    "Timeline",
    "compare_table",
    "latency_stats",
    "metric_value",
    "render_table",
    "request_table",
    "summarize",
    "summary_to_json",
    "sweep_table",
    "write_run_outputs",
]

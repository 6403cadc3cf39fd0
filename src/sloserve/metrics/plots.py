"""PNG plots of a run and of comparisons.

matplotlib is imported inside the functions so that ``import sloserve.metrics`` stays fast. Figures
are made with ``matplotlib.figure.Figure`` and rendered by the Agg canvas, never through pyplot, so
no global backend is switched and no figure is left open."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sloserve.metrics.summary import metric_value
from sloserve.metrics.timeline import Timeline

# Series longer than this are thinned (every k-th point) before plotting.
MAX_POINTS = 5000


def _figure(figsize: tuple[float, float]) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    return Path(path)


def caption(summary: dict, *, with_scheduler: bool = True, with_workload: bool = True) -> str:
    """What a plot shows, from a run's summary: "vllm · llama-2-7b on a100-80gb · sharegpt@rate=9"
    (parts the summary lacks are left out)."""
    parts = []
    if with_scheduler and summary.get("scheduler"):
        parts.append(str(summary["scheduler"]))
    if summary.get("model"):
        parts.append(f"{summary['model']} on {summary['gpu']}" if summary.get("gpu") else str(summary["model"]))
    if with_workload and summary.get("workload"):
        parts.append(str(summary["workload"]))
    return " · ".join(parts)


def _thin(n: int) -> slice:
    return slice(None, None, max(1, -(-n // MAX_POINTS)))


def plot_run(
    out_dir: Path,
    requests_table: dict[str, np.ndarray],
    timeline: Timeline,
    *,
    kv_capacity_tokens: int | None = None,
    title: str = "",
) -> list[Path]:
    """Write ``latency_cdf.png`` (CDFs of TTFT, TPOT and normalized latency over completed requests,
    one line per class when both are present) and ``timeline.png`` (forward size, and KV used and
    allocated per replica over time with the per-replica capacity line) into ``out_dir``; ``title``
    (``caption``) names the run on both."""
    out_dir = Path(out_dir)
    return [
        plot_latency_cdf(out_dir / "latency_cdf.png", requests_table, title=title),
        plot_timeline(out_dir / "timeline.png", timeline, kv_capacity_tokens=kv_capacity_tokens, title=title),
    ]


def plot_latency_cdf(path: Path, requests_table: dict[str, np.ndarray], *, title: str = "") -> Path:
    """Empirical CDFs of TTFT, TPOT and normalized latency (completed requests, NaN left out)."""
    t = requests_table
    done = t["finished"]
    groups: dict[str, np.ndarray] = {"all": done}
    classes = [c for c in ("rt", "be") if (done & (t["request_class"] == c)).any()]
    if len(classes) > 1:
        groups.update({c: done & (t["request_class"] == c) for c in classes})
    panels = (
        ("ttft_s", "TTFT (s)"),
        ("tpot_s", "TPOT (s/token)"),
        ("normalized_latency_s", "normalized latency (s/token)"),
    )
    fig = _figure((13, 3.8))
    axes = fig.subplots(1, 3)
    for ax, (col, label) in zip(axes, panels):
        for name, mask in groups.items():
            v = np.sort(t[col][mask])
            v = v[~np.isnan(v)]
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(groups) > 1:
            ax.legend()
    fig.suptitle(f"{title + ': ' if title else ''}latency CDFs ({int(done.sum())} completed requests)")
    return _save(fig, Path(path))


def plot_timeline(path: Path, timeline: Timeline, *, kv_capacity_tokens: int | None = None, title: str = "") -> Path:
    """Forward size (tokens per step; with prefix caching, prefill tokens computed and found cached)
    and KV tokens used / allocated after each step, over time."""
    cols = timeline.as_dict()
    fig = _figure((10, 6))
    ax_fwd, ax_kv = fig.subplots(2, 1, sharex=True)
    replicas = np.unique(cols["replica"])
    for i, rep in enumerate(replicas):
        rows = np.flatnonzero(cols["replica"] == rep)
        rows = rows[_thin(rows.size)]
        t, color = cols["start_s"][rows], f"C{i}"
        suffix = f" (replica {rep})" if replicas.size > 1 else ""
        ax_fwd.plot(t, cols["num_tokens"][rows], ".", ms=2, color=color, label=f"step{suffix}")
        if cols["num_cached_tokens"].any():  # prefix caching: prefill computed vs found cached
            prefill = cols["num_prefill_tokens"][rows]
            ax_fwd.plot(t, prefill, "+", ms=3, color=color, alpha=0.6, label=f"prefill computed{suffix}")
            cached = cols["num_cached_tokens"][rows]
            ax_fwd.plot(t[cached > 0], cached[cached > 0], "x", ms=3, color="C3", label=f"prefill found cached{suffix}")
        ax_kv.step(t, cols["kv_used_tokens"][rows], where="post", lw=0.8, color=color, label=f"used{suffix}")
        ax_kv.step(
            t,
            cols["kv_allocated_tokens"][rows],
            where="post",
            lw=0.8,
            ls="--",
            color=color,
            alpha=0.7,
            label=f"allocated{suffix}",
        )
    if kv_capacity_tokens:
        ax_kv.axhline(kv_capacity_tokens, color="k", lw=1, ls=":", label="capacity per replica")
    ax_fwd.set_ylabel("tokens per step")
    ax_fwd.set_title(f"forward size ({len(timeline):,} steps)")
    ax_kv.set_ylabel("KV tokens")
    ax_kv.set_xlabel("time (s)")
    ax_kv.set_title("KV cache")
    for ax in (ax_fwd, ax_kv):
        ax.grid(alpha=0.3)
    # NOTE: legends outside the axes, at the right: inside, they cover the series they name
    for ax in (ax_fwd, ax_kv):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    if title:
        fig.suptitle(title)
    return _save(fig, Path(path))


def plot_sweep(
    results: dict[str, list[tuple[float, dict]]],
    path: Path,
    metric: str = "normalized_latency_s",
    stat: str = "mean",
    ylabel: str | None = None,
    *,
    logy: bool = False,
    title: str | None = None,
) -> Path:
    """One line per scheduler: request rate (x) against ``metric``/``stat`` of its summaries (y).

    ``results`` maps a scheduler name to ``[(rate_rps, summary), ...]``; ``metric`` may be a dotted
    path such as ``"classes.rt.ttft_s"`` (see ``metric_value``). Missing values leave a gap.
    """
    fig = _figure((7.6, 4.4))
    ax = fig.subplots()
    for name, points in results.items():
        pts = sorted(points, key=lambda p: p[0])
        xs = [rate for rate, _ in pts]
        ys = [metric_value(summary, metric, stat) for _, summary in pts]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("request rate (req/s)")
    ylabel = ylabel or f"{metric} ({stat})"
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title or f"{ylabel} vs request rate", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return _save(fig, Path(path))


# (metric, stat, label, scale) of the default comparison bars.
COMPARE_BARS: tuple[tuple[str, str, str, float], ...] = (
    ("throughput_rps", "mean", "throughput (req/s)", 1.0),
    ("normalized_latency_s", "mean", "mean normalized latency (s/token)", 1.0),
    ("ttft_s", "p99", "p99 TTFT (s)", 1.0),
    ("slo_attainment", "mean", "SLO attainment (%)", 100.0),
)


def plot_compare_bars(
    summaries: dict[str, dict],
    path: Path,
    bars: tuple[tuple[str, str, str, float], ...] = COMPARE_BARS,
    *,
    title: str = "",
) -> Path:
    """One panel per ``(metric, stat, label, scale)`` in ``bars``, one bar per scheduler, each bar
    labelled with its value. A panel whose values span more than 100x is on a log scale (a 0.4 s
    bar beside a 168 s one would otherwise be invisible); a value the summary lacks is "n/a"."""
    names = list(summaries)
    fig = _figure((3.6 * len(bars), 4.0))
    axes = fig.subplots(1, len(bars), squeeze=False)
    for ax, (metric, stat, label, scale) in zip(axes[0], bars):
        values = np.array([metric_value(summaries[n], metric, stat) * scale for n in names], dtype=np.float64)
        log = wide_spread(values)
        heights = np.where(np.isfinite(values), values, 0.0)
        bars_drawn = ax.bar(range(len(names)), heights, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(bars_drawn, labels=[_short(v) for v in values], fontsize=8, padding=2)
        if log:
            ax.set_yscale("log")
            ax.set_title(f"{label}, log scale", fontsize=10)
        else:
            ax.set_title(label, fontsize=10)
            ax.margins(y=0.12)  # room for the labels
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    return _save(fig, Path(path))


def wide_spread(values: np.ndarray, ratio: float = 100.0) -> bool:
    """Whether the positive finite ``values`` span more than ``ratio`` (plot them on a log scale)."""
    positive = values[np.isfinite(values) & (values > 0)]
    return positive.size > 1 and bool(positive.max() / positive.min() > ratio)


def _short(value: float) -> str:
    if not np.isfinite(value):
        return "n/a"
    return f"{value:.3g}"

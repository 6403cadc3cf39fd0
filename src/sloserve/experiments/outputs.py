"""What every experiment writes: its rows as CSV, and its figures (``plot_grid`` for sweeps,
``plot_bars`` for one setting), titled with the paper's figure and setting."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _powers_of_two(values: list) -> bool:
    """A grid of powers of two spanning more than 4x (InferMax's I, O, M): plotted on a log2 axis."""
    numbers = [v for v in values if isinstance(v, (int, float)) and v > 0]
    return (
        len(numbers) == len(values) > 1
        and max(numbers) / min(numbers) > 4
        and all(float(np.log2(v)).is_integer() for v in numbers)
    )


def plot_grid(
    rows: list[dict], path: Path, metrics: tuple[str, ...], column: str = "O", x: str = "I", title: str = ""
) -> None:
    """One column of panels per value of ``column``, one row per metric, a line per scheduler. The x
    axis is log2 for a grid of powers of two, linear otherwise (request rates)."""
    from matplotlib.figure import Figure

    columns = sorted({r[column] for r in rows})
    schedulers = list(dict.fromkeys(r["scheduler"] for r in rows))
    log2_x = _powers_of_two(sorted({r[x] for r in rows}))
    fig = Figure(figsize=(3.2 * len(columns) + 1.6, 2.4 * len(metrics) + 0.4))
    axes = fig.subplots(len(metrics), len(columns), squeeze=False)
    for ci, value in enumerate(columns):
        for mi, metric in enumerate(metrics):
            ax = axes[mi][ci]
            for name in schedulers:
                pts = sorted((r[x], r[metric]) for r in rows if r[column] == value and r["scheduler"] == name)
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, label=name)
            if log2_x:
                ax.set_xscale("log", base=2)
            values = [r[metric] for r in rows if r[column] == value]
            if metric in ("latency_s", "ttft_s", "tpot_s") and min(values, default=0) > 0:
                ax.set_yscale("log")
            if mi == 0:
                ax.set_title(f"{column} = {value}", fontsize=9)
            if ci == 0:
                ax.set_ylabel(metric, fontsize=9)
            if mi == len(metrics) - 1:
                ax.set_xlabel(x)
            ax.grid(alpha=0.3)
    # NOTE: one legend for the figure, right of the panels: inside one, it covers its lines
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 1.5 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=100)


def plot_bars(rows: list[dict], path: Path, metrics: tuple[tuple[str, str], ...], title: str) -> None:
    """One panel per ``(key, label)`` of ``metrics``, one bar per row (labelled by its scheduler),
    each bar with its value."""
    from matplotlib.figure import Figure

    names = [str(r["scheduler"]) for r in rows]
    fig = Figure(figsize=(max(3.2, 0.55 * len(names) + 1.2) * len(metrics), 3.8))
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, (key, label) in zip(axes, metrics, strict=True):
        values = [float(r[key]) for r in rows]
        drawn = ax.bar(range(len(names)), values, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(drawn, labels=[f"{v:.3g}" for v in values], fontsize=8, padding=2)
        ax.margins(y=0.12)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)

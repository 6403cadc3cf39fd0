"""What ``sloserve plan`` shows: the ranked table, ``plan.json`` and three plots (goodput per GPU of
every configuration; cost against goodput with the Pareto front; attainment against rate of the
winners)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sloserve.metrics.plots import _figure, _save

STATUS_TEXT = {
    "verified": "meets the SLO at the load",
    "estimated": "not verified: dearer than the verified ones",
    "unverifiable": "missed the SLO when simulated whole",
    "pruned": "pruned: cannot be the cheapest",
    "infeasible": "cannot serve the load within --max-gpus",
    "error": "refused by the simulator",
}


def plan_table(doc: dict, width: int, limit: int = 15) -> Any:
    """The ranked candidates as a rich table: the answer first, then its alternatives."""
    from rich.table import Table

    q = doc["query"]
    slo = ", ".join(f"{k.removesuffix('_s').upper()} {v:g} s" for k, v in q["slo"].items() if v is not None)
    table = Table(
        title=f"{q['model']}: {q['qps']:g} req/s of {q['workload']} within {slo or 'its SLOs'} for "
        f"{q['attainment']:.0%} of requests",
        width=width,
    )
    for header in (
        "#",
        "configuration",
        "GPUs",
        "$/hour",
        "unit goodput req/s",
        "per GPU",
        "attainment at load",
        "status",
    ):
        table.add_column(header, justify="left" if header in ("configuration", "status") else "right", overflow="fold")
    for rank, c in enumerate(doc["candidates"][:limit], 1):
        verified = c["verified"]
        goodput = f"{'>=' if c['goodput_capped'] else ''}{c['goodput_rps']:.3g}" if c["goodput_rps"] else "-"
        table.add_row(
            str(rank),
            f"{c['units']} x {c['label']}" if c["units"] else c["label"],
            str(c["num_gpus"]) if c["num_gpus"] else "-",
            f"{c['cost_per_hour']:.2f}" if c["cost_per_hour"] else "-",
            goodput,
            f"{c['goodput_per_gpu_rps']:.3g}" if c["goodput_rps"] else "-",
            f"{verified['attainment']:.1%}" if verified else "-",
            STATUS_TEXT.get(c["status"], c["status"]),
        )
    return table


def write_plan(doc: dict, out: Path) -> list[Path]:
    """``plan.json`` and the plots under ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(doc, indent=2))
    return [
        out / "plan.json",
        plot_goodput_per_gpu(doc, out / "goodput_per_gpu.png"),
        plot_cost_vs_goodput(doc, out / "cost_vs_goodput.png"),
        plot_winners_attainment(doc, out / "attainment_vs_rate.png"),
    ]


def _searched(doc: dict) -> list[dict]:
    return [c for c in doc["candidates"] if c["goodput_rps"] or c["probes"]]


def _title(doc: dict, what: str) -> str:
    q = doc["query"]
    return f"{what}: {q['model']} · {q['workload']} · target {q['attainment']:.0%} attainment"


def plot_goodput_per_gpu(doc: dict, path: Path, limit: int = 30) -> Path:
    """One horizontal bar per configuration: its unit's goodput per GPU (req/s), the answer and its
    alternatives coloured by status."""
    rows = sorted(_searched(doc), key=lambda c: c["goodput_per_gpu_rps"], reverse=True)[:limit]
    fig = _figure((9.0, 1.2 + 0.32 * max(len(rows), 1)))
    ax = fig.subplots()
    colors = {"verified": "C2", "unverifiable": "C3", "infeasible": "C7"}
    ys = range(len(rows))
    bars = ax.barh(
        list(ys), [c["goodput_per_gpu_rps"] for c in rows], color=[colors.get(c["status"], "C0") for c in rows]
    )
    ax.bar_label(
        bars,
        labels=[f"{c['goodput_per_gpu_rps']:.3g}{'+' if c['goodput_capped'] else ''}" for c in rows],
        fontsize=7,
        padding=2,
    )
    ax.set_yticks(list(ys), [c["label"] for c in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("goodput per GPU (req/s meeting the SLO target, one unit)")
    ax.margins(x=0.15)
    ax.grid(alpha=0.3, axis="x")
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color="C2", label="verified at the load"),
            Patch(color="C0", label="estimated / pruned"),
            Patch(color="C3", label="missed when simulated whole"),
            Patch(color="C7", label="infeasible"),
        ],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0,
    )
    ax.set_title(_title(doc, "goodput per GPU"), fontsize=9)
    return _save(fig, path)


def plot_cost_vs_goodput(doc: dict, path: Path) -> Path:
    """Each configuration's unit: cost per hour (x) against goodput (y); the Pareto front (no other
    unit is both cheaper and serves more) joined by a line, the answer starred."""
    rows = [c for c in _searched(doc) if c["goodput_rps"]]
    fig = _figure((7.6, 4.6))
    ax = fig.subplots()
    gpus = sorted({c["gpu"] for c in rows})
    for i, gpu in enumerate(gpus):
        for capped in (False, True):
            mine = [c for c in rows if c["gpu"] == gpu and c["goodput_capped"] == capped]
            if mine:
                ax.scatter(
                    [c["unit_price_per_hour"] for c in mine],
                    [c["goodput_rps"] for c in mine],
                    s=22,
                    label=f"{gpu}{' (at least: not searched further)' if capped else ''}",
                    **({"facecolors": "none", "edgecolors": f"C{i}"} if capped else {"color": f"C{i}"}),
                )
    # NOTE: the front is over measured goodputs only: a capped point's goodput is a lower bound.
    front, best = [], -1.0
    for c in sorted(
        (c for c in rows if not c["goodput_capped"]), key=lambda c: (c["unit_price_per_hour"], -c["goodput_rps"])
    ):
        if c["goodput_rps"] > best:
            front.append(c)
            best = c["goodput_rps"]
    if front:
        ax.plot(
            [c["unit_price_per_hour"] for c in front],
            [c["goodput_rps"] for c in front],
            color="k",
            lw=1,
            label="Pareto front",
        )
        for c in front:
            ax.annotate(
                c["label"],
                (c["unit_price_per_hour"], c["goodput_rps"]),
                fontsize=6,
                xytext=(4, -8),
                textcoords="offset points",
            )
    answer = doc.get("answer")
    if answer:
        ax.scatter(
            [answer["unit_price_per_hour"]],
            [answer["goodput_rps"]],
            marker="*",
            s=160,
            color="gold",
            edgecolor="k",
            zorder=5,
            label=f"answer: {answer['units']} x {answer['label']}",
        )
    ax.axhline(doc["query"]["qps"], color="C3", ls="--", lw=0.8, label=f"target load {doc['query']['qps']:g} req/s")
    ax.set_xlabel("cost of one unit ($/hour)")
    ax.set_ylabel("goodput of one unit (req/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title(_title(doc, "cost vs goodput"), fontsize=9)
    return _save(fig, path)


def plot_winners_attainment(doc: dict, path: Path, num: int = 4) -> Path:
    """SLO attainment against per-unit rate for the answer and its alternatives (their goodput
    probes), with the target."""
    winners = [c for c in doc["candidates"] if c["status"] == "verified"][:num] or _searched(doc)[:num]
    fig = _figure((7.6, 4.4))
    ax = fig.subplots()
    for i, c in enumerate(winners):
        probes = sorted(c["probes"], key=lambda p: p["rate"])
        ax.plot(
            [p["rate"] for p in probes],
            [100 * p["attainment"] for p in probes],
            marker="o",
            color=f"C{i}",
            label=c["label"],
        )
    ax.axhline(100 * doc["query"]["attainment"], color="C3", ls="--", lw=0.8, label="target")
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # 1, 2, 5, 10, 20, 50, ...
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("request rate of one unit (req/s, log scale)")
    ax.set_ylabel("SLO attainment (%)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title(_title(doc, "attainment vs rate"), fontsize=9)
    return _save(fig, path)

"""Gantt chart of a schedule, like InferMax Figure 15: (p)refill, decode and evict boxes per request,
and the KV cache usage over time."""

from __future__ import annotations

from pathlib import Path

from sloserve.optimal.problem import BatchPlan, BoundProblem


def plot_gantt(problem: BoundProblem, plan: list[BatchPlan], path: Path, title: str = "") -> Path:
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig = Figure(figsize=(11.5, 1.6 + 0.45 * len(problem.prompts)))
    ax = fig.add_subplot()
    known = list(problem.prompts)  # prompt + generated tokens
    computed = [0] * len(problem.prompts)
    for batch in plan:
        width = batch.end_s - batch.start_s
        for i in batch.evicted:
            ax.broken_barh([(batch.start_s, width)], (i - 0.4, 0.8), facecolors="tab:red")
            computed[i] = 0
        for i, c in batch.tokens.items():
            decode = known[i] - computed[i] == 1
            ax.broken_barh(
                [(batch.start_s, width)],
                (i - 0.4, 0.8),
                facecolors="0.6" if decode else "black",
                edgecolors="white",
                linewidth=0.5,
            )
            computed[i] += c
            if computed[i] == known[i]:
                known[i] += 1
    ax.set_yticks(range(len(problem.prompts)), [f"R{i + 1}" for i in range(len(problem.prompts))])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    kv = ax.twinx()
    kv.step(
        [b.start_s for b in plan] + [plan[-1].end_s] if plan else [],
        [0] + [b.kv_tokens for b in plan] if plan else [],
        where="post",
        color="tab:blue",
    )
    kv.axhline(problem.kv_capacity_tokens, color="tab:blue", linestyle=":", linewidth=1)
    kv.set_ylabel("KV tokens", color="tab:blue")
    kv.set_ylim(0, problem.kv_capacity_tokens * 1.1)
    ax.set_title(title or "schedule")
    legend = [Patch(facecolor="black", label="(p)refill"), Patch(facecolor="0.6", label="decode"),
              Patch(facecolor="tab:red", label="evict"), Line2D([], [], color="tab:blue", label="KV tokens"),
              Line2D([], [], color="tab:blue", linestyle=":", label="KV capacity M")]  # fmt: skip
    # NOTE: outside the axes: inside, it covers boxes
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.08, 1.0), borderaxespad=0, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path

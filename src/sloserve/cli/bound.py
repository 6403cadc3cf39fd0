"""``sloserve bound``: InferMax's optimal schedule (CP-SAT) and the relaxation beside the heuristics."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from sloserve.cli.app import main
from sloserve.cli.options import (
    check_out,
    scheduler_list,
)
from sloserve.core.errors import ConfigError
from sloserve.runs import check_rate

# Most requests `bound` takes: its heuristics run step by step and keep every batch as a warm start
# for the exact model (measured: 5,000 requests take 30 s and 330 MB; 100,000 would take ~10 minutes).
MAX_BOUND_REQUESTS = 10_000


@main.command()
@click.option("--fixed", help="Fixed lengths I,O for every request (InferMax §4 workloads).")
@click.option("--trace", help="Or sample requests from a trace (name or path).")
@click.option("--num-requests", type=int, default=3, show_default=True)
@click.option("--rate", type=float, help="Poisson arrivals (online setting); default offline.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--kv-capacity-tokens", "capacity", type=int, help="M [default: max(2I, I+O-1) of the longest]")
@click.option("--max-num-batched-tokens", "budget", type=int, default=4096, show_default=True, help="C")
@click.option("--prefill-token-budget", "prefill_budget", type=int, help="P (Sarathi's budget) [none]")
@click.option("--cost-model", default="llama-2-7b-a100", show_default=True, help="A linear preset or JSON file.")
@click.option(
    "--compare",
    "compare_with",
    default="vllm,vllm_ef,sarathi,infermax",
    show_default=True,
    help="Heuristic schedulers to run, warm-start from and compare with.",
)
@click.option("--time-limit", type=float, default=60.0, show_default=True, help="Solver time limit (s).")
@click.option("--max-cells", type=int, default=None, help="Allow larger models (requests x batches).")
@click.option("--out", type=click.Path(path_type=Path), help="Write schedule.json and gantt.png here.")
def bound(
    fixed,
    trace,
    num_requests,
    rate,
    seed,
    capacity,
    budget,
    prefill_budget,
    cost_model,
    compare_with,
    time_limit,
    max_cells,
    out,
) -> None:
    """The optimal schedule (InferMax §5, OR-Tools CP-SAT) and each heuristic's gap to it."""
    import numpy as np

    from sloserve.cost import LinearCostModel, linear_coefficients
    from sloserve.optimal import MAX_CELLS, BoundProblem, relaxed_bound, run_heuristic, solve_bound

    try:
        import ortools  # noqa: F401
    except ImportError:
        raise ConfigError("sloserve bound needs OR-Tools: pip install 'sloserve[bound]'") from None
    check_out(out)  # NOTE: before the solve, which may take minutes
    _check_options(fixed, trace, num_requests, rate, time_limit, max_cells)
    reqs = _workload(fixed, trace, num_requests, rate, seed).requests
    prompts = tuple(r.num_prompt_tokens for r in reqs)
    outputs = tuple(r.true_output_tokens for r in reqs)
    capacity = _default_capacity(prompts, outputs) if capacity is None else capacity
    cost = LinearCostModel(linear_coefficients(cost_model))
    problem = BoundProblem(prompts, outputs, tuple(r.arrival_time for r in reqs), capacity, budget, prefill_budget)
    names = scheduler_list(compare_with)
    runs = []
    for i, name in enumerate(names):
        click.echo(f"running {name} ({i + 1}/{len(names)}) on {len(reqs)} requests...", err=True)
        runs.append(run_heuristic(name, problem, cost))
    best = min(runs, key=lambda r: r.latency_s)
    problem = dataclasses.replace(problem, num_batches=max(r.num_batches for r in runs))
    relaxed = relaxed_bound(problem, cost)
    cells, limit = len(reqs) * problem.num_batches, MAX_CELLS if max_cells is None else max_cells
    shown = (
        f"I={list(prompts)}, O={list(outputs)}"
        if len(reqs) <= 8
        else f"mean I={np.mean(prompts):.0f}, O={np.mean(outputs):.0f}"
    )
    click.echo(
        f"{len(reqs)} requests ({shown}), M={capacity}, C={budget}, P={prefill_budget}, {problem.num_batches} batches"
    )
    click.echo(f"relaxation: any schedule takes at least {relaxed * 1e3:.3f} ms (optimal/relaxation.py)")
    in_reach = cells <= limit
    result = solve_bound(problem, cost, time_limit_s=time_limit, hint=best.hint, max_cells=limit) if in_reach else None
    solved = result is not None and bool(result.schedule)  # NOTE: UNKNOWN (time limit hit first) has none
    if solved:
        click.echo(
            f"bound: {result.status} in {result.wall_s:.1f}s ({result.num_variables} variables): latency "
            f"{result.latency_s * 1e3:.3f} ms, best bound {result.best_bound_s * 1e3:.3f} ms, gap {result.gap:.1%}, "
            f"evictions {sum(len(b.evicted) for b in result.schedule)}"
        )
        reference, against = result.latency_s, "the bound's schedule"
    elif in_reach:
        click.echo(
            f"bound: {result.status} in {result.wall_s:.1f}s ({result.num_variables} variables): no schedule "
            f"within --time-limit {time_limit:g} s (a longer limit may find one)"
        )
        reference, against = relaxed, "the relaxation"
    else:
        # NOTE: the relaxation still bounds every heuristic; only the exact model is out of reach.
        click.echo(
            f"bound: not solved: {len(reqs)} requests x {problem.num_batches} batches = {cells} cells exceeds "
            f"the limit of {limit} (--max-cells raises it; the model is NP-hard)"
        )
        reference, against = relaxed, "the relaxation"
    for run in runs:
        over = run.latency_s / reference - 1 if reference > 0 else 0.0
        click.echo(
            f"  {run.name:14s} latency {run.latency_s * 1e3:10.3f} ms  ({over:+.1%} over {against}), "
            f"{run.num_evictions} evictions"
        )
    if out is not None:
        status = result.status if in_reach else "NOT_SOLVED"
        _write_schedule(out, problem, status, relaxed, runs, result if solved else None)


def _check_options(fixed, trace, num_requests, rate, time_limit, max_cells) -> None:
    """A ConfigError for the first option out of range (before any request is sampled)."""
    if (fixed is None) == (trace is None):
        raise ConfigError("give --fixed I,O or --trace NAME")
    if num_requests < 1:
        raise ConfigError(f"--num-requests must be >= 1, got {num_requests}")
    if not time_limit > 0:
        raise ConfigError(f"--time-limit must be > 0 seconds, got {time_limit}")
    if max_cells is not None and max_cells < 1:
        raise ConfigError(f"--max-cells must be >= 1, got {max_cells}")
    check_rate("--rate", rate)
    if num_requests > MAX_BOUND_REQUESTS:
        raise ConfigError(
            f"--num-requests {num_requests} is above bound's limit of {MAX_BOUND_REQUESTS:,} (the exact model is "
            "NP-hard and solves tens of requests; past the limit only the relaxation bounds the heuristics): "
            "give fewer, or compare policies on large workloads with `sloserve compare`"
        )


def _workload(fixed, trace, num_requests, rate, seed):
    """The requests of ``--fixed I,O`` or sampled from ``--trace``, Poisson at ``--rate`` or all at t=0."""
    if fixed is not None:
        try:
            prompt, output = (int(x) for x in fixed.split(","))
        except ValueError:
            raise ConfigError(f"--fixed expects I,O (two integers), got {fixed!r}") from None
        if prompt < 1 or output < 1:
            raise ConfigError(f"--fixed lengths must be >= 1, got {fixed!r}")
        from sloserve.workload import synthetic_workload

        return synthetic_workload(prompt, output, num_requests, context_len=10**9, seed=seed, rate=rate)
    from sloserve.workload import workload_from_trace

    return workload_from_trace(
        trace, num_requests=num_requests, seed=seed, context_len=10**9, rate=rate, offline=rate is None
    )


def _default_capacity(prompts: tuple[int, ...], outputs: tuple[int, ...]) -> int:
    """M when not given: max(2I, I+O-1) of the longest request, capped at the bound's largest but never below what
    that request needs."""
    from sloserve.optimal.problem import MAX_BOUND_TOKENS

    longest = max(range(len(prompts)), key=lambda i: prompts[i] + outputs[i])
    capacity = max(2 * prompts[longest], prompts[longest] + outputs[longest] - 1)
    return max(min(capacity, MAX_BOUND_TOKENS), prompts[longest] + outputs[longest] - 1)


def _write_schedule(out: Path, problem, status: str, relaxed: float, runs: list, result) -> None:
    """``out``/schedule.json (the problem, the relaxation, each heuristic; the schedule where one was found, then
    drawn in gantt.png too)."""
    import json

    from sloserve.optimal.gantt import plot_gantt

    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "status": status,
        "relaxed_bound_s": relaxed,
        "problem": dataclasses.asdict(problem),  # (I, O, T, M, C, P, J)
        "heuristics": {r.name: {"latency_s": r.latency_s, "evictions": r.num_evictions} for r in runs},
    }
    if result is not None:
        doc.update(
            latency_s=result.latency_s,
            objective_s=result.objective_s,
            best_bound_s=result.best_bound_s,
            gap=result.gap,
            schedule=[
                {
                    "start_s": b.start_s,
                    "end_s": b.end_s,
                    "tokens": b.tokens,
                    "evicted": b.evicted,
                    "kv_tokens": b.kv_tokens,
                }
                for b in result.schedule
            ],
        )
        plot_gantt(
            problem,
            result.schedule,
            out / "gantt.png",
            title=f"{result.status} schedule, latency {result.latency_s * 1e3:.2f} ms",
        )
    (out / "schedule.json").write_text(json.dumps(doc, indent=2))
    click.echo(f"wrote {out}/schedule.json" + (f" and {out}/gantt.png" if result is not None else ""))

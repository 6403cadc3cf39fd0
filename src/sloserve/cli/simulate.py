"""``sloserve simulate``, ``compare`` and ``sweep``: the simulator on a workload, one scheduler,
several, or several over rates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from sloserve.cli.app import main
from sloserve.cli.options import (
    ParallelExecutor,
    ProgressBar,
    check_out,
    has_metric,
    offset_progress,
    parallel_options,
    print_table,
    report,
    run_one,
    scheduler_list,
    system_options,
    table_width,
    workload_options,
    write_outputs,
)
from sloserve.core.errors import ConfigError
from sloserve.runs import (
    SimOptions,
    check_rate,
    public,
    setup_from_options,
)


# --- commands ------------------------------------------------------------------------------------
@main.command()
@click.option("--scheduler", default="vllm", show_default=True, help="Scheduler name (see `sloserve schedulers`).")
@click.option("--set", "set_pairs", multiple=True, metavar="KEY=VALUE", help="Scheduler option; repeatable.")
@workload_options
@system_options
@click.option("--out", type=click.Path(path_type=Path), help="Write summary.json, requests.csv, timeline.csv, plots.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def simulate(scheduler: str, set_pairs: tuple[str, ...], out: Path | None, as_json: bool, **options: Any) -> None:
    """Simulate one scheduler on a workload."""
    from sloserve.sched import parse_set_options

    check_out(out)
    set_options = parse_set_options(set_pairs)
    setup = setup_from_options(SimOptions(**options))
    workload = setup.make_workload()
    summary = run_one(setup, scheduler, set_options, workload, progress=not as_json)
    report(scheduler, summary, workload, out, as_json, f"{workload.name}, {len(workload)} requests")


@main.command()
@click.option("--schedulers", default="vllm,sarathi,orca", show_default=True, help="Comma-separated names.")
@click.option("--set", "set_pairs", multiple=True, metavar="NAME.KEY=VALUE", help="Option for one scheduler.")
@workload_options
@system_options
@click.option("--out", type=click.Path(path_type=Path), help="Write one folder per scheduler and compare.png.")
@click.option("--json", "as_json", is_flag=True, help="Print {scheduler: summary} as JSON on stdout.")
def compare(schedulers: str, set_pairs: tuple[str, ...], out: Path | None, as_json: bool, **options: Any) -> None:
    """Run several schedulers on the same workload and print one table."""
    from sloserve.metrics import compare_table, summary_to_json
    from sloserve.metrics.plots import caption, plot_compare_bars

    check_out(out)
    names = scheduler_list(schedulers)
    per_scheduler = _split_set_options(set_pairs, names)
    setup = setup_from_options(SimOptions(**options))
    workload = setup.make_workload()
    summaries = {name: run_one(setup, name, per_scheduler[name], workload, progress=not as_json) for name in names}
    if out is not None:
        for name, summary in summaries.items():
            write_outputs(out / name, summary)
        (out / "compare.json").write_text(summary_to_json({n: public(s) for n, s in summaries.items()}))
        first = next(iter(summaries.values()))
        plot_compare_bars(
            {n: public(s) for n, s in summaries.items()},
            out / "compare.png",
            title=f"{caption(first, with_scheduler=False)}, {len(workload)} requests",
        )
    if as_json:
        click.echo(summary_to_json({n: public(s) for n, s in summaries.items()}))
    else:
        print_table(compare_table(summaries, f"{workload.name}, {len(workload)} requests", table_width()))
        if out is not None:
            click.echo(f"wrote {out}/<scheduler>/ and {out}/compare.png")


def _split_set_options(pairs: tuple[str, ...], names: list[str]) -> dict[str, dict[str, str]]:
    """``vllm.block_size=32`` goes to vllm; ``block_size=32`` goes to every scheduler, except one that is
    given its own (whichever comes first on the command line)."""
    from sloserve.sched import parse_set_options

    every: dict[str, str] = {}
    per: dict[str, dict[str, str]] = {name: {} for name in names}
    for key, value in parse_set_options(pairs).items():
        scheduler, dot, option = key.partition(".")
        if dot and scheduler in per:
            per[scheduler][option] = value
        elif dot:
            raise ConfigError(f"--set {key}: {scheduler!r} is not among --schedulers {','.join(names)}")
        else:
            every[key] = value
    return {name: {**every, **own} for name, own in per.items()}


@main.command()
@click.option("--rates", required=True, help="Comma-separated Poisson rates (requests/s).")
@click.option("--schedulers", default="vllm,sarathi,orca", show_default=True)
@click.option("--set", "set_pairs", multiple=True, metavar="NAME.KEY=VALUE")
@workload_options
@system_options
@click.option("--metric", default="normalized_latency_s", show_default=True, help="Summary key to plot.")
@parallel_options
@click.option("--out", type=click.Path(path_type=Path), default=Path("sweep-out"), show_default=True)
def sweep(
    rates: str,
    schedulers: str,
    set_pairs: tuple[str, ...],
    metric: str,
    workers: int | None,
    ray_address: str | None,
    out: Path,
    **options: Any,
) -> None:
    """Rate sweep: the metric (default normalized latency) against request rate, per scheduler.
    Runs one by one, or on Ray with --workers N / --ray-address (the same results)."""
    from sloserve.metrics import summary_to_json, sweep_table
    from sloserve.metrics.plots import caption, plot_sweep
    from sloserve.runs import simulate_options

    check_out(out)
    try:
        rate_values = [float(r) for r in rates.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"--rates must be comma-separated numbers, got {rates!r}") from None
    if not rate_values:
        raise ConfigError("--rates needs at least one rate (requests/s)")
    for value in rate_values:
        check_rate("--rates", value)
    names = scheduler_list(schedulers)
    per_scheduler = _split_set_options(set_pairs, names)
    sim_options = SimOptions(**options)
    calls = [(sim_options, name, per_scheduler[name], rate) for rate in rate_values for name in names]
    first = simulate_options(*calls[0])  # in this process: a --metric the summary lacks fails fast
    if not has_metric(first, metric):
        numeric = [k for k, v in first.items() if isinstance(v, (int, float)) or (isinstance(v, dict) and "mean" in v)]
        raise ConfigError(f"--metric {metric!r} is not in the summary; e.g. {', '.join(numeric)}")
    with ParallelExecutor(workers, ray_address, default_workers=1) as executor:
        with ProgressBar(len(calls), f"sweep ({executor.workers} workers)", enabled=True) as on_progress:
            rest = executor.map(simulate_options, calls[1:], on_done=offset_progress(on_progress, 1))
    results: dict[str, list[tuple[float, dict]]] = {name: [] for name in names}
    for (_, name, _, rate), summary in zip(calls, [first, *rest], strict=True):
        results[name].append((rate, summary))
    out.mkdir(parents=True, exist_ok=True)
    what = " · ".join(
        x
        for x in (
            caption(first, with_scheduler=False, with_workload=False),
            str(first.get("workload", "")).split("@")[0],
        )
        if x
    )
    plot_sweep(
        results,
        out / f"sweep_{metric}.png",
        metric=metric,
        logy=True,
        title=f"{metric} vs request rate{': ' + what if what else ''}",
    )
    (out / "sweep.json").write_text(summary_to_json({n: [{"rate": r, **s} for r, s in v] for n, v in results.items()}))
    print_table(sweep_table(results, metric))
    click.echo(f"wrote {out}/sweep_{metric}.png and {out}/sweep.json")

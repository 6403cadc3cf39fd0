"""The ``sloserve`` command: simulate, compare, sweep, bound, run and profile the real engine, and list
traces, schedulers and hardware."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sloserve.core.errors import ConfigError, SloserveError, UnknownNameError
from sloserve.runs import (
    Setup,
    fresh_workload,
    make_workload_from_options,
    public,
    run_simulation,
    setup_from_options,
)


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


class _Command(click.Command):
    """Turns sloserve's own errors into one line on stderr and exit code 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (SloserveError, FileNotFoundError) as exc:
            _fail(str(exc))


class _Group(click.Group):
    command_class = _Command


@click.group(cls=_Group)
@click.version_option(package_name="sloserve")
def main() -> None:
    """SLO-aware LLM serving schedulers: simulate them on real traces."""


# --- shared options ------------------------------------------------------------------------------
def _workload_options(fn: Callable) -> Callable:
    options = [
        click.option("--trace", help="Bundled trace name (see `sloserve traces`) or a CSV/JSONL path."),
        click.option("--workload", help="Workload spec: a bundled name or a YAML path (instead of --trace)."),
        click.option("--columns", help="Column mapping for a user trace, e.g. prompt=in,output=out,arrival=t."),
        click.option("--rate", type=float, help="Poisson arrival rate (requests/s)."),
        click.option("--burstiness", type=float, help="Gamma arrivals with this coefficient of variation."),
        click.option("--trace-arrivals", is_flag=True, help="Replay the trace's own timestamps."),
        click.option("--offline", is_flag=True, help="All requests arrive at t=0."),
        click.option(
            "--num-requests",
            type=int,
            default=None,
            help="Requests to sample [1000 with --trace; its rows, at most 1000, with --trace-arrivals].",
        ),
        click.option("--max-tokens", type=int, help="Per-request max_tokens (default: context - prompt)."),
        click.option("--slo-ttft", type=float, help="TTFT SLO in seconds for --trace requests."),
        click.option("--slo-tpot", type=float, help="TPOT SLO in seconds for --trace requests."),
        click.option("--slo-jct", type=float, help="JCT SLO in seconds for --trace requests."),
        click.option("--rt-rate", type=float, help="With --workload: the rate of its Poisson/gamma RT streams."),
        click.option("--seed", type=int, default=0, show_default=True),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _system_options(fn: Callable) -> Callable:
    options = [
        click.option(
            "--model",
            default="llama-2-7b",
            show_default=True,
            help="Model spec name, or an engine model: random:NAME or a local HF directory.",
        ),
        click.option("--gpu", default="a100", show_default=True, help="GPU spec name."),
        click.option("--num-gpus", type=int, default=1, show_default=True, help="Tensor-parallel GPUs per replica."),
        click.option("--max-model-len", type=int, help="Context length (default: the model's own)."),
        click.option("--cost-model", help="Linear preset name, 'roofline', or a JSON preset file."),
        click.option("--kv-capacity-tokens", type=int, help="KV cache size per replica (default: from memory)."),
        click.option("--memory-utilization", type=float, default=0.9, show_default=True),
        click.option(
            "--swap-space-gib", type=float, default=4.0, show_default=True, help="CPU swap space per replica."
        ),
        click.option("--replicas", type=int, default=1, show_default=True),
        click.option("--router", default="round-robin", show_default=True, help="round-robin or least-outstanding."),
        click.option(
            "--disaggregate",
            metavar="P:D",
            help="DistServe-style: P prefill replicas hand requests to D decode replicas.",
        ),
        click.option(
            "--link-gbps",
            type=float,
            default=100.0,
            show_default=True,
            help="KV transfer link per prefill replica (with --disaggregate), Gb/s.",
        ),
        click.option("--no-fast-path", is_flag=True, help="Run every step one by one (for checking)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _run_one(setup: Setup, scheduler: str, set_options: dict[str, str], workload, *, progress: bool) -> dict:
    """``run_simulation`` with a progress bar over the requests when ``progress``."""
    with _progress(len(workload.requests), scheduler, enabled=progress) as on_progress:
        return run_simulation(setup, scheduler, set_options, workload, on_progress=on_progress)


class _progress:
    """A rich progress bar on stderr when it is a terminal; a no-op callback otherwise."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label = total, label
        self.enabled = enabled and sys.stderr.isatty()
        self._bar = None

    def __enter__(self) -> Callable[..., None] | None:
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self._bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._bar.start()
        task = self._bar.add_task(self.label, total=self.total)

        def update(done: int, description: str | None = None) -> None:
            self._bar.update(task, completed=done, **({"description": description} if description else {}))

        return update

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _has_metric(summary: dict, metric: str) -> bool:
    """``metric`` (a key or dotted path, as ``metrics.metric_value`` reads it) names a number or stats."""
    node: Any = summary
    for part in metric.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return node is None or isinstance(node, (int, float)) or (isinstance(node, dict) and "mean" in node)


def _check_out(out: Path | None) -> None:
    """--out must be a directory or a path that can become one (checked before a run, not after)."""
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--out {out}: {parent} is a file, not a directory")
            break


def _check_file_out(path: Path | None, option: str) -> None:
    """A file to write must name a file in an existing directory (checked before the work)."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"{option} {path}: is a directory, not a file")
    if not path.parent.is_dir():
        raise ConfigError(f"{option} {path}: {path.parent} is not an existing directory")


def _write(out: Path, summary: dict) -> None:
    from sloserve.metrics import write_run_outputs

    requests, timeline = summary["_result"]
    write_run_outputs(out, public(summary), requests, timeline)


def _report(scheduler: str, summary: dict, workload, out: Path | None, as_json: bool, title: str) -> None:
    """Write a one-scheduler run's outputs and print its summary (JSON, or a table and notes)."""
    from sloserve.metrics import compare_table, summary_to_json

    if out is not None:
        _write(out, summary)
    if as_json:
        click.echo(summary_to_json(public(summary)))
        return
    _print_table(compare_table({scheduler: summary}, title, _table_width()))
    if workload.num_clipped:
        click.echo(f"note: {workload.num_clipped} requests clipped to the model context: {workload.clipped_details}")
    if out is not None:
        click.echo(f"wrote {out}/summary.json, requests.csv, timeline.csv and plots")


def _table_width() -> int:
    """The terminal's width; 160 when stdout is a file or a pipe (nothing wraps lines there)."""
    from rich.console import Console

    console = Console()
    return console.width if console.is_terminal else 160


def _print_table(table) -> None:
    from rich.console import Console

    Console(width=_table_width()).print(table)


# NOTE: cost.fit's FORMS and DEFAULT_FORM, spelt out: importing sloserve.cost here would load scipy
# (a third of a second) for every command.
FIT_FORMS = ("knee", "floor", "infermax")
DEFAULT_FIT_FORM = "floor"


def _parallel_options(fn: Callable) -> Callable:
    fn = click.option("--ray-address", help="Run on the Ray cluster at this address (host:port, ray://host:port, "
                      "auto); its nodes need the same sloserve installed.")(fn)  # fmt: skip
    return click.option("--workers", type=int,
                        help="Simulations at once: 1 runs them one by one here; N > 1 on a local Ray of N CPUs "
                        "(pip install 'sloserve[ray]').")(fn)  # fmt: skip


def _offset(on_progress: Callable[[int], None] | None, done_before: int) -> Callable[[int], None] | None:
    """A progress callback that counts ``done_before`` runs as already done."""
    return None if on_progress is None else lambda done: on_progress(done_before + done)


class _executor:
    """``make_executor`` as a context manager (Ray shuts down on the way out). ``default_workers``:
    what no --workers means (None: every core on Ray when Ray is installed, else one by one)."""

    def __init__(self, workers: int | None, address: str | None, default_workers: int | None) -> None:
        if workers is None and not address:
            workers = default_workers
            if workers is None and importlib.util.find_spec("ray") is None:
                click.echo("note: Ray is not installed (pip install 'sloserve[ray]'): running one by one", err=True)
                workers = 1
        from sloserve.parallel import make_executor

        self._executor = make_executor(workers, address)

    def __enter__(self):
        return self._executor

    def __exit__(self, *exc: object) -> None:
        self._executor.close()


# --- commands ------------------------------------------------------------------------------------
@main.command()
@click.option("--scheduler", default="vllm", show_default=True, help="Scheduler name (see `sloserve schedulers`).")
@click.option("--set", "set_pairs", multiple=True, metavar="KEY=VALUE", help="Scheduler option; repeatable.")
@_workload_options
@_system_options
@click.option("--out", type=click.Path(path_type=Path), help="Write summary.json, requests.csv, timeline.csv, plots.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def simulate(scheduler: str, set_pairs: tuple[str, ...], out: Path | None, as_json: bool, **options: Any) -> None:
    """Simulate one scheduler on a workload."""
    from sloserve.sched import parse_set_options

    _check_out(out)
    set_options = parse_set_options(set_pairs)
    setup = setup_from_options(options)
    workload = setup.make_workload()
    summary = _run_one(setup, scheduler, set_options, workload, progress=not as_json)
    _report(scheduler, summary, workload, out, as_json, f"{workload.name}, {len(workload)} requests")


def _scheduler_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ConfigError("--schedulers needs at least one name")
    return names


@main.command()
@click.option("--schedulers", default="vllm,sarathi,orca", show_default=True, help="Comma-separated names.")
@click.option("--set", "set_pairs", multiple=True, metavar="NAME.KEY=VALUE", help="Option for one scheduler.")
@_workload_options
@_system_options
@click.option("--out", type=click.Path(path_type=Path), help="Write one folder per scheduler and compare.png.")
@click.option("--json", "as_json", is_flag=True, help="Print {scheduler: summary} as JSON on stdout.")
def compare(schedulers: str, set_pairs: tuple[str, ...], out: Path | None, as_json: bool, **options: Any) -> None:
    """Run several schedulers on the same workload and print one table."""
    from sloserve.metrics import compare_table, summary_to_json
    from sloserve.metrics.plots import caption, plot_compare_bars

    _check_out(out)
    names = _scheduler_list(schedulers)
    per_scheduler = _split_set_options(set_pairs, names)
    setup = setup_from_options(options)
    workload = setup.make_workload()
    summaries = {name: _run_one(setup, name, per_scheduler[name], workload, progress=not as_json) for name in names}
    if out is not None:
        for name, summary in summaries.items():
            _write(out / name, summary)
        (out / "compare.json").write_text(summary_to_json({n: public(s) for n, s in summaries.items()}))
        first = next(iter(summaries.values()))
        plot_compare_bars({n: public(s) for n, s in summaries.items()}, out / "compare.png",
                          title=f"{caption(first, with_scheduler=False)}, {len(workload)} requests")  # fmt: skip
    if as_json:
        click.echo(summary_to_json({n: public(s) for n, s in summaries.items()}))
    else:
        _print_table(compare_table(summaries, f"{workload.name}, {len(workload)} requests", _table_width()))
        if out is not None:
            click.echo(f"wrote {out}/<scheduler>/ and {out}/compare.png")


def _split_set_options(pairs: tuple[str, ...], names: list[str]) -> dict[str, dict[str, str]]:
    """``vllm.block_size=32`` goes to vllm; ``block_size=32`` goes to every scheduler."""
    from sloserve.sched import parse_set_options

    per: dict[str, dict[str, str]] = {name: {} for name in names}
    for key, value in parse_set_options(pairs).items():
        scheduler, dot, option = key.partition(".")
        if dot and scheduler in per:
            per[scheduler][option] = value
        elif dot:
            raise ConfigError(f"--set {key}: {scheduler!r} is not among --schedulers {','.join(names)}")
        else:
            for options in per.values():
                options[key] = value
    return per


@main.command()
@click.option("--rates", required=True, help="Comma-separated Poisson rates (requests/s).")
@click.option("--schedulers", default="vllm,sarathi,orca", show_default=True)
@click.option("--set", "set_pairs", multiple=True, metavar="NAME.KEY=VALUE")
@_workload_options
@_system_options
@click.option("--metric", default="normalized_latency_s", show_default=True, help="Summary key to plot.")
@_parallel_options
@click.option("--out", type=click.Path(path_type=Path), default=Path("sweep-out"), show_default=True)
def sweep(rates: str, schedulers: str, set_pairs: tuple[str, ...], metric: str, workers: int | None,
          ray_address: str | None, out: Path, **options: Any) -> None:  # fmt: skip
    """Rate sweep: the metric (default normalized latency) against request rate, per scheduler.
    Runs one by one, or on Ray with --workers N / --ray-address (the same results)."""
    from sloserve.metrics import summary_to_json, sweep_table
    from sloserve.metrics.plots import caption, plot_sweep
    from sloserve.runs import simulate_options

    _check_out(out)
    try:
        rate_values = [float(r) for r in rates.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"--rates must be comma-separated numbers, got {rates!r}") from None
    if not rate_values or any(r <= 0 for r in rate_values):
        raise ConfigError(f"--rates must be > 0, got {rates!r}")
    names = _scheduler_list(schedulers)
    per_scheduler = _split_set_options(set_pairs, names)
    calls = [(options, name, per_scheduler[name], rate) for rate in rate_values for name in names]
    first = simulate_options(*calls[0])  # in this process: a --metric the summary lacks fails fast
    if not _has_metric(first, metric):
        numeric = [k for k, v in first.items() if isinstance(v, (int, float)) or (isinstance(v, dict) and "mean" in v)]
        raise ConfigError(f"--metric {metric!r} is not in the summary; e.g. {', '.join(numeric)}")
    with _executor(workers, ray_address, default_workers=1) as executor:
        with _progress(len(calls), f"sweep ({executor.workers} workers)", enabled=True) as on_progress:
            rest = executor.map(simulate_options, calls[1:], on_done=_offset(on_progress, 1))
    results: dict[str, list[tuple[float, dict]]] = {name: [] for name in names}
    for (_, name, _, rate), summary in zip(calls, [first, *rest], strict=True):
        results[name].append((rate, summary))
    out.mkdir(parents=True, exist_ok=True)
    what = " · ".join(x for x in (caption(first, with_scheduler=False, with_workload=False),
                                  str(first.get("workload", "")).split("@")[0]) if x)  # fmt: skip
    plot_sweep(results, out / f"sweep_{metric}.png", metric=metric, logy=True,
               title=f"{metric} vs request rate{': ' + what if what else ''}")  # fmt: skip
    (out / "sweep.json").write_text(summary_to_json({n: [{"rate": r, **s} for r, s in v] for n, v in results.items()}))
    _print_table(sweep_table(results, metric))
    click.echo(f"wrote {out}/sweep_{metric}.png and {out}/sweep.json")


def _parse_set_grid(pairs: tuple[str, ...], names: list[str]) -> dict[str, dict[str, list[str]]]:
    """``--set-grid KEY=V1,V2`` (every scheduler) or ``NAME.KEY=V1,V2`` (one): scheduler -> key -> values."""
    grid: dict[str, dict[str, list[str]]] = {name: {} for name in names}
    for pair in pairs:
        key, sep, values = pair.partition("=")
        choices = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not choices:
            raise ConfigError(f"--set-grid expects KEY=V1,V2 or SCHEDULER.KEY=V1,V2, got {pair!r}")
        scheduler, dot, option = key.strip().rpartition(".")
        if dot and scheduler not in grid:
            raise ConfigError(f"--set-grid {pair}: {scheduler!r} is not among --schedulers {','.join(names)}")
        for name in [scheduler] if dot else names:
            grid[name][option] = choices
    return grid


def _validate_grid(grid: dict[str, dict[str, list[str]]], model, gpu: str, cost_model: str | None) -> None:
    """Build each scheduler at every point of its grid once: a bad name or value fails before the search."""
    import itertools

    from sloserve.cost import build_cost_model, get_gpu
    from sloserve.sched import make_scheduler

    cost = build_cost_model(model, get_gpu(gpu), cost_model=cost_model)
    for name, knobs in grid.items():
        for values in itertools.product(*knobs.values()):
            make_scheduler(name, kv_capacity_tokens=10 * model.max_context_len, max_model_len=model.max_context_len,
                           kv_bytes_per_token=model.kv_bytes_per_token, cost_model=cost,
                           options=dict(zip(knobs, values, strict=True)))  # fmt: skip


def _layouts(text: str) -> list[tuple[int, int]]:
    """``--layouts colocated,1:1,1:2``: (0, 0) for colocated, (P, D) for P prefill and D decode replicas."""
    layouts = []
    for part in (p.strip().lower() for p in text.split(",")):
        p, sep, d = part.partition(":")
        if part == "colocated":
            layouts.append((0, 0))
        elif sep and p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1:
            layouts.append((int(p), int(d)))
        else:
            raise ConfigError(f"--layouts expects colocated and/or P:D pairs such as 1:1, got {part!r}")
    return list(dict.fromkeys(layouts))


@main.command()
@click.option("--qps", type=float, required=True, help="The load to serve (Poisson requests/s; with --workload "
              "its RT streams' rate).")  # fmt: skip
@click.option("--attainment", type=float, default=0.9, show_default=True,
              help="Share of requests that must meet their SLOs.")  # fmt: skip
@click.option("--trace", help="Bundled trace name (see `sloserve traces`) or a CSV/JSONL path.")
@click.option("--workload", help="Workload spec: a bundled name or a YAML path (instead of --trace).")
@click.option("--columns", help="Column mapping for a user trace, e.g. prompt=in,output=out.")
@click.option("--num-requests", type=int, default=1000, show_default=True,
              help="Requests per simulated unit (a deployment of k units runs k times as many).")  # fmt: skip
@click.option("--max-tokens", type=int, help="Per-request max_tokens (default: context - prompt).")
@click.option("--burstiness", type=float, help="Gamma arrivals with this coefficient of variation.")
@click.option("--slo-ttft", type=float, help="TTFT SLO in seconds (--trace).")
@click.option("--slo-tpot", type=float, help="TPOT SLO in seconds (--trace).")
@click.option("--slo-jct", type=float, help="JCT SLO in seconds (--trace).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--model", default="llama-2-7b", show_default=True, help="Model spec name (see `sloserve hardware`).")
@click.option("--gpus", default="a100,h100,h200", show_default=True, help="GPU types to consider.")
@click.option("--tp", "tensor_parallel", default="1,2,4,8", show_default=True,
              help="Tensor-parallel degrees to consider (those that fit and divide the heads).")  # fmt: skip
@click.option("--max-gpus", type=int, default=16, show_default=True, help="Most GPUs a deployment may use.")
@click.option("--schedulers", default="vllm,sarathi", show_default=True, help="Schedulers to consider.")
@click.option("--layouts", default="colocated,1:1,1:2,2:1", show_default=True,
              help="colocated and/or disaggregated P:D units (P prefill and D decode replicas).")  # fmt: skip
@click.option("--set-grid", "grid_pairs", multiple=True, metavar="[NAME.]KEY=V1,V2",
              help="Scheduler options to search over; repeatable.")  # fmt: skip
@click.option("--prices", help="USD per GPU-hour over the defaults, e.g. a100=1.2,a30=0.6.")
@click.option("--cost-model", default="roofline", show_default=True,
              help="One cost model for every candidate, so they compare on equal terms.")  # fmt: skip
@click.option("--memory-utilization", type=float, default=0.9, show_default=True)
@click.option("--swap-space-gib", type=float, default=4.0, show_default=True, help="CPU swap space per replica.")
@click.option("--router", default="round-robin", show_default=True, help="round-robin or least-outstanding.")
@click.option("--link-gbps", type=float, default=100.0, show_default=True, help="KV link per prefill replica, Gb/s.")
@click.option("--tolerance", type=float, default=0.05, show_default=True,
              help="Goodput bisection stops when its bracket is within this (relative).")  # fmt: skip
@click.option("--alternatives", type=int, default=3, show_default=True, help="Runner-up deployments to verify.")
@_parallel_options
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Write plan.json and the plots here.")
@click.option("--json", "as_json", is_flag=True, help="Print plan.json on stdout instead of the table.")
def plan(qps: float, attainment: float, gpus: str, tensor_parallel: str, max_gpus: int, schedulers: str,
         layouts: str, grid_pairs: tuple[str, ...], prices: str | None, tolerance: float, alternatives: int,
         workers: int | None, ray_address: str | None, out: Path, as_json: bool, **options: Any) -> None:  # fmt: skip
    """The cheapest deployment that serves --qps within the SLOs: searches GPU type, tensor parallelism,
    replicas, colocated or disaggregated (P:D), scheduler and --set-grid options; each candidate's
    goodput by bisection, the winners simulated whole. Parallel on Ray (see docs/planning.md)."""
    from sloserve.plan import PlanQuery, enumerate_candidates, parse_prices
    from sloserve.plan import plan as run_plan
    from sloserve.plan.prices import price_per_gpu_hour
    from sloserve.plan.report import plan_table, write_plan
    from sloserve.runs import SYSTEM_DEFAULTS, WORKLOAD_DEFAULTS, make_workload_from_options, model_spec
    from sloserve.sched import SCHEDULERS
    from sloserve.sched.registry import describe_options

    _check_out(out)
    if not qps > 0 or qps == float("inf"):
        raise ConfigError(f"--qps must be > 0, got {qps}")
    if not 0 < attainment <= 1:
        raise ConfigError(f"--attainment must be in (0, 1], got {attainment}")
    if max_gpus < 1:
        raise ConfigError(f"--max-gpus must be >= 1, got {max_gpus}")
    if not 0 < tolerance < 1:
        raise ConfigError(f"--tolerance must be in (0, 1), got {tolerance}")
    if alternatives < 0:
        raise ConfigError(f"--alternatives must be >= 0, got {alternatives}")
    if options["trace"] and not any(options[k] is not None for k in ("slo_ttft", "slo_tpot", "slo_jct")):
        raise ConfigError("plan needs an SLO to meet: give --slo-ttft, --slo-tpot and/or --slo-jct")
    base = {**WORKLOAD_DEFAULTS, **SYSTEM_DEFAULTS, **options}
    model = model_spec(options["model"])
    workload = make_workload_from_options(base, model.max_context_len, rate=qps)  # bad workload options fail here
    names = _scheduler_list(schedulers)
    for name in names:
        if name not in SCHEDULERS:
            raise UnknownNameError("scheduler", name, sorted(SCHEDULERS))
    gpu_names = [g.strip() for g in gpus.split(",") if g.strip()]
    if not gpu_names:
        raise ConfigError("--gpus needs at least one GPU name")
    grid = _parse_set_grid(grid_pairs, names)
    _validate_grid(grid, model, gpu_names[0], options["cost_model"])
    price_table = parse_prices(prices)
    degrees = _int_list(tensor_parallel, "--tp")
    if 0 in degrees:
        raise ConfigError(f"--tp degrees must be >= 1, got {tensor_parallel!r}")
    role_schedulers = {n for n in names if "role" in describe_options(n)}
    candidates, skipped = enumerate_candidates(model, gpu_names, list(degrees), names, _layouts(layouts), grid,
                                               max_gpus, options["memory_utilization"], role_schedulers)  # fmt: skip
    if not candidates:
        reasons = "; ".join(f"{x['label']}: {x['reason']}" for x in skipped[:3])
        raise ConfigError(f"no configuration to search ({len(skipped)} left out): {reasons}")
    for gpu in sorted({c.gpu for c in candidates}):
        price_per_gpu_hour(price_table, gpu)  # a GPU without a price fails here
    query = PlanQuery(qps, attainment, max_gpus, base, tolerance, alternatives)
    slo = {"ttft_s": options["slo_ttft"], "tpot_s": options["slo_tpot"], "jct_s": options["slo_jct"]}
    describe = {"model": model.name, "workload": workload.name.split("@")[0], "slo": slo,
                "num_requests_per_unit": options["num_requests"], "seed": options["seed"],
                "cost_model": options["cost_model"], "router": options["router"]}  # fmt: skip
    with _executor(workers, ray_address, default_workers=None) as executor:
        with _progress(len(candidates), f"plan ({executor.workers} workers)", enabled=True) as on_progress:

            def on_round(text: str, decided: int) -> None:
                if on_progress is not None:  # the bar counts decided candidates; its label, the round
                    on_progress(decided, f"plan ({executor.workers} workers), {text}")

            doc = run_plan(query, candidates, price_table, executor, skipped=skipped, describe=describe,
                           on_round=on_round)  # fmt: skip
    written = write_plan(doc, out)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        _print_table(plan_table(doc, _table_width()))
        for line in _plan_lines(doc):
            click.echo(line)
        click.echo(f"wrote {', '.join(str(p) for p in written)}")
    if doc["answer"] is None:
        _fail(doc["message"])


def _plan_lines(doc: dict) -> list[str]:
    """The answer and its alternatives in words."""
    s = doc["search"]
    lines = [f"searched {s['candidates']} configurations in {s['runs']} simulations ({s['rounds']} rounds, "
             f"{s['workers']} workers, {s['wall_s']:.1f} s)"]  # fmt: skip
    for title, c in [("answer", doc["answer"])] + [("alternative", a) for a in doc["alternatives"]]:
        if c is None:
            continue
        v = c["verified"]
        lines.append(f"{title}: {c['units']} x {c['label']} = {c['num_gpus']} GPUs, ${c['cost_per_hour']:.2f}/hour; "
                     f"simulated whole at {doc['query']['qps']:g} req/s: {v['attainment']:.1%} attainment, "
                     f"p99 TTFT {v['ttft_p99_s']:.3g} s, p99 TPOT {v['tpot_p99_s']:.3g} s")  # fmt: skip
    return lines


@main.command()
def traces() -> None:
    """List the bundled traces with row counts and length statistics."""
    from rich.table import Table

    from sloserve.workload import TRACES, trace_summary

    table = Table(title="bundled traces (token counts)")
    for col in ("name", "rows", "prompt mean/p50/p99/max", "output mean/p50/p99/max", "arrivals", "description"):
        table.add_column(col)
    for name, info in TRACES.items():
        s = trace_summary(name)
        fmt = "{:.0f} / {:.0f} / {:.0f} / {:.0f}"
        arrivals = f"{s['duration_s']:.0f} s, {s['rate_rps']:.2f} req/s" if s["has_arrivals"] else "-"
        table.add_row(
            name,
            str(s["rows"]),
            fmt.format(s["prompt_mean"], s["prompt_p50"], s["prompt_p99"], s["prompt_max"]),
            fmt.format(s["output_mean"], s["output_p50"], s["output_p99"], s["output_max"]),
            arrivals,
            info.description,
        )
    _print_table(table)


@main.command()
def schedulers() -> None:
    """List the registered schedulers and their options."""
    from sloserve.sched import SCHEDULERS
    from sloserve.sched.registry import describe_options

    for name in sorted(SCHEDULERS):
        click.echo(f"{name}: {SCHEDULERS[name].description}")
        click.echo("    " + ", ".join(f"{k}={v}" for k, v in describe_options(name).items()))


@main.command()
def hardware() -> None:
    """List the bundled model and GPU specs and the cost-model presets."""
    from rich.table import Table

    from sloserve.cost import GPUS, MODELS, list_presets

    models = Table(title="models (--model)")
    for header in ("name", "params (B)", "layers", "hidden", "heads / KV heads", "context", "KV KiB/token"):
        models.add_column(header, justify="left" if header == "name" else "right")
    for name in sorted(MODELS):
        m = MODELS[name]
        models.add_row(name, f"{m.num_params / 1e9:.1f}", str(m.num_layers), f"{m.hidden_size:,}",
                       f"{m.num_attention_heads} / {m.num_kv_heads}", f"{m.max_context_len:,}",
                       f"{m.kv_bytes_per_token / 1024:g}")  # fmt: skip
    gpus = Table(title="GPUs (--gpu)")
    for header in ("name", "memory GB", "BF16 TFLOP/s", "HBM TB/s", "PCIe GB/s", "NVLink GB/s"):
        gpus.add_column(header, justify="left" if header == "name" else "right")
    for name in sorted(GPUS):
        g = GPUS[name]
        gpus.add_row(name, f"{g.memory_bytes / 1e9:g}", f"{g.peak_flops / 1e12:g}", f"{g.hbm_bandwidth / 1e12:g}",
                     f"{g.pcie_bandwidth / 1e9:g}", f"{g.interconnect_bandwidth / 1e9:g}")  # fmt: skip
    _print_table(models)
    _print_table(gpus)
    click.echo("cost-model presets (--cost-model): " + ", ".join(list_presets()) + ", roofline, or a JSON file")


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

    from sloserve.cost import LinearCostModel, get_preset, load_preset
    from sloserve.optimal import MAX_CELLS, BoundProblem, relaxed_bound, run_heuristic, solve_bound
    from sloserve.optimal.gantt import plot_gantt

    try:
        import ortools  # noqa: F401
    except ImportError:
        raise ConfigError("sloserve bound needs OR-Tools: pip install 'sloserve[bound]'") from None
    if (fixed is None) == (trace is None):
        raise ConfigError("give --fixed I,O or --trace NAME")
    if num_requests < 1:
        raise ConfigError(f"--num-requests must be >= 1, got {num_requests}")
    if fixed is not None:
        try:
            prompt, output = (int(x) for x in fixed.split(","))
        except ValueError:
            raise ConfigError(f"--fixed expects I,O (two integers), got {fixed!r}") from None
        if prompt < 1 or output < 1:
            raise ConfigError(f"--fixed lengths must be >= 1, got {fixed!r}")
        from sloserve.workload import synthetic_workload

        workload = synthetic_workload(prompt, output, num_requests, context_len=10**9, seed=seed, rate=rate)
    else:
        from sloserve.workload import workload_from_trace

        workload = workload_from_trace(
            trace, num_requests=num_requests, seed=seed, context_len=10**9, rate=rate, offline=rate is None
        )
    reqs = workload.requests
    prompts = tuple(r.num_prompt_tokens for r in reqs)
    outputs = tuple(r.true_output_tokens for r in reqs)
    if capacity is None:
        longest = max(range(len(reqs)), key=lambda i: prompts[i] + outputs[i])
        capacity = max(2 * prompts[longest], prompts[longest] + outputs[longest] - 1)
    cost = LinearCostModel(load_preset(cost_model) if cost_model.endswith(".json") else get_preset(cost_model))
    problem = BoundProblem(prompts, outputs, tuple(r.arrival_time for r in reqs), capacity, budget, prefill_budget)
    names = _scheduler_list(compare_with)
    runs = [run_heuristic(name, problem, cost) for name in names]
    best = min(runs, key=lambda r: r.latency_s)
    problem = dataclasses.replace(problem, num_batches=max(r.num_batches for r in runs))
    relaxed = relaxed_bound(problem, cost)
    cells, limit = len(reqs) * problem.num_batches, max_cells or MAX_CELLS
    shown = (
        f"I={list(prompts)}, O={list(outputs)}"
        if len(reqs) <= 8
        else f"mean I={np.mean(prompts):.0f}, O={np.mean(outputs):.0f}"
    )
    click.echo(
        f"{len(reqs)} requests ({shown}), M={capacity}, C={budget}, P={prefill_budget}, {problem.num_batches} batches"
    )
    click.echo(f"relaxation: any schedule takes at least {relaxed * 1e3:.3f} ms (optimal/relaxation.py)")
    solved = cells <= limit
    if solved:
        result = solve_bound(problem, cost, time_limit_s=time_limit, hint=best.hint, max_cells=limit)
        click.echo(
            f"bound: {result.status} in {result.wall_s:.1f}s ({result.num_variables} variables): latency "
            f"{result.latency_s * 1e3:.3f} ms, best bound {result.best_bound_s * 1e3:.3f} ms, gap {result.gap:.1%}, "
            f"evictions {sum(len(b.evicted) for b in result.schedule)}"
        )
        reference, against = result.latency_s, "the bound's schedule"
    else:
        # NOTE: the relaxation still bounds every heuristic; only the exact model is out of reach.
        click.echo(f"bound: not solved: {len(reqs)} requests x {problem.num_batches} batches = {cells} cells exceeds "
                   f"the limit of {limit} (--max-cells raises it; the model is NP-hard)")  # fmt: skip
        reference, against = relaxed, "the relaxation"
    for run in runs:
        over = run.latency_s / reference - 1 if reference > 0 else 0.0
        click.echo(
            f"  {run.name:14s} latency {run.latency_s * 1e3:10.3f} ms  (+{over:.1%} over {against}), "
            f"{run.num_evictions} evictions"
        )
    if out is not None:
        import json as _json

        out.mkdir(parents=True, exist_ok=True)
        doc = {
            "status": result.status if solved else "NOT_SOLVED", "relaxed_bound_s": relaxed,
            "problem": {"prompts": prompts, "outputs": outputs, "arrivals": problem.arrivals,
                        "kv_capacity_tokens": capacity, "max_num_batched_tokens": budget,
                        "prefill_token_budget": prefill_budget, "num_batches": problem.num_batches},
            "heuristics": {r.name: {"latency_s": r.latency_s, "evictions": r.num_evictions} for r in runs},
        }  # fmt: skip
        if solved:
            doc.update(latency_s=result.latency_s, objective_s=result.objective_s, best_bound_s=result.best_bound_s,
                       gap=result.gap, schedule=[{"start_s": b.start_s, "end_s": b.end_s, "tokens": b.tokens,
                                                  "evicted": b.evicted, "kv_tokens": b.kv_tokens}
                                                 for b in result.schedule])  # fmt: skip
            plot_gantt(
                problem,
                result.schedule,
                out / "gantt.png",
                title=f"{result.status} schedule, latency {result.latency_s * 1e3:.2f} ms",
            )
        (out / "schedule.json").write_text(_json.dumps(doc, indent=2))
        click.echo(f"wrote {out}/schedule.json" + (f" and {out}/gantt.png" if solved else ""))


@main.command()
@click.argument("name")
@click.option("--out", type=click.Path(path_type=Path), default=Path("experiments-out"), show_default=True)
@click.option("--quick", is_flag=True, help="A smaller grid (minutes instead of tens of minutes).")
@click.option(
    "--trace",
    help="Workload of the EconoServe experiments: sharegpt (default), alpaca-like, "
    "bookcorpus-like, or another bundled trace.",
)
@_parallel_options
def experiment(name: str, out: Path, quick: bool, trace: str | None, workers: int | None,
               ray_address: str | None) -> None:  # fmt: skip
    """Run one of the papers' experiments; writes its CSV and plot and prints the paper's directions
    next to ours. Names: see `sloserve experiment list`."""
    from sloserve.experiments import EXPERIMENTS

    _check_out(out)
    if name == "list":
        for key, fn in EXPERIMENTS.items():
            summary = (fn.__doc__ or "").strip().split("\n\n")[0]  # the docstring's first paragraph
            click.echo(f"{key}: {' '.join(summary.split())}")
        return
    if name not in EXPERIMENTS:
        raise UnknownNameError("experiment", name, list(EXPERIMENTS))
    if trace is not None and not name.startswith("econoserve-"):
        raise ConfigError(f"--trace applies to the econoserve-* experiments, not {name}")
    if trace is not None and trace not in ("alpaca-like", "bookcorpus-like"):
        from sloserve.workload import TRACES

        if trace not in TRACES:
            raise UnknownNameError("trace", trace, ["alpaca-like", "bookcorpus-like", *TRACES])
    out.mkdir(parents=True, exist_ok=True)
    with _executor(workers, ray_address, default_workers=1) as executor:
        rows, lines = EXPERIMENTS[name](out, quick, executor=executor, **({"trace": trace} if trace else {}))
    for line in lines:
        click.echo(line)
    click.echo(
        f"{len(rows)} runs; wrote {out}/ ({', '.join(sorted(p.name for p in out.iterdir() if p.name.startswith(name.split('-')[0])))})"
    )


@main.command(name="fit-cost")
@click.option(
    "--csv",
    "csv_path",
    required=True,
    type=click.Path(path_type=Path),
    help="Measured batch times: num_decode, decode_kv_tokens, num_prefill, prefill_tokens, "
    "prefill_attention_work, prefill_context_tokens, time_s.",
)
@click.option("--layers", type=int, required=True, help="Model layers (coefficients are per layer).")
@click.option("--name", help="Preset name [the CSV file's stem].")
@click.option(
    "--form",
    type=click.Choice(FIT_FORMS),
    default=DEFAULT_FIT_FORM,
    show_default=True,
    help="knee: InferMax's linear model with a knee in tokens below which the non-attention part "
    "is flat (memory-bound); floor: the knee form under a floor for steps with a prefill and one "
    "for decode-only steps (the host's kernel launches, a graph's weight read); infermax: the "
    "paper's straight line.",
)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="JSON preset to write.")
def fit_cost(csv_path: Path, layers: int, name: str | None, form: str, out: Path) -> None:
    """Fit the linear cost model to measured batch times (a CSV such as `sloserve profile --csv`
    writes); `--cost-model OUT` then uses it."""
    from sloserve.cost import fit_linear, save_preset

    if layers < 1:
        raise ConfigError(f"--layers must be >= 1, got {layers}")
    _check_file_out(out, "--out")
    coefficients, report = fit_linear(csv_path, num_layers=layers, name=name, form=form)
    save_preset(coefficients, out, extra={"fit": report._asdict(), "source": str(csv_path), "form": form})
    click.echo(
        f"fitted {coefficients.name} ({form} form{_knee_note(coefficients)}) on {report.n_rows} batches: mean relative "
        f"error {report.mean_rel_error:.2%}, max {report.max_rel_error:.2%}; wrote {out}"
    )
    if report.unidentified:
        click.echo(f"note: the data does not pin down {', '.join(report.unidentified)} (left at 0)")


def _knee_note(coefficients) -> str:
    return f", knee at {coefficients.knee_tokens:.0f} tokens" if coefficients.knee_tokens else ""


def _engine_options(fn: Callable) -> Callable:
    options = [
        click.option(
            "--model", required=True, help="Local HF model directory or random:NAME (e.g. random:tiny-llama)."
        ),
        click.option("--device", default="cpu", show_default=True, help="cpu or cuda."),
        click.option("--dtype", default="auto", show_default=True, help="auto, float32, float16 or bfloat16."),
        click.option("--max-model-len", type=int, help="Context length (default: the model's own)."),
        click.option("--kv-capacity-tokens", type=int, help="KV cache slots (default: from free memory)."),
        click.option(
            "--attention-backend",
            default="auto",
            show_default=True,
            help="auto (Triton kernels on CUDA when triton is installed, else torch), torch or triton.",
        ),
        click.option(
            "--cuda-graphs/--no-cuda-graphs",
            default=None,
            help="Replay decode-only steps as CUDA graphs (needs cuda and the triton backend) [on where supported].",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _load_engine_model(options: dict[str, Any]):
    try:
        from sloserve.engine.loader import load_model
    except ImportError as exc:  # torch, safetensors or tokenizers missing
        raise ConfigError(f"the engine needs the engine extra: pip install 'sloserve[engine]' ({exc})") from None
    return load_model(options["model"], device=options["device"], dtype=options["dtype"], seed=options["seed"],
                      attention_backend=options["attention_backend"], cuda_graphs=options["cuda_graphs"])  # fmt: skip


@main.command()
@click.option("--scheduler", default="vllm", show_default=True, help="Scheduler name (see `sloserve schedulers`).")
@click.option("--set", "set_pairs", multiple=True, metavar="KEY=VALUE", help="Scheduler option; repeatable.")
@_workload_options
@_engine_options
@click.option("--cost-model", help="Preset or JSON file for policies that estimate batch times (BROS).")
@click.option(
    "--virtual-clock",
    is_flag=True,
    help="Advance time by measured step times instead of waiting for arrivals on the wall clock.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="Write summary.json, requests.csv, timeline.csv, plots, and steps.csv: each step's shape "
    "and measured time, a profile CSV (`sloserve fit-cost` reads it).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def run(scheduler: str, set_pairs: tuple[str, ...], cost_model: str | None, virtual_clock: bool, out: Path | None,
        as_json: bool, **options: Any) -> None:  # fmt: skip
    """Replay a workload through the real engine (random prompt tokens of the trace's lengths,
    outputs forced to the trace's lengths with ignore_eos, greedy)."""
    import numpy as np

    from sloserve.metrics import summarize
    from sloserve.sched import parse_set_options

    _check_out(out)
    set_options = parse_set_options(set_pairs)
    loaded = _load_engine_model(options)
    from sloserve.engine.llm_engine import LLMEngine, run_requests, synthetic_prompt
    from sloserve.engine.sampler import SamplingParams

    engine = LLMEngine(loaded, scheduler, kv_capacity_tokens=options["kv_capacity_tokens"],
                       max_model_len=options["max_model_len"], cost_model=cost_model, seed=options["seed"],
                       scheduler_options=set_options)  # fmt: skip
    workload = make_workload_from_options(options, engine.max_model_len)
    requests, chains = fresh_workload(workload)
    rng = np.random.default_rng(options["seed"])
    prompts = [synthetic_prompt(r.num_prompt_tokens, loaded.config.vocab_size, rng) for r in requests]
    params = [SamplingParams(max_tokens=r.true_output_tokens, temperature=0, ignore_eos=True) for r in requests]
    if out is not None:
        engine.executor.step_log = []
    with _progress(len(requests), f"{scheduler} (engine)", enabled=True) as on_progress:  # stderr: --json is safe
        wall = run_requests(engine, requests, prompts, params, wall_clock=not virtual_clock, chains=chains,
                            on_progress=on_progress)  # fmt: skip
    kv = engine.scheduler.kv
    summary = summarize(
        requests,
        engine.replica.timeline,
        kv_capacity_tokens=kv.capacity_tokens,
        sim_wall_s=wall,
        num_allocation_failures=kv.num_allocation_failures,
        swapped_bytes=kv.swapped_bytes,
        policy_metrics=engine.scheduler.policy_metrics(),
        extra={
            "engine": True,
            "scheduler": scheduler,
            "scheduler_options": set_options,
            "model": options["model"],
            "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "attention_backend": loaded.attention_backend,
            "cuda_graphs": loaded.cuda_graphs,
            "clock": "virtual" if virtual_clock else "wall",
            "max_model_len": engine.max_model_len,
            "workload": workload.name,
            "num_clipped": workload.num_clipped,
            "seed": options["seed"],
        },
    )
    summary["_result"] = (requests, engine.replica.timeline)
    _report(scheduler, summary, workload, out, as_json,
            f"engine: {options['model']} on {loaded.device}, {workload.name}, {len(requests)} requests")  # fmt: skip
    if out is not None:
        from sloserve.cost.fit import write_profile_csv

        shapes, times = zip(*engine.executor.step_log, strict=True) if engine.executor.step_log else ((), ())
        write_profile_csv(shapes, times, out / "steps.csv")
        if not as_json:
            click.echo(f"wrote {out}/steps.csv ({len(times)} steps: shape and measured seconds, a profile CSV)")


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{option} expects comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"{option} expects non-negative integers, got {text!r}")
    return values


@main.command(name="profile")
@_engine_options
@click.option("--out", type=click.Path(path_type=Path), required=True, help="JSON preset to write.")
@click.option("--name", help="Preset name [the output file's stem].")
@click.option(
    "--prefill-chunks",
    default="32,64,128,256,512,1024,2048,4096,8192,16384",
    show_default=True,
    help="Prefill chunk sizes c.",
)
@click.option("--context-lens", default="0,512,2048", show_default=True, help="Tokens cached before a chunk (m).")
@click.option("--batch-sizes", default="1,2,4,8,16,32,64,128,256", show_default=True, help="Decode batch sizes.")
@click.option("--decode-kv-lens", default="128,512,2048", show_default=True, help="Tokens cached per decode.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs per point (median).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--form",
    type=click.Choice(FIT_FORMS),
    default=DEFAULT_FIT_FORM,
    show_default=True,
    help="Cost model form to fit (see `sloserve fit-cost --help`).",
)
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(path_type=Path),
    help="Also write the measured batch times (the CSV `sloserve fit-cost` reads).",
)
def profile_cmd(out: Path, name: str | None, prefill_chunks: str, context_lens: str, batch_sizes: str,
                decode_kv_lens: str, repeats: int, form: str, csv_path: Path | None, **options: Any) -> None:  # fmt: skip
    """Measure the engine's batch times over a grid and fit the linear cost model to them; the preset
    works with `simulate --cost-model OUT`. Reports the error on held-out points."""
    from sloserve.cost import save_preset, write_profile_csv

    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    _check_file_out(out, "--out")
    _check_file_out(csv_path, "--csv")
    grid_values = dict(
        prefill_chunks=_int_list(prefill_chunks, "--prefill-chunks"),
        context_lens=_int_list(context_lens, "--context-lens"),
        batch_sizes=_int_list(batch_sizes, "--batch-sizes"),
        decode_kv_lens=_int_list(decode_kv_lens, "--decode-kv-lens"),
    )
    loaded = _load_engine_model(options)
    from sloserve.cost.profile_grid import ProfileGrid
    from sloserve.engine.llm_engine import default_kv_capacity, resolve_max_model_len
    from sloserve.engine.profile import profile

    max_len = resolve_max_model_len(loaded.config, options["max_model_len"])
    slots = options["kv_capacity_tokens"] or default_kv_capacity(loaded, max_len)
    with _progress(1, "profiling", enabled=True) as bar:
        result = profile(loaded, ProfileGrid(**grid_values), max_model_len=max_len, max_slots=slots,
                         name=name or out.stem, repeats=repeats, form=form,
                         on_point=(lambda i, n: bar(i / n)) if bar else None)  # fmt: skip
    report = result.fit.report
    if csv_path is not None:
        write_profile_csv(result.shapes, result.times_s, csv_path)
    save_preset(result.fit.coefficients, out, extra={
        "model": options["model"], "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
        "attention_backend": loaded.attention_backend, "cuda_graphs": loaded.cuda_graphs,
        "form": form, "fit": report._asdict(), "held_out": {"points": len(result.held_out),
                                              "mean_rel_error": result.held_out_mean_rel_error,
                                              "max_rel_error": result.held_out_max_rel_error},
        "grid": {k: list(v) for k, v in grid_values.items()},
    })  # fmt: skip
    click.echo(
        f"profiled {len(result.shapes)} batches of {options['model']} on {loaded.device}; fitted ({form} form"
        f"{_knee_note(result.fit.coefficients)}) on {report.n_rows}: mean relative error {report.mean_rel_error:.2%}, max {report.max_rel_error:.2%}; "
        f"held out {len(result.held_out)}: mean {result.held_out_mean_rel_error:.2%}, "
        f"max {result.held_out_max_rel_error:.2%}; wrote {out}"
    )


def _import_server(what: str):
    """A server module, or a ConfigError naming the extra it needs."""
    import importlib

    try:
        return importlib.import_module(f"sloserve.server.{what}")
    except ImportError as exc:
        raise ConfigError(f"this command needs the serve extra: pip install 'sloserve[serve]' ({exc})") from None


@main.command()
@click.option("--scheduler", default="vllm", show_default=True, help="Scheduler name (see `sloserve schedulers`).")
@click.option("--set", "set_pairs", multiple=True, metavar="KEY=VALUE", help="Scheduler option; repeatable.")
@_engine_options
@click.option("--cost-model", help="Preset or JSON file for policies that estimate batch times (BROS).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--served-model-name", help="The name clients send as `model` [--model as given].")
@click.option(
    "--max-queued-requests",
    type=int,
    default=1024,
    show_default=True,
    help="Requests waiting for their first token; beyond it, 429.",
)
@click.option("--rt-ttft-ms", type=float, help="Default TTFT SLO of real-time requests (ms).")
@click.option("--rt-tpot-ms", type=float, help="Default TPOT SLO of real-time requests (ms).")
@click.option("--request-log", type=click.Path(path_type=Path), help="Append one JSONL line per request here.")
@click.option(
    "--drain-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds running requests get to finish after SIGTERM.",
)
@click.option("--log-level", default="info", show_default=True, help="uvicorn's log level.")
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    help="Serve the Files and Batch API, keeping files and batches here (SQLite); a restart resumes them.",
)
@click.option("--max-batch-file-mb", type=float, default=200, show_default=True, help="Largest upload to /v1/files.")
@click.option("--max-batch-lines", type=int, default=50_000, show_default=True, help="Most requests in one batch.")
@click.option(
    "--max-batch-lines-in-engine",
    type=int,
    default=256,
    show_default=True,
    help="Batch lines in the engine at once (best-effort requests; the rest wait in the data dir).",
)
def serve(scheduler: str, set_pairs: tuple[str, ...], cost_model: str | None, seed: int, host: str, port: int,
          served_model_name: str | None, max_queued_requests: int, rt_ttft_ms: float | None,
          rt_tpot_ms: float | None, request_log: Path | None, drain_timeout: float, log_level: str,
          data_dir: Path | None, max_batch_file_mb: float, max_batch_lines: int, max_batch_lines_in_engine: int,
          **options: Any) -> None:  # fmt: skip
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics) with the chosen scheduler. Requests with service_tier "flex" are
    best-effort; the others real-time. With --data-dir, also the Files and Batch API (/v1/files,
    /v1/batches), whose lines run best-effort beside online traffic."""
    from sloserve.sched import parse_set_options

    set_options = parse_set_options(set_pairs)
    serve_module = _import_server("serve")
    if not 0 < port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {port}")
    if drain_timeout < 0:
        raise ConfigError(f"--drain-timeout must be >= 0, got {drain_timeout}")
    serve_module.check_address(host, port)
    from sloserve.engine.engine_core import EngineSpec

    spec = EngineSpec(options["model"], scheduler, device=options["device"], dtype=options["dtype"], seed=seed,
                      attention_backend=options["attention_backend"], cuda_graphs=options["cuda_graphs"],
                      kv_capacity_tokens=options["kv_capacity_tokens"], max_model_len=options["max_model_len"],
                      cost_model=cost_model, scheduler_options=set_options)  # fmt: skip
    serve_options = serve_module.ServeOptions(
        host=host, port=port, served_model_name=served_model_name or options["model"],
        max_queued_requests=max_queued_requests, rt_ttft_ms=rt_ttft_ms, rt_tpot_ms=rt_tpot_ms,
        request_log=request_log, drain_timeout_s=drain_timeout, log_level=log_level, data_dir=data_dir,
        batch_limits=_import_server("batch_api").BatchLimits(
            max_file_bytes=int(max_batch_file_mb * 1024 * 1024), max_file_lines=max_batch_lines,
            max_lines_in_engine=max_batch_lines_in_engine),
    )  # fmt: skip
    app = serve_module.make_app(spec, serve_options)
    click.echo(f"serving {serve_options.served_model_name} with {scheduler} on http://{host}:{port}/v1", err=True)
    serve_module.run_server(app, serve_options)


@main.command(name="bench-serve")
@click.option(
    "--base-url",
    default="http://127.0.0.1:8000/v1",
    show_default=True,
    help="The server's OpenAI API root (ours or any OpenAI-compatible one, e.g. vLLM's).",
)
@click.option("--model", "served_model", required=True, help="The model name the server serves.")
@_workload_options
@click.option("--max-model-len", type=int, help="Clip requests to this context [the server's max_model_len].")
@click.option(
    "--vocab-size",
    type=int,
    default=256,
    show_default=True,
    help="Prompt token ids are drawn from [0, this): ids every model has by default.",
)
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Per-request timeout (s).")
@click.option("--out", type=click.Path(path_type=Path), help="Write summary.json, requests.csv and latency_cdf.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def bench_serve(base_url: str, served_model: str, max_model_len: int | None, vocab_size: int, timeout_s: float,
                out: Path | None, as_json: bool, **options: Any) -> None:  # fmt: skip
    """Replay a trace or workload against a running server (streamed completions, prompts of the
    trace's lengths, max_tokens = its output lengths with ignore_eos) and measure TTFT, TPOT,
    inter-token and end-to-end latency as the client sees them."""
    bench = _import_server("bench")
    _check_out(out)
    if vocab_size < 1:
        raise ConfigError(f"--vocab-size must be >= 1, got {vocab_size}")
    if not timeout_s > 0:
        raise ConfigError(f"--timeout must be > 0, got {timeout_s}")
    if max_model_len is None:
        max_model_len = bench.server_max_model_len(base_url, served_model)
    workload = make_workload_from_options(options, max_model_len)
    requests, chains = fresh_workload(workload)
    prompts = bench.synthetic_prompts(requests, vocab_size, options["seed"])
    with _progress(len(requests), f"bench-serve {served_model}", enabled=not as_json) as on_progress:
        result = bench.run_benchmark(base_url, served_model, requests, prompts, chains=chains, timeout_s=timeout_s,
                                     on_progress=on_progress)  # fmt: skip
    summary = bench.summarize_benchmark(result, extra={
        "base_url": base_url, "model": served_model, "workload": workload.name, "num_clipped": workload.num_clipped,
        "seed": options["seed"], "max_model_len": max_model_len,
    })  # fmt: skip
    if out is not None:
        bench.write_outputs(out, summary, result)
    if result.errors:
        first = min(result.errors)
        click.echo(f"note: {len(result.errors)} requests failed; request {first}: {result.errors[first]}", err=True)
    if as_json:
        from sloserve.metrics import summary_to_json

        click.echo(summary_to_json(summary))
        return
    from sloserve.metrics import compare_table

    _print_table(compare_table({served_model: summary}, f"bench-serve: {base_url}, {workload.name}, "
                               f"{len(requests)} requests", _table_width()))  # fmt: skip
    if out is not None:
        click.echo(f"wrote {out}/summary.json, requests.csv and latency_cdf.png")


@main.command(name="workloads")
def workloads_cmd() -> None:
    """List the bundled workload specs."""
    from sloserve.workload import list_workloads

    for name, description in list_workloads().items():
        click.echo(f"{name}: {description}")


if __name__ == "__main__":
    main()

"""``sloserve plan``: the cheapest deployment that serves a load within its SLOs (sloserve.plan)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from sloserve.cli.app import fail, main
from sloserve.cli.options import (
    ParallelExecutor,
    ProgressBar,
    check_out,
    int_list,
    parallel_options,
    prefix_caching_option,
    print_table,
    scheduler_list,
    table_width,
)
from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.core.request import SLO
from sloserve.runs import (
    check_rate,
    make_workload_from_options,
)


def _parse_set_grid(pairs: tuple[str, ...], names: list[str]) -> dict[str, dict[str, list[str]]]:
    """``--set-grid KEY=V1,V2`` (every scheduler) or ``NAME.KEY=V1,V2`` (one, whichever comes first):
    scheduler -> key -> values. A key given twice is refused."""
    every: dict[str, list[str]] = {}
    own: dict[str, dict[str, list[str]]] = {name: {} for name in names}
    for pair in pairs:
        key, sep, values = pair.partition("=")
        choices = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not choices:
            raise ConfigError(f"--set-grid expects KEY=V1,V2 or SCHEDULER.KEY=V1,V2, got {pair!r}")
        scheduler, dot, option = key.strip().rpartition(".")
        if dot and scheduler not in own:
            raise ConfigError(f"--set-grid {pair}: {scheduler!r} is not among --schedulers {','.join(names)}")
        target = own[scheduler] if dot else every
        if option in target:
            raise ConfigError(f"--set-grid {key.strip()} is given twice")
        target[option] = choices
    return {name: {**every, **own[name]} for name in names}


def _validate_grid(grid: dict[str, dict[str, list[str]]], model, gpu: str, cost_model: str | None) -> None:
    """Build each scheduler at every point of its grid once: a bad name or value fails before the search."""
    import itertools

    from sloserve.cost import build_cost_model, get_gpu
    from sloserve.sched import make_scheduler

    cost = build_cost_model(model, get_gpu(gpu), cost_model=cost_model)
    for name, knobs in grid.items():
        for values in itertools.product(*knobs.values()):
            make_scheduler(
                name,
                kv_capacity_tokens=10 * model.max_context_len,
                max_model_len=model.max_context_len,
                kv_bytes_per_token=model.kv_bytes_per_token,
                cost_model=cost,
                options=dict(zip(knobs, values, strict=True)),
            )


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
@click.option(
    "--qps",
    type=float,
    required=True,
    help="The load to serve (Poisson requests/s; with --workload its RT streams' rate).",
)
@click.option(
    "--attainment", type=float, default=0.9, show_default=True, help="Share of requests that must meet their SLOs."
)
@click.option("--trace", help="Bundled trace name (see `sloserve traces`) or a CSV/JSONL path.")
@click.option("--workload", help="Workload spec: a bundled name or a YAML path (instead of --trace).")
@click.option("--columns", help="Column mapping for a user trace, e.g. prompt=in,output=out.")
@click.option(
    "--num-requests",
    type=int,
    default=1000,
    show_default=True,
    help="Requests per simulated unit (a deployment of k units runs k times as many).",
)
@click.option("--max-tokens", type=int, help="Per-request max_tokens (default: context - prompt).")
@click.option("--burstiness", type=float, help="Gamma arrivals with this coefficient of variation.")
@click.option("--slo-ttft", type=float, help="TTFT SLO in seconds (--trace).")
@click.option("--slo-tpot", type=float, help="TPOT SLO in seconds (--trace).")
@click.option("--slo-jct", type=float, help="JCT SLO in seconds (--trace).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--model", default="llama-2-7b", show_default=True, help="Model spec name (see `sloserve hardware`).")
@click.option("--gpus", default="a100,h100,h200", show_default=True, help="GPU types to consider.")
@click.option(
    "--tp",
    "tensor_parallel",
    default="1,2,4,8",
    show_default=True,
    help="Tensor-parallel degrees to consider (those that fit and divide the heads).",
)
@click.option("--max-gpus", type=int, default=16, show_default=True, help="Most GPUs a deployment may use.")
@click.option("--schedulers", default="vllm,sarathi", show_default=True, help="Schedulers to consider.")
@click.option(
    "--layouts",
    default="colocated,1:1,1:2,2:1",
    show_default=True,
    help="colocated and/or disaggregated P:D units (P prefill and D decode replicas).",
)
@click.option(
    "--set-grid",
    "grid_pairs",
    multiple=True,
    metavar="[NAME.]KEY=V1,V2",
    help="Scheduler options to search over; repeatable.",
)
@click.option("--prices", help="USD per GPU-hour over the defaults, e.g. a100=1.2,a30=0.6.")
@click.option(
    "--cost-model",
    default="roofline",
    show_default=True,
    help="One cost model for every candidate, so they compare on equal terms.",
)
@click.option("--memory-utilization", type=float, default=0.9, show_default=True)
@click.option("--swap-space-gib", type=float, default=4.0, show_default=True, help="CPU swap space per replica.")
@click.option(
    "--router",
    default="round-robin",
    show_default=True,
    help="round-robin, least-outstanding, prefix-affinity or slo (docs/simulator.md).",
)
@click.option("--link-gbps", type=float, default=100.0, show_default=True, help="KV link per prefill replica, Gb/s.")
@click.option(
    "--tolerance",
    type=float,
    default=0.05,
    show_default=True,
    help="Goodput bisection stops when its bracket is within this (relative).",
)
@click.option("--alternatives", type=int, default=3, show_default=True, help="Runner-up deployments to verify.")
@prefix_caching_option
@parallel_options
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Write plan.json and the plots here.")
@click.option("--json", "as_json", is_flag=True, help="Print plan.json on stdout instead of the table.")
def plan(
    qps: float,
    attainment: float,
    gpus: str,
    tensor_parallel: str,
    max_gpus: int,
    schedulers: str,
    layouts: str,
    grid_pairs: tuple[str, ...],
    prices: str | None,
    tolerance: float,
    alternatives: int,
    workers: int | None,
    ray_address: str | None,
    out: Path,
    as_json: bool,
    **options: Any,
) -> None:
    """The cheapest deployment that serves --qps within the SLOs: searches GPU type, tensor parallelism,
    replicas, colocated or disaggregated (P:D), scheduler and --set-grid options; each candidate's
    goodput by bisection, the winners simulated whole. Parallel on Ray (see docs/planning.md)."""
    from sloserve.plan import PlanQuery
    from sloserve.plan import plan as run_plan
    from sloserve.runs import SimOptions

    check_out(out)
    _check_numbers(qps, attainment, max_gpus, tolerance, alternatives)
    base = SimOptions(**options)
    model, workload = _model_and_workload(base, qps)
    candidates, skipped, price_table = _candidates(
        base, model, gpus, tensor_parallel, schedulers, layouts, grid_pairs, max_gpus, prices
    )
    query = PlanQuery(qps, attainment, max_gpus, base, tolerance, alternatives)
    slo = {"ttft_s": base.slo_ttft, "tpot_s": base.slo_tpot, "jct_s": base.slo_jct}
    describe = {"model": model.name, "workload": workload.name.split("@")[0], "slo": slo,
                "num_requests_per_unit": base.num_requests, "seed": base.seed,
                "cost_model": base.cost_model, "router": base.router,
                "enable_prefix_caching": base.enable_prefix_caching}  # fmt: skip
    with ParallelExecutor(workers, ray_address, default_workers=None) as executor:
        with ProgressBar(len(candidates), f"plan ({executor.workers} workers)", enabled=True) as on_progress:

            def on_round(text: str, decided: int) -> None:
                if on_progress is not None:  # the bar counts decided candidates; its label, the round
                    on_progress(decided, f"plan ({executor.workers} workers), {text}")

            doc = run_plan(
                query, candidates, price_table, executor, skipped=skipped, describe=describe, on_round=on_round
            )
    _write_and_show(doc, out, as_json)
    if doc["answer"] is None:
        fail(doc["message"])


def _check_numbers(qps: float, attainment: float, max_gpus: int, tolerance: float, alternatives: int) -> None:
    check_rate("--qps", qps)
    if not 0 < attainment <= 1:
        raise ConfigError(f"--attainment must be in (0, 1], got {attainment}")
    if max_gpus < 1:
        raise ConfigError(f"--max-gpus must be >= 1, got {max_gpus}")
    if not 0 < tolerance < 1:
        raise ConfigError(f"--tolerance must be in (0, 1), got {tolerance}")
    if alternatives < 0:
        raise ConfigError(f"--alternatives must be >= 0, got {alternatives}")


def _model_and_workload(base, qps: float):
    """The model spec and the workload at ``qps``: bad workload options fail here, and a trace without SLOs."""
    from sloserve.checkpoint import model_spec

    model = model_spec(base.model)
    workload = make_workload_from_options(base, model.max_context_len, rate=qps)
    if base.trace and not any(r.slo != SLO() for r in workload.requests):  # NOTE: a request log records SLOs
        raise ConfigError(
            "plan needs an SLO to meet: give --slo-ttft, --slo-tpot and/or --slo-jct, or a trace whose rows "
            "record their SLOs (serve --request-log)"
        )
    return model, workload


def _candidates(
    base,
    model,
    gpus: str,
    tensor_parallel: str,
    schedulers: str,
    layouts: str,
    grid_pairs: tuple[str, ...],
    max_gpus: int,
    prices: str | None,
) -> tuple[list, list[dict[str, Any]], dict[str, float]]:
    """The deployments to search, those left out (with why) and the prices per GPU-hour: a bad scheduler
    name, --set-grid value, --prices, --tp or --layouts, no deployment to search, or one on a GPU without a
    price is a ConfigError first."""
    from sloserve.plan import enumerate_candidates, parse_prices
    from sloserve.plan.prices import price_per_gpu_hour
    from sloserve.sched import SCHEDULERS
    from sloserve.sched.registry import supports_disaggregation

    names = scheduler_list(schedulers)
    for name in names:
        if name not in SCHEDULERS:
            raise UnknownNameError("scheduler", name, sorted(SCHEDULERS))
    gpu_names = [g.strip() for g in gpus.split(",") if g.strip()]
    if not gpu_names:
        raise ConfigError("--gpus needs at least one GPU name")
    grid = _parse_set_grid(grid_pairs, names)
    _validate_grid(grid, model, gpu_names[0], base.cost_model)
    price_table = parse_prices(prices)
    degrees = int_list(tensor_parallel, "--tp", minimum=1)
    role_schedulers = {n for n in names if supports_disaggregation(n)}
    candidates, skipped = enumerate_candidates(
        model,
        gpu_names,
        list(degrees),
        names,
        _layouts(layouts),
        grid,
        max_gpus,
        base.memory_utilization,
        role_schedulers,
    )
    if not candidates:
        reasons = "; ".join(f"{x['label']}: {x['reason']}" for x in skipped[:3])
        raise ConfigError(f"no configuration to search ({len(skipped)} left out): {reasons}")
    for gpu in sorted({c.gpu for c in candidates}):
        price_per_gpu_hour(price_table, gpu)  # a GPU without a price fails here
    return candidates, skipped, price_table


def _write_and_show(doc: dict, out: Path, as_json: bool) -> None:
    """plan.json, its plots and (where there is an answer) deploy.yaml under ``out``; the table or the JSON."""
    from sloserve.plan.deploy import deployment_of, write_deployment
    from sloserve.plan.report import plan_table, write_plan

    written = write_plan(doc, out)
    deployment = deployment_of(doc)
    if deployment is not None:
        query = doc["query"]
        header = (
            f"written by sloserve plan: the cheapest deployment serving {query['qps']:g} req/s of "
            f"{query['workload']} at {query['attainment']:.0%} SLO attainment\nserve it with: sloserve serve "
            f"--config {out / 'deploy.yaml'} --model MODEL_DIR --device cuda"
        )
        written.append(write_deployment(deployment, out / "deploy.yaml", header))
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        print_table(plan_table(doc, table_width()))
        for line in _plan_lines(doc):
            click.echo(line)
        if deployment is not None and deployment.simulated_only():
            click.echo(f"note: the answer uses {deployment.simulated_only()}: sloserve serve cannot deploy it")
        click.echo(f"wrote {', '.join(str(p) for p in written)}")


def _plan_lines(doc: dict) -> list[str]:
    """The answer and its alternatives in words."""
    s = doc["search"]
    lines = [
        f"searched {s['candidates']} configurations in {s['runs']} simulations ({s['rounds']} rounds, "
        f"{s['workers']} workers, {s['wall_s']:.1f} s)"
    ]
    for title, c in [("answer", doc["answer"])] + [("alternative", a) for a in doc["alternatives"]]:
        if c is None:
            continue
        v = c["verified"]
        lines.append(
            f"{title}: {c['units']} x {c['label']} = {c['num_gpus']} GPUs, ${c['cost_per_hour']:.2f}/hour; "
            f"simulated whole at {doc['query']['qps']:g} req/s: {v['attainment']:.1%} attainment, "
            f"p99 TTFT {v['ttft_p99_s']:.3g} s, p99 TPOT {v['tpot_p99_s']:.3g} s"
        )
    return lines

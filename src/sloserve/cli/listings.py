"""``sloserve traces``, ``schedulers``, ``hardware`` and ``workloads``: what is bundled."""

from __future__ import annotations

import click

from sloserve.cli.app import main
from sloserve.cli.options import (
    print_table,
)


@main.command()
@click.argument("names", nargs=-1, metavar="[TRACE]...")
@click.option("--columns", help="Column mapping for trace files, e.g. prompt=in,output=out,arrival=t.")
def traces(names: tuple[str, ...], columns: str | None) -> None:
    """List the bundled traces with row counts and length statistics, or those of the traces given
    (bundled names or CSV/JSONL files; a served request log shows its classes, priorities and SLOs)."""
    from rich.table import Table

    from sloserve.runs import parse_columns
    from sloserve.workload import TRACES, trace_summary

    summaries = [trace_summary(name, parse_columns(columns)) for name in names or TRACES]
    recorded = any(s["recorded"] for s in summaries)
    hashed = any(s["prefix_shared"] is not None for s in summaries)
    table = Table(title=f"{'traces' if names else 'bundled traces'} (token counts)")
    headers = ["name", "rows", "prompt mean/p50/p99/max", "output mean/p50/p99/max", "arrivals"]
    headers += ["prefix shared"] if hashed else []
    headers += ["served as (rows)"] if recorded else []
    for col in (*headers, "description"):
        table.add_column(col)
    for s in summaries:
        fmt = "{:.0f} / {:.0f} / {:.0f} / {:.0f}"
        arrivals = f"{s['duration_s']:.4g} s, {s['rate_rps']:.2f} req/s" if s["has_arrivals"] else "-"
        row = [
            s["name"],
            str(s["rows"]),
            fmt.format(s["prompt_mean"], s["prompt_p50"], s["prompt_p99"], s["prompt_max"]),
            fmt.format(s["output_mean"], s["output_p50"], s["output_p99"], s["output_max"]),
            arrivals,
        ]
        if hashed:
            row.append("-" if s["prefix_shared"] is None else f"{s['prefix_shared']:.1%}")
        if recorded:
            row.append(_served_as(s["recorded"]))
        info = TRACES.get(s["name"])
        table.add_row(*row, info.description if info is not None else s["source"])
    print_table(table)


def _served_as(recorded: dict | None) -> str:
    """A request log's classes, priorities and SLOs, in one cell ("-": left to the replay's stream)."""
    if recorded is None:
        return "-"
    classes = ", ".join(f"{name} {n}" for name, n in recorded["classes"].items())
    priorities = ", ".join(f"{level}: {n}" for level, n in recorded["priorities"].items())
    return f"{classes}; priority {priorities}; with SLO {recorded['with_slo']}"


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
        models.add_row(
            name,
            f"{m.num_params / 1e9:.1f}",
            str(m.num_layers),
            f"{m.hidden_size:,}",
            f"{m.num_attention_heads} / {m.num_kv_heads}",
            f"{m.max_context_len:,}",
            f"{m.kv_bytes_per_token / 1024:g}",
        )
    gpus = Table(title="GPUs (--gpu)")
    for header in ("name", "memory GB", "BF16 TFLOP/s", "memory TB/s", "PCIe GB/s", "GPU-GPU GB/s"):
        gpus.add_column(header, justify="left" if header == "name" else "right")
    for name in sorted(GPUS):
        g = GPUS[name]
        gpus.add_row(
            name,
            f"{g.memory_bytes / 1e9:g}",
            f"{g.peak_flops / 1e12:g}",
            f"{g.hbm_bandwidth / 1e12:g}",
            f"{g.pcie_bandwidth / 1e9:g}",
            f"{g.interconnect_bandwidth / 1e9:g}",
        )
    print_table(models)
    print_table(gpus)
    click.echo("cost-model presets (--cost-model): " + ", ".join(list_presets()) + ", roofline, or a JSON file")


@main.command(name="workloads")
def workloads_cmd() -> None:
    """List the bundled workload specs."""
    from sloserve.workload import list_workloads

    for name, description in list_workloads().items():
        click.echo(f"{name}: {description}")

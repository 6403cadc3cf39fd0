"""``sloserve traces``, ``schedulers``, ``hardware`` and ``workloads``: what is bundled."""

from __future__ import annotations

import click

from sloserve.cli.app import main
from sloserve.cli.options import (
    print_table,
)


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
    print_table(table)


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
    for header in ("name", "memory GB", "BF16 TFLOP/s", "HBM TB/s", "PCIe GB/s", "NVLink GB/s"):
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

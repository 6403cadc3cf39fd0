"""``sloserve experiment NAME``: the papers' experiments (sloserve.experiments)."""

from __future__ import annotations

from pathlib import Path

import click

from sloserve.cli.app import main
from sloserve.cli.options import (
    ParallelExecutor,
    check_out,
    parallel_options,
)
from sloserve.core.errors import ConfigError, UnknownNameError


@main.command()
@click.argument("name")
@click.option("--out", type=click.Path(path_type=Path), default=Path("experiments-out"), show_default=True)
@click.option("--quick", is_flag=True, help="A smaller grid (minutes instead of tens of minutes).")
@click.option(
    "--trace",
    help="Workload of the EconoServe experiments: sharegpt (default), alpaca-like, "
    "bookcorpus-like, or another bundled trace.",
)
@parallel_options
def experiment(
    name: str, out: Path, quick: bool, trace: str | None, workers: int | None, ray_address: str | None
) -> None:
    """Run one of the papers' experiments; writes its CSV and plot and prints the paper's directions
    next to ours. Names: see `sloserve experiment list`."""
    from sloserve.experiments import EXPERIMENTS

    check_out(out)
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
    with ParallelExecutor(workers, ray_address, default_workers=1) as executor:
        rows, lines = EXPERIMENTS[name](out, quick, executor=executor, **({"trace": trace} if trace else {}))
    for line in lines:
        click.echo(line)
    click.echo(
        f"{len(rows)} runs; wrote {out}/ ({', '.join(sorted(p.name for p in out.iterdir() if p.name.startswith(name.split('-')[0])))})"
    )

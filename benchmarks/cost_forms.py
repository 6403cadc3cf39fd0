"""One cost-model fit for every scheduler: InferMax's straight line, the same line with a knee, and the
line under two floors.

A fit of InferMax's linear model over whole prompts (vLLM's batches), chunks (Sarathi's) and decodes
has to draw one line through a part of the step that is flat below some batch size (the weights are
read once per step: memory-bound) and linear above it (compute-bound). The "knee" form
(``cost/linear.py``) adds that one number; the "floor" form puts the whole step under a floor, one for
steps with a prefill (eager: the host's kernel launches) and one for decode-only steps (on a GPU,
replayed graphs). This script shows, side by side in one run:

1. Fit error. Batch times of a profile grid (``sloserve profile``'s default grid) from a reference
   model: by default the roofline model of Llama-2-7B on an A100-80GB (a GPU's shape from its
   datasheet; there is no GPU here), or a CSV measured by ``sloserve profile --csv`` (``--csv``).
   Both forms are fitted on 3 of every 4 points; the 4th are held out. Errors by kind of batch.
2. Per-scheduler fidelity (reference model only). vLLM and Sarathi-Serve simulated on ShareGPT with
   the reference model and with each fit: the error of each fit's mean TTFT, TPOT, JCT and
   throughput. The goal (issue 29): one fit within 5% for every scheduler.
3. With ``--csv`` and ``--engine``: each fit (on the same 3 of 4 points) simulated with ``sloserve
   simulate`` on the workloads the engine ran, against the engine's measured figures.
4. With ``--csv`` and ``--steps``: each fit on the steps an engine run took (``sloserve run --out``
   writes them as steps.csv): by kind of step, the time the fit gives all of them against the time
   they took. A run's TTFT is a sum of its prefill steps, its TPOT one of its decode steps: this says
   which of them a fit misprices, where the figures of item 3 only say that it does.

    python benchmarks/cost_forms.py
    python benchmarks/cost_forms.py --csv profile.csv --layers 30   # fit errors of a measured profile
    python benchmarks/cost_forms.py --layers 32 \
        --csv benchmarks/profiles/h200-random-llama-3-8b-bf16-graphs.csv \
        --engine benchmarks/profiles/h200-random-llama-3-8b-bf16-graphs-engine.json
    python benchmarks/cost_forms.py --csv profile.csv --layers 32 --steps run-vllm/steps.csv
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from sloserve.cost import (
    BatchShape,
    LinearCostModel,
    fit_linear_shapes,
    get_gpu,
    get_model,
    kv_capacity_tokens,
    save_preset,
)
from sloserve.cost.fit import read_profile_csv
from sloserve.cost.profile_grid import ProfileGrid
from sloserve.cost.roofline import RooflineCostModel
from sloserve.metrics.summary import request_table
from sloserve.sched import make_scheduler
from sloserve.sim import simulate
from sloserve.workload import workload_from_trace

FORMS = ("infermax", "knee", "floor")
HOLD_OUT_EVERY = 4  # as `sloserve profile`
CONSOLE = Console(width=120)


def kind(s: BatchShape) -> str:
    if s.num_prefill and s.num_decode:
        return "mixed"
    if s.num_prefill:
        return "prompts <= 256 tokens" if s.prefill_tokens <= 256 else "prompts > 256 tokens"
    return "decodes"


def fit_table(shapes: list[BatchShape], times: list[float], num_layers: int, title: str) -> dict[str, LinearCostModel]:
    train = [i for i in range(len(shapes)) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    held = [i for i in range(len(shapes)) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    models = {}
    for form in FORMS:
        fit = fit_linear_shapes(
            [shapes[i] for i in train], [times[i] for i in train], num_layers=num_layers, name=f"fit-{form}", form=form
        )
        models[form] = LinearCostModel(fit.coefficients)
    kinds = sorted({kind(shapes[i]) for i in held})
    table = Table(title=title)
    table.add_column("held-out batches")
    for form, model in models.items():
        knee = f" (knee at {model.coefficients.knee_tokens:.0f} tokens)" if model.coefficients.knee_tokens else ""
        table.add_column(f"{form}{knee}: mean / max |error|", justify="right")
    for k in [*kinds, "all"]:
        rows = [i for i in held if k == "all" or kind(shapes[i]) == k]
        cells = []
        for model in models.values():
            err = np.array([abs(model.batch_time(shapes[i]).total_s / times[i] - 1) for i in rows])
            cells.append(f"{err.mean():.1%} / {err.max():.1%}")
        table.add_row(f"{k} ({len(rows)})", *cells)
    CONSOLE.print(table)
    return models


def simulated(cost, scheduler: str, capacity: int, num_requests: int, rate: float) -> dict[str, float]:
    workload = workload_from_trace("sharegpt", num_requests=num_requests, seed=0, context_len=4096, rate=rate)
    simulate(
        workload.requests, lambda: make_scheduler(scheduler, kv_capacity_tokens=capacity, max_model_len=4096), cost
    )
    t = request_table(workload.requests)
    makespan = np.nanmax(t["finish_s"]) - np.nanmin(t["arrival_s"])
    return {
        "TTFT": float(np.nanmean(t["ttft_s"])),
        "TPOT": float(np.nanmean(t["tpot_s"])),
        "JCT": float(np.nanmean(t["jct_s"])),
        "throughput": len(workload.requests) / makespan,
    }


ENGINE_FIGURES = (
    ("throughput", "throughput_rps"),
    ("JCT", "jct_s"),
    ("TTFT", "ttft_s"),
    ("TPOT", "tpot_s"),
    ("norm. latency", "normalized_latency_s"),
)


def against_engine(models: dict[str, LinearCostModel], engine_path: str) -> None:
    """Each fit simulated (`sloserve simulate`, as a user would) on each workload the engine ran; the
    error of each mean figure against the engine's."""
    engine = json.loads(Path(engine_path).read_text())
    table = Table(title=f"{engine_path}: simulated / engine - 1")
    for column in ("scheduler", "load", "form", *(name for name, _ in ENGINE_FIGURES)):
        table.add_column(column, justify="left" if column in ("scheduler", "form") else "right")
    errors: dict[str, list[float]] = {form: [] for form in models}
    with tempfile.TemporaryDirectory() as folder:
        for run in engine["runs"]:
            load = ["--offline"] if run["rate"] is None else ["--rate", str(run["rate"])]
            for form, model in models.items():
                preset = Path(folder) / f"{form}.json"
                save_preset(model.coefficients, preset)
                args = ["simulate", "--model", engine["model"], "--cost-model", str(preset), "--trace", engine["trace"],
                        "--num-requests", str(engine["num_requests"]), "--seed", str(engine["seed"]),
                        "--scheduler", run["scheduler"], *load, "--max-model-len", str(engine["max_model_len"]),
                        "--kv-capacity-tokens", str(engine["kv_capacity_tokens"]), "--json"]  # fmt: skip
                done = subprocess.run(
                    [sys.executable, "-m", "sloserve.cli", *args], capture_output=True, text=True, check=True
                )
                sim = json.loads(done.stdout)
                row = []
                for _, key in ENGINE_FIGURES:
                    got = sim[key] if key == "throughput_rps" else sim[key]["mean"]
                    errors[form].append(abs(got / run[key] - 1))
                    row.append(f"{got / run[key] - 1:+.1%}")
                label = "offline" if run["rate"] is None else f"{run['rate']} req/s"
                table.add_row(run["scheduler"], label, form, *row)
    CONSOLE.print(table)
    print(
        "mean / max |error| over every figure: "
        + ", ".join(f"{form} {np.mean(e):.1%} / {np.max(e):.1%}" for form, e in errors.items())
        + " (goal: mean 5%)"
    )


def steps_table(models: dict[str, LinearCostModel], path: str) -> Table:
    """Each fit against the steps a run took (a profile CSV of them), by kind of step: the fit's total
    time for those steps over their measured total (the share of the run's time a fit misses), and the
    mean |error| of one step."""
    shapes, times = read_profile_csv(path)
    lines = (path, "each fit's time for the run's own steps / measured - 1 (mean |error| of a step)")
    table = Table(title="\n".join(lines), min_width=max(map(len, lines)))
    table.add_column("steps")
    table.add_column("measured s", justify="right")
    for form in models:
        table.add_column(form, justify="right")
    kinds = sorted({kind(s) for s in shapes})
    for k in [*kinds, "all"]:
        rows = [i for i in range(len(shapes)) if k == "all" or kind(shapes[i]) == k]
        measured = np.array([times[i] for i in rows])
        cells = []
        for model in models.values():
            predicted = np.array([model.batch_time(shapes[i]).total_s for i in rows])
            step_error = np.mean(np.abs(predicted / measured - 1))
            cells.append(f"{predicted.sum() / measured.sum() - 1:+.1%} ({step_error:.1%})")
        table.add_row(f"{k} ({len(rows)})", f"{measured.sum():.3f}", *cells)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", help="a profile measured by `sloserve profile --csv` (fit errors only)")
    parser.add_argument("--layers", type=int, help="the profiled model's layers (with --csv)")
    parser.add_argument(
        "--engine",
        help="with --csv: the engine's figures on workloads (JSON, as "
        "benchmarks/profiles/*-engine.json) to simulate each fit on",
    )
    parser.add_argument(
        "--steps",
        nargs="+",
        default=(),
        help="with --csv: steps of engine runs (steps.csv of `sloserve run --out`) to price with each fit",
    )
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--rates", default="3,6,9", help="ShareGPT request rates (req/s) to simulate")
    args = parser.parse_args()
    if args.csv:
        if not args.layers:
            parser.error("--csv needs --layers")
        shapes, times = read_profile_csv(args.csv)
        models = fit_table(shapes, times, args.layers, f"{args.csv}: held-out error of each form's fit")
        if args.engine:
            against_engine(models, args.engine)
        for path in args.steps:
            CONSOLE.print(steps_table(models, path))
        return

    model, gpu = get_model("llama-2-7b"), get_gpu("a100")
    capacity = kv_capacity_tokens(model, gpu)
    reference = RooflineCostModel(model, gpu)
    shapes = [BatchShape.of(*batch) for batch in ProfileGrid().shapes(4096, capacity)]  # `profile`'s default grid
    times = [reference.batch_time(s).total_s for s in shapes]
    fits = fit_table(
        shapes, times, model.num_layers, "Llama-2-7B, A100-80GB roofline: held-out error of each form's fit"
    )

    table = Table(title=f"ShareGPT, {args.num_requests} requests: each fit's error against the reference model")
    metrics = ("TTFT", "TPOT", "JCT", "throughput")
    for column in ("scheduler", "rate", "form", *(f"mean {m}" if m != "throughput" else m for m in metrics)):
        table.add_column(column, justify="left" if column in ("scheduler", "form") else "right")
    worst = dict.fromkeys(FORMS, 0.0)
    for scheduler in ("vllm", "sarathi"):
        for rate in (float(r) for r in args.rates.split(",")):
            truth = simulated(reference, scheduler, capacity, args.num_requests, rate)
            for form in FORMS:
                got = simulated(fits[form], scheduler, capacity, args.num_requests, rate)
                errors = [got[metric] / truth[metric] - 1 for metric in metrics]
                worst[form] = max(worst[form], *(abs(e) for e in errors))
                table.add_row(scheduler, f"{rate:g}", form, *(f"{e:+.1%}" for e in errors))
    CONSOLE.print(table)
    print(
        "largest |error| over schedulers, rates and metrics: "
        + ", ".join(f"{form} {worst[form]:.1%}" for form in FORMS)
        + " (goal: 5%)"
    )


if __name__ == "__main__":
    main()

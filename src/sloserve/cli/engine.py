"""``sloserve run``, ``profile`` and ``fit-cost``: the real engine offline, and the cost model fitted
to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from sloserve.cli.app import main
from sloserve.cli.options import (
    DEFAULT_FIT_FORM,
    FIT_FORMS,
    ProgressBar,
    check_file_out,
    check_out,
    engine_options,
    engine_prefix_caching_option,
    int_list,
    report,
    workload_options,
)
from sloserve.core.errors import ConfigError
from sloserve.runs import (
    SimOptions,
    fresh_workload,
    make_workload_from_options,
)

# Most timed runs per profile point (the median is taken): a default profile takes 3, and 100 already
# make it a long wait on a CPU.
MAX_PROFILE_REPEATS = 100


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
    check_file_out(out, "--out")
    coefficients, report = fit_linear(csv_path, num_layers=layers, name=name, form=form)
    save_preset(coefficients, out, extra={"fit": report._asdict(), "source": str(csv_path), "form": form})
    click.echo(
        f"fitted {coefficients.name} ({form} form{_knee_note(coefficients)}) on {report.n_rows} batches: mean relative "
        f"error {report.mean_rel_error:.2%}, max {report.max_rel_error:.2%}; wrote {out}"
    )
    _note_unidentified(report)
    try:
        coefficients.check_steps_take_time()
    except ConfigError as e:
        click.echo(f"note: --cost-model {out} will be refused until the profile has such steps: {e}")


def _note_unidentified(report) -> None:
    if report.unidentified:
        click.echo(f"note: the data does not pin down {', '.join(report.unidentified)} (left at 0)")


def _note_beyond_context(grid_values: dict[str, tuple[int, ...]], max_model_len: int) -> None:
    """Name the lengths given on the command line that no profiled batch within the context can have
    (the defaults' longest are left out for a short context without a word)."""
    context = click.get_current_context()
    shortest_chunk = min(grid_values["prefill_chunks"])
    limits = {  # the longest each can be, and why
        "prefill_chunks": (max_model_len, f"longer than the context of {max_model_len} tokens"),
        "context_lens": (
            max_model_len - shortest_chunk,
            f"no room left for the shortest chunk ({shortest_chunk} tokens) in the context of {max_model_len}",
        ),
        "decode_kv_lens": (max_model_len - 1, f"no room left for the decoded token in the context of {max_model_len}"),
    }
    for key, (limit, why) in limits.items():
        beyond = [v for v in grid_values[key] if v > limit]
        if beyond and context.get_parameter_source(key) is not click.core.ParameterSource.DEFAULT:
            option = "--" + key.replace("_", "-")
            click.echo(f"note: {option} {','.join(map(str, beyond))} not measured: {why}", err=True)


def _knee_note(coefficients) -> str:
    return f", knee at {coefficients.knee_tokens:.0f} tokens" if coefficients.knee_tokens else ""


def _load_engine_model(options: dict[str, Any]):
    from sloserve.checkpoint import check_engine_model

    check_engine_model(options["model"])  # NOTE: before torch is imported: a typo in --model is answered at once
    try:
        from sloserve.engine.loader import load_model
    except ImportError as exc:  # torch, safetensors or tokenizers missing
        raise ConfigError(f"the engine needs the engine extra: pip install 'sloserve[engine]' ({exc})") from None
    return load_model(
        options["model"],
        device=options["device"],
        dtype=options["dtype"],
        seed=options["seed"],
        attention_backend=options["attention_backend"],
        cuda_graphs=options["cuda_graphs"],
    )


@main.command()
@click.option("--scheduler", default="vllm", show_default=True, help="Scheduler name (see `sloserve schedulers`).")
@click.option("--set", "set_pairs", multiple=True, metavar="KEY=VALUE", help="Scheduler option; repeatable.")
@workload_options
@engine_options
@engine_prefix_caching_option
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
def run(
    scheduler: str,
    set_pairs: tuple[str, ...],
    cost_model: str | None,
    virtual_clock: bool,
    out: Path | None,
    as_json: bool,
    **options: Any,
) -> None:
    """Replay a workload through the real engine (random prompt tokens of the trace's lengths, the
    same tokens for the same hash ids; outputs forced to the trace's lengths with ignore_eos, greedy)."""

    from sloserve.engine.gc_heap import freeze_switch, frozen_heap
    from sloserve.metrics import summarize
    from sloserve.sched import parse_set_options

    check_out(out)
    set_options = parse_set_options(set_pairs)
    freeze = freeze_switch()
    loaded = _load_engine_model(options)
    from sloserve.engine.llm_engine import LLMEngine, run_requests
    from sloserve.engine.sampler import SamplingParams
    from sloserve.workload.build import synthetic_prompts

    engine = LLMEngine(
        loaded,
        scheduler,
        kv_capacity_tokens=options["kv_capacity_tokens"],
        max_model_len=options["max_model_len"],
        cost_model=cost_model,
        seed=options["seed"],
        scheduler_options=set_options,
        enable_prefix_caching=options["enable_prefix_caching"],
    )
    workload = make_workload_from_options(SimOptions.of_workload(options), engine.max_model_len)
    requests, chains = fresh_workload(workload)
    # A prompt with prefix structure (a trace's hash_ids) gets the same tokens for the same content.
    prompts = synthetic_prompts(requests, loaded.config.vocab_size, options["seed"])
    params = [SamplingParams(max_tokens=r.true_output_tokens, temperature=0, ignore_eos=True) for r in requests]
    if out is not None:
        engine.executor.step_log = []
    progress = ProgressBar(len(requests), f"{scheduler} (engine)", enabled=True)  # stderr: --json is safe
    with progress as on_progress, frozen_heap(freeze):  # (as a served engine core runs: engine/gc_heap.py)
        wall = run_requests(
            engine, requests, prompts, params, wall_clock=not virtual_clock, chains=chains, on_progress=on_progress
        )
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
            "enable_prefix_caching": engine.scheduler.kv.prefix_cache is not None,
            "max_model_len": engine.max_model_len,
            "workload": workload.name,
            "num_clipped": workload.num_clipped,
            "seed": options["seed"],
        },
    )
    summary["_result"] = (requests, engine.replica.timeline)
    report(
        scheduler,
        summary,
        workload,
        out,
        as_json,
        f"engine: {options['model']} on {loaded.device}, {workload.name}, {len(requests)} requests",
    )
    if out is not None:
        from sloserve.cost.fit import write_profile_csv

        shapes, times = zip(*engine.executor.step_log, strict=True) if engine.executor.step_log else ((), ())
        write_profile_csv(shapes, times, out / "steps.csv")
        if not as_json:
            click.echo(f"wrote {out}/steps.csv ({len(times)} steps: shape and measured seconds, a profile CSV)")


@main.command(name="profile")
@engine_options
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
@click.option(
    "--host-share/--no-host-share",
    default=True,
    show_default=True,
    help="Also measure the engine loop's host work per step (scheduling, update, publishing tokens) and "
    "price it in the preset (h_s, h_r): for predicting served and wall-clock runs; off for `run --virtual-clock`.",
)
def profile_cmd(
    out: Path,
    name: str | None,
    prefill_chunks: str,
    context_lens: str,
    batch_sizes: str,
    decode_kv_lens: str,
    repeats: int,
    form: str,
    csv_path: Path | None,
    host_share: bool,
    **options: Any,
) -> None:
    """Measure the engine's batch times over a grid and fit the linear cost model to them; the preset
    works with `simulate --cost-model OUT`. Reports the error on held-out points."""
    from sloserve.cost import save_preset, write_profile_csv

    if not 1 <= repeats <= MAX_PROFILE_REPEATS:
        raise ConfigError(f"--repeats must be in 1..{MAX_PROFILE_REPEATS}, got {repeats:,}")
    check_file_out(out, "--out")
    check_file_out(csv_path, "--csv")
    grid_values = dict(
        prefill_chunks=int_list(prefill_chunks, "--prefill-chunks", minimum=1),
        context_lens=int_list(context_lens, "--context-lens"),
        batch_sizes=int_list(batch_sizes, "--batch-sizes", minimum=1),
        decode_kv_lens=int_list(decode_kv_lens, "--decode-kv-lens", minimum=1),
    )
    loaded = _load_engine_model(options)
    from sloserve.cost.profile_grid import ProfileGrid
    from sloserve.engine.llm_engine import default_kv_capacity, resolve_max_model_len
    from sloserve.engine.profile import profile

    max_len = resolve_max_model_len(loaded.config, options["max_model_len"])
    slots = options["kv_capacity_tokens"] or default_kv_capacity(loaded, max_len)
    _note_beyond_context(grid_values, max_len)
    with ProgressBar(1, "profiling", enabled=True) as bar:
        result = profile(
            loaded,
            ProfileGrid(**grid_values),
            max_model_len=max_len,
            max_slots=slots,
            name=name or out.stem,
            repeats=repeats,
            form=form,
            on_point=(lambda i, n: bar(i / n)) if bar else None,
            host_share=host_share,
        )
    report = result.fit.report
    if csv_path is not None:
        write_profile_csv(result.shapes, result.times_s, csv_path)
    save_preset(
        result.fit.coefficients,
        out,
        extra={
            "model": options["model"],
            "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "attention_backend": loaded.attention_backend,
            "cuda_graphs": loaded.cuda_graphs,
            "form": form,
            "fit": report._asdict(),
            "held_out": {
                "points": len(result.held_out),
                "mean_rel_error": result.held_out_mean_rel_error,
                "max_rel_error": result.held_out_max_rel_error,
            },
            "grid": {k: list(v) for k, v in grid_values.items()},
            **({"host": result.host.__dict__} if result.host else {}),
        },
    )
    click.echo(
        f"profiled {len(result.shapes)} batches of {options['model']} on {loaded.device}; fitted ({form} form"
        f"{_knee_note(result.fit.coefficients)}) on {report.n_rows}: mean relative error {report.mean_rel_error:.2%}, max {report.max_rel_error:.2%}; "
        f"held out {len(result.held_out)}: mean {result.held_out_mean_rel_error:.2%}, "
        f"max {result.held_out_max_rel_error:.2%}"
        + (
            f"; host share {result.host.per_step_s * 1e3:.3f} ms a step + {result.host.per_request_s * 1e3:.4f} ms a "
            f"request (over {result.host.num_steps} served steps, mean error {result.host.mean_rel_error:.1%})"
            if result.host
            else ""
        )
        + f"; wrote {out}"
    )
    _note_unidentified(report)

"""What the commands share: option groups (workload, system, parallel runs, the engine), running and
reporting one simulation, progress bars, checks of output paths."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sloserve.core.errors import ConfigError
from sloserve.runs import (
    Setup,
    public,
    run_simulation,
)


# --- shared options ------------------------------------------------------------------------------
def prefix_caching_flag(default: str) -> Callable:
    """``--enable-prefix-caching/--no-enable-prefix-caching`` (vLLM's name), None when not given."""
    return click.option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        default=None,
        help=f"Share computed KV blocks between requests whose prompts start alike (vLLM's option) [{default}].",
    )


# The simulator's default (runs.run_simulation) and the engine's (LLMEngine).
prefix_caching_option = prefix_caching_flag(
    "on when the workload's prompts carry prefix structure (Mooncake's hash_ids, conversations) and the "
    "scheduler supports it"
)
engine_prefix_caching_option = prefix_caching_flag("on where the scheduler supports it, as vLLM v1")


def workload_options(fn: Callable) -> Callable:
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


def system_options(fn: Callable) -> Callable:
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
        click.option(
            "--router",
            default="round-robin",
            show_default=True,
            help="round-robin, least-outstanding, prefix-affinity or slo (docs/simulator.md).",
        ),
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
        prefix_caching_option,
        click.option("--no-fast-path", is_flag=True, help="Run every step one by one (for checking)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def run_one(setup: Setup, scheduler: str, set_options: dict[str, str], workload, *, progress: bool) -> dict:
    """``run_simulation`` with a progress bar over the requests when ``progress``."""
    with ProgressBar(len(workload.requests), scheduler, enabled=progress) as on_progress:
        return run_simulation(setup, scheduler, set_options, workload, on_progress=on_progress)


class ProgressBar:
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


def has_metric(summary: dict, metric: str) -> bool:
    """``metric`` (a key or dotted path, as ``metrics.metric_value`` reads it) names a number or stats."""
    node: Any = summary
    for part in metric.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return node is None or isinstance(node, (int, float)) or (isinstance(node, dict) and "mean" in node)


def check_out(out: Path | None) -> None:
    """--out must be a directory or a path that can become one (checked before a run, not after)."""
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    existing = out if out.exists() else next(parent for parent in out.parents if parent.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file, not a directory")
    _check_writable("--out", out, existing)


def check_file_out(path: Path | None, option: str) -> None:
    """A file to write must name a file in an existing directory that can be written in (checked
    before the work: a profile measured for minutes was once lost to a raw errno at the end)."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"{option} {path}: is a directory, not a file")
    if not path.parent.is_dir():
        raise ConfigError(f"{option} {path}: {path.parent} is not an existing directory")
    _check_writable(option, path, path.parent)


def _check_writable(option: str, path: Path, folder: Path) -> None:
    """A ConfigError naming ``option`` unless an entry can be made in ``folder``: tried as the outputs will
    be written, not read off permission bits (root passes those, and /proc refuses root too)."""
    import tempfile

    try:
        tempfile.TemporaryDirectory(dir=folder, prefix=".sloserve-check-").cleanup()
    except OSError as e:
        raise ConfigError(
            f"{option} {path}: cannot write in {folder} ({e.strerror.lower()}); give a folder you can write to"
        ) from None


def write_outputs(out: Path, summary: dict) -> None:
    from sloserve.metrics import write_run_outputs

    requests, timeline = summary["_result"]
    write_run_outputs(out, public(summary), requests, timeline)


def report(scheduler: str, summary: dict, workload, out: Path | None, as_json: bool, title: str) -> None:
    """Write a one-scheduler run's outputs and print its summary (JSON, or a table and notes)."""
    from sloserve.metrics import compare_table, summary_to_json

    if out is not None:
        write_outputs(out, summary)
    if as_json:
        click.echo(summary_to_json(public(summary)))
        return
    print_table(compare_table({scheduler: summary}, title, table_width()))
    if workload.num_clipped:
        click.echo(f"note: {workload.num_clipped} requests clipped to the model context: {workload.clipped_details}")
    if out is not None:
        click.echo(f"wrote {out}/summary.json, requests.csv, timeline.csv and plots")


def table_width() -> int:
    """The terminal's width; 160 when stdout is a file or a pipe (nothing wraps lines there)."""
    from rich.console import Console

    console = Console()
    return console.width if console.is_terminal else 160


def print_table(table) -> None:
    from rich.console import Console

    Console(width=table_width()).print(table)


# NOTE: cost.fit's FORMS and DEFAULT_FORM, spelt out: importing sloserve.cost here would load scipy
# (a third of a second) for every command.
FIT_FORMS = ("knee", "floor", "infermax")


DEFAULT_FIT_FORM = "floor"


def parallel_options(fn: Callable) -> Callable:
    fn = click.option(
        "--ray-address",
        help="Run on the Ray cluster at this address (host:port, ray://host:port, "
        "auto); its nodes need the same sloserve installed.",
    )(fn)
    return click.option(
        "--workers",
        type=int,
        help="Simulations at once: 1 runs them one by one here; N > 1 on a local Ray of N CPUs "
        "(pip install 'sloserve[ray]').",
    )(fn)


def offset_progress(on_progress: Callable[[int], None] | None, done_before: int) -> Callable[[int], None] | None:
    """A progress callback that counts ``done_before`` runs as already done."""
    return None if on_progress is None else lambda done: on_progress(done_before + done)


class ParallelExecutor:
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


def scheduler_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ConfigError("--schedulers needs at least one name")
    return names


def int_list(text: str, option: str, minimum: int = 0) -> tuple[int, ...]:
    """Comma-separated integers, each at least ``minimum``."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{option} expects comma-separated integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise ConfigError(f"{option} expects integers >= {minimum}, got {text!r}")
    return values


def engine_options(fn: Callable) -> Callable:
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

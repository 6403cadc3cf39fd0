"""Simulator speed: simulated requests and steps per wall second near saturation, on one core.

For each scheduler (vllm, sarathi) and trace (sharegpt, azure-conv) it measures the saturation
throughput with an offline run, then simulates 30k Poisson requests at 90% of it, with the fast path
and (on fewer requests) step by step, side by side. It also times a whole `sloserve simulate` command
(start to exit, an upper bound on the time to the first simulated batch) and the peak memory of a
100k-request run, each in a fresh process.

Goal (issue #2): >= 10,000 simulated requests per wall second for both schedulers; first batch within
2 s; 100k requests under 1 GiB.

    python benchmarks/sim_speed.py [--requests 30000] [--slow-requests 3000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

from sloserve.cost import LinearCostModel, get_gpu, get_model, get_preset, kv_capacity_tokens
from sloserve.sched import make_scheduler
from sloserve.sim import simulate
from sloserve.workload import workload_from_trace
from sloserve.workload.traces import _load_bundled, load_trace

GOAL_RPS = 10_000
MODEL, GPU, PRESET = "llama-2-7b", "a100", "llama-2-7b-a100"

MEMORY_SNIPPET = """
import resource
from sloserve.cost import LinearCostModel, get_preset
from sloserve.sched import make_scheduler
from sloserve.sim import simulate
from sloserve.workload import workload_from_trace
w = workload_from_trace("sharegpt", num_requests=100_000, seed=0, context_len=4096, rate=9.0)
simulate(w.requests, lambda: make_scheduler("vllm", kv_capacity_tokens={cap}, max_model_len=4096),
         LinearCostModel(get_preset("{preset}")))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def run(trace: str, scheduler: str, capacity: int, *, n: int, rate: float | None, fast: bool = True, repeat: int = 1):
    """(best wall time of ``repeat`` identical runs, steps, simulated throughput)."""
    walls = []
    for _ in range(repeat):
        workload = workload_from_trace(trace, num_requests=n, seed=0, context_len=4096, rate=rate, offline=rate is None)
        t0 = time.perf_counter()
        result = simulate(
            workload.requests,
            lambda: make_scheduler(scheduler, kv_capacity_tokens=capacity, max_model_len=4096),
            LinearCostModel(get_preset(PRESET)),
            fast_path=fast,
        )
        walls.append(time.perf_counter() - t0)
    makespan = max(r.finish_time for r in workload.requests) - min(r.arrival_time for r in workload.requests)
    return min(walls), len(result.timeline), n / makespan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--slow-requests", type=int, default=3_000)
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed runs per cell; the best is reported (as timeit does)"
    )
    args = parser.parse_args()
    capacity = kv_capacity_tokens(get_model(MODEL), get_gpu(GPU))
    table = Table(title=f"simulator speed, {MODEL} on {GPU} ({PRESET} cost model), {args.requests} requests")
    for col in ("trace", "scheduler", "rate (req/s)", "sim req/s", "steps/s", "x goal", "fast/slow", "sim wall (s)"):
        table.add_column(col, justify="right")
    for trace in ("sharegpt", "azure-conv"):
        for scheduler in ("vllm", "sarathi"):
            _, _, saturation = run(trace, scheduler, capacity, n=3000, rate=None)
            rate = round(0.9 * saturation, 2)
            wall, steps, _ = run(trace, scheduler, capacity, n=args.requests, rate=rate, repeat=args.repeat)
            slow_wall, _, _ = run(trace, scheduler, capacity, n=args.slow_requests, rate=rate, fast=False)
            fast_wall, _, _ = run(trace, scheduler, capacity, n=args.slow_requests, rate=rate)
            rps = args.requests / wall
            table.add_row(
                trace,
                scheduler,
                f"{rate:.2f}",
                f"{rps:,.0f}",
                f"{steps / wall:,.0f}",
                f"{rps / GOAL_RPS:.2f}",
                f"{slow_wall / fast_wall:.2f}",
                f"{wall:.2f}",
            )
    console = Console(width=140)
    console.print(table)

    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "sloserve.cli",
            "simulate",
            "--trace",
            "sharegpt",
            "--rate",
            "9",
            "--num-requests",
            "1",
            "--json",
        ],
        check=True,
        capture_output=True,
    )
    command_s = time.perf_counter() - t0
    rss = subprocess.run(
        [sys.executable, "-c", MEMORY_SNIPPET.format(cap=capacity, preset=PRESET)],
        check=True,
        capture_output=True,
        text=True,
    )
    peak_mib = float(rss.stdout.strip().splitlines()[-1])
    loads = []
    for name in ("bwb", "mooncake-conv", "azure-conv"):  # the biggest bundled traces
        _load_bundled.cache_clear()
        t0 = time.perf_counter()
        load_trace(name)
        loads.append(f"{name} {time.perf_counter() - t0:.2f} s")
    console.print(f"loading the biggest bundled traces: {', '.join(loads)} (goal < 0.3 s each)")
    console.print(f"`sloserve simulate` of 1 request, start to exit: {command_s:.2f} s (goal: first batch < 2 s)")
    console.print(f"peak memory of a 100k-request vllm run: {peak_mib:.0f} MiB (goal < 1024 MiB)")
    console.print("fast/slow: wall time step by step / with the closed-form fast path, same requests.")
    console.print(f"sim req/s: the best of {args.repeat} identical runs (shared machines are noisy).")


if __name__ == "__main__":
    main()

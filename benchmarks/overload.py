"""Every registered scheduler under overload, side by side: KV-starved and over-saturated cases.

    python benchmarks/overload.py [--requests 400] [--schedulers vllm,bros,...]

Cases (issue 41), each run as `sloserve simulate` runs it (``runs.run_simulation``):

  bros-azure-conv/4   the BROS RT/BE mix (Azure conversation RT stream at 2 req/s, closed-loop BE
                      batches), OPT-13B on 2x A100-40GB with KV at a quarter of what the GPUs hold
  sharegpt-1.5x       ShareGPT, Poisson at 1.5x the rate vllm sustains offline, Llama-2-7B on an A100
  mixed-rt-be/3k      real-time ShareGPT mixed with best-effort batch jobs, OPT-13B in 3,000 KV tokens

Per scheduler and case: requests completed, preemptions per request, output throughput and RT
normalized latency (mean seconds per output token) as ratios to vllm's, simulated requests per wall
second, and what that speed is made of: the steps the policy scheduled (a stretch of repeated steps,
sim/stretch.py, is scheduled once) and the wall time per scheduled step. Goals (issue 41): every
request completes; <= 2 preemptions per request; >= 1,000 simulated req/s; BROS >= 0.8x vllm's
throughput with RT normalized latency <= 0.5x vllm's where BE requests share the GPU. A cell that
misses a goal is marked.
"""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console
from rich.table import Table

from sloserve.core.errors import ConfigError
from sloserve.cost import get_gpu, get_model, kv_capacity_tokens
from sloserve.runs import SimOptions, public, run_simulation, setup_from_options
from sloserve.sched import scheduler_names

GOAL_PREEMPTIONS = 2.0
GOAL_SIM_RPS = 1_000
GOAL_BROS_THROUGHPUT = 0.8
GOAL_BROS_RT_LATENCY = 0.5
# "scheduled": the steps the policy scheduled; "ms/scheduled": wall time per scheduled step
COLUMNS = (
    "scheduler",
    "completed",
    "preempt/req",
    "tput x vllm",
    "RT lat x vllm",
    "sim req/s",
    "scheduled",
    "ms/scheduled",
    "misses",
)


def cases(num_requests: int) -> dict[str, SimOptions]:
    opt13b = dict(model="opt-13b", gpu="a100-40gb", num_gpus=2)
    quarter = kv_capacity_tokens(get_model("opt-13b"), get_gpu("a100-40gb"), num_gpus=2) // 4
    sharegpt = SimOptions(trace="sharegpt", offline=True, num_requests=num_requests)
    saturation = run_simulation(setup_from_options(sharegpt), "vllm", {}, setup_from_options(sharegpt).make_workload())
    rate = 1.5 * saturation["throughput_rps"]
    return {
        "bros-azure-conv/4": SimOptions(
            workload="bros-azure-conv", num_requests=num_requests, rt_rate=2.0, kv_capacity_tokens=quarter, **opt13b
        ),
        f"sharegpt-1.5x ({rate:.1f}/s)": dataclasses.replace(sharegpt, offline=False, rate=rate),
        "mixed-rt-be/3k": SimOptions(
            workload="mixed-rt-be", num_requests=num_requests, kv_capacity_tokens=3000, **opt13b
        ),
    }


def rt_latency(summary: dict) -> float:
    """Mean normalized latency of the RT requests (all requests when none is RT)."""
    rt = summary["classes"].get("rt", summary)
    return rt["normalized_latency_s"]["mean"]


def scheduled_steps(result: dict) -> int:
    """The steps a run's policy scheduled: the timeline's rows with scheduling time (a stretch's later
    steps have none)."""
    _, timeline = result["_result"]
    return int((timeline.column("sched_time_s") > 0).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--schedulers", default=None, help="comma-separated (default: every registered one)")
    args = parser.parse_args()
    names = args.schedulers.split(",") if args.schedulers else scheduler_names()
    names = ["vllm", *(n for n in names if n != "vllm")]
    console = Console(width=150)
    for case, options in cases(args.requests).items():
        setup = setup_from_options(options)
        workload = setup.make_workload()
        table = Table(title=f"{case}: {len(workload.requests)} requests, KV {setup.kv_capacity_tokens:,} tokens")
        for col in COLUMNS:
            table.add_column(col, justify="right")
        base = None
        for name in names:
            try:
                result = run_simulation(setup, name, {}, workload)
            except ConfigError as e:  # a policy that cannot run this case (its message says why)
                table.add_row(name, *[""] * (len(COLUMNS) - 2), f"n/a: {str(e)[:60]}")
                continue
            s, scheduled = public(result), scheduled_steps(result)
            base = base or s
            preempt = s["preemptions"] / s["num_requests"]
            tput = s["throughput_tps"] / base["throughput_tps"]
            lat = rt_latency(s) / rt_latency(base)
            misses = []
            if s["completed"] < s["num_requests"]:
                misses.append("incomplete")
            if preempt > GOAL_PREEMPTIONS:
                misses.append("preemptions")
            if s["sim_requests_per_wall_s"] < GOAL_SIM_RPS:
                misses.append("sim speed")
            has_be = "be" in s["classes"]  # BROS's goal is about serving RT requests beside BE ones
            if name == "bros" and has_be and (tput < GOAL_BROS_THROUGHPUT or lat > GOAL_BROS_RT_LATENCY):
                misses.append("bros goal")
            table.add_row(
                name,
                f"{s['completed']}/{s['num_requests']}",
                f"{preempt:.2f}",
                f"{tput:.2f}",
                f"{lat:.2f}",
                f"{s['sim_requests_per_wall_s']:,.0f}",
                f"{scheduled:,}",
                f"{s['sim_wall_s'] / scheduled * 1e3:.2f}",
                ", ".join(misses),
            )
        console.print(table)


if __name__ == "__main__":
    main()

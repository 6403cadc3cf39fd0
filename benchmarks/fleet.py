"""A fleet behind one endpoint: `sloserve serve --replicas 2` (two engine replicas on Ray Serve) against
`sloserve serve` with one engine, the same workload through the same client, side by side.

    python benchmarks/fleet.py                 # random:tiny-llama on the CPU, one core per replica
    python benchmarks/fleet.py --router slo    # the fleet routed by another policy

Figures (issue 42's goals):
- offline: every request at t=0; output-token throughput of 2 replicas / 1 replica (goal >= 1.7);
- light: Poisson arrivals at --rate, requests rarely queue; TTFT p50 of the fleet - one engine, what
  the router and Ray Serve add (goal <= 2 ms).
One replica gets one core and one torch thread on both sides (`--cpus-per-replica 1`; the single engine
pinned to core 0 as benchmarks/serve_overhead.py does). The HTTP process, Ray and the load client share
the machine's cores with the replicas: on a 2-core machine they take from the fleet's compute.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

from serve_overhead import engine_pid, pin, workload  # NOTE: its loads, so that the two benchmarks compare
from sloserve.bench.client import free_loopback_port, run_benchmark, synthetic_prompts, wait_until_ready
from sloserve.metrics.summary import request_table
from sloserve.runs import fresh_request


def start_server(args, port: int, replicas: int, extra: Sequence[str] = ()) -> subprocess.Popen:
    """`sloserve serve` of the model of ``args`` on ``port``: one engine, or ``replicas`` of one core each;
    ``extra`` flags added."""
    command = [sys.executable, "-m", "sloserve.cli", "serve", "--model", args.model, "--served-model-name", args.model,
               "--dtype", args.dtype, "--scheduler", args.scheduler, "--port", str(port), "--log-level", "warning",
               "--kv-capacity-tokens", str(args.kv_capacity_tokens),
               "--max-model-len", str(args.max_model_len), "--max-queued-requests", str(10 * args.num_requests)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command += extra
    if replicas > 1:
        command += ["--replicas", str(replicas), "--cpus-per-replica", "1", "--router", args.router]
    else:
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(command, env=env)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process=proc, timeout_s=300)
    except RuntimeError as e:
        proc.kill()
        sys.exit(f"the server did not start: {e}")
    if replicas == 1:  # its engine process on core 0, as a replica of the fleet gets one core
        pin(engine_pid(proc.pid), {0})
    return proc


def served(args, port: int, requests) -> dict[str, float]:
    requests = [fresh_request(r) for r in requests]
    prompts = synthetic_prompts(requests, 256, args.seed)
    result = run_benchmark(f"http://127.0.0.1:{port}/v1", args.model, requests, prompts)
    if result.errors:
        sys.exit(f"{len(result.errors)} requests failed: {next(iter(result.errors.values()))}")
    table = request_table(requests)
    done = table["finished"]
    return {
        "tokens_per_s": float(table["output_tokens"][done].sum()) / result.wall_s,
        "ttft_p50_s": float(np.nanpercentile(table["ttft_s"][done], 50)),
        "tpot_mean_s": float(np.nanmean(table["tpot_s"][done])),
    }


def run(args, replicas: int, loads: dict) -> dict[str, dict[str, float]]:
    port = free_loopback_port()
    proc = start_server(args, port, replicas)
    try:
        return {name: served(args, port, requests) for name, requests in loads.items()}
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """The served model, its fleet and the trace (``start_server`` and ``workload`` read them)."""
    parser.add_argument("--model", default="random:tiny-llama")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--scheduler", default="vllm")
    parser.add_argument("--router", default="least-outstanding")
    parser.add_argument("--trace", default="sharegpt")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on the trace's output lengths")
    parser.add_argument("--kv-capacity-tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fleet_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=200, help="requests of the offline load")
    parser.add_argument("--light-requests", type=int, default=60, help="requests of the light load")
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson rate of the light load (req/s)")
    args = parser.parse_args()

    loads = {"offline": workload(args, True, args.num_requests), "light": workload(args, False, args.light_requests)}
    one = run(args, 1, loads)
    two = run(args, 2, loads)
    print(
        f"{args.model}, {args.scheduler}, {args.trace}: offline {args.num_requests} requests, light "
        f"{args.light_requests} at {args.rate} req/s; 2 replicas routed by {args.router}, one core each"
    )
    print("| load | figure | 1 engine | 2 replicas | 2 / 1 | 2 - 1 |")
    print("|---|---|---|---|---|---|")
    for name in loads:
        for key in ("tokens_per_s", "ttft_p50_s", "tpot_mean_s"):
            a, b = one[name][key], two[name][key]
            unit = 1.0 if key == "tokens_per_s" else 1e3
            label = "output tokens/s" if key == "tokens_per_s" else key.removesuffix("_s") + " ms"
            print(f"| {name} | {label} | {a * unit:.2f} | {b * unit:.2f} | {b / a:.3f} | {(b - a) * unit:+.2f} |")
    ratio = two["offline"]["tokens_per_s"] / one["offline"]["tokens_per_s"]
    print(f"\nthroughput, 2 replicas / 1 (offline, goal >= 1.7): {ratio:.3f}")
    added = (two["light"]["ttft_p50_s"] - one["light"]["ttft_p50_s"]) * 1e3
    print(f"TTFT added at p50 (light load, goal <= 2 ms): {added:+.2f} ms")


if __name__ == "__main__":
    main()

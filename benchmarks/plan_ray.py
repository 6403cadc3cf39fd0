"""`sloserve plan`: one search serially and on Ray, side by side; and EconoServe vs DistServe GPU counts.

Part 1 runs one fixed search (Llama-2-7B, ShareGPT at 20 req/s, TTFT 1 s / TPOT 0.1 s, three GPU types x
TP 1, 2 x colocated or 1P:1D x vLLM, Sarathi-Serve) with ``--workers 1`` and then on a local Ray with
every core, and prints both wall times, their ratio (goal >= 1.7x on 2 cores) and whether the two
plans are identical. "search" is the plan's own time; "process" adds Python's and Ray's start.

Part 2 is EconoServe §4 (Figure 12, homogeneous A100s): for each load, the fewest A100s with which
EconoServe (colocated), DistServe (vLLM on 1P:1D units, 100 Gb/s link) and colocated vLLM serve it with
90% of requests within TTFT 2 s and TPOT 0.1 s, OPT-13B on ShareGPT.

    python benchmarks/plan_ray.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEARCH = (
    "--trace",
    "sharegpt",
    "--qps",
    "20",
    "--slo-ttft",
    "1",
    "--slo-tpot",
    "0.1",
    "--model",
    "llama-2-7b",
    "--gpus",
    "a100,h100,h200",
    "--tp",
    "1,2",
    "--layouts",
    "colocated,1:1",
    "--schedulers",
    "vllm,sarathi",
)
DISTSERVE = {"econoserve": ("econoserve", "colocated"), "distserve": ("vllm", "1:1"), "vllm": ("vllm", "colocated")}


def _plan(out: Path, *args: str) -> tuple[dict, float]:
    wall0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "sloserve.cli", "plan", *args, "--out", str(out)], capture_output=True, text=True
    )
    wall = time.perf_counter() - wall0
    if proc.returncode not in (0, 2):
        sys.exit(f"plan failed: {proc.stderr}")
    return json.loads((out / "plan.json").read_text()), wall


def speed(tmp: Path, num_requests: int) -> None:
    args = (*SEARCH, "--num-requests", str(num_requests))
    serial, serial_wall = _plan(tmp / "serial", *args, "--workers", "1")
    ray, ray_wall = _plan(tmp / "ray", *args)  # every core
    s, r = serial.pop("search"), ray.pop("search")
    print(
        f"\n## one search, serial vs Ray ({os.cpu_count()} cores; {s['candidates']} configurations, {s['runs']} "
        f"simulations of {num_requests} requests per unit)\n"
    )
    print("| executor | workers | search s | process s |")
    print("|---|---|---|---|")
    print(f"| serial | 1 | {s['wall_s']:.1f} | {serial_wall:.1f} |")
    print(f"| Ray (local) | {r['workers']} | {r['wall_s']:.1f} | {ray_wall:.1f} |")
    print(
        f"\nspeed-up: {s['wall_s'] / r['wall_s']:.2f}x search, {serial_wall / ray_wall:.2f}x process (goal >= 1.7x "
        f"on 2 cores); identical plans: {serial == ray}"
    )
    a = serial["answer"]
    print(f"answer: {a['units']} x {a['label']} = {a['num_gpus']} GPUs, ${a['cost_per_hour']:.2f}/hour")


def distserve(tmp: Path, loads: list[float], num_requests: int) -> None:
    print(
        "\n## EconoServe §4 (Figure 12): fewest A100s that serve each load, OPT-13B, ShareGPT, "
        "TTFT 2 s / TPOT 0.1 s at 90%\n"
    )
    print("| load req/s | " + " | ".join(f"{name} GPUs" for name in DISTSERVE) + " | EconoServe vs DistServe |")
    print("|---|" + "---|" * (len(DISTSERVE) + 1))
    for load in loads:
        gpus = {}
        for name, (scheduler, layout) in DISTSERVE.items():
            doc, _ = _plan(
                tmp / f"{name}-{load:g}",
                "--trace",
                "sharegpt",
                "--qps",
                f"{load:g}",
                "--slo-ttft",
                "2",
                "--slo-tpot",
                "0.1",
                "--model",
                "opt-13b",
                "--gpus",
                "a100",
                "--tp",
                "1",
                "--max-gpus",
                "64",
                "--schedulers",
                scheduler,
                "--layouts",
                layout,
                "--num-requests",
                str(num_requests),
            )
            gpus[name] = doc["answer"]["num_gpus"] if doc["answer"] else None
        e, d = gpus["econoserve"], gpus["distserve"]
        saving = f"{e / d - 1:+.0%} GPUs" if e and d else "n/a"
        print(f"| {load:g} | " + " | ".join(str(gpus[n] or "-") for n in DISTSERVE) + f" | {saving} |")
    print(
        "\npaper (§4, homogeneous, OPT-13B): EconoServe uses 73% fewer GPUs than DistServe for the same goodput "
        "(its SLO: JCT within 2x the request's isolated time)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Fewer requests and loads.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        speed(Path(tmp), 500 if args.quick else 2000)
        distserve(Path(tmp), [4.0, 16.0] if args.quick else [2.0, 4.0, 8.0, 16.0, 32.0], 500 if args.quick else 1000)


if __name__ == "__main__":
    main()

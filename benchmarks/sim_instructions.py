"""Instructions the simulator executes per request, counted by valgrind: repeatable where timings are not.

For each benchmark cell of ``sim_speed.py`` (vllm and sarathi on sharegpt and azure-conv, near
saturation) it runs, under ``valgrind --tool=cachegrind --cache-sim=no``, one process that simulates
the first 1k requests of a 10k-request workload and one that simulates all 10k; the difference is
the simulation's own count for 9k requests (imports and the workload build cancel out). The same
source gives the same count on every run, so two versions compare to a fraction of a percent.
Keep the ``--profiles`` files to see where the instructions go (``cg_diff A B | cg_annotate``).

    python benchmarks/sim_instructions.py [--profiles DIR]
    python benchmarks/sim_instructions.py --prefix-caching   # Mooncake, caching off and on

``--prefix-caching`` counts instead what caching costs (issue 40's goal: on within 2x of off): the
first 2,000 requests of Mooncake's conversation trace as ``prefix_caching.py`` runs them (vllm,
Llama-3-8B on an A100, roofline), one process with caching off, one with it on, and one that only
builds the workload, whose count both others less.

Needs valgrind (``apt install valgrind``); takes about a minute per cell on two cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sim_speed import GPU, MODEL, PRESET  # the same model, GPU and cost model as the timed benchmark

# (trace, scheduler, rate): the rates sim_speed.py measures as 90% of saturation.
CELLS = [
    ("sharegpt", "vllm", 9.33),
    ("sharegpt", "sarathi", 9.24),
    ("azure-conv", "vllm", 5.16),
    ("azure-conv", "sarathi", 4.96),
]
WORKLOAD_REQUESTS = 10_000
BASE_REQUESTS = 1_000

CHILD = f"""
import sys
from sloserve.cost import LinearCostModel, get_gpu, get_model, get_preset, kv_capacity_tokens
from sloserve.sched import make_scheduler
from sloserve.sim import simulate
from sloserve.workload import workload_from_trace
trace, scheduler, rate, n = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
cap = kv_capacity_tokens(get_model({MODEL!r}), get_gpu({GPU!r}))
w = workload_from_trace(trace, num_requests={WORKLOAD_REQUESTS}, seed=0, context_len=4096, rate=rate)
simulate(w.requests[:n], lambda: make_scheduler(scheduler, kv_capacity_tokens=cap, max_model_len=4096),
         LinearCostModel(get_preset({PRESET!r})))
"""

# The Mooncake runs of --prefix-caching: argv[1] "off", "on" or "build" (the workload alone).
CACHING_CHILD = """
import sys
sys.path.insert(0, sys.argv[2])
from prefix_caching import MODEL, mooncake_workload
from sloserve.runs import SimOptions, run_simulation, setup_from_options
setup = setup_from_options(SimOptions(model=MODEL, gpu="a100", enable_prefix_caching=sys.argv[1] == "on"))
workload = mooncake_workload(2000, 4.0, setup.model.max_context_len)
if sys.argv[1] != "build":
    run_simulation(setup, "vllm", {}, workload)
"""


def count(trace: str, scheduler: str, rate: float, n: int, profile: Path) -> int:
    """Instructions of one process that simulates the first ``n`` requests."""
    return _count([CHILD, trace, scheduler, str(rate), str(n)], profile, f"{trace}/{scheduler}, {n} requests")


def _count(child: list[str], profile: Path, what: str) -> int:
    """Instructions of ``python -c *child`` under cachegrind."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
    cmd = [
        "setarch", "-R",  # no address randomization: the same count every run
        "valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={profile}",
        sys.executable, "-c", *child,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    match = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"valgrind run failed ({what}):\n{done.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def prefix_caching(folder: Path) -> None:
    """The --prefix-caching table: Mooncake with caching off and on, the workload build subtracted."""
    here = str(Path(__file__).parent)
    modes = ("build", "off", "on")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        build, off, on = pool.map(
            lambda mode: _count([CACHING_CHILD, mode, here], folder / f"mooncake_{mode}.cg", f"mooncake, {mode}"),
            modes,
        )
    table = Table(title="simulator instructions, Mooncake conversation trace, 2,000 requests, vllm")
    for col in ("caching off, M", "caching on, M", "on / off"):
        table.add_column(col, justify="right")
    table.add_row(f"{(off - build) / 1e6:,.0f}", f"{(on - build) / 1e6:,.0f}", f"{(on - build) / (off - build):.2f}x")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, help="keep the cachegrind profiles in this folder")
    parser.add_argument("--prefix-caching", action="store_true", help="Mooncake with caching off and on instead")
    args = parser.parse_args()
    for tool in ("valgrind", "setarch"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: this benchmark counts instructions with valgrind")
    # Byte-compile first: otherwise every run compiles edited modules again (10^8 instructions).
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(__file__).parents[1] / "src")], check=False)
    folder = args.profiles or Path(tempfile.mkdtemp(prefix="sloserve-cg-"))
    folder.mkdir(parents=True, exist_ok=True)
    if args.prefix_caching:
        prefix_caching(folder)
        if args.profiles is None:
            shutil.rmtree(folder)
        return
    jobs = [(cell, n) for cell in CELLS for n in (BASE_REQUESTS, WORKLOAD_REQUESTS)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        counts = list(
            pool.map(lambda job: count(*job[0], job[1], folder / f"{job[0][0]}_{job[0][1]}_{job[1]}.cg"), jobs)
        )
    table = Table(title=f"simulator instructions, requests {BASE_REQUESTS + 1:,}-{WORKLOAD_REQUESTS:,} of a workload")
    for col in ("trace", "scheduler", "rate (req/s)", "M instructions", "per request"):
        table.add_column(col, justify="right")
    for i, (trace, scheduler, rate) in enumerate(CELLS):
        own = counts[2 * i + 1] - counts[2 * i]
        table.add_row(
            trace, scheduler, f"{rate}", f"{own / 1e6:,.0f}", f"{own / (WORKLOAD_REQUESTS - BASE_REQUESTS):,.0f}"
        )
    Console().print(table)
    if args.profiles is None:
        shutil.rmtree(folder)
    else:
        print(f"profiles in {folder}: cg_diff SMALL.cg LARGE.cg > diff.out && cg_annotate diff.out")


if __name__ == "__main__":
    main()

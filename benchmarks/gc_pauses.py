"""The served path's garbage-collection pauses (issue 43 item 4): the server's process and its engine's, with the
heap each starts with frozen (the default, ``engine/gc_heap.py``) and not (``SLOSERVE_FREEZE_GC=0``), on the
same offline load.

    python benchmarks/gc_pauses.py [--num-requests 1000] [--repeats 2]

Each run starts a ``sloserve serve`` (pinned as ``serve_overhead.py`` pins it on a machine of 4 cores or fewer:
the engine's process on core 0, the HTTP process and the client on core 1), sends it the trace's requests at
t=0 and reads its ``/metrics``: each process's full (oldest-generation) collections during the load and their
seconds in all (and so a collection's mean), during which that process stood still. Beside them, how long the
requests took to reach the engine (the spread of their arrivals on the engine's clock, from the server's
``--request-log``: the server's admissions) and what the client measured: output tokens/s and mean TPOT. The
two settings alternate, ``--repeats`` runs each; the table gives each run, then the settings' means and their
ratio (frozen / not).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

from serve_overhead import (
    add_server_arguments,
    figures,
    logged_lines,
    logged_times,
    server_counters,
    start_server,
    workload,
)
from sloserve.bench.client import free_loopback_port, run_benchmark, synthetic_prompts
from sloserve.runs import fresh_request

PROCESSES = ("server", "engine")  # (``serve_overhead.SERVER_COUNTERS``' prefixes)
SETTINGS = {"not frozen": "0", "frozen": "1"}


def one_run(args, frozen: str, requests, vocab_size: int) -> dict[str, float]:
    """A fresh server with SLOSERVE_FREEZE_GC=``frozen`` under the offline load: its figures."""
    os.environ["SLOSERVE_FREEZE_GC"] = frozen  # (the server's environment is this process's)
    port = free_loopback_port()
    request_log = os.path.join(tempfile.mkdtemp(prefix="gc-pauses-"), "requests.jsonl")
    proc = start_server(args, port, ("--request-log", request_log))
    if args.pin:
        os.sched_setaffinity(0, {1})
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        before = server_counters(base_url)  # (the start-up's: the server's among them, its freeze's collection)
        requests = [fresh_request(r) for r in requests]
        result = run_benchmark(base_url, args.model, requests, synthetic_prompts(requests, vocab_size, args.seed))
        after = server_counters(base_url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if result.errors:
        raise SystemExit(f"{len(result.errors)} requests failed: {next(iter(result.errors.values()))}")
    run = figures(requests, result.wall_s)
    arrival = logged_times([json.loads(line) for line in logged_lines(request_log, 0)])[0]
    run["arrival spread ms"] = 1e3 * (arrival.max() - arrival.min())  # (the engine's clock: the server's admissions)
    for p in PROCESSES:
        count = after[f"{p}_gc_collections"] - before[f"{p}_gc_collections"]
        seconds = after[f"{p}_gc_s"] - before[f"{p}_gc_s"]
        run[f"{p} collections"], run[f"{p} seconds"] = count, seconds
        run[f"{p} ms a collection"] = 1e3 * seconds / count if count else float("nan")  # (none in this run)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser, num_requests=1000)
    parser.add_argument("--vocab-size", type=int, default=256, help="prompt ids are drawn from [0, this)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()  # NOTE: serve_overhead's start_server and workload read their options from it

    requests = workload(args, True, args.num_requests)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, frozen in SETTINGS.items():
            runs[name].append(one_run(args, frozen, requests, args.vocab_size))

    keys = [f"{p} {what}" for p in PROCESSES for what in ("collections", "seconds", "ms a collection")]
    keys += ["arrival spread ms", "tokens_per_s", "tpot_mean_s"]
    print(
        f"{args.model} on {args.device}, {args.scheduler}, {args.trace}: {args.num_requests} requests at t=0"
        f"{', pinned' if args.pin else ''}; each process's full garbage collections during the load"
    )
    print(
        "| figure | "
        + " | ".join(f"{name} {i + 1}" for name in SETTINGS for i in range(args.repeats))
        + " | frozen / not |"
    )
    print("|---" * (2 + len(SETTINGS) * args.repeats) + "|")
    for key in keys:
        values = [run[key] for name in SETTINGS for run in runs[name]]
        # (a setting's mean over its runs that had the figure: "ms a collection" is NaN in a run without one)
        had = [[run[key] for run in runs[name] if not np.isnan(run[key])] for name in SETTINGS]
        means = [float(np.mean(values)) if values else float("nan") for values in had]
        ratio = f"{means[1] / means[0]:.3f}" if means[0] and not np.isnan(means[0] + means[1]) else "-"
        print(f"| {key} | " + " | ".join(f"{v:.4g}" for v in values) + f" | {ratio} |")


if __name__ == "__main__":
    main()

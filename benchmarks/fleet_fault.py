"""A replica killed under load: `sloserve serve --replicas 2` serving a Poisson stream while one replica's
actor process gets SIGKILL (issue 42's fault goal).

    python benchmarks/fleet_fault.py                    # random:tiny-llama, 300 sharegpt requests at 20 req/s
    python benchmarks/fleet_fault.py --kill-after 2     # earlier in the run

It prints what became of every request: completed, ended with an error object (an error event in the
stream, or an HTTP error body), or hung (the client's timeout); what the server counted (/metrics:
requests by outcome, replica failures) and logged (--request-log: one line per request that got a token);
and how long Ray Serve took to run two replicas again. Goal: none hangs, every request is completed or
ends with an error object, the request log holds every request that got a token, and the replica is
back within 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from fleet import fleet_arguments, start_server
from serve_overhead import workload
from sloserve.bench.client import free_loopback_port, run_benchmark, synthetic_prompts
from sloserve.fleet.replica import local_replica_pids
from sloserve.runs import fresh_request

BACK_WITHIN_S = 60.0  # the goal, and how long the benchmark waits for the new replica


def kill_one_replica(after_s: float, report: dict) -> None:
    """``after_s`` seconds from now, SIGKILL one replica's actor process; then wait until two replicas
    run again, none of them the killed one, and put the times in ``report``."""
    time.sleep(after_s)
    pids = sorted(local_replica_pids())
    if len(pids) != 2:
        report["error"] = f"expected 2 replica processes, found {len(pids)}"
        return
    os.kill(pids[0], signal.SIGKILL)
    killed_at = time.monotonic()
    report["killed_pid"] = pids[0]
    while time.monotonic() - killed_at < 2 * BACK_WITHIN_S:
        now = local_replica_pids()
        if len(now) == 2 and pids[0] not in now:
            report["back_after_s"] = time.monotonic() - killed_at
            return
        time.sleep(0.2)


def server_counts(port: int) -> dict[str, float]:
    """/metrics: requests ended by outcome (all classes) and replica failures by outcome."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("sloserve_requests", "sloserve_replica_failures"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = f"{family.name} {sample.labels['outcome']}"
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def _by_outcome(counts: dict[str, float], family: str) -> str:
    return ", ".join(f"{key.split()[1]} {n:g}" for key, n in counts.items() if key.split()[0] == family)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fleet_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=20.0, help="Poisson rate (req/s)")
    parser.add_argument("--kill-after", type=float, default=5.0, help="seconds into the run")
    parser.add_argument("--timeout", type=float, default=300.0, help="a request not ended by then hung")
    args = parser.parse_args()

    requests = [fresh_request(r) for r in workload(args, False, args.num_requests)]
    prompts = synthetic_prompts(requests, 256, args.seed)
    log = Path(tempfile.mkdtemp(prefix="sloserve-fleet-fault-")) / "requests.jsonl"
    port = free_loopback_port()
    proc = start_server(args, port, 2, ["--request-log", str(log)])
    try:
        report: dict = {}
        killer = threading.Thread(target=kill_one_replica, args=(args.kill_after, report), daemon=True)
        killer.start()
        result = run_benchmark(f"http://127.0.0.1:{port}/v1", args.model, requests, prompts, timeout_s=args.timeout)
        killer.join(timeout=2 * BACK_WITHIN_S)
        counts = server_counts(port)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    if "error" in report:
        sys.exit(report["error"])

    hung = [e for e in result.errors.values() if e.startswith("TimeoutError")]
    error_objects = len(result.errors) - len(hung)
    completed = len(requests) - len(result.errors)
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    logged_done = sum(1 for line in logged if line["finish_reason"] in ("stop", "length"))
    back = report.get("back_after_s")
    print(
        f"{args.model}, {args.scheduler}, {args.trace}: {args.num_requests} requests at {args.rate:g} req/s on 2 "
        f"replicas ({args.router}); replica process {report.get('killed_pid')} killed {args.kill_after:g} s in"
    )
    print("| figure | value |\n|---|---|")
    rows = [
        ("requests", len(requests)),
        ("completed", completed),
        ("ended with an error object", error_objects),
        ("hung (no end within --timeout)", len(hung)),
        ("server: ended by outcome (/metrics)", _by_outcome(counts, "sloserve_requests")),
        ("server: replica failures (/metrics)", _by_outcome(counts, "sloserve_replica_failures")),
        ("request log: lines (completed / other)", f"{len(logged)} ({logged_done} / {len(logged) - logged_done})"),
        ("replica back after", "not within 120 s" if back is None else f"{back:.1f} s"),
    ]
    for name, value in rows:
        print(f"| {name} | {value} |")
    server_ended = sum(v for k, v in counts.items() if k.startswith("sloserve_requests "))
    ok = (
        not hung
        and completed + error_objects == len(requests)
        and server_ended == len(requests)
        and logged_done == completed
        and back is not None
        and back <= BACK_WITHIN_S
    )
    print(f"\ngoal (none hangs, every request ends and is counted, completed ones logged, back within 60 s): {ok}")
    if result.errors:
        print(
            "an error:",
            next(e for e in result.errors.values() if not e.startswith("TimeoutError")) if error_objects else hung[0],
        )


if __name__ == "__main__":
    main()

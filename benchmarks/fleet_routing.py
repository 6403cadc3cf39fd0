"""The routing policies served and simulated on the same workload: `sloserve serve --replicas 2 --router R`
measured by `bench-serve`, beside `sloserve simulate --replicas 2 --router R` with a cost model fitted to
the same engine (`sloserve profile`), for each router.

    python benchmarks/fleet_routing.py                  # random:tiny-llama on the CPU, one core per replica
    python benchmarks/fleet_routing.py --trace mooncake-conv --trace-arrivals   # a prefix-sharing trace

Issue 42's goal: the order of the routers by SLO attainment is the same served and simulated, and each
figure is within 15%. The profile runs pinned to core 0 with one torch thread, as each replica's engine
does.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from fidelity import figure, simulate, sloserve
from fleet import start_server
from serve_fidelity import profile
from sloserve.bench.client import free_loopback_port
from sloserve.router import ROUTERS

FIGURES = [
    ("SLO attainment", "slo_attainment", None),
    ("mean TTFT s", "ttft_s", "mean"),
    ("mean TPOT s", "tpot_s", "mean"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tiny-llama")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--scheduler", default="vllm")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--trace", default="sharegpt")
    parser.add_argument("--trace-arrivals", action="store_true", help="the trace's own arrival times")
    parser.add_argument("--rate", type=float, default=40.0, help="Poisson rate (req/s) without --trace-arrivals")
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--slo-ttft", type=float, default=0.1)
    parser.add_argument("--slo-tpot", type=float, default=0.02)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on the trace's output lengths")
    parser.add_argument("--kv-capacity-tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-chunks", default="16,32,64,128,256,512,1024")
    parser.add_argument("--context-lens", default="0,256,512")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,100")
    parser.add_argument("--decode-kv-lens", default="64,256,768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="Folder for the preset and the summaries [a temporary one]")
    args = parser.parse_args()
    args.pin = True  # NOTE: serve_fidelity.profile reads it: the profile on one core, as a replica's engine

    out = args.out or Path(tempfile.mkdtemp(prefix="sloserve-fleet-routing-"))
    out.mkdir(parents=True, exist_ok=True)
    engine = ["--model", args.model, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
              "--kv-capacity-tokens", str(args.kv_capacity_tokens)]  # fmt: skip
    preset = out / "preset.json"
    print(profile(args, engine, preset))
    arrivals = ["--trace-arrivals"] if args.trace_arrivals else ["--rate", f"{args.rate:g}"]
    workload = ["--trace", args.trace, *arrivals, "--num-requests", str(args.num_requests), "--seed", str(args.seed),
                "--max-tokens", str(args.max_tokens), "--slo-ttft", str(args.slo_ttft),
                "--slo-tpot", str(args.slo_tpot), "--max-model-len", str(args.max_model_len)]  # fmt: skip
    rows = {}
    for router in args.routers.split(","):
        port = free_loopback_port()
        args.router = router  # NOTE: start_server reads it
        proc = start_server(args, port, 2)
        try:
            served = json.loads(
                sloserve(
                    "bench-serve",
                    "--base-url",
                    f"http://127.0.0.1:{port}/v1",
                    "--model",
                    args.model,
                    *workload,
                    "--json",
                )
            )
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        sim = simulate(
            args.model,
            preset,
            "--scheduler",
            args.scheduler,
            *workload,
            "--kv-capacity-tokens",
            str(args.kv_capacity_tokens),
            "--replicas",
            "2",
            "--router",
            router,
        )
        (out / f"served-{router}.json").write_text(json.dumps(served, indent=2))
        (out / f"sim-{router}.json").write_text(json.dumps(sim, indent=2))
        rows[router] = (served, sim)

    print(
        f"\n{args.model}, {args.scheduler}, {args.trace} ({' '.join(arrivals)}), {args.num_requests} requests, SLO "
        f"TTFT {args.slo_ttft} s TPOT {args.slo_tpot} s; 2 replicas, one core each; summaries in {out}"
    )
    print("| router | figure | served | simulated | error |\n|---|---|---|---|---|")
    for router, (served, sim) in rows.items():
        for name, key, field in FIGURES:
            a, b = figure(served, key, field), figure(sim, key, field)
            error = abs(b - a) / a if a else float("nan")
            print(f"| {router} | {name} | {a:.4g} | {b:.4g} | {error:.1%} |")
    by = {side: sorted(rows, key=lambda r: -figure(rows[r][side], "slo_attainment", None)) for side in (0, 1)}
    print(f"\nrouters by SLO attainment, served: {', '.join(by[0])}; simulated: {', '.join(by[1])}")
    print(f"same order: {by[0] == by[1]}")


if __name__ == "__main__":
    main()

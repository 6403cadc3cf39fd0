"""Simulator fidelity against the served engine: profile the engine, then send the same workload to
`sloserve serve` with `sloserve bench-serve` and simulate it with the fitted preset, and print the
simulator's error on throughput and mean TTFT, TPOT and end-to-end latency.

    python benchmarks/serve_fidelity.py          # random:tiny-llama on the CPU (goal: mean error <= 10%)
    python benchmarks/serve_fidelity.py --model random:llama-3-8b --device cuda --dtype bfloat16 \\
        --prefill-chunks 32,64,128,256,512,1024,2048,4096 --context-lens 0,512,2048 \\
        --batch-sizes 1,2,4,8,16,32,64,128,256 --decode-kv-lens 128,512,2048 --max-model-len 4096

Unlike benchmarks/fidelity.py (the engine's own clock against the simulator's), the served figures are
what a client measures: HTTP, the event loop and detokenization are in them and not in the simulator.
Two loads: offline (every request at t=0), then Poisson at --load times the served offline throughput.
With --pin (the default on 4 cores or fewer) the profile and the server's engine process run on core
0 with one torch thread, the server's HTTP process and the client on core 1, as in
benchmarks/serve_overhead.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fidelity import figure, sloserve
from serve_overhead import free_port, start_server

METRICS = [
    ("throughput req/s", "throughput_rps", None),
    ("mean TTFT s", "ttft_s", "mean"),
    ("mean TPOT s", "tpot_s", "mean"),
    ("mean end-to-end s", "jct_s", "mean"),
]


def profile(args, engine: list[str], preset: Path) -> str:
    command = [sys.executable, "-m", "sloserve.cli", "profile", *engine, "--out", str(preset),
               "--prefill-chunks", args.prefill_chunks, "--context-lens", args.context_lens,
               "--batch-sizes", args.batch_sizes, "--decode-kv-lens", args.decode_kv_lens,
               "--repeats", str(args.repeats)]  # fmt: skip
    env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if args.pin else {})}
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=env,
        check=False,
        preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if args.pin else None,
    )
    if done.returncode != 0:
        sys.exit(f"profile failed:\n{done.stderr}")
    return done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--scheduler", default="vllm")
    parser.add_argument("--trace", default="sharegpt")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-capacity-tokens", type=int, default=65536)
    parser.add_argument("--load", type=float, default=0.7, help="Poisson rate as a fraction of offline throughput")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-chunks", default="16,32,64,128,256,512,1024")
    parser.add_argument("--context-lens", default="0,256,512")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,100")
    parser.add_argument("--decode-kv-lens", default="64,256,768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) <= 4)
    parser.add_argument("--out", type=Path, help="Folder for the preset and the summaries [a temporary one]")
    args = parser.parse_args()  # NOTE: serve_overhead.start_server reads the server's options from it

    out = args.out or Path(tempfile.mkdtemp(prefix="sloserve-serve-fidelity-"))
    out.mkdir(parents=True, exist_ok=True)
    engine = [
        "--model",
        args.model,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--kv-capacity-tokens",
        str(args.kv_capacity_tokens),
    ]
    preset = out / "preset.json"
    print(profile(args, engine, preset))

    port = free_port()
    proc = start_server(args, port)
    if args.pin:
        os.sched_setaffinity(0, {1})
    rows = []
    try:
        load = ["--offline"]
        for run in ("offline", "poisson"):
            workload = [
                "--trace",
                args.trace,
                "--num-requests",
                str(args.num_requests),
                "--seed",
                str(args.seed),
                *load,
            ]
            served = json.loads(
                sloserve(
                    "bench-serve",
                    "--base-url",
                    f"http://127.0.0.1:{port}/v1",
                    "--model",
                    args.model,
                    *workload,
                    "--max-model-len",
                    str(args.max_model_len),
                    "--json",
                )
            )
            (out / f"served-{run}.json").write_text(json.dumps(served, indent=2))
            sim = json.loads(
                sloserve(
                    "simulate",
                    "--model",
                    args.model,
                    "--cost-model",
                    str(preset),
                    "--scheduler",
                    args.scheduler,
                    *workload,
                    "--max-model-len",
                    str(args.max_model_len),
                    "--kv-capacity-tokens",
                    str(args.kv_capacity_tokens),
                    "--json",
                )
            )
            (out / f"sim-{run}.json").write_text(json.dumps(sim, indent=2))
            rows.append(("offline" if run == "offline" else f"{load[1]} req/s", served, sim))
            load = ["--rate", f"{args.load * served['throughput_rps']:.3g}"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    print(
        f"\n{args.model} on {args.device} ({args.dtype}), {args.scheduler}, {args.trace}, {args.num_requests} "
        f"requests{', pinned' if args.pin else ''}; preset and summaries in {out}"
    )
    print("| load | figure | served | simulated | error |\n|---|---|---|---|---|")
    errors = []
    for label, served, sim in rows:
        for name, key, field in METRICS:
            a, b = figure(served, key, field), figure(sim, key, field)
            error = abs(b - a) / a if a else float("nan")
            errors.append(error)
            print(f"| {label} | {name} | {a:.4g} | {b:.4g} | {error:.1%} |")
    print(
        f"\nsimulator error over {len(errors)} figures: mean {sum(errors) / len(errors):.1%}, max {max(errors):.1%} "
        f"(goal: mean <= 10% on the CPU, <= 5% on a GPU)"
    )


if __name__ == "__main__":
    main()

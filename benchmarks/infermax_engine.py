"""InferMax Figures 13 and 14 on our engine: Figure 9's schedulers (O = 32, B requests at t = 0, a
sweep of the KV capacity M) run on a real model, beside the simulator on the same workloads.

The paper ran Figure 9 on vLLM v0.6.3 ("vLLM-Sys", §4.7, Figure 14) and found that evictions raise TPS
up to 2.3x at M = 100 and 1K. Our simulator finds that they lower it at M = 1K (docs/reproduction.md,
"Figure 9 at M = 1K"). This script asks the same question of the engine: each scheduler and its
eviction-free variant, on the engine (its clock: the sum of measured step times, `--virtual-clock`)
and in the simulator with a cost model (a preset, or one fitted to this engine by `sloserve profile`).
It also prints Figure 13's measure for every run: the simulator's latency against the engine's (the
paper: 5.5% mean, 12% max against vLLM-Sys's GPU time).

    python benchmarks/infermax_engine.py --cost-model fidelity-preset.json   # a GPU, random:llama-3-8b
    python benchmarks/infermax_engine.py --device cpu --model random:tiny-llama --dtype float32 \\
        --num-requests 24 --inputs 4,16 --capacities 200 --cost-model tiny-preset.json

Setting: InferMax §4.1's (experiments/infermax.py): C = 4096, token-granular KV (block size 1), no
watermark, no cap on running requests. The model is loaded once; each run gets a fresh engine and KV
cache. TPS is output tokens over the time the whole workload took.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from sloserve.engine.llm_engine import LLMEngine, engine_cost_model, run_requests, synthetic_prompt
from sloserve.engine.loader import load_model
from sloserve.engine.sampler import SamplingParams
from sloserve.experiments.infermax import OPTIONS, C, fixed_metrics, run_fixed
from sloserve.workload import synthetic_workload

PAIRS = (("vllm", "vllm_ef"), ("sarathi", "sarathi_ef"))


def engine_run(loaded, name: str, prompt: int, output: int, num_requests: int, capacity: int, context: int) -> dict:
    """One offline run on the engine (virtual clock: measured step times, no waiting)."""
    engine = LLMEngine(loaded, name, kv_capacity_tokens=capacity, max_model_len=context, scheduler_options=OPTIONS)
    requests = synthetic_workload(prompt, output, num_requests, context_len=context).requests
    rng = np.random.default_rng(0)
    prompts = [synthetic_prompt(prompt, loaded.config.vocab_size, rng) for _ in requests]
    params = [SamplingParams(max_tokens=output, temperature=0, ignore_eos=True) for _ in requests]
    run_requests(engine, requests, prompts, params, wall_clock=False)
    return fixed_metrics(name, prompt, output, capacity, requests, where="engine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--cost-model",
        default=None,
        help="the simulator's: a preset name or a JSON file from `sloserve profile` [llama-2-7b-a100]",
    )
    parser.add_argument("--num-requests", type=int, default=1024, help="B [1024, as the paper]")
    parser.add_argument("--output", type=int, default=32, help="O [32]")
    parser.add_argument("--inputs", default="16,64", help="the prompt lengths I to run [16,64]")
    parser.add_argument("--capacities", default="1000", help="the KV capacities M in tokens [1000]")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    context = min(C, loaded.config.max_position_embeddings)
    cost = engine_cost_model(args.cost_model)
    rows = []
    for capacity in (int(m) for m in args.capacities.split(",")):
        for prompt in (int(i) for i in args.inputs.split(",")):
            if prompt + args.output - 1 > capacity:
                continue
            for name in (n for pair in PAIRS for n in pair):
                work = (name, prompt, args.output, args.num_requests, capacity)
                simulated = {**run_fixed(*work, preset=cost), "where": "simulator"}  # at C, as Figure 9
                rows += [engine_run(loaded, *work, context), simulated]
                print(json.dumps(rows[-2]), json.dumps(rows[-1]), sep="\n", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")

    lines = (
        f"{args.model} on {loaded.device} ({args.dtype}), O = {args.output}, B = {args.num_requests}",
        f"TPS of each scheduler over its eviction-free variant's (its evictions); simulator: {cost.name}",
    )
    table = Table(title="\n".join(lines), min_width=max(map(len, lines)))
    for column in ("M", "I", "scheduler", "engine", "simulator"):
        table.add_column(column, justify="left" if column == "scheduler" else "right")
    cell = {(r["where"], r["M"], r["I"], r["scheduler"]): r for r in rows}
    for capacity, prompt in sorted({(r["M"], r["I"]) for r in rows}):
        for base, ef in PAIRS:
            ratios = []
            for where in ("engine", "simulator"):
                b, e = cell[where, capacity, prompt, base], cell[where, capacity, prompt, ef]
                ratios.append(f"{b['tps'] / e['tps']:.2f}x ({b['evictions']:,})")
            table.add_row(f"{capacity:,}", str(prompt), base, *ratios)
    Console(width=120).print(table)
    print(
        "paper (vLLM-Sys, Figure 14): evictions raise TPS up to 2.3x at M = 100 and 1K, lower it up to 1.5x at larger M"
    )

    # Figure 13's measure: the simulator's latency (the whole workload's) against the engine's.
    errors = Table(title="the simulator's latency against the engine's, each run")
    for column in ("M", "I", "scheduler", "engine s", "simulator s", "error"):
        errors.add_column(column, justify="left" if column == "scheduler" else "right")
    gaps = []
    for capacity, prompt, name in sorted({(r["M"], r["I"], r["scheduler"]) for r in rows}):
        real, sim = cell["engine", capacity, prompt, name], cell["simulator", capacity, prompt, name]
        gaps.append(abs(sim["latency_s"] / real["latency_s"] - 1))
        errors.add_row(
            f"{capacity:,}",
            str(prompt),
            name,
            f"{real['latency_s']:.3f}",
            f"{sim['latency_s']:.3f}",
            f"{sim['latency_s'] / real['latency_s'] - 1:+.1%}",
        )
    Console(width=120).print(errors)
    print(
        f"mean / max |error| {np.mean(gaps):.1%} / {np.max(gaps):.1%} "
        "(paper, Figure 13: 5.5% / 12% against vLLM-Sys's GPU time)"
    )


if __name__ == "__main__":
    main()

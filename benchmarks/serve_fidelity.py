"""Simulator fidelity against the served engine: profile the engine, then send the same workload to
`sloserve serve` with `sloserve bench-serve` and simulate it with the fitted preset, and print the
simulator's error on throughput and mean TTFT, TPOT and end-to-end latency.

    python benchmarks/serve_fidelity.py          # random:tiny-llama on the CPU (goal: mean error <= 10%)
    python benchmarks/serve_fidelity.py --scheduler bros --workload mixed.yaml   # RT and BE, by class
    python benchmarks/serve_fidelity.py --model random:llama-3-8b --device cuda --dtype bfloat16 \\
        --prefill-chunks 32,64,128,256,512,1024,2048,4096 --context-lens 0,512,2048 \\
        --batch-sizes 1,2,4,8,16,32,64,128,256 --decode-kv-lens 128,512,2048 --max-model-len 4096

Unlike benchmarks/fidelity.py (the engine's own clock against the simulator's), the served figures are
what a client measures: HTTP, the event loop and detokenization are in them and not in the simulator.
Two loads: offline (every request at t=0), then Poisson at --load times the served offline throughput
(the same prompts: the server's prefix cache is reset before each load, which the simulator starts cold);
with --workload, the spec's own arrivals instead, and the figures of each class too (the request log
records each request's class, SLO and priority, and the replay keeps them). The served and in-process
engines schedule with the fitted preset too (BROS, EconoServe and InferMax decide by batch times).
Each load is simulated twice, and compared on two clocks:
- as the client sent it (the trace's requests at t=0, or its Poisson arrivals) against what the client
  measured: HTTP, the event loop, detokenization and streaming are in the served figures only;
- as the engine received it: the server's request log (``serve --request-log``) replayed with
  ``--trace-arrivals`` (an offline load reaches the engine over HTTP one request after another, not
  all at t=0), against the figures of that log (arrival, first token and finish on the engine's
  clock). Same requests, same arrivals, same clock.
Between the two, the same received requests run through the engine in-process (``sloserve run`` on the
wall clock, pinned as the server's engine is): served against in-process is what the served path adds
(the server's process, the pipe, the engine core's publishing), in-process against simulated is the
simulator's own error (the profile's batch times and its measured host share).
Last, the served engine's steps (``serve --step-log``) beside the in-process engine's (``run --out``'s
steps.csv) by batch: the executor's time of a step of the same shape served and in-process, and the served
loop's host work around it (the engine's scheduling and update, publishing, polling).
With --pin (the default on 4 cores or fewer) the profile and the server's engine process run on core
0 with one torch thread, the server's HTTP process and the client on core 1, as in
benchmarks/serve_overhead.py.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
from pathlib import Path

from fidelity import figure, simulate, sloserve
from figures import record
from serve_overhead import logged_times, mean_tpot, start_server
from sloserve.bench.client import free_loopback_port

METRICS = [
    ("throughput req/s", "throughput_rps", None),
    ("mean TTFT s", "ttft_s", "mean"),
    ("mean TPOT s", "tpot_s", "mean"),
    ("mean end-to-end s", "jct_s", "mean"),
]


def engine_summary(lines: list[str]) -> dict:
    """A request log's figures on the engine's clock, as the simulator's summary defines them
    (throughput over first arrival to last finish; TPOT over each request's tokens after its first),
    and each class's under ``classes`` (its throughput over the whole run's span, as the summary's)."""
    logged = [json.loads(line) for line in lines]
    span = max(r["finish_s"] for r in logged) - min(r["arrival_s"] for r in logged)
    summary = _logged_figures(logged, span)
    summary["classes"] = {
        c: _logged_figures([r for r in logged if r["request_class"] == c], span)
        for c in sorted({r["request_class"] for r in logged})
    }
    return summary


def _logged_figures(logged: list[dict], span_s: float) -> dict:
    arrival, first, finish, out = logged_times(logged)
    return {
        "throughput_rps": len(logged) / span_s,
        "ttft_s": {"mean": float((first - arrival).mean())},
        "tpot_s": {"mean": mean_tpot(first, finish, out)},
        "jct_s": {"mean": float((finish - arrival).mean())},
    }


def profile(args, engine: list[str], preset: Path) -> str:
    return sloserve(
        "profile", *engine, "--out", str(preset), "--prefill-chunks", args.prefill_chunks,
        "--context-lens", args.context_lens, "--batch-sizes", args.batch_sizes,
        "--decode-kv-lens", args.decode_kv_lens, "--repeats", str(args.repeats), pin=args.pin,
    ).strip()  # fmt: skip


def in_process(args, engine: list[str], replay: list[str], out: Path) -> dict:
    """The received requests through the engine in this machine's process (``sloserve run`` on the wall
    clock), pinned as the server's engine is."""
    run = sloserve("run", *engine, "--scheduler", args.scheduler, *replay, "--out", str(out), "--json", pin=args.pin)
    return json.loads(run)


def class_rows(rows: list[tuple]) -> list[tuple]:
    """Each row's figures again for each class its workload has (label "LOAD, CLASS")."""
    out = []
    for label, *summaries in rows:
        for c in sorted(summaries[0].get("classes", {})) if len(summaries[0].get("classes", {})) > 1 else []:
            out.append((f"{label}, {c}", *(s["classes"][c] for s in summaries)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--scheduler", default="vllm")
    parser.add_argument("--trace", default="sharegpt")
    parser.add_argument("--workload", help="a workload spec (its own arrivals; instead of --trace and the two loads)")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-capacity-tokens", type=int, default=65536)
    parser.add_argument("--load", type=float, default=0.7, help="Poisson rate as a fraction of offline throughput")
    parser.add_argument("--seed", type=int, default=0)
    # Up to vLLM's token budget at the default context (max(1,024, 2,048) tokens): the offline load's prefill
    # steps reach 2,047 tokens, batches of several prompts that the grid's (k prompts of c tokens, k * c up to
    # the largest chunk) then cover; up to 1,024 the fit extrapolated them
    parser.add_argument("--prefill-chunks", default="16,32,64,128,256,512,1024,2048")
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

    port = free_loopback_port()
    request_log = out / "request-log.jsonl"
    request_log.unlink(missing_ok=True)
    step_log = out / "served-steps.csv"  # (each served step's shape, time and the engine loop's parts)
    proc = start_server(
        args, port, ("--request-log", str(request_log), "--cost-model", str(preset), "--step-log", str(step_log))
    )
    if args.pin:
        os.sched_setaffinity(0, {1})
    rows = []
    try:
        load = ["--offline"]
        for run in ("spec",) if args.workload else ("offline", "poisson"):
            source = ["--workload", args.workload] if args.workload else ["--trace", args.trace, *load]
            workload = [*source, "--num-requests", str(args.num_requests), "--seed", str(args.seed)]
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
                    "--reset-prefix-cache",  # NOTE: the Poisson load resends the offline one's prompts: cold, as simulated
                    "--json",
                )
            )
            (out / f"served-{run}.json").write_text(json.dumps(served, indent=2))
            # This load's lines of the request log (one a request, written as each ends): the
            # requests as the engine received them.
            lines = request_log.read_text().splitlines()[-args.num_requests :]
            received = out / f"received-{run}.jsonl"
            received.write_text("\n".join(lines) + "\n")
            replay = ["--trace", str(received), "--num-requests", str(len(lines)), "--trace-arrivals"]
            sims = []
            for sim_workload, name in ((workload, "sent"), (replay, "received")):
                sim = simulate(
                    args.model,
                    preset,
                    "--scheduler",
                    args.scheduler,
                    *sim_workload,
                    "--max-model-len",
                    str(args.max_model_len),
                    "--kv-capacity-tokens",
                    str(args.kv_capacity_tokens),
                )
                (out / f"sim-{run}-{name}.json").write_text(json.dumps(sim, indent=2))
                sims.append(sim)
            label = {"offline": "offline", "spec": args.workload, "poisson": f"{load[-1]} req/s"}[run]
            rows.append((label, served, engine_summary(lines), *sims, (replay, run)))
            load = ["--rate", f"{args.load * served['throughput_rps']:.3g}"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # The served figures' errors first: a run cut short in the in-process runs below (the GPU runbook's stage
    # limit) still reports and records them
    for which in ("sent", "received"):
        record(f"sim_error_as_{which}", mean_error(rows, which))
    # After the server is gone (it and the in-process engine would share core 0)
    with_preset = [*engine, "--cost-model", str(preset)]
    runs = [(row[0], row[-1][1]) for row in rows]  # (each load's label and its files' name)
    rows = [(*row[:-1], in_process(args, with_preset, row[-1][0], out / f"run-{row[-1][1]}")) for row in rows]

    print(
        f"\n{args.model} on {args.device} ({args.dtype}), {args.scheduler}, {args.workload or args.trace}, {args.num_requests} "
        f"requests{', pinned' if args.pin else ''}; preset and summaries in {out}"
    )
    print(
        "| load | figure | client | simulated as sent | error | engine | in-process | served / in-process "
        "| simulated as received | error vs engine | error vs in-process |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    # NOTE: the mean errors are over the whole workload's figures; each class's rows follow them
    for table_rows in (rows, class_rows(rows)):
        for label, client, engine_side, sent, received, local in table_rows:
            for name, key, field in METRICS:
                cli, sim_sent, eng, loc, sim_recv = (
                    figure(x, key, field) for x in (client, sent, engine_side, local, received)
                )
                print(
                    f"| {label} | {name} | {cli:.4g} | {sim_sent:.4g} | {error(cli, sim_sent):.1%} | {eng:.4g} | "
                    f"{loc:.4g} | {eng / loc:.3f} | {sim_recv:.4g} | {error(eng, sim_recv):.1%} | "
                    f"{error(loc, sim_recv):.1%} |"
                )
    for which in COMPARED:
        mean_error(rows, which)
    print(
        "\nThe served engine's steps (--step-log) against the in-process engine's (run --out), by batch: execute is "
        "the executor's step (the profile's time), the loop's parts the served engine's host work around it\n"
        "| load | steps | served: steps, KV tokens a step | execute ms | engine step ms | publish ms | between ms "
        "| in-process: steps, KV tokens a step | execute ms | served / in-process execute |\n" + "|---" * 10 + "|"
    )
    for label, run in runs:
        lines = (out / f"received-{run}.jsonl").read_text().splitlines()
        compare_steps(label, served_steps(step_log, lines), out / f"run-{run}" / "steps.csv")


# Decode-only steps by their decodes (the steps with a prefill in one more row)
DECODE_BATCHES = ((1, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 1 << 30))


def served_steps(step_log: Path, lines: list[str]) -> list[dict]:
    """The step log's rows of one load: the steps that started from its first arrival to its last finish."""
    logged = [json.loads(line) for line in lines]
    first, last = min(r["arrival_s"] for r in logged), max(r["finish_s"] for r in logged)
    return [row for row in step_rows(step_log) if first <= row["start_s"] <= last]


def step_rows(path: Path) -> list[dict[str, float]]:
    """A profile CSV's rows (a run's steps.csv, a served step log), every column a number."""
    with path.open(newline="") as handle:
        return [{column: float(value) for column, value in row.items()} for row in csv.DictReader(handle)]


def compare_steps(label: str, served: list[dict], in_process_steps: Path) -> None:
    """Print the served steps of a load beside the in-process run's of the same requests, by batch."""
    in_process = step_rows(in_process_steps)

    def group(steps: list[dict], lo: int | None, hi: int | None) -> list[dict]:
        if lo is None:  # the steps with a prefill
            return [s for s in steps if s["num_prefill"] > 0]
        return [s for s in steps if s["num_prefill"] == 0 and lo <= s["num_decode"] <= hi]

    def mean(steps: list[dict], column: str) -> float:
        return sum(s[column] for s in steps) / len(steps)

    for lo, hi in (*DECODE_BATCHES, (None, None)):
        here, there = group(served, lo, hi), group(in_process, lo, hi)
        if not here or not there:
            continue
        name = "with a prefill" if lo is None else f"{lo}-{hi} decodes" if hi < 1 << 30 else f"{lo}+ decodes"
        served_ms = [1e3 * mean(here, c) for c in ("time_s", "engine_step_s", "publish_s", "between_s")]
        print(
            f"| {label} | {name} | {len(here)}, {mean(here, 'decode_kv_tokens'):.0f} | "
            + " | ".join(f"{ms:.3f}" for ms in served_ms)
            + f" | {len(there)}, {mean(there, 'decode_kv_tokens'):.0f} | {1e3 * mean(there, 'time_s'):.3f} | "
            f"{mean(here, 'time_s') / mean(there, 'time_s'):.3f} |"
        )


def error(measured: float, simulated: float) -> float:
    return abs(simulated - measured) / measured if measured else float("nan")


# Each mean error's (measured, simulated) places in a row of ``main``'s (label, client, engine, simulated as
# sent, simulated as received, in-process), and what it compares
COMPARED = {
    "sent": (1, 3, "as sent, against the client"),
    "received": (2, 4, "as received, against the engine's clock"),
    "in-process": (5, 4, "as received, against the engine in-process"),
}


def mean_error(rows: list[tuple], which: str) -> float:
    """Print and return the simulator's mean error ``which`` (of ``COMPARED``) over the whole workload's figures
    of ``rows``."""
    measured, simulated, label = COMPARED[which]
    errors = [error(figure(row[measured], k, f), figure(row[simulated], k, f)) for row in rows for _, k, f in METRICS]
    mean = sum(errors) / len(errors)
    print(
        f"simulator error {label}, over {len(errors)} figures: mean {mean:.1%}, max {max(errors):.1%} "
        "(goal: mean <= 10% on the CPU, <= 5% on a GPU)"
    )
    return mean


if __name__ == "__main__":
    main()

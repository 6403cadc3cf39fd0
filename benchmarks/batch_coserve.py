"""Online real-time traffic beside a large Batch API job on one server: BROS's Figure 10 scenario on
the real engine, BROS against vLLM and vLLM with priority.

    python benchmarks/batch_coserve.py                       # random:tiny-llama on the CPU
    python benchmarks/batch_coserve.py --model random:llama-3-8b --device cuda --dtype bfloat16 \
        --rt-ttft-ms 200 --rt-tpot-ms 50 --rt-rate 8

For each scheduler, a `sloserve serve --data-dir` subprocess on 127.0.0.1 runs three phases:
- RT alone: a Poisson stream of RT requests (the trace's lengths, the SLO below) via bench-serve's
  client; the figures are TTFT and TPOT SLO attainment and TTFT p50/p99 as the client sees them;
- batch alone: a batch of --batch-lines lines (the trace's lengths, best-effort) for --be-window-s;
  the figure is BE output tokens/s (from the batch's usage before and after the window);
- RT + batch: the batch keeps running while the same RT stream is replayed; RT figures as above, and
  the BE tokens/s over the stream's duration.
What to read: RT attainment with the batch against without it (the cost of co-serving to RT), and
BE tokens/s with RT against alone (what the batch keeps).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import openai

from sloserve.bench.client import free_loopback_port, run_benchmark, synthetic_prompts, wait_until_ready
from sloserve.core.request import SLO
from sloserve.metrics.summary import request_table
from sloserve.runs import fresh_request
from sloserve.workload import workload_from_trace


def start_server(args, scheduler: str, port: int, data_dir: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "sloserve.cli", "serve", "--model", args.model, "--served-model-name", args.model,
               "--device", args.device,
               "--dtype", args.dtype, "--scheduler", scheduler, "--port", str(port), "--log-level", "warning",
               "--kv-capacity-tokens", str(args.kv_capacity_tokens), "--max-model-len", str(args.max_model_len),
               "--data-dir", data_dir, "--max-batch-lines-in-engine", str(args.batch_lines_in_engine),
               "--rt-ttft-ms", str(args.rt_ttft_ms), "--rt-tpot-ms", str(args.rt_tpot_ms)]  # fmt: skip
    proc = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process=proc, timeout_s=180)
    except RuntimeError as e:
        proc.kill()
        sys.exit(f"the server ({scheduler}) did not start: {e}")
    return proc


def rt_stream(args) -> list:
    w = workload_from_trace(
        args.trace,
        num_requests=args.rt_requests,
        seed=args.seed,
        context_len=args.max_model_len,
        rate=args.rt_rate,
        max_tokens=args.max_tokens,
        slo=SLO(ttft_s=args.rt_ttft_ms / 1000, tpot_s=args.rt_tpot_ms / 1000),
    )
    return w.requests


def batch_file(args, vocab_size: int) -> bytes:
    """--batch-lines completion lines with the trace's lengths (random token ids, ignore_eos)."""
    w = workload_from_trace(
        args.trace,
        num_requests=args.batch_lines,
        seed=args.seed + 1,
        context_len=args.max_model_len,
        offline=True,
        max_tokens=args.max_tokens,
    )
    prompts = synthetic_prompts(w.requests, vocab_size, args.seed + 1)
    lines = [
        {
            "custom_id": f"be-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": args.model,
                "prompt": prompt,
                "max_tokens": r.true_output_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i, (r, prompt) in enumerate(zip(w.requests, prompts, strict=True))
    ]
    return "\n".join(json.dumps(line) for line in lines).encode()


def rt_figures(args, base_url: str, vocab_size: int, requests) -> dict[str, float]:
    requests = [fresh_request(r) for r in requests]
    result = run_benchmark(base_url, args.model, requests, synthetic_prompts(requests, vocab_size, args.seed))
    if result.errors:
        sys.exit(f"{len(result.errors)} RT requests failed: {next(iter(result.errors.values()))}")
    table = request_table(requests)
    done = table["finished"]
    ttft, tpot = table["ttft_s"][done], table["tpot_s"][done]
    met = (ttft <= args.rt_ttft_ms / 1000) & ((tpot <= args.rt_tpot_ms / 1000) | np.isnan(tpot))
    return {
        "slo_attainment": float(met.mean()),
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3),
        "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
        "tpot_mean_ms": float(np.nanmean(tpot) * 1e3),
        "wall_s": result.wall_s,
    }


def be_tokens(client: openai.OpenAI, batch_id: str) -> int:
    return client.batches.retrieve(batch_id).usage.output_tokens


def run_scheduler(args, scheduler: str, vocab_size: int, content: bytes) -> dict[str, dict[str, float]]:
    port = free_loopback_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    with tempfile.TemporaryDirectory(prefix="sloserve-batch-bench-") as data_dir:
        proc = start_server(args, scheduler, port, data_dir)
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        try:
            alone = rt_figures(args, base_url, vocab_size, rt_stream(args))
            file = client.files.create(file=("batch.jsonl", io.BytesIO(content)), purpose="batch")
            batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
            time.sleep(args.warmup_s)  # the batch fills the engine
            before, start = be_tokens(client, batch.id), time.perf_counter()
            time.sleep(args.be_window_s)
            be_alone = (be_tokens(client, batch.id) - before) / (time.perf_counter() - start)
            before, start = be_tokens(client, batch.id), time.perf_counter()
            shared = rt_figures(args, base_url, vocab_size, rt_stream(args))
            be_shared = (be_tokens(client, batch.id) - before) / (time.perf_counter() - start)
            status = client.batches.retrieve(batch.id)
            if status.status != "in_progress":
                print(
                    f"warning: {scheduler}: the batch was {status.status} before the RT stream ended; "
                    "give more --batch-lines",
                    file=sys.stderr,
                )
            else:
                client.batches.cancel(batch.id)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    return {"rt_alone": alone, "rt_with_batch": shared, "be": {"alone": be_alone, "with_rt": be_shared}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--schedulers", default="bros,vllm,vllm_priority")
    parser.add_argument("--trace", default="sharegpt")
    parser.add_argument("--rt-requests", type=int, default=60)
    parser.add_argument("--rt-rate", type=float, default=2.0, help="Poisson rate of the RT stream (req/s)")
    parser.add_argument("--rt-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--rt-tpot-ms", type=float, default=150.0)
    parser.add_argument("--batch-lines", type=int, default=8000, help="enough to outlast the measurement")
    parser.add_argument("--batch-lines-in-engine", type=int, default=256)
    parser.add_argument("--warmup-s", type=float, default=5.0, help="batch alone before its window is measured")
    parser.add_argument("--be-window-s", type=float, default=15.0)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128, help="cap on the trace's output lengths")
    parser.add_argument("--kv-capacity-tokens", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=256, help="prompt token ids are drawn from [0, this)")
    args = parser.parse_args()

    vocab_size = args.vocab_size
    content = batch_file(args, vocab_size)
    results = {s: run_scheduler(args, s, vocab_size, content) for s in args.schedulers.split(",")}

    print(
        f"{args.model} on {args.device}, {args.trace}: RT {args.rt_requests} requests at {args.rt_rate} req/s "
        f"(SLO TTFT {args.rt_ttft_ms:g} ms, TPOT {args.rt_tpot_ms:g} ms), a batch of {args.batch_lines} lines "
        f"({args.batch_lines_in_engine} in the engine), KV {args.kv_capacity_tokens} tokens"
    )
    print(
        "| scheduler | RT SLO % alone | RT SLO % with batch | RT TTFT p50 / p99 ms alone | with batch | "
        "BE tok/s alone | BE tok/s with RT | BE kept |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        a, s, be = r["rt_alone"], r["rt_with_batch"], r["be"]
        # NOTE: a batch that ran out before its window (the warning above) gives no BE rate to keep
        kept = f"{be['with_rt'] / be['alone']:.2f}" if be["alone"] > 0 else "-"
        print(
            f"| {name} | {a['slo_attainment'] * 100:.1f} | {s['slo_attainment'] * 100:.1f} | "
            f"{a['ttft_p50_ms']:.0f} / {a['ttft_p99_ms']:.0f} | {s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | "
            f"{be['alone']:.0f} | {be['with_rt']:.0f} | {kept} |"
        )


if __name__ == "__main__":
    main()

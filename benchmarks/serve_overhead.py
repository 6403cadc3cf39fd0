"""Server overhead: the same workload through `sloserve bench-serve` against `sloserve serve` and through
the engine in-process (`run_requests` on the wall clock, as `sloserve run` does), side by side.

    python benchmarks/serve_overhead.py                       # random:tiny-llama on the CPU
    python benchmarks/serve_overhead.py --model random:llama-3-8b --device cuda --dtype bfloat16

Two loads, each run in-process first and then against the server (a subprocess on 127.0.0.1):
- offline: every request at t=0; the figure is output-token throughput, served / in-process
  (goal >= 0.9);
- light: Poisson arrivals at --rate, so requests rarely queue; the figure is the TTFT the server adds
  at the median, served p50 - in-process p50 (goal <= 5 ms). The client's TTFT is to the first
  streamed chunk with text, the engine's to the end of the step that sampled the first token.

Prompts are random token ids of the trace's prompt lengths; outputs are forced to the trace's lengths
(ignore_eos), greedy: the same work on both sides.

A second table splits the served figures where they are taken: on the engine's clock (the server's
--request-log: each request's arrival at the engine, first token and finish) beside the in-process
engine's, with the arrival spread (how long the server took to hand the offline load's requests, all sent
at t=0, to the engine) beside the time the client took to write them (aiohttp's trace of each request's
headers sent): a spread the client did not make is the server's admitting. The engine's figures apart
from the client's say whether a served run loses in the engine (other batches, slower steps) or between
the engine and the client.
A third runs the offline load in-process again on the arrivals the served engine saw (the request log's,
the first at 0): the two engines on the same arrivals and the same clock, so that what the served path
costs the engine is told from what the requests' arrival over HTTP changes (a trickle admits them into
batches already decoding: more mixed steps, lower TTFT, higher TPOT).
Last, each served process's CPU time over the offline load (the server's HTTP process, its engine's), as a
share of a core and a time an output token: the HTTP process streams every token through one event loop, and
near a whole core it would hold the tokens back whatever the engine does.

--pin (the default on a machine of 4 cores or fewer) gives the engine the same compute on both sides:
core 0 and one torch thread, for the in-process run and for the server's engine process alike. The
server's HTTP process and the load client share core 1 (in a deployment the client runs elsewhere,
and the API server has cores of its own).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request

import numpy as np

from figures import record
from sloserve.bench.client import free_loopback_port, run_benchmark, synthetic_prompts, wait_until_ready
from sloserve.engine.gc_heap import freeze_switch, frozen_heap
from sloserve.engine.llm_engine import LLMEngine, run_requests
from sloserve.engine.loader import load_model
from sloserve.engine.sampler import SamplingParams
from sloserve.metrics.summary import request_table
from sloserve.workload import workload_from_trace


def workload(args, offline: bool, num_requests: int):
    w = workload_from_trace(
        args.trace,
        num_requests=num_requests,
        seed=args.seed,
        context_len=args.max_model_len,
        offline=offline,
        rate=None if offline else args.rate,
        max_tokens=args.max_tokens,
    )
    return w.requests


def figures(requests, wall_s: float) -> dict[str, float]:
    table = request_table(requests)
    done = table["finished"]
    return {
        "tokens_per_s": float(table["output_tokens"][done].sum()) / wall_s,
        "completed_tokens": int(table["output_tokens"][done].sum()),
        "wall_s": wall_s,
        "ttft_p50_s": float(np.nanpercentile(table["ttft_s"][done], 50)),
        "ttft_mean_s": float(np.nanmean(table["ttft_s"][done])),
        "tpot_mean_s": float(np.nanmean(table["tpot_s"][done])),
        "completed": int(done.sum()),
        **engine_clock(
            table["arrival_s"][done],
            table["first_token_s"][done],
            table["last_token_s"][done],
            table["output_tokens"][done],
        ),
    }


def engine_clock(arrival: np.ndarray, first: np.ndarray, last: np.ndarray, output: np.ndarray) -> dict[str, float]:
    """The engine's figures from its own times (seconds, one entry a request): output tokens over the
    span from the first arrival to the last token, TTFT, TPOT, and the span of the arrivals."""
    return {
        "engine_span_s": float(last.max() - arrival.min()),
        "engine_tokens_per_s": float(output.sum() / (last.max() - arrival.min())),
        "engine_ttft_p50_s": float(np.percentile(first - arrival, 50)),
        "engine_tpot_mean_s": mean_tpot(first, last, output),
        "arrival_spread_s": float(arrival.max() - arrival.min()),
    }


def mean_tpot(first: np.ndarray, last: np.ndarray, output: np.ndarray) -> float:
    """The mean over requests of more than one token of their time per token after the first."""
    many = output > 1
    return float(((last - first)[many] / (output[many] - 1)).mean())


def logged_times(logged: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Request-log lines' (``serve --request-log``) arrival, first token and finish (the engine's clock,
    seconds) and output tokens, an array each."""
    arrival, first, finish, output = (
        np.array([line[key] for line in logged], dtype=float)
        for key in ("arrival_s", "first_token_s", "finish_s", "output_tokens")
    )
    return arrival, first, finish, output


def logged_lines(request_log: str, offset: int) -> list[str]:
    """The lines the server wrote to its --request-log past ``offset`` bytes (one a request, as each ends)."""
    with open(request_log, encoding="utf-8") as f:
        f.seek(offset)
        return f.read().splitlines()


def as_received(args, lines: list[str]) -> list:
    """The requests of request-log ``lines`` as the engine received them: their lengths, and their
    arrivals on the engine's clock (the first at 0)."""
    path = os.path.join(os.path.dirname(args.request_log), "received.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    w = workload_from_trace(
        path, num_requests=len(lines), seed=args.seed, context_len=args.max_model_len, trace_arrivals=True
    )
    return w.requests


def in_process(args, loaded, requests) -> dict[str, float]:
    from sloserve.runs import fresh_request

    requests = [fresh_request(r) for r in requests]
    engine = LLMEngine(
        loaded,
        args.scheduler,
        kv_capacity_tokens=args.kv_capacity_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    prompts = synthetic_prompts(requests, loaded.config.vocab_size, args.seed)
    params = [SamplingParams(max_tokens=r.true_output_tokens, temperature=0, ignore_eos=True) for r in requests]
    before = allocator_counts(loaded.device)
    with frozen_heap(freeze_switch()):  # (as the served engine's process and `sloserve run` do: gc_heap.py)
        wall = run_requests(engine, requests, prompts, params, wall_clock=True)
    after = allocator_counts(loaded.device)
    # (the caching allocator's trips to the driver during the run: a cudaMalloc can take a millisecond, and a
    # retry after freeing the cache, cudaFree, waits for the device: a stall of the engine's pipeline)
    allocator = {f"allocator_{k}": after[k] - before[k] for k in after}
    return {**figures(requests, wall), "device_idle_s": engine.executor.device_idle.seconds, **allocator}


def allocator_counts(device) -> dict[str, int]:
    """The CUDA caching allocator's segment allocations, frees and retries so far (none off CUDA)."""
    if device.type != "cuda":
        return {}
    import torch

    stats = torch.cuda.memory_stats(device)
    keys = {"segment allocs": "num_device_alloc", "segment frees": "num_device_free", "retries": "num_alloc_retries"}
    return {name: int(stats.get(key, 0)) for name, key in keys.items()}


# The server's counters a load's figures take the growth of: (key, family, labels)
SERVER_COUNTERS = (
    ("device_idle_s", "sloserve_device_idle_seconds_total", 'replica="0"'),  # a GPU's waits for the host
    # full garbage collections (engine/gc_heap.py), of the server's process and of its engine's
    ("server_gc_collections", "sloserve_gc_full_collections_total", 'process="server"'),
    ("server_gc_s", "sloserve_gc_full_collection_seconds_total", 'process="server"'),
    ("engine_gc_collections", "sloserve_gc_full_collections_total", 'process="engine-0"'),
    ("engine_gc_s", "sloserve_gc_full_collection_seconds_total", 'process="engine-0"'),
)


def server_counters(base_url: str) -> dict[str, float]:
    """The server's ``SERVER_COUNTERS`` now (0 for one it does not report)."""
    text = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    found = {}
    for key, family, labels in SERVER_COUNTERS:
        match = re.search(rf"^{family}\{{{labels}\}} (\S+)$", text, re.MULTILINE)
        found[key] = float(match.group(1)) if match else 0.0
    return found


def cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has run (its threads', user and system; Linux's /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # (after the command's name, which may hold spaces)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def engine_pid(server_pid: int) -> int:
    """The server's engine process: its child that multiprocessing spawned."""
    children = [int(c) for c in open(f"/proc/{server_pid}/task/{server_pid}/children").read().split()]
    engines = [c for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
    if len(engines) != 1:
        raise RuntimeError(f"expected the server to have one engine process, found {engines} among {children}")
    return engines[0]


def served(
    args, base_url: str, vocab_size: int, requests, server_pid: int, profile: bool = False
) -> tuple[dict[str, float], list[str]]:
    """The load against the server (process ``server_pid``): its figures, with each process's CPU seconds
    during the load (``server_cpu_s``, ``engine_cpu_s``), and the lines the server logged of its requests. With
    ``profile``, py-spy samples that process and its children (the engine) for ``--py-spy-seconds``
    from the start, into ``--py-spy`` (collapsed stacks, each thread's apart, its idle samples too: where the
    engine core waits, for the GPU or for work, as well as where it works)."""
    from sloserve.runs import fresh_request

    requests = [fresh_request(r) for r in requests]
    prompts = synthetic_prompts(requests, vocab_size, args.seed)
    spy = None
    if profile:
        spy = subprocess.Popen(
            [
                "py-spy",
                "record",
                "--pid",
                str(server_pid),
                "--subprocesses",
                "--nonblocking",
                "--threads",
                "--idle",
                "--rate",
                "250",
                "--duration",
                str(args.py_spy_seconds),
                "--format",
                "raw",
                "--output",
                args.py_spy,
            ]
        )
    offset = os.path.getsize(args.request_log)
    counted_before = server_counters(base_url)
    pids = {"server_cpu_s": server_pid, "engine_cpu_s": engine_pid(server_pid)}
    cpu_before = {key: cpu_seconds(pid) for key, pid in pids.items()}
    result = run_benchmark(base_url, args.model, requests, prompts)
    counted = {k: v - counted_before[k] for k, v in server_counters(base_url).items()}
    counted.update({key: cpu_seconds(pid) - cpu_before[key] for key, pid in pids.items()})
    lines = logged_lines(args.request_log, offset)
    if spy is not None:
        try:
            spy.wait(timeout=args.py_spy_seconds + 60)
        except subprocess.TimeoutExpired:  # a diagnosis: the figures still come
            spy.kill()
    if result.errors:
        sys.exit(f"{len(result.errors)} requests failed: {next(iter(result.errors.values()))}")
    # NOTE: the client's figures, then the engine's from the server's log (a request's line is written
    # when it ends, before its last event reaches the client)
    engine = engine_clock(*logged_times([json.loads(x) for x in lines]))
    written = result.sent_s[-1] - result.sent_s[0]  # (the client's clock: its first request to its last written)
    return {**figures(requests, result.wall_s), **engine, **counted, "client_sent_spread_s": written}, lines


def print_table(local: dict, remote: dict, keys: tuple[str, ...]) -> None:
    """Each load's figures ``keys`` in-process and served, their ratio and difference (ms, but tokens/s)."""
    print("| load | figure | in-process | served | served / in-process | served - in-process |")
    print("|---|---|---|---|---|---|")
    for name in local:
        for key in keys:
            a, b = local[name][key], remote[name][key]
            throughput = key.endswith("tokens_per_s")
            unit = 1.0 if throughput else 1e3
            label = "output tokens/s" if throughput else key.removeprefix("engine_").removesuffix("_s") + " ms"
            ratio = f"{b / a:.3f}" if a else "-"
            print(f"| {name} | {label} | {a * unit:.2f} | {b * unit:.2f} | {ratio} | {(b - a) * unit:+.2f} |")


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cores``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cores)


def pin_server(pid: int) -> None:
    """The server's engine process (its spawned child) on core 0, its HTTP process on core 1."""
    pin(engine_pid(pid), {0})
    pin(pid, {1})


def start_server(args, port: int, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """``sloserve serve`` on 127.0.0.1:``port`` with the model options in ``args`` (and ``extra``)."""
    command = [sys.executable, "-m", "sloserve.cli", "serve", *extra, "--model", args.model, "--served-model-name", args.model,
               "--device", args.device,
               "--dtype", args.dtype, "--scheduler", args.scheduler, "--port", str(port), "--log-level", "warning",
               "--kv-capacity-tokens", str(args.kv_capacity_tokens), "--max-model-len", str(args.max_model_len),
               "--max-queued-requests", str(10 * args.num_requests)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": "1"} if args.pin else {})}
    proc = subprocess.Popen(command, env=env)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process=proc, timeout_s=120)
    except RuntimeError as e:
        proc.kill()
        sys.exit(f"the server did not start: {e}")
    if args.pin:
        try:
            pin_server(proc.pid)
        except (OSError, RuntimeError):
            proc.kill()
            raise
    return proc


def add_server_arguments(parser: argparse.ArgumentParser, num_requests: int) -> None:
    """The options ``start_server`` and ``workload`` read: the model's, the trace's and the pinning."""
    parser.add_argument("--model", default="random:tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--scheduler", default="vllm")
    parser.add_argument("--trace", default="sharegpt")
    parser.add_argument("--num-requests", type=int, default=num_requests, help="requests of the offline load")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on the trace's output lengths")
    parser.add_argument("--kv-capacity-tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=(os.cpu_count() or 1) <= 4,
        help="engine on core 0 with one torch thread on both sides, the client on core 1",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser, num_requests=200)
    parser.add_argument("--light-requests", type=int, default=60, help="requests of the light load")
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson rate of the light load (req/s)")
    parser.add_argument("--py-spy", metavar="FILE", help="sample the server's processes during the offline load")
    parser.add_argument("--py-spy-seconds", type=int, default=15)
    parser.add_argument("--stream-interval", type=int, default=1, help="the server's (tokens a chunk after the first)")
    args = parser.parse_args()
    if args.pin:
        import torch

        torch.set_num_threads(1)
        os.sched_setaffinity(0, {0})

    args.request_log = os.path.join(tempfile.mkdtemp(prefix="serve-overhead-"), "requests.jsonl")
    open(args.request_log, "w").close()
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, seed=args.seed)
    loads = {"offline": workload(args, True, args.num_requests), "light": workload(args, False, args.light_requests)}
    local = {name: in_process(args, loaded, reqs) for name, reqs in loads.items()}
    vocab_size = loaded.config.vocab_size
    del loaded  # NOTE: the server loads its own copy: on a GPU, free this one's memory first
    gc.collect()
    if args.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
    port = free_loopback_port()
    proc = start_server(args, port, ("--request-log", args.request_log, "--stream-interval", str(args.stream_interval)))
    if args.pin:
        os.sched_setaffinity(0, {1})
    remote, received = {}, {}
    try:
        for name, reqs in loads.items():
            spied = bool(args.py_spy) and name == "offline"
            remote[name], received[name] = served(
                args, f"http://127.0.0.1:{port}/v1", vocab_size, reqs, proc.pid, spied
            )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # The offline load in-process again, on the arrivals the served engine saw (after the server is gone:
    # the two would share core 0, and a GPU's memory)
    if args.pin:
        os.sched_setaffinity(0, {0})
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, seed=args.seed)
    same = {"offline": in_process(args, loaded, as_received(args, received["offline"]))}

    print(
        f"{args.model} on {args.device}, {args.scheduler}, {args.trace}: offline {args.num_requests} requests, "
        f"light {args.light_requests} at {args.rate} req/s{', pinned' if args.pin else ''}"
    )
    print_table(local, remote, ("tokens_per_s", "ttft_p50_s", "ttft_mean_s", "tpot_mean_s"))
    print(
        "\nOn the engine's clock (served: the server's --request-log), tokens/s from the first arrival to the last token:"
    )
    print_table(local, remote, ("engine_tokens_per_s", "engine_ttft_p50_s", "engine_tpot_mean_s", "arrival_spread_s"))
    # Where the arrival spread comes from: the client putting the burst on the wire, or the server admitting it
    print(
        f"the offline load's {args.num_requests} requests, all sent at t=0: the client wrote them over "
        f"{remote['offline']['client_sent_spread_s'] * 1e3:.1f} ms, the engine received them over "
        f"{remote['offline']['arrival_spread_s'] * 1e3:.1f} ms"
    )
    print(
        "\nThe offline load in-process on the arrivals the served engine saw (its request log), both on the engine's clock:"
    )
    print_table(same, remote, ("engine_tokens_per_s", "engine_ttft_p50_s", "engine_tpot_mean_s", "arrival_spread_s"))
    in_process_offline, served_offline, same_offline = local["offline"], remote["offline"], same["offline"]
    ratio = served_offline["tokens_per_s"] / in_process_offline["tokens_per_s"]
    print(f"\nthroughput ratio (offline, goal >= 0.97): {ratio:.3f}")
    record("served_throughput_ratio", ratio)
    record("served_tpot_added", served_offline["tpot_mean_s"] / in_process_offline["tpot_mean_s"] - 1)
    # Apart from how the requests reached the engine: what the served path costs the engine itself
    record(
        "served_throughput_ratio_same_arrivals",
        served_offline["engine_tokens_per_s"] / same_offline["engine_tokens_per_s"],
    )
    record(
        "served_tpot_added_same_arrivals", served_offline["engine_tpot_mean_s"] / same_offline["engine_tpot_mean_s"] - 1
    )
    added = (remote["light"]["ttft_p50_s"] - local["light"]["ttft_p50_s"]) * 1e3
    print(f"TTFT added at p50 (light load, goal <= 5 ms): {added:+.2f} ms")
    print(
        "full garbage collections during the served offline load: "
        + ", ".join(
            f"{who} {served_offline[f'{who}_gc_collections']:.0f} ({served_offline[f'{who}_gc_s'] * 1e3:.1f} ms)"
            for who in ("server", "engine")
        )
    )
    # Each process's CPU time over the served offline load, as a share of one core over the client's wall clock
    # and a time an output token: a server process near a whole core streams late whatever the engine does
    wall_s = served_offline["wall_s"]
    print(
        "CPU during the served offline load: "
        + ", ".join(
            f"{who} process {served_offline[f'{who}_cpu_s']:.2f} s ({served_offline[f'{who}_cpu_s'] / wall_s:.0%} of "
            f"a core, {served_offline[f'{who}_cpu_s'] / served_offline['completed_tokens'] * 1e6:.1f} us an output token)"
            for who in ("server", "engine")
        )
    )
    record("served_server_cpu_share", served_offline["server_cpu_s"] / wall_s)
    if args.device.startswith("cuda"):
        # The GPU's waits for the host between steps (sloserve_device_idle_seconds_total), as a share of the
        # engine's span: where the served engine's host work, unlike the in-process engine's, is not hidden
        shares = {
            what: run["device_idle_s"] / run["engine_span_s"]
            for what, run in (("in-process", in_process_offline), ("same arrivals", same_offline),
                              ("served", served_offline))
        }  # fmt: skip
        print("device idle between steps (offline): " + ", ".join(f"{k} {v:.1%}" for k, v in shares.items()))
        counts = {k.removeprefix("allocator_"): v for k, v in same_offline.items() if k.startswith("allocator_")}
        print(
            "in-process on the same arrivals, the CUDA allocator's " + ", ".join(f"{k} {v}" for k, v in counts.items())
        )
        record("served_device_idle_share", shares["served"])
        record("in_process_device_idle_share", shares["same arrivals"])


if __name__ == "__main__":
    main()

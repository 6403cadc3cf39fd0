"""Prefix caching on Mooncake's conversation trace (FAST'25, with its hash_ids): hit rate, TTFT and
throughput with and without caching, how much KV capacity the hit rate needs, and what caching costs
the simulator.

The trace's own arrivals (3 s buckets, jittered) are slowed by ``--slowdown`` so that one replica is
not swamped (Mooncake served this hour on a cluster); the conversations keep their order. Prompts are
clipped to the model's context (Llama-3-8B: 8192 tokens), which keeps each prompt's first segments.

    python benchmarks/prefix_caching.py [--requests 2000] [--slowdown 4] [--gpu a100]

Tables: (1) per scheduler, caching off and on, side by side, with the simulator's wall time on/off;
(2) the same on the bundled multi-turn workload ``chat-sessions`` (ShareGPT turns resending their
history and a shared system prompt); (3) the hit rate against KV capacity (vllm) on Mooncake, up to a
cache that never evicts, whose hit rate is the trace's own bound (tests/kv/test_prefix_cache.py checks
that equality).
"""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console
from rich.table import Table

from sloserve.core.request import RequestClass
from sloserve.runs import SimOptions, run_simulation, setup_from_options
from sloserve.sched import supports_prefix_caching
from sloserve.workload import build_workload, load_workload_spec
from sloserve.workload.spec import ArrivalSpec, StreamSpec, TraceSource, WorkloadSpec

MODEL = "llama-3-8b"


def mooncake_workload(num_requests: int, slowdown: float, context_len: int):
    stream = StreamSpec(
        "conversation", RequestClass.RT, TraceSource("mooncake-conv"), ArrivalSpec("trace"), num_requests
    )
    spec = WorkloadSpec("mooncake-conv", [stream])
    return build_workload(spec, seed=0, context_len=context_len, rate_scale=1 / slowdown)


def run(setup, workload, scheduler: str, caching: bool, capacity: int | None = None) -> dict:
    """One simulation as `sloserve simulate` runs it (``runs.run_simulation``), with KV ``capacity``
    tokens (default: the GPU's); its summary, ``sim_wall_s`` the simulator's wall time."""
    options = dataclasses.replace(setup.options, enable_prefix_caching=caching, kv_capacity_tokens=capacity)
    huge = capacity is not None and capacity > 10 * setup.kv_capacity_tokens  # a cache that never evicts
    return run_simulation(setup_from_options(options), scheduler, {"max_num_seqs": "4096"} if huge else {}, workload)


def side_by_side(setup, workload, title: str) -> Table:
    """vllm, sarathi and bros with caching off, and on where the policy supports it."""
    table = Table(title=title)
    for col in (
        "scheduler",
        "caching",
        "hit rate",
        "TTFT mean s",
        "TTFT p99 s",
        "out tok/s",
        "sim wall s",
        "wall on/off",
    ):
        table.add_column(col, justify="right")
    for scheduler in ("vllm", "sarathi", "bros"):
        off = run(setup, workload, scheduler, False)
        rows = [(False, off)]
        if supports_prefix_caching(scheduler):
            rows.append((True, run(setup, workload, scheduler, True)))
        for caching, s in rows:
            table.add_row(
                scheduler,
                "on" if caching else "off",
                f"{s['prefix_cache_hit_rate']:.3f}",
                f"{s['ttft_s']['mean']:.2f}",
                f"{s['ttft_s']['p99']:.2f}",
                f"{s['throughput_tps']:,.0f}",
                f"{s['sim_wall_s']:.2f}",
                f"{s['sim_wall_s'] / off['sim_wall_s']:.1f}x"
                if caching
                else ("" if len(rows) > 1 else "not supported yet"),
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--slowdown", type=float, default=4.0, help="divide the trace's arrival rate by this")
    parser.add_argument("--gpu", default="a100")
    args = parser.parse_args()

    setup = setup_from_options(SimOptions(model=MODEL, gpu=args.gpu))
    workload = mooncake_workload(args.requests, args.slowdown, setup.model.max_context_len)
    rate = len(workload.requests) / workload.duration_s
    console = Console(width=140)
    console.print(
        f"mooncake-conv, first {len(workload.requests)} requests at {rate:.2f} req/s (trace / {args.slowdown:g}), "
        f"{MODEL} on {setup.gpu.name}, {setup.cost_model.name}, KV {setup.kv_capacity_tokens:,} tokens"
    )

    console.print(side_by_side(setup, workload, "mooncake-conv: caching off / on, side by side"))
    chat = build_workload(load_workload_spec("chat-sessions"), seed=0, context_len=setup.model.max_context_len)
    chat_rate = len(chat.chains) / max(r.arrival_time for r in chat.requests if r.think_time_s == 0)
    title = f"chat-sessions ({len(chat.requests)} turns, {chat_rate:.2f} sessions/s): caching off / on"
    console.print(side_by_side(setup, chat, title))

    curve = Table(title="mooncake-conv: hit rate against KV capacity (vllm, caching on)")
    for col in ("KV capacity tokens", "x preset", "hit rate", "evicted blocks", "TTFT mean s"):
        curve.add_column(col, justify="right")
    for factor in (0.125, 0.25, 0.5, 1, 2, 4, 1000):
        capacity = int(setup.kv_capacity_tokens * factor)
        s = run(setup, workload, "vllm", True, capacity)
        curve.add_row(
            f"{capacity:,}" if factor < 1000 else "never evicts",
            f"{factor:g}",
            f"{s['prefix_cache_hit_rate']:.3f}",
            f"{s['policy']['num_prefix_cache_evicted_blocks']:,}",
            f"{s['ttft_s']['mean']:.2f}",
        )
    console.print(curve)


if __name__ == "__main__":
    main()

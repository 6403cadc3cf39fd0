"""The routing policies (sloserve/router.py) side by side on a fleet of simulated replicas.

    python benchmarks/routing.py [--requests 2000]

Cases, each as ``sloserve simulate --replicas N --router NAME`` runs it (vllm, prefix caching on):
  chat-sessions  multi-turn chat (each turn resends its history after a shared system prompt, closed
                 loop per session), Llama-3-8B on 4 A100s
  mixed-rt-be    RT ShareGPT requests with SLOs at 10 req/s beside BE batch jobs, Llama-2-13B on 2
                 A100s (near saturation: where the choice of replica shows)
Per router: prefix-cache hit rate, TTFT mean and p99, RT SLO attainment, output throughput and the
simulator's wall time.
"""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console
from rich.table import Table

from sloserve.router import ROUTERS
from sloserve.runs import SimOptions, run_simulation, setup_from_options

CASES = {
    "chat-sessions, 4 x llama-3-8b on a100": SimOptions(workload="chat-sessions", model="llama-3-8b", replicas=4),
    "mixed-rt-be (RT 10/s), 2 x llama-2-13b on a100": SimOptions(
        workload="mixed-rt-be", rt_rate=10.0, model="llama-2-13b", replicas=2
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    console = Console(width=140)
    for title, case in CASES.items():
        options = dataclasses.replace(case, gpu="a100", num_requests=args.requests, enable_prefix_caching=True)
        table = Table(title=f"{title}: {args.requests} requests")
        for col in ("router", "hit rate", "TTFT mean s", "TTFT p99 s", "RT SLO met", "out tok/s", "sim wall s"):
            table.add_column(col, justify="right")
        for router in ROUTERS:
            setup = setup_from_options(dataclasses.replace(options, router=router))
            s = run_simulation(setup, "vllm", {}, setup.make_workload())
            rt = s["classes"].get("rt", s)
            table.add_row(
                router,
                f"{s['prefix_cache_hit_rate']:.3f}",
                f"{s['ttft_s']['mean']:.3f}",
                f"{s['ttft_s']['p99']:.3f}",
                f"{rt['slo_attainment']:.3f}",
                f"{s['throughput_tps']:,.0f}",
                f"{s['sim_wall_s']:.2f}",
            )
        console.print(table)


if __name__ == "__main__":
    main()

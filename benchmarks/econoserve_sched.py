"""Scheduling time per step with 10,000 queued requests, as a share of the simulated batch time
(EconoServe goal: under 1%; MultiRes, O(n^2), is the expensive foil).

    python benchmarks/econoserve_sched.py [--queued 10000] [--steps 300]

Setting: OPT-13B on an A100-80GB (roofline), 12 GB of KV, the bundled ShareGPT trace with every
request queued at t=0. Each scheduler runs ``--steps`` steps; the table gives the mean wall time of
``schedule()`` and its ratio to the mean simulated step time, side by side in one run.
"""

from __future__ import annotations

import argparse
import time

from sloserve.cost import build_cost_model, get_gpu, get_model
from sloserve.sched import make_scheduler
from sloserve.sim.executor import SimExecutor
from sloserve.workload import workload_from_trace

SCHEDULERS = ("vllm", "sarathi", "econoserve-d", "econoserve-sd", "econoserve-sdo", "econoserve", "multires")


def measure(name: str, queued: int, steps: int) -> tuple[float, float]:
    model, gpu = get_model("opt-13b"), get_gpu("a100-80gb")
    cost = build_cost_model(model, gpu)
    capacity = int(12e9 // model.kv_bytes_per_token)
    requests = workload_from_trace("sharegpt", num_requests=queued, seed=0, context_len=model.max_context_len,
                                   offline=True).requests  # fmt: skip
    s = make_scheduler(name, kv_capacity_tokens=capacity, max_model_len=model.max_context_len,
                       kv_bytes_per_token=model.kv_bytes_per_token, cost_model=cost)  # fmt: skip
    for r in requests:
        s.add_request(r)
    executor, now, sched_s, batch_s = SimExecutor(cost), 0.0, 0.0, 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = s.schedule(now)
        sched_s += time.perf_counter() - t0
        result = executor.execute(out, now)
        end = float(result.step_end_times[-1])
        batch_s += end - now
        now = end
        s.update(out, result, now)
    return sched_s / steps, batch_s / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(f"{args.queued} requests queued, {args.steps} steps each")
    print(f"{'scheduler':16s} {'schedule() ms':>14s} {'batch ms':>10s} {'share':>8s}")
    for name in SCHEDULERS:
        sched, batch = measure(name, args.queued, args.steps)
        print(f"{name:16s} {sched * 1e3:14.3f} {batch * 1e3:10.2f} {sched / batch:8.2%}")


if __name__ == "__main__":
    main()

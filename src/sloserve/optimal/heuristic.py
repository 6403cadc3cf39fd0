"""Run heuristic schedulers on a bound problem: their latency, and their schedule as a warm start."""

from __future__ import annotations

from dataclasses import dataclass

from sloserve.core.outputs import SchedulerOutput
from sloserve.core.request import Request
from sloserve.cost.linear import LinearCostModel
from sloserve.kv.manager import PagedKVManager
from sloserve.optimal.problem import BatchPlan, BoundProblem
from sloserve.optimal.replay import ReplayScheduler
from sloserve.sched import make_scheduler
from sloserve.sim import simulate


def problem_requests(problem: BoundProblem) -> list[Request]:
    """Fresh requests of the problem; request_id = index."""
    return [
        Request(request_id=i, arrival_time=t, num_prompt_tokens=p, true_output_tokens=o, max_tokens=o)
        for i, (p, o, t) in enumerate(zip(problem.prompts, problem.outputs, problem.arrivals, strict=True))
    ]


def latency(requests: list[Request]) -> float:
    """InferMax's latency: from the first arrival to the last finish."""
    return max(r.finish_time for r in requests) - min(r.arrival_time for r in requests)


@dataclass
class HeuristicRun:
    name: str
    latency_s: float
    num_batches: int
    num_evictions: int
    hint: list[dict[int, tuple[int, bool]]]  # per batch {request: (tokens, evicted at this batch)}


def run_heuristic(name: str, problem: BoundProblem, cost: LinearCostModel) -> HeuristicRun:
    """Simulate scheduler ``name`` under the problem's limits (token-granular KV of M slots, no
    watermark, token budget C) and record its schedule."""
    requests = problem_requests(problem)
    max_len = max(p + o for p, o in zip(problem.prompts, problem.outputs, strict=True))
    C = problem.max_num_batched_tokens
    options: dict[str, object] = {
        "block_size": 1,
        "watermark": 0.0,
        "max_num_batched_tokens": C,
        "max_num_seqs": min(256, C),
    }
    if problem.prefill_token_budget is not None:
        options["prefill_token_budget"] = min(problem.prefill_token_budget, problem.max_num_batched_tokens)
    hint: list[dict[int, tuple[int, bool]]] = []

    def record(_replica: int, out: SchedulerOutput) -> None:
        batch = {r.request_id: (c, False) for r, c in out.chunks}
        if out.decode is not None:
            batch.update({r.request_id: (1, False) for r in out.decode.cohort.members})
        for p in out.preempted:
            batch[p.request.request_id] = (0, True)
        hint.append(batch)

    def factory():
        return make_scheduler(
            name,
            kv_capacity_tokens=problem.kv_capacity_tokens,
            max_model_len=max_len,
            options=options,
        )

    simulate(requests, factory, cost, fast_path=False, on_step=record)
    evictions = sum(r.num_preemptions for r in requests)
    return HeuristicRun(name, latency(requests), len(hint), evictions, hint)


def replay(problem: BoundProblem, plan: list[BatchPlan], cost: LinearCostModel) -> list[Request]:
    """Run ``plan`` through the simulator; returns the requests with their timestamps."""
    requests = problem_requests(problem)
    simulate(
        requests,
        lambda: ReplayScheduler(PagedKVManager(problem.kv_capacity_tokens, 1), plan),
        cost,
        fast_path=False,
    )
    return requests

"""Shared test helpers: hand-made requests and a step-by-step driver that records every output."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from sloserve.core.outputs import SchedulerOutput
from sloserve.core.prefix import SegmentedPrompt
from sloserve.core.request import SLO, Request, RequestClass
from sloserve.cost import LinearCostModel, get_preset
from sloserve.predict import LengthPredictor
from sloserve.sched import make_scheduler
from sloserve.sched.base import Scheduler
from sloserve.sim.executor import SimExecutor


def llama7b_cost() -> LinearCostModel:
    return LinearCostModel(get_preset("llama-2-7b-a100"))


def make_requests(lengths: list[tuple[int, int]], arrivals: list[float] | None = None) -> list[Request]:
    """Requests with (prompt, output) lengths; max_tokens = output."""
    arrivals = arrivals or [0.0] * len(lengths)
    return [
        Request(request_id=i, arrival_time=t, num_prompt_tokens=p, true_output_tokens=o, max_tokens=o)
        for i, ((p, o), t) in enumerate(zip(lengths, arrivals, strict=True))
    ]


def rt_be_specs(ttft_s: st.SearchStrategy, tpot_s: st.SearchStrategy) -> st.SearchStrategy:
    """Small random RT/BE mixes for ``rt_be_requests``: 2-30 requests of 8-300 prompt and 2-150 output
    tokens arriving within 2 s, each RT or BE, with SLOs drawn from ``ttft_s`` and ``tpot_s``."""
    request = st.tuples(st.integers(8, 300), st.integers(2, 150), st.floats(0, 2), st.booleans(), ttft_s, tpot_s)
    return st.lists(request, min_size=2, max_size=30)


def rt_be_requests(specs: list[tuple[int, int, float, bool, float, float]]) -> list[Request]:
    """Requests from (prompt, output, arrival, BE?, TTFT SLO, TPOT SLO) each; max_tokens = output."""
    return [
        Request(
            request_id=i,
            arrival_time=arrival,
            num_prompt_tokens=prompt,
            true_output_tokens=output,
            max_tokens=output,
            request_class=RequestClass.BE if be else RequestClass.RT,
            slo=SLO(ttft_s=ttft, tpot_s=tpot),
        )
        for i, (prompt, output, arrival, be, ttft, tpot) in enumerate(specs)
    ]


@dataclass
class StepLog:
    """What one step scheduled, captured before it ran."""

    chunks: list[tuple[int, int]]  # (request id, tokens)
    decodes: list[int]  # request ids in the cohort
    preempted: list[tuple[int, str]]
    swap_out: int
    swap_in: int


@dataclass
class Driver:
    """Runs a scheduler step by step on the simulated executor, checking invariants every step."""

    scheduler: Scheduler
    executor: SimExecutor = field(default_factory=lambda: SimExecutor(llama7b_cost()))
    now: float = 0.0
    log: list[StepLog] = field(default_factory=list)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule(self.now)
        assert not out.is_empty, "scheduler stuck"
        self.log.append(
            StepLog(
                chunks=[(r.request_id, c) for r, c in out.chunks],
                decodes=sorted(r.request_id for r in out.decode.cohort.members) if out.decode else [],
                preempted=[(p.request.request_id, p.mode.value) for p in out.preempted],
                swap_out=len(out.swap_out),
                swap_in=len(out.swap_in),
            )
        )
        kv = self.scheduler.kv
        for r, c in out.chunks:  # (a chunk left in the step of a request preempted after it had none)
            assert kv.num_tracked_tokens(r) >= r.num_computed_tokens + c, f"{r} runs {c} tokens without their KV"
        result = self.executor.execute(out, self.now)
        self.now = float(result.step_end_times[-1])
        self.scheduler.update(out, result, self.now)
        self.scheduler.check_integrity()
        return out

    def run(self, requests: list[Request], max_steps: int = 100_000) -> None:
        pending = sorted(requests, key=lambda r: r.arrival_time)
        i = 0
        for _ in range(max_steps):
            while i < len(pending) and pending[i].arrival_time <= self.now:
                self.scheduler.add_request(pending[i])
                i += 1
            if not self.scheduler.has_unfinished():
                if i == len(pending):
                    return
                self.now = pending[i].arrival_time
                continue
            self.step()
        raise AssertionError("did not finish")


def scheduler(
    name: str, capacity: int, max_model_len: int = 4096, enable_prefix_caching: bool = False, **options
) -> Scheduler:
    swap = options.pop("swap_space_tokens", 0)
    return make_scheduler(
        name,
        kv_capacity_tokens=capacity,
        max_model_len=max_model_len,
        kv_bytes_per_token=524288,
        swap_space_tokens=swap,
        options=options,
        cost_model=llama7b_cost(),
        enable_prefix_caching=enable_prefix_caching,
    )


def timestamps(requests: list[Request]) -> np.ndarray:
    """(N, 7): first token, last token, finish, max gap, first scheduled, preemption time and GT
    queuing time per request (by id)."""
    ordered = sorted(requests, key=lambda r: r.request_id)
    return np.array(
        [
            [
                r.first_token_time,
                r.last_token_time,
                r.finish_time,
                r.max_token_gap,
                r.first_scheduled_time,
                r.preempted_s,
                r.gt_queued_s,
            ]
            for r in ordered
        ]
    )


class FixedPredictor(LengthPredictor):
    """Predicts the lengths it is given per request id (the true length otherwise); re-predictions
    are exact."""

    def __init__(self, predictions: dict[int, int]) -> None:
        self.predictions = predictions

    def predict(self, request: Request) -> int:
        return self.predictions.get(request.request_id, request.true_output_tokens)

    def predict_remaining(self, request: Request) -> int:
        return max(1, request.true_output_tokens - request.num_output_tokens)


def shared_prefix_workload(seed: int) -> tuple[int, list[Request]]:
    """A random RT/BE mix whose prompts share their first segments (ids 0-2) or not, in a small cache:
    (KV capacity, requests). The generator of a sweep over every scheduler with prefix caching, fast
    path and step by step: the seeds it failed on are tests."""
    rng = random.Random(seed)
    n, capacity, segment = rng.randint(5, 40), rng.choice([800, 1600, 4000]), rng.choice([16, 64, 128])
    requests = []
    for i in range(n):
        prompt = rng.randint(1, min(700, capacity - 120))
        ids = tuple(
            rng.choice([0, 1, 2, 1000 + i]) if k < 3 else 2000 + i * 10 + k for k in range(-(-prompt // segment))
        )
        output, arrival, be = rng.randint(1, 150), rng.uniform(0, 1.5), rng.random() < 0.4
        slo = SLO(rng.choice([0.05, 0.1, 0.5]), rng.uniform(0.003, 0.05))
        cls = RequestClass.BE if be else RequestClass.RT
        requests.append(
            Request(
                i,
                arrival,
                prompt,
                output,
                output,
                cls,
                slo,
                prompt_blocks=SegmentedPrompt.uniform(ids, segment, prompt),
            )
        )
    return capacity, requests


def reset_prefix_cache_and_check(kv, prompted: list[Request]) -> None:
    """``kv.reset_prefix_cache()`` as one of a random test's operations: it succeeds exactly when no request
    holds a GPU block; then every block is back in the pool and none of ``prompted``'s prompts finds a cached
    block, else nothing changed (a lookup finds what it found before)."""
    cache = kv.prefix_cache
    evictable = cache.evictable.count if cache is not None else 0
    held = kv.gpu.num_free + evictable < kv.gpu.num_blocks
    probes = [
        Request(10_000 + r.request_id, 0.0, r.num_prompt_tokens, 1, 1, prompt_blocks=r.prompt_blocks) for r in prompted
    ]
    found = [list(kv.find_cached_prefix(p)) for p in probes]
    free = kv.num_free_blocks
    done = kv.reset_prefix_cache()
    assert done is not held
    if done:
        assert kv.gpu.num_free == kv.gpu.num_blocks == kv.num_free_blocks
        assert all(not len(kv.find_cached_prefix(p)) for p in probes)
    else:
        assert kv.num_free_blocks == free
        assert [list(kv.find_cached_prefix(p)) for p in probes] == found
    kv.check_integrity()

"""The simulator: fast path equals step-by-step, determinism, conservation, clusters."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import llama7b_cost, rt_be_requests, rt_be_specs, scheduler, shared_prefix_workload, timestamps
from sloserve.core.errors import ConfigError
from sloserve.core.request import RequestClass, RequestStatus
from sloserve.sched.registry import scheduler_names
from sloserve.sim import simulate
from sloserve.workload.build import workload_from_trace

CAPACITY = 20_000  # small enough that vLLM and Sarathi preempt on these workloads


def _run(trace: str, name: str, fast: bool, *, n=300, rate=None, trace_arrivals=False, seed=1, **options):
    workload = workload_from_trace(
        trace,
        num_requests=n,
        seed=seed,
        context_len=4096,
        rate=rate,
        trace_arrivals=trace_arrivals,
        offline=rate is None and not trace_arrivals,
    )
    result = simulate(
        workload.requests,
        lambda: scheduler(name, CAPACITY, **options),
        llama7b_cost(),
        fast_path=fast,
    )
    return workload.requests, result


CASES = [
    ("sharegpt", "vllm", dict(rate=12.0)),
    ("sharegpt", "sarathi", dict(rate=12.0)),
    # chunk stretches with swapping, a histogram predictor's reservations, and a small P
    ("arxiv", "sarathi", dict(rate=3.0, preemption_mode="swap", swap_space_tokens=8_000)),
    ("azure-conv", "sarathi", dict(rate=6.0, predictor="histogram", reservation="predicted_check")),
    ("arxiv", "sarathi", dict(rate=3.0, prefill_token_budget=128)),
    ("sharegpt", "orca", dict(rate=2.0)),
    ("azure-conv", "vllm", dict(trace_arrivals=True)),
    ("azure-conv", "sarathi", dict(trace_arrivals=True)),
    ("bwb", "vllm", dict()),  # offline: long decode stretches
    ("arxiv", "sarathi", dict(rate=4.0)),
    # decodes named as chunks (no cohort), repeated until an arrival or a completion
    ("sharegpt", "srtf", dict(rate=12.0)),
    ("bwb", "srtf", dict()),
    ("azure-conv", "srtf", dict(trace_arrivals=True, predictor="histogram")),
    ("sharegpt", "multires", dict(rate=12.0)),
    ("bwb", "multires", dict()),  # offline: requests outlive their reservations' blocks
    ("azure-conv", "multires", dict(rate=6.0, predictor="histogram")),
    ("sharegpt", "rank_i", dict(rate=12.0)),
    ("bwb", "rank_org", dict()),
    ("azure-conv", "rank_o", dict(rate=6.0, predictor="histogram")),
    ("sharegpt", "fastserve", dict(rate=12.0)),
    ("bwb", "fastserve", dict()),  # offline: requests sink through every level
    ("azure-conv", "fastserve", dict(trace_arrivals=True, base_quantum_s=0.05, quantum_ratio=1.5)),
    # RR with one class: FCFS decodes repeated until an arrival, a completion or a decode finding no block
    ("sharegpt", "rr", dict(rate=12.0)),
    ("bwb", "rr", dict()),
    # EconoServe's ordered queues, full under overload: decode steps repeat until a task changes range
    ("sharegpt", "econoserve", dict(rate=20.0)),
    ("azure-conv", "econoserve", dict(trace_arrivals=True)),
    # BROS: decode steps repeat while its order, (6), (7) and (8) leave them the same (RT/BE mixes
    # in scarce KV: test_rt_be_stretches_under_overload)
    ("sharegpt", "bros", dict(rate=12.0, default_tpot_s=0.03)),  # TPOT near the step time: (6) binds
    ("azure-conv", "bros_nobicache", dict(rate=6.0, default_tpot_s=0.04, default_ttft_s=0.2)),
    ("azure-conv", "bros", dict(n=100, trace_arrivals=True, deadlines="token_group")),  # (token groups: no stretch)
]


@pytest.mark.parametrize("trace,name,kwargs", CASES)
def test_fast_path_gives_the_same_timestamps(trace, name, kwargs):
    slow_reqs, slow = _run(trace, name, fast=False, **kwargs)
    fast_reqs, fast = _run(trace, name, fast=True, **kwargs)
    a, b = timestamps(slow_reqs), timestamps(fast_reqs)
    assert np.isfinite(a[:, :3]).all()
    np.testing.assert_allclose(b, a, rtol=1e-9, atol=0, equal_nan=True)
    assert [r.num_preemptions for r in slow_reqs] == [r.num_preemptions for r in fast_reqs]
    assert len(fast.timeline) == len(slow.timeline), "a stretch stands for exactly its steps"
    for col in (
        "num_tokens",
        "num_prefill_tokens",
        "num_decode",
        "num_requests",
        "kv_used_tokens",
        "kv_allocated_tokens",
    ):
        np.testing.assert_array_equal(fast.timeline.column(col), slow.timeline.column(col), err_msg=col)
    np.testing.assert_allclose(fast.timeline.column("start_s"), slow.timeline.column("start_s"), rtol=1e-9)


def _overload_run(name: str, case: str, fast: bool):
    from sloserve.cost import get_gpu, get_model, kv_capacity_tokens
    from sloserve.runs import SimOptions, run_simulation, setup_from_options

    opt13b = dict(model="opt-13b", gpu="a100-40gb", num_gpus=2, num_requests=150, no_fast_path=not fast)
    if case == "bros-azure-conv/4":
        quarter = kv_capacity_tokens(get_model("opt-13b"), get_gpu("a100-40gb"), num_gpus=2) // 4
        options = SimOptions(workload="bros-azure-conv", rt_rate=2.0, kv_capacity_tokens=quarter, **opt13b)
    else:
        options = SimOptions(workload="mixed-rt-be", kv_capacity_tokens=3000, **opt13b)
    setup = setup_from_options(options)
    summary = run_simulation(setup, name, {}, setup.make_workload())
    return summary, *summary["_result"]


@pytest.mark.parametrize("name", ["bros", "bros_nobicache", "rr"])
@pytest.mark.parametrize("case", ["bros-azure-conv/4", "mixed-rt-be/3k"])
def test_rt_be_stretches_under_overload(name, case):
    """benchmarks/overload.py's KV-starved RT/BE cases, small: BROS drops, swaps and checkpoints between
    its stretches (RR evicts, and serves one class while the other's first request finds no room);
    every timestamp, preemption, copied byte and timeline row is the same both ways, and most steps
    ran in stretches."""
    slow, slow_reqs, slow_timeline = _overload_run(name, case, fast=False)
    fast, fast_reqs, fast_timeline = _overload_run(name, case, fast=True)
    np.testing.assert_allclose(timestamps(fast_reqs), timestamps(slow_reqs), rtol=1e-9, atol=0, equal_nan=True)
    assert [r.num_preemptions for r in slow_reqs] == [r.num_preemptions for r in fast_reqs]
    assert slow["preemptions"] + slow["swapped_bytes"] > 0, "the case drops or checkpoints KV"
    assert (fast["preemptions"], fast["swapped_bytes"]) == (slow["preemptions"], slow["swapped_bytes"])
    assert len(fast_timeline) == len(slow_timeline)
    for col in ("num_tokens", "num_decode", "num_requests", "kv_used_tokens", "kv_allocated_tokens", "num_preempted"):
        np.testing.assert_array_equal(fast_timeline.column(col), slow_timeline.column(col), err_msg=col)
    np.testing.assert_allclose(fast_timeline.column("start_s"), slow_timeline.column("start_s"), rtol=1e-9)
    stretched = fast_timeline.column("sched_time_s") == 0
    assert stretched.sum() > len(stretched) / 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["bros", "bros_nobicache", "rr"]),
    specs=rt_be_specs(st.just(0.1), st.sampled_from([0.015, 0.03, 0.1])),
    capacity=st.sampled_from([512, 1024, 4096]),
)
def test_bros_stretches_on_random_workloads(name, specs, capacity):
    """Small random RT/BE mixes in scarce KV with mixed SLOs (orders that change, (6) that binds,
    requests refused room by a little): the same run both ways."""
    _same_both_ways(name, specs, capacity)


@pytest.mark.parametrize("seed", [0, 4])
@pytest.mark.parametrize("name", ["bros", "bros_nobicache"])
def test_bros_stretches_while_members_pass_the_refused_request(name, seed):
    """15-30 RT/BE requests in 512 KV tokens: during stretches RT members' deadlines pass that of the
    request refused room, which may then evict them (from that step they are among its victims). The
    same run both ways; without those members among its victims, or with them a step late, not."""
    rng = np.random.default_rng(seed)
    specs = [
        (
            int(rng.integers(8, 300)),
            int(rng.integers(2, 150)),
            float(rng.uniform(0, 2)),
            bool(rng.random() < 0.5),
            0.1,
            float(rng.choice([0.015, 0.03, 0.1])),
        )
        for _ in range(int(rng.integers(15, 30)))
    ]
    _same_both_ways(name, specs, 512)


def _same_both_ways(name: str, specs, capacity: int) -> None:
    """``rt_be_requests(specs)`` run by ``name`` with and without the fast path: the same run."""

    def run(fast: bool):
        requests = rt_be_requests(specs)
        result = simulate(
            requests, lambda: scheduler(name, capacity, swap_space_tokens=20_000), llama7b_cost(), fast_path=fast
        )
        return requests, result

    slow_reqs, slow = run(False)
    fast_reqs, fast = run(True)
    np.testing.assert_allclose(timestamps(fast_reqs), timestamps(slow_reqs), rtol=1e-9, atol=0, equal_nan=True)
    assert [r.num_preemptions for r in slow_reqs] == [r.num_preemptions for r in fast_reqs]
    assert fast.swapped_bytes == slow.swapped_bytes
    for col in ("num_tokens", "num_requests", "kv_used_tokens", "kv_allocated_tokens", "num_preempted"):
        np.testing.assert_array_equal(fast.timeline.column(col), slow.timeline.column(col), err_msg=col)


def _every_scheduler_run(name: str, fast: bool):

    workload = workload_from_trace("sharegpt", num_requests=120, seed=7, context_len=4096, rate=15.0)
    for r in workload.requests[1::2]:
        r.request_class = RequestClass.BE
    result = simulate(
        workload.requests,
        lambda: scheduler(name, 12_000, swap_space_tokens=4_000),
        llama7b_cost(),
        fast_path=fast,
    )
    return workload.requests, result


@pytest.mark.parametrize("name", scheduler_names())
def test_every_scheduler_gives_the_same_timestamps_with_the_fast_path(name):
    """Whatever a policy's horizons (the defaults: none), stretches change no timestamp."""
    slow_reqs, slow = _every_scheduler_run(name, fast=False)
    fast_reqs, fast = _every_scheduler_run(name, fast=True)
    np.testing.assert_allclose(timestamps(fast_reqs), timestamps(slow_reqs), rtol=1e-9, atol=0, equal_nan=True)
    assert [r.num_preemptions for r in slow_reqs] == [r.num_preemptions for r in fast_reqs]
    assert len(fast.timeline) == len(slow.timeline)


def test_fast_path_stretches_exist():
    """The equivalence above is not vacuous: stretches of many steps happen."""
    _, result = _run("bwb", "vllm", fast=True, n=100)
    sched_times = result.timeline.column("sched_time_s")
    assert (sched_times == 0).sum() > len(sched_times) / 2  # most steps were advanced in stretches


@pytest.mark.parametrize("name", ["srtf", "multires", "rank_i", "fastserve"])
def test_named_decode_stretches_exist(name):
    """SRTF, MultiRes, rank and FastServe name their decodes; their decode-only steps still run as
    stretches (and count as decodes)."""
    _, result = _run("sharegpt", name, fast=True, n=200, rate=12.0)
    timeline = result.timeline
    stretched = timeline.column("sched_time_s") == 0
    assert stretched.sum() > len(stretched) / 2
    assert (timeline.column("num_prefill_tokens")[stretched] == 0).all()
    assert (timeline.column("num_decode")[stretched] == timeline.column("num_tokens")[stretched]).all()


def test_chunk_stretches_exist():
    """Sarathi's middle chunks of long prompts run as stretches, and those go on past arrivals."""
    reqs, result = _run("arxiv", "sarathi", fast=True, n=60, rate=3.0)
    timeline = result.timeline
    sched_time, starts = timeline.column("sched_time_s"), timeline.column("start_s")
    stretched = np.flatnonzero((sched_time == 0) & (timeline.column("num_prefill_tokens") > 0))
    assert len(stretched) > 50
    # Where each row's stretch began: the latest row at or before it that was scheduled.
    began = np.maximum.accumulate(np.where(sched_time > 0, np.arange(len(starts)), 0))
    arrivals = np.array([r.arrival_time for r in reqs])
    passed = [((arrivals > starts[began[i]]) & (arrivals < starts[i])).any() for i in stretched]
    assert any(passed)


def test_chunk_stretch_runs_through_a_completion_on_one_replica():
    """On one replica a chunk stretch goes on through the step in which a decode finishes (the
    timestamps stay those of step by step: the cases above)."""
    reqs, result = _run("arxiv", "sarathi", fast=True, n=60, rate=3.0)
    timeline = result.timeline
    stretched = (timeline.column("sched_time_s") == 0) & (timeline.column("num_prefill_tokens") > 0)
    ends = (timeline.column("start_s") + timeline.column("duration_s"))[stretched]
    finishes = np.array([r.finish_time for r in reqs])
    assert np.isclose(finishes[:, None], ends[None, :], rtol=1e-12, atol=0).any()


def assert_same_both_ways(run) -> None:
    """``run(fast)`` simulates and returns its requests: with the fast path they go to the same replicas
    at the same timestamps as step by step."""
    slow, fast = run(False), run(True)
    assert [r.replica for r in slow] == [r.replica for r in fast]
    np.testing.assert_allclose(timestamps(fast), timestamps(slow), rtol=1e-9, atol=0, equal_nan=True)


@pytest.mark.parametrize("router", ["round-robin", "least-outstanding"])
def test_fast_path_same_timestamps_in_a_cluster(router):
    """Stretches that run past arrivals route every arrival as step-by-step does."""

    def run(fast):
        workload = workload_from_trace("arxiv", num_requests=150, seed=4, context_len=4096, rate=9.0)
        simulate(
            workload.requests,
            lambda: scheduler("sarathi", CAPACITY),
            llama7b_cost(),
            num_replicas=3,
            router=router,
            fast_path=fast,
        )
        return workload.requests

    assert_same_both_ways(run)


@pytest.mark.parametrize("num_decode", [1, 2])
def test_fast_path_same_timestamps_with_disaggregation(num_decode):
    """A decode replica's stretch stops where a prefill replica may hand it a request: that hand-off is
    no event yet when the stretch is planned (the prefill replica has not finished its step). A
    decode replica of 4,096 tokens: it preempts and refills."""

    def run(fast):
        workload = workload_from_trace("sharegpt", num_requests=60, seed=0, context_len=4096, rate=10.0)
        simulate(
            workload.requests,
            lambda: scheduler("sarathi", 4096, role="prefill"),
            llama7b_cost(),
            make_decode_scheduler=lambda: scheduler("sarathi", 4096, role="decode"),
            num_decode_replicas=num_decode,
            fast_path=fast,
        )
        return workload.requests

    assert_same_both_ways(run)


def test_fast_path_same_timestamps_with_conversations_on_two_replicas():
    """A replica's stretch stops where another replica may finish a turn: the conversation's next turn
    (routed to either replica) is no event until then."""

    def run(fast):
        workload = workload_from_trace("sharegpt", num_requests=60, seed=6, context_len=4096, rate=20.0)
        requests = workload.requests
        chains = [[[r] for r in requests[i : i + 3]] for i in range(0, len(requests), 3)]  # 3 turns each
        for r in requests:
            r.think_time_s = 0.05
        simulate(
            requests, lambda: scheduler("vllm", CAPACITY), llama7b_cost(), num_replicas=2, fast_path=fast, chains=chains
        )
        return requests

    assert_same_both_ways(run)


@pytest.mark.parametrize("name", ["vllm", "sarathi", "orca"])
def test_conservation_every_request_completes_with_its_length(name):
    reqs, result = _run("sharegpt", name, fast=True, n=400, rate=20.0, seed=3)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED
        assert r.num_output_tokens == r.true_output_tokens
        assert r.arrival_time <= r.first_token_time <= r.last_token_time == r.finish_time
    processed = int(result.timeline.column("num_tokens").sum())
    assert processed >= sum(r.num_prompt_tokens + r.true_output_tokens - 1 for r in reqs)
    if result.num_preemptions == 0:
        assert processed == sum(r.num_prompt_tokens + r.true_output_tokens - 1 for r in reqs)


def test_determinism_for_a_seed():
    a, ra = _run("azure-conv", "sarathi", fast=True, trace_arrivals=True, seed=7)
    b, rb = _run("azure-conv", "sarathi", fast=True, trace_arrivals=True, seed=7)
    np.testing.assert_array_equal(timestamps(a), timestamps(b))
    np.testing.assert_array_equal(ra.timeline.column("duration_s"), rb.timeline.column("duration_s"))
    c, _ = _run("azure-conv", "sarathi", fast=True, trace_arrivals=True, seed=8)
    assert not np.array_equal(timestamps(a), timestamps(c))


@pytest.mark.parametrize("router", ["round-robin", "least-outstanding"])
def test_cluster_of_replicas(router):
    workload = workload_from_trace("sharegpt", num_requests=400, seed=2, context_len=4096, rate=30.0)
    result = simulate(
        workload.requests,
        lambda: scheduler("vllm", CAPACITY),
        llama7b_cost(),
        num_replicas=3,
        router=router,
    )
    replicas = [r.replica for r in workload.requests]
    assert set(replicas) == {0, 1, 2}
    if router == "round-robin":
        assert replicas == [i % 3 for i in range(400)]
    assert all(r.status is RequestStatus.FINISHED for r in workload.requests)
    assert set(result.timeline.column("replica").tolist()) == {0, 1, 2}
    # Three replicas finish the same load sooner than one.
    single = workload_from_trace("sharegpt", num_requests=400, seed=2, context_len=4096, rate=30.0)
    simulate(single.requests, lambda: scheduler("vllm", CAPACITY), llama7b_cost())
    assert max(r.finish_time for r in workload.requests) < max(r.finish_time for r in single.requests)


def test_simultaneous_arrivals_are_routed_by_request_id():
    """Ties between arrivals go to the lowest request id, whatever order the requests are given in."""
    workload = workload_from_trace("sharegpt", num_requests=40, seed=2, context_len=4096, offline=True)
    requests = workload.requests[::-1]  # given latest id first; all arrive at t=0
    simulate(requests, lambda: scheduler("vllm", CAPACITY), llama7b_cost(), num_replicas=3)
    assert [r.replica for r in sorted(requests, key=lambda r: r.request_id)] == [i % 3 for i in range(40)]


def _disaggregated(requests, link_bandwidth=12.5e9, **options):
    kvb = 524288  # Llama-2-7B: 2 x 32 layers x 32 heads x 128 x 2 bytes
    return simulate(
        requests,
        lambda: scheduler("vllm", CAPACITY, role="prefill", **options),
        llama7b_cost(),
        make_decode_scheduler=lambda: scheduler("vllm", CAPACITY, role="decode", **options),
        num_decode_replicas=1,
        link_bandwidth=link_bandwidth,
    ), kvb


def test_disaggregated_request_waits_for_its_kv_transfer():
    """DistServe: the prompt's KV crosses the link before the decode replica's first step."""
    from helpers import make_requests
    from sloserve.cost.base import BatchShape

    (req,) = make_requests([(1000, 2)])
    result, kvb = _disaggregated([req])
    transfer = 1000 * kvb / 12.5e9  # 1000 tokens x 0.5 MiB at 100 Gb/s = 41.9 ms
    decode_step = llama7b_cost().batch_time(BatchShape(num_decode=1, decode_kv_tokens=1000)).total_s
    assert req.max_token_gap == pytest.approx(transfer + decode_step, rel=1e-9)
    assert req.replica == 1 and req.num_output_tokens == 2
    assert result.extra["kv_transferred_bytes"] == 1000 * kvb
    assert set(result.timeline.column("replica").tolist()) == {0, 1}
    prefill_rows = result.timeline.column("replica") == 0
    assert (result.timeline.column("num_decode")[prefill_rows] == 0).all(), "prefill replica never decodes"


def test_disaggregated_transfers_share_the_link_one_at_a_time():
    from helpers import make_requests

    a, b = make_requests([(800, 2), (800, 2)])  # prefilled in one batch, handed off together
    _disaggregated([a, b])
    transfer = 800 * 524288 / 12.5e9
    assert a.first_token_time == b.first_token_time
    assert b.last_token_time - a.last_token_time == pytest.approx(transfer, rel=1e-6)


def test_disaggregated_cluster_conserves_tokens():
    workload = workload_from_trace("sharegpt", num_requests=300, seed=5, context_len=4096, rate=8.0)
    result, kvb = _disaggregated(workload.requests)
    for r in workload.requests:
        assert r.status is RequestStatus.FINISHED and r.num_output_tokens == r.true_output_tokens
    handed_off = [r for r in workload.requests if r.true_output_tokens > 1]
    assert result.extra["kv_transferred_bytes"] == sum(r.num_prompt_tokens for r in handed_off) * kvb
    assert {r.replica for r in handed_off} == {1}


def test_closed_loop_batches_arrive_when_the_previous_batch_completes():
    """BROS §7.1: best-effort jobs are resubmitted as a batch when the previous batch completes."""
    from sloserve.workload import build_workload, parse_workload_spec

    spec = parse_workload_spec(
        {
            "name": "be-loop",
            "streams": [
                {
                    "name": "rt",
                    "class": "rt",
                    "source": {"trace": "sharegpt"},
                    "arrival": {"process": "poisson", "rate": 4},
                    "num_requests": 120,
                },
                {
                    "name": "be",
                    "class": "be",
                    "source": {"uniform": {"prompt": [512, 1024], "output": [32, 128]}},
                    "arrival": {"process": "closed-batches", "batch_size": 16},
                    "num_requests": 64,
                },
            ],
        }
    )
    workload = build_workload(spec, seed=3, context_len=4096)
    (chain,) = workload.chains
    assert [len(b) for b in chain] == [16, 16, 16, 16]
    assert all(r.arrival_time == 0 for r in chain[0]) and all(r.arrival_time == float("inf") for r in chain[1])
    simulate(workload.requests, lambda: scheduler("sarathi", CAPACITY), llama7b_cost(), chains=workload.chains)
    for before, after in zip(chain, chain[1:]):
        assert {r.arrival_time for r in after} == {max(r.finish_time for r in before)}
    assert all(r.status is RequestStatus.FINISHED for r in workload.requests)


def test_jct_decomposition_on_infermax_figure1():
    """Figure 1 (KV 8): R3 is preempted in B2 and refilled in B3, so its preemption time is B2's
    duration; nobody waits or queues, and the rest of each JCT is execution."""
    from helpers import make_requests
    from sloserve.metrics import request_table

    reqs = make_requests([(3, 2), (1, 2), (2, 2)])
    result = simulate(
        reqs, lambda: scheduler("vllm", 8, max_model_len=8, block_size=1, watermark=0), llama7b_cost(), fast_path=False
    )
    starts = result.timeline.column("start_s")
    assert len(starts) == 3
    r1, r2, r3 = reqs
    assert r3.num_preemptions == 1 and r3.preempted_s == starts[2] - starts[1] > 0
    assert r1.preempted_s == r2.preempted_s == 0.0
    table = request_table(reqs)
    np.testing.assert_array_equal(table["waiting_s"], [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(table["gt_queuing_s"], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(table["execution_s"], table["jct_s"] - table["preemption_s"], rtol=1e-12)
    assert table["num_allocation_failures"].tolist() == [0, 0, 1]


@pytest.mark.parametrize(
    "name,options",
    [
        ("vllm", dict(preemption_mode="recompute")),
        ("vllm", dict(preemption_mode="swap", swap_space_tokens=8_000)),
        ("sarathi", dict()),
        ("econoserve", dict()),
        ("bros", dict()),
    ],
)
def test_jct_decomposition_parts_are_consistent(name, options):
    """Waiting, preemption, GT queuing and execution are >= 0 and add up to the JCT; only preempted
    requests have preemption time, and only a policy with a GT queue has GT queuing."""
    from sloserve.metrics import request_table

    reqs, _ = _run("sharegpt", name, fast=True, n=300, rate=12.0, **options)
    table = request_table(reqs)
    assert table["finished"].all()
    for part in ("waiting_s", "preemption_s", "gt_queuing_s"):
        assert (table[part] >= 0).all(), part
    assert (table["execution_s"] > 0).all()
    total = table["waiting_s"] + table["preemption_s"] + table["gt_queuing_s"] + table["execution_s"]
    np.testing.assert_allclose(total, table["jct_s"], rtol=1e-9)
    preempted = table["num_preemptions"] > 0
    assert preempted.any(), "the capacity is meant to force preemptions"
    assert (table["preemption_s"][~preempted] == 0).all()
    assert (table["preemption_s"][preempted] > 0).all() or name == "econoserve"
    assert (table["num_allocation_failures"][preempted] > 0).all()
    if name == "econoserve":
        assert (table["gt_queuing_s"] > 0).any()
    else:
        assert (table["gt_queuing_s"] == 0).all()


def test_policy_metrics_merge_over_replicas():
    from sloserve.sim.simulator import merge_policy_metrics

    merged = merge_policy_metrics(
        [
            {"num_stops": 2, "sched_part_s": 0.5, "sizes": [1, 2], "target": 144, "mode": "a"},
            {"num_stops": 3, "sched_part_s": 0.25, "sizes": [4], "target": 144, "mode": "b"},
        ]
    )
    assert merged == {"num_stops": 5, "sched_part_s": 0.75, "sizes": [1, 2, 4], "target": 144}


# Every registered scheduler on a small RT + BE workload under memory pressure (preemptions, swaps,
# BROS checkpoints, EconoServe lending): preemption counts and finish times, as JSON.
_EVERY_SCHEDULER = """
import json, sys
from sloserve.core.request import RequestClass
from sloserve.cost import LinearCostModel, get_preset
from sloserve.sched import make_scheduler
from sloserve.sched.registry import scheduler_names
from sloserve.sim import simulate
from sloserve.workload import workload_from_trace

cost = LinearCostModel(get_preset("llama-2-7b-a100"))
digest = {"optimize": sys.flags.optimize}
for name in scheduler_names():
    workload = workload_from_trace("sharegpt", num_requests=60, seed=5, context_len=4096, rate=30.0)
    for r in workload.requests[1::2]:
        r.request_class = RequestClass.BE
    result = simulate(
        workload.requests,
        lambda: make_scheduler(name, kv_capacity_tokens=12_000, max_model_len=4096, kv_bytes_per_token=524288,
                               swap_space_tokens=4_000, cost_model=cost),
        cost,
    )
    digest[name] = [result.num_preemptions, [r.finish_time for r in workload.requests]]
print(json.dumps(digest))
"""


def test_same_results_with_asserts_stripped():
    """``python -O`` drops assert statements: no scheduler or KV manager may do its work inside one
    (an allocation in an assert was skipped under -O, and EconoServe crashed)."""
    import json
    import subprocess
    import sys

    runs = [
        subprocess.Popen(
            [sys.executable, *flags, "-c", _EVERY_SCHEDULER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for flags in ([], ["-O"])
    ]
    digests = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, f"{run.args[1:-2]}: {stderr[-2000:]}"
        digests.append(json.loads(stdout))
    plain, optimized = digests
    assert (plain.pop("optimize"), optimized.pop("optimize")) == (0, 1)
    assert sum(preemptions for preemptions, _ in plain.values()) > 0, "the workload is meant to preempt"
    assert optimized == plain


@pytest.mark.parametrize("name", ["vllm", "sarathi", "econoserve", "bros"])
def test_simulation_leaves_no_cyclic_garbage(name):
    """``simulate`` pauses the cyclic garbage collector (it would only re-walk the live requests):
    that is safe only while a run creates no reference cycles, and the collector's state comes back."""
    import gc

    from sloserve.sched import make_scheduler

    workload = workload_from_trace("sharegpt", num_requests=200, seed=5, context_len=4096, rate=20.0)
    for r in workload.requests[1::2]:
        r.request_class = RequestClass.BE
    cost = llama7b_cost()
    gc.collect()
    assert gc.isenabled()
    simulate(
        workload.requests,
        lambda: make_scheduler(
            name, kv_capacity_tokens=CAPACITY, max_model_len=4096, kv_bytes_per_token=524288, cost_model=cost
        ),
        cost,
    )
    assert gc.isenabled()
    assert gc.collect() == 0, "a simulation left objects in reference cycles"


@pytest.mark.parametrize("seed", [1085, 1086, 1092, 3026, 6071])
def test_every_scheduler_completes_shared_prefixes_in_a_small_cache_both_ways(seed):
    """The workloads on which a sweep (every scheduler with prefix caching, fast path and step by step)
    found an allocation that failed after packing (bros_nobicache) or queues that stopped moving
    (synccoupled): every scheduler completes them, with the same timestamps both ways."""
    for name in scheduler_names():
        runs = []
        for fast in (True, False):
            capacity, requests = shared_prefix_workload(seed)
            make = functools.partial(
                scheduler, name, capacity, max_model_len=1024, swap_space_tokens=20_000, enable_prefix_caching=True
            )
            try:
                simulate(requests, make, llama7b_cost(), fast_path=fast)
            except ConfigError:  # a request this scheduler's cache cannot hold (its reserve): refused up front
                runs.append(None)
                continue
            assert all(r.num_output_tokens == r.true_output_tokens for r in requests), name
            runs.append(timestamps(requests))
        if runs[0] is None or runs[1] is None:
            assert runs[0] is runs[1] is None, name  # (refused both ways)
            continue
        np.testing.assert_allclose(runs[0], runs[1], rtol=1e-9, atol=0, equal_nan=True, err_msg=name)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31))
def test_every_scheduler_completes_random_shared_prefixes_both_ways(seed):
    """As above on random seeds of the same generator (``--hypothesis-profile explore`` draws new ones:
    the sweep that found the five above ran some 20,000 workload-scheduler pairs)."""
    test_every_scheduler_completes_shared_prefixes_in_a_small_cache_both_ways(seed)


@pytest.mark.parametrize("name", ["vllm", "sarathi", "infermax"])
def test_fast_path_gives_the_same_timestamps_with_prefix_caching(name):
    """Mooncake's shared prefixes in a KV cache that evicts: stretches (sarathi's chunk stretches
    register the blocks their later steps fill) change no timestamp and no cache hit."""
    from sloserve.sched import make_scheduler

    runs = []
    for fast in (False, True):
        workload = workload_from_trace("mooncake-conv", num_requests=150, seed=2, context_len=4096, trace_arrivals=True)
        result = simulate(
            workload.requests,
            lambda: make_scheduler(name, kv_capacity_tokens=40_000, max_model_len=4096, enable_prefix_caching=True),
            llama7b_cost(),
            fast_path=fast,
        )
        runs.append((workload.requests, result))
    (slow_reqs, slow), (fast_reqs, fast) = runs
    np.testing.assert_allclose(timestamps(fast_reqs), timestamps(slow_reqs), rtol=1e-9, atol=0, equal_nan=True)
    assert [r.num_cached_tokens for r in fast_reqs] == [r.num_cached_tokens for r in slow_reqs]
    assert sum(r.num_cached_tokens for r in fast_reqs) > 0
    assert slow.policy_metrics["num_prefix_cache_evicted_blocks"] > 0  # the cache was full
    assert len(fast.timeline) == len(slow.timeline)
    # the timeline's steps: what admitted requests found cached (every admission; a request's own count
    # is its first), fast path or not
    for result, reqs in ((slow, slow_reqs), (fast, fast_reqs)):
        assert result.timeline.column("num_cached_tokens").sum() >= sum(r.num_cached_tokens for r in reqs) > 0
    np.testing.assert_array_equal(fast.timeline.column("num_cached_tokens"), slow.timeline.column("num_cached_tokens"))

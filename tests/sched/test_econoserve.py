"""EconoServe (papers/econoserve.md §3): decoupled PT/GT queues, time-synced groups, exact allocation
with padding and reserve, offload-free preemption, KV-cache pipelining, ordering, variants."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import Driver, FixedPredictor, llama7b_cost, make_requests, scheduler, shared_prefix_workload
from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.core.prefix import SegmentedPrompt
from sloserve.core.request import Request
from sloserve.cost import BatchShape, CostBreakdown, CostModel
from sloserve.cost.derived import jct_slo_s, saturating_forward_size
from sloserve.kv.pipelined import PipelinedKVManager
from sloserve.sched.econoserve import EconoServeScheduler
from sloserve.sched.ordering import TaskQueue
from sloserve.workload import workload_from_trace

VARIANTS = ("econoserve-d", "econoserve-sd", "econoserve-sdo", "econoserve", "econoserve-oracle", "synccoupled")


def econo(name: str, capacity: int, predictions: dict[int, int] | None = None, **options) -> EconoServeScheduler:
    s = scheduler(name, capacity, **options)
    assert isinstance(s, EconoServeScheduler)
    if predictions is not None:
        s.predictor = FixedPredictor(predictions)
    return s


def test_figure_7a_a_hosted_gt_runs_in_the_second_half_of_its_hosts_region():
    """Host RL 32 and hosted RL 16 (outputs 33 and 17: the first token comes with the prompt): the
    hosted GT writes its KV in the host's second half and is done exactly when the host gets there.
    4 blocks: the reserve (1) and the two prompts (1 each), then the host's region (2) fill the cache:
    the RL-16 GT gets no region of its own (①) and is hosted (②)."""
    s = econo("econoserve-oracle", 64, buffer=0.0, reserve=0.25, target_forward_size=64)
    host, hosted = make_requests([(8, 33), (8, 17)])
    drv = Driver(s)
    for r in (host, hosted):
        s.add_request(r)
    regions = {}
    while s.has_unfinished():
        drv.step()
        kv = s.kv
        assert isinstance(kv, PipelinedKVManager)
        for r in (host, hosted):
            if r in kv.regions and r not in regions:
                regions[r] = list(kv.regions[r].slots)
        if hosted in kv.regions:
            # Its tokens past the prompt sit inside the host's region, second half.
            written = kv.slot_ids(hosted, 8, hosted.num_computed_tokens)
            assert set(written) <= set(regions[host][16:32])
        if host.num_computed_tokens > 8 + 16:
            assert hosted.is_finished  # gone before the host needed offset 16
    assert regions[hosted] == regions[host][16:32]
    assert s.num_hosted == 1 and s.num_hosted_evictions == 0
    assert host.num_output_tokens == 33 and hosted.num_output_tokens == 17
    # What pipelining had: ① left the RL-16 GT queued; the host lends 32/2 - b = 16, the hosted 16/2 = 8 (b = 0).
    metrics = s.policy_metrics()
    assert metrics["gt_queue_after_admission"] == [0, 1, 0] and metrics["lend_limit_tokens"] == [16, 8]


def test_an_overrunning_hosted_gt_is_evicted_to_cpu_and_finishes_later_with_all_its_tokens():
    # The hosted GT is predicted at 17 but generates 40: its host reaches its slots first.
    s = econo("econoserve", 64, predictions={1: 17}, buffer=0.0, padding=0.0, reserve=0.25, target_forward_size=64)
    host, hosted = make_requests([(8, 33), (8, 40)])
    drv = Driver(s)
    for r in (host, hosted):
        s.add_request(r)
    copies = []
    while s.has_unfinished():
        out = drv.step()
        copies += out.slot_copies
    assert s.num_hosted >= 1 and s.num_hosted_evictions == 1
    assert any(c.to_cpu for c in copies) and any(not c.to_cpu for c in copies)  # out to CPU, then back
    assert hosted.num_output_tokens == 40 and hosted.num_preemptions == 1 and host.num_output_tokens == 33


def test_an_under_predicted_gt_grows_into_the_reserve():
    s = econo("econoserve-sdo", 2048, predictions={0: 10}, padding=0.0, reserve=0.25, target_forward_size=64)
    (r,) = make_requests([(16, 60)])
    Driver(s).run([r])
    assert r.num_output_tokens == 60 and r.num_preemptions == 0  # went on past its region (free KV)
    assert r.num_allocation_failures == 1  # under-provisioned once: the reserve absorbed it


def test_an_under_predicted_gt_without_reserve_left_stops_with_its_kv_and_is_regrouped_by_l_new():
    # 128 slots: the reserve (25%: 32 slots) holds one prompt; r0 is predicted 9 but generates 70.
    s = econo("econoserve-sdo", 128, predictions={0: 9, 1: 60}, padding=0.0, reserve=0.25, target_forward_size=64)
    r0, r1 = make_requests([(16, 70), (16, 60)])
    drv = Driver(s)
    for r in (r0, r1):
        s.add_request(r)
    stopped_at = None
    while s.has_unfinished() and stopped_at is None:
        out = drv.step()
        for p in out.preempted:
            assert p.request is r0 and p.mode.value == "keep"
            stopped_at = r0.num_output_tokens
    assert stopped_at is not None
    # Stopped offload-free: its KV stays on the GPU while it waits in the GT queue with L_new.
    assert r0 in s.gt_queue and s.kv.num_tracked_tokens(r0) == r0.num_computed_tokens
    assert s.gt_queue.length(r0) == 70 - stopped_at  # re-predicted remaining length (exact here)
    while s.has_unfinished():
        drv.step()
    assert r0.num_output_tokens == 70 and r1.num_output_tokens == 60


def test_time_synced_groups_start_and_finish_together_with_exact_predictions():
    # Group A (4 x RL 40) fills the KV; group B (4 x RL 12) waits in the GT queue until A completes,
    # then starts and finishes as one group.
    s = econo("econoserve-sd", 16 * 16, predictor="oracle", padding=0.0, reserve=0.25, target_forward_size=64)
    a = make_requests([(8, 41)] * 4)
    b = [Request(4 + i, 0.05, 8, 13, 13) for i in range(4)]
    Driver(s).run(a + b)
    assert len({r.finish_time for r in a}) == 1
    assert len({r.finish_time for r in b}) == 1
    assert min(r.finish_time for r in b) > max(r.finish_time for r in a)
    assert s.group_sizes[:2] == [4, 4]


def test_ordering_puts_tighter_deadlines_first_then_larger_occupied_kv():
    q = TaskQueue("ordered", (0.5, 2.0), kv_range_tokens=128)
    late, urgent, small_kv, big_kv = make_requests([(8, 8)] * 4)
    q.advance(0.0)
    q.add(late, deadline=5.0, occupied_kv_tokens=900, length=300)
    q.add(small_kv, deadline=0.3, occupied_kv_tokens=10, length=500)
    q.add(big_kv, deadline=0.4, occupied_kv_tokens=300, length=20)
    q.add(urgent, deadline=0.1, occupied_kv_tokens=10, length=100)
    assert list(q) == [big_kv, small_kv, urgent, late]  # < 0.5 s first; within it, KV range 2 > 0
    assert q.first_fit(200) is big_kv and q.first_fit(10) is None
    assert q.first_fit(150) is big_kv
    q.remove(big_kv)
    assert q.first_fit(150) is urgent  # binary search in the range: the longest that fits
    assert q.largest_at_most(400) is late and q.largest_at_most(99) is None
    q.advance(4.0)  # late's deadline is now 1 s away: the middle range, still after the urgent ones
    assert list(q)[-1] is late
    q.advance(4.8)
    assert q.first_fit(1000) is not None and set(q) == {small_kv, urgent, late}


@settings(max_examples=30, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "add", "remove", "advance", "fit"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=400,
    )
)
def test_ordered_queue_matches_a_sorted_reference(ops):
    """Moves between deadline ranges leave stale entries behind (dropped lazily, or by a rebuild):
    the queue's order, first() and first_fit() still equal a full sort by (deadline range, occupied
    KV range descending, length descending, arrival); and no task changes range before
    ``next_move_time`` (what lets the simulator repeat EconoServe's decode steps up to it)."""
    q = TaskQueue("ordered", (0.5, 2.0), kv_range_tokens=128)
    reqs = make_requests([(8, 8)] * 200)
    tasks: dict = {}  # request -> (deadline, kv, length, seq)
    now, seq = 0.0, 0
    q.advance(now)
    for r in reqs[:150]:  # enough that one advance moves more than half of a range: it is rebuilt
        tasks[r] = (2.0 + (seq * 37 % 200) / 100, seq * 53 % 700, 1 + seq * 31 % 300, seq)
        q.add(r, *tasks[r][:3])
        seq += 1

    def key_range(r, at: float) -> int:
        left = tasks[r][0] - at
        return 0 if left < 0.5 else 1 if left < 2.0 else 2

    def first_move(r, at: float) -> float:
        """When ``r`` passes the bound of its range at ``at``."""
        return {0: math.inf, 1: tasks[r][0] - 0.5, 2: tasks[r][0] - 2.0}[key_range(r, at)]

    def ref_order():
        def key(r):
            deadline, kv, length, n = tasks[r]
            return (key_range(r, now), -(kv // 128), -length, n)

        return sorted(tasks, key=key)

    for op, x in ops:
        if op == "add" and len(tasks) < len(reqs):
            r = next(r for r in reqs if r not in tasks)
            tasks[r] = (now + (x % 4000) / 1000, x % 700, 1 + x % 300, seq)
            seq += 1
            q.add(r, *tasks[r][:3])
        elif op == "remove" and tasks:
            r = ref_order()[x % len(tasks)]
            del tasks[r]
            q.remove(r)
        elif op == "advance":
            # next_move_time: no task changes range before it (it may be earlier than the first move)
            soonest, ranges = q.next_move_time(), {r: key_range(r, now) for r in tasks}
            assert soonest <= min((first_move(r, now) for r in tasks), default=math.inf)
            now += (x % 3000) / 1000
            if now < soonest:
                assert ranges == {r: key_range(r, now) for r in tasks}
            q.advance(now)
        elif op == "fit":
            room = x % 320
            order = ref_order()
            fits = [r for r in order if tasks[r][2] <= room]
            # The first range pair (deadline, KV) holding a fit, and in it the longest (then earliest).
            assert q.first_fit(room) is (fits[0] if fits else None)
            # Pipelining's lookup ignores ranges: the longest that fits, the earliest among equals.
            best = min(fits, key=lambda r: (-tasks[r][2], tasks[r][3])) if fits else None
            assert q.largest_at_most(room) is best
        order = ref_order()
        assert list(q) == order and q.first() is (order[0] if order else None) and len(q) == len(order)


def test_the_oracle_variant_has_no_allocation_failures_and_every_variant_finishes():
    for name in VARIANTS:
        reqs = workload_from_trace("sharegpt", num_requests=60, seed=0, context_len=4096, rate=20.0).requests
        s = scheduler(name, 4000)
        Driver(s).run(reqs)
        assert all(r.num_output_tokens == r.true_output_tokens for r in reqs), name
        if name == "econoserve-oracle":
            assert s.kv.num_allocation_failures == 0
            assert all(r.num_allocation_failures == 0 for r in reqs)
            assert s.num_offload_free_stops == 0 and s.num_hosted_evictions == 0


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(VARIANTS),
    lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 120)), min_size=1, max_size=25),
    gaps=st.lists(st.floats(0, 0.2), min_size=25, max_size=25),
    capacity_blocks=st.integers(40, 120),
    reserve=st.sampled_from([0.0, 0.05, 0.2]),
    caching=st.booleans(),
)
def test_random_workloads_keep_invariants_and_finish(name, lengths, gaps, capacity_blocks, reserve, caching):
    """With prefix caching too: prompts start with 0-2 shared 32-token segments, so hosted GTs, stops
    and drops run beside shared prompt blocks (check_integrity: none is freed or written under a user)."""
    arrivals = [sum(gaps[: i + 1]) for i in range(len(lengths))]
    reqs = make_requests(lengths, arrivals)
    for i, r in enumerate(reqs):
        segments = (7, 8 + i % 2, 100 + i)[: 1 + i % 3] + tuple(range(1000 + 20 * i, 1020 + 20 * i))
        r.prompt_blocks = SegmentedPrompt.uniform(segments, 32, r.num_prompt_tokens)
    s = scheduler(name, capacity_blocks * 16, enable_prefix_caching=caching, target_forward_size=64, reserve=reserve)
    Driver(s).run(reqs)  # check_integrity after every step
    assert all(r.num_output_tokens == r.true_output_tokens for r in reqs)
    assert s.kv.num_free_blocks == s.kv.gpu.num_blocks


def test_synccoupled_resumes_a_gt_stopped_past_its_region():
    """Without a reserve an under-predicted SyncCoupled GT stops (O4) with its KV; it must come back
    with its new predicted RL, not wait forever (hypothesis found this: request 3, 33 tokens)."""
    reqs = make_requests([(1, 1), (1, 1), (56, 120), (1, 33), (1, 70), (80, 118), (136, 120), (200, 120)])
    s = scheduler("synccoupled", 75 * 16, target_forward_size=64, reserve=0.0)
    Driver(s).run(reqs)
    assert s.num_offload_free_stops > 0
    assert all(r.num_output_tokens == r.true_output_tokens for r in reqs)


def test_synccoupled_admits_a_long_prompt_whose_padded_region_would_not_fit():
    """A request that fits the cache alone (prompt 667 + 117 outputs - 1 = 783 of 800 - 16 reserved
    tokens), predicted exactly: its padded region (117 x 1.15 = 135) must be cut to what the cache
    leaves past its prompt, else nothing ever runs it (a fast/slow sweep found this, stuck with the
    request queued and nothing running). It is admitted at once and completes."""
    reqs = make_requests([(667, 117)])
    s = econo("synccoupled", 800, {0: 117})
    Driver(s).run(reqs)
    assert reqs[0].num_output_tokens == 117
    assert s.kv.num_free_blocks == s.kv.gpu.num_blocks


def test_synccoupled_frees_queued_gts_when_they_hold_what_the_head_needs():
    """Two GTs stopped past their regions (O4) keep their KV in the GT queue and hold all of it while
    nothing runs: the head could not grow, and nothing ever would. As the decoupled variants do, queued
    GTs from the back drop their KV (recompute) until the head fits (a prefix-caching sweep found it:
    seed 6071, stuck with the queues full and nothing running)."""
    capacity, requests = shared_prefix_workload(6071)
    s = scheduler("synccoupled", capacity, max_model_len=1024, enable_prefix_caching=True)
    Driver(s).run(requests)
    assert all(r.num_output_tokens == r.true_output_tokens for r in requests)
    assert s.num_dropped > 0


class LinearOnly(CostModel):
    def batch_time(self, shape: BatchShape) -> CostBreakdown:
        t = 0.01 + 1e-5 * shape.num_tokens
        return CostBreakdown(t, t, 0.0, 0.0, 0.0)


def test_tfs_is_where_throughput_saturates():
    # n / (a + b n) reaches 95% of its best (at 4096) at n = 0.95 a / (b (1 - 0.95 r)), r = best * b.
    best = 4096 / (0.01 + 1e-5 * 4096)
    tfs = saturating_forward_size(LinearOnly(), 4096, fraction=0.95)
    assert tfs / (0.01 + 1e-5 * tfs) >= 0.95 * best > (tfs - 16) / (0.01 + 1e-5 * (tfs - 16))
    s = scheduler("econoserve", 8192)
    assert s.target_forward_size == saturating_forward_size(llama7b_cost(), 4096)


def test_jct_slo_is_scale_times_unloaded_latency():
    cost = llama7b_cost()
    one = jct_slo_s(cost, 100, 50, 1.0)
    assert jct_slo_s(cost, 100, 50, 2.0) == pytest.approx(2 * one)
    assert jct_slo_s(cost, 100, 100, 1.0) > one


@pytest.mark.parametrize(
    "options, message",
    [
        ({"padding": 1.0}, "padding must be in \\[0, 1\\)"),
        ({"reserve": -0.1}, "reserve must be in \\[0, 1\\)"),
        ({"buffer": 1.5}, "buffer must be in \\[0, 1\\)"),
        ({"target_forward_size": 0}, "target_forward_size \\(TFS\\) must be in"),
        ({"slo_scale": 0}, "slo_scale must be a finite number > 0"),
        ({"slo_scale": "inf"}, "slo_scale must be a finite number > 0, got inf"),  # (a ValueError once)
        ({"soon_deadline_s": "inf"}, "urgent_deadline_s < soon_deadline_s, both finite, got 0.5, inf"),
        ({"predictor": "psychic"}, "predictor.*expected one of oracle, noisy-oracle, histogram"),
        ({"pipelining": "false"}, "pipelining and kv_manager=pipelined go together"),
        ({"predictor_bucket_tokens": 0}, "predictor_bucket_tokens must be >= 1"),
    ],
)
def test_bad_options_are_one_clear_error(options, message):
    with pytest.raises(ConfigError, match=message):
        scheduler("econoserve", 8192, **{k: str(v) for k, v in options.items()})


def test_bucketed_predictions_group_gts_of_the_same_cell():
    """--set predictor_bucket_tokens=50: RLs predicted in 50-token cells (as [23]'s predictor), so
    GTs of one cell admitted together form one time-synced group."""
    s = scheduler("econoserve-sd", 64 * 16, predictor_bucket_tokens="50", reserve="0.25", target_forward_size="512")
    reqs = [
        Request(request_id=i, arrival_time=0.0, num_prompt_tokens=8, true_output_tokens=20 + i % 3, max_tokens=4096)
        for i in range(6)
    ]
    Driver(s).run(reqs)
    assert all(r.predicted_output_tokens % 50 == 0 for r in reqs)
    assert all(r.num_output_tokens == r.true_output_tokens for r in reqs)
    assert s.group_sizes == [6]  # unbucketed, these six predictions differ: six groups of one


def test_unknown_variant_lists_the_valid_ones():
    with pytest.raises(UnknownNameError, match="econoserve, econoserve-d, econoserve-oracle, econoserve-sd"):
        scheduler("econoserve-x", 8192)


def test_summary_reports_gt_queuing_allocation_failures_and_group_sizes():
    """Through the simulator: GTs wait in the GT queue (GT queuing time), mispredicted GTs count as
    allocation failures, and the summary carries Figure 2's group sizes as a CDF."""
    from sloserve.metrics import summarize
    from sloserve.sim import simulate

    reqs = workload_from_trace("sharegpt", num_requests=200, seed=0, context_len=4096, rate=40.0).requests
    result = simulate(reqs, lambda: scheduler("econoserve", 6000), llama7b_cost())
    summary = summarize(
        reqs,
        result.timeline,
        kv_capacity_tokens=6000,
        sim_wall_s=result.sim_wall_s,
        policy_metrics=result.policy_metrics,
    )
    assert any(r.gt_queued_s > 0 for r in reqs)
    failed = [r for r in reqs if r.num_allocation_failures]
    assert failed and summary["allocation_failure_share"] == len(failed) / len(reqs)
    # Every preemption in EconoServe follows a failure (an overrun stop or a hosted GT's eviction).
    assert all(r.num_allocation_failures for r in reqs if r.num_preemptions)
    groups = summary["policy"]["gt_group_sizes"]
    assert groups["count"] == len(result.policy_metrics["gt_group_sizes"]) >= 1
    assert sum(result.policy_metrics["gt_group_sizes"]) >= len(reqs)  # every GT joins a group (again after a stop)
    assert groups["cdf"][-1][1] == 1.0 and groups["max"] == groups["cdf"][-1][0]
    fractions = [f for _, f in groups["cdf"]]
    assert fractions == sorted(fractions)
    assert (
        summary["forward_size_to_target"]
        == summary["forward_size"]["mean"] / result.policy_metrics["target_forward_size"]
    )


def test_kv_bound_by_hand_and_above_every_schedulers_offline_throughput():
    """The KV bound: with one kind of request (I = 100, O = 3) a running request holds 101 tokens on
    average, so 1,010 tokens of KV run 10 decodes a step; and no scheduler's simulated throughput
    (prefills included) goes past the bound of its own workload."""
    from sloserve.cost import build_cost_model, get_gpu, get_model
    from sloserve.cost.derived import kv_bound_throughput_rps
    from sloserve.sched import make_scheduler
    from sloserve.sim import simulate

    cost = llama7b_cost()
    step = cost.batch_time(BatchShape(num_decode=10, decode_kv_tokens=1010)).total_s
    assert kv_bound_throughput_rps(cost, [100], [3], 1010) == pytest.approx(10 / step / 3)
    with pytest.raises(ConfigError):
        kv_bound_throughput_rps(cost, [], [], 1010)

    model = get_model("opt-13b")
    cost = build_cost_model(model, get_gpu("a100-80gb"))
    capacity = 14_648  # 12 GB of OPT-13B KV, as in EconoServe §2.1
    for name in ("vllm", "sarathi", "econoserve-d"):
        requests = workload_from_trace(
            "sharegpt", num_requests=300, seed=0, context_len=model.max_context_len, offline=True
        ).requests
        bound = kv_bound_throughput_rps(
            cost, [r.num_prompt_tokens for r in requests], [r.true_output_tokens for r in requests], capacity
        )
        simulate(
            requests,
            lambda n=name: make_scheduler(
                n,
                kv_capacity_tokens=capacity,
                max_model_len=2048,
                kv_bytes_per_token=model.kv_bytes_per_token,
                cost_model=cost,
            ),
            cost,
        )
        throughput = len(requests) / max(r.finish_time for r in requests)
        assert 0.3 * bound < throughput <= bound, name

"""BROS (papers/bros.md): priority packing under a cost-model check, adaptive batch size, RR."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import Driver, llama7b_cost, rt_be_requests, rt_be_specs, scheduler, shared_prefix_workload, timestamps
from sloserve.core.errors import ConfigError
from sloserve.core.request import SLO, Request, RequestClass, RequestStatus
from sloserve.sched.bros import BrosScheduler
from sloserve.sim import simulate


def mixed(num_rt: int, num_be: int, rt_gap: float = 0.05, ttft: float = 0.4, tpot: float = 0.2) -> list[Request]:
    reqs = []
    for i in range(num_be):
        reqs.append(
            Request(
                request_id=i,
                arrival_time=0.0,
                num_prompt_tokens=600 + 20 * (i % 10),
                true_output_tokens=60 + i % 40,
                max_tokens=200,
                request_class=RequestClass.BE,
            )
        )
    for j in range(num_rt):
        reqs.append(
            Request(
                request_id=num_be + j,
                arrival_time=0.01 + rt_gap * j,
                num_prompt_tokens=100 + 37 * (j % 9),
                true_output_tokens=30 + 7 * (j % 11),
                max_tokens=200,
                request_class=RequestClass.RT,
                slo=SLO(ttft_s=ttft, tpot_s=tpot),
            )
        )
    return reqs


class Recording(Driver):
    """Also records, per step, BROS's estimate, the residual it respected and the batch size."""

    def step(self):
        out = super().step()
        s = self.scheduler
        self.packed = getattr(self, "packed", [])
        self.packed.append((s.last_estimate_s, s.last_residual_s, len(out.chunks), s.batch_size))
        return out


def test_packer_respects_the_most_urgent_residual_time():
    reqs = mixed(num_rt=60, num_be=40)
    drv = Recording(scheduler("bros", 30_000))
    drv.run(reqs)
    assert all(r.status is RequestStatus.FINISHED and r.num_output_tokens == r.true_output_tokens for r in reqs)
    constrained = [(est, res, n) for est, res, n, _ in drv.packed if res < math.inf]
    assert constrained, "RT deadlines constrained some batches"
    for est, res, n in constrained:
        assert est <= res or n == 1, (est, res, n)  # a smaller batch would fit: never exceeded


def test_rt_requests_go_first_and_be_requests_fill_in():
    reqs = mixed(num_rt=30, num_be=40)
    Driver(scheduler("bros", 30_000)).run(reqs)
    rt = [r for r in reqs if r.request_class is RequestClass.RT]
    be = [r for r in reqs if r.request_class is RequestClass.BE]
    ttft_rt = sum(r.first_token_time - r.arrival_time for r in rt) / len(rt)
    assert ttft_rt < 0.4  # the TTFT SLO holds on average though 40 BE prompts arrived first
    assert all(r.num_output_tokens == r.true_output_tokens for r in be)


def test_adaptive_batch_size_grows_without_rt_pressure_and_resets_on_a_violation():
    sched = scheduler("bros", 60_000, initial_batch_size=4, batch_size_step=4, max_batch_size=32)
    drv = Recording(sched)
    be_only = mixed(num_rt=0, num_be=40)
    drv.run(be_only)
    sizes = [b for *_, b in drv.packed]
    assert sizes[:4] == [8, 12, 16, 20] and max(sizes) == 32  # additive increase up to the cap
    # BE work lets the batch size grow; then a burst of RT prompts with a tight but feasible TTFT
    # arrives: one fits the most urgent deadline, all of them do not, so the estimate would
    # violate it and the batch size goes back to the start.
    sched2 = scheduler("bros", 60_000, initial_batch_size=4, batch_size_step=4, max_batch_size=32)
    drv2 = Recording(sched2)
    burst = mixed(num_rt=8, num_be=40, rt_gap=0.0, ttft=0.04, tpot=0.5)
    for r in burst:
        if r.request_class is RequestClass.RT:
            r.arrival_time = 30.0  # after the BE work: the system is idle and B has grown
    drv2.run(burst)
    sizes = [b for *_, b in drv2.packed]
    grown = next(i for i, b in enumerate(sizes) if b > 8)
    assert 4 in sizes[grown:], sizes


def test_rr_alternates_classes():
    reqs = mixed(num_rt=20, num_be=20, rt_gap=0.0)
    drv = Driver(scheduler("rr", 60_000))
    drv.run(reqs)
    kinds = []
    by_id = {r.request_id: r for r in reqs}
    for step in drv.log:
        classes = {by_id[rid].request_class for rid, _ in step.chunks}
        assert len(classes) == 1, "one class per iteration"
        kinds.append(classes.pop())
    both = [i for i in range(len(kinds) - 1) if kinds[i] != kinds[i + 1]]
    assert len(both) > 10  # they take turns while both have work
    assert all(r.num_output_tokens == r.true_output_tokens for r in reqs)


def test_bros_bad_configuration():
    with pytest.raises(ConfigError, match="initial_batch_size <= max_batch_size, got 64 > 32"):
        scheduler("bros", 10_000, initial_batch_size=64, max_batch_size=32)
    with pytest.raises(ConfigError, match="default_ttft_s must be > 0"):
        scheduler("bros", 10_000, default_ttft_s=0)
    with pytest.raises(ConfigError, match="dropping=swap needs kv_manager=bidirectional"):
        scheduler("bros_nobicache", 10_000, dropping="swap")
    with pytest.raises(ConfigError, match="add --set dropping=recompute"):
        scheduler("bros", 10_000, rt_growth="free_block_first")
    assert scheduler("bros", 10_000, rt_growth="free_block_first", dropping="recompute").config.dropping == "recompute"
    with pytest.raises(ValueError, match="SLO ttft_s must be > 0"):
        SLO(ttft_s=-1)
    from sloserve.sched import make_scheduler

    with pytest.raises(ConfigError, match="needs a cost model"):
        make_scheduler("bros", kv_capacity_tokens=10_000, max_model_len=4096)
    assert isinstance(scheduler("bros", 10_000), BrosScheduler) and llama7b_cost() is not None


def test_token_group_deadlines():
    """``deadlines=token_group``: the current group of g tokens is due g x TPOT after the previous
    group came, its next token early enough for the rest to follow one per average iteration; per
    token, token k is due at first token + (k - 1) x TPOT."""
    by_group = scheduler("bros", 10_000, deadlines="token_group", token_group_size=2)
    per_token = scheduler("bros", 10_000)
    r = Request(request_id=0, arrival_time=0.0, num_prompt_tokens=4, true_output_tokens=10, max_tokens=10)
    assert by_group.deadline(r) == per_token.deadline(r) == pytest.approx(0.4)  # the first token: TTFT
    by_group.iteration_ema_s = 0.05

    def emit(now: float) -> None:
        r.add_output_token(now)
        by_group.on_token_emitted(r)

    emit(0.3)  # token 1, group 0: the next group (tokens 2-3) is due 0.3 + 2 x 0.2
    assert by_group.deadline(r) == pytest.approx(0.7 - 0.05)  # token 2, with token 3 after it
    emit(0.5)
    assert by_group.deadline(r) == pytest.approx(0.7)  # token 3 closes the group
    emit(0.6)  # token 3 came: group 2 (tokens 4-5) is due 0.6 + 0.4
    assert by_group.deadline(r) == pytest.approx(1.0 - 0.05)
    assert per_token.deadline(r) == pytest.approx(0.3 + 3 * 0.2)  # banked slack: due at 0.9 regardless
    with pytest.raises(ConfigError, match="deadlines must be per_token or token_group, got 'soon'"):
        scheduler("bros", 10_000, deadlines="soon")
    with pytest.raises(ConfigError, match="token_group_size must be >= 1, got 0"):
        scheduler("bros", 10_000, token_group_size=0)


def test_vllm_priority_admits_rt_before_earlier_be():
    reqs = mixed(num_rt=6, num_be=30, rt_gap=0.0)
    for r in reqs:
        if r.request_class is RequestClass.RT:
            r.arrival_time = 0.0  # all queued together; BE requests have lower ids (arrived "first")
    drv = Driver(scheduler("vllm_priority", 8_000, max_num_seqs=8))
    drv.run(reqs)
    first_batch = [rid for rid, _ in drv.log[0].chunks]
    rt_ids = {r.request_id for r in reqs if r.request_class is RequestClass.RT}
    assert set(first_batch[:6]) == rt_ids
    assert all(r.num_output_tokens == r.true_output_tokens for r in reqs)


def test_rt_rate_flag_and_bros_workload(tmp_path):
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sloserve.cli",
            "compare",
            "--workload",
            "bros-sharegpt",
            "--rt-rate",
            "3",
            "--num-requests",
            "240",
            "--schedulers",
            "bros,rr,vllm_priority",
            "--model",
            "opt-13b",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summaries = json.loads(proc.stdout)
    for s in summaries.values():
        assert set(s["classes"]) == {"rt", "be"}
        assert s["classes"]["rt"]["completed"] + s["classes"]["be"]["completed"] == s["completed"] == 240


def test_rt_overwrites_be_slots_which_are_checkpointed_and_restored():
    """With bidirectional blocks, RT requests arriving into a cache full of BE requests take over BE
    slots (lazily checkpointed); the BE requests resume later and finish with all their tokens."""
    from sloserve.kv.bidirectional import BidirectionalKVManager

    reqs = mixed(num_rt=12, num_be=12, rt_gap=0.02)
    sched = scheduler("bros", 6_400, block_size=16, max_num_batched_tokens=4096)
    assert isinstance(sched.kv, BidirectionalKVManager)
    drv = Driver(sched)
    drv.run(reqs)
    kv = sched.kv
    assert kv.checkpointed_bytes > 0 and kv.restored_bytes > 0
    assert kv.restored_bytes <= kv.checkpointed_bytes
    assert all(r.status is RequestStatus.FINISHED and r.num_output_tokens == r.true_output_tokens for r in reqs)
    assert kv.allocated_tokens == 0 and kv.num_free_blocks == kv.gpu.num_blocks


@pytest.mark.parametrize("name", ["bros", "bros_nobicache"])
def test_be_requests_holding_every_block_do_not_stall(name):
    """BE requests admitted while blocks were free grow until no block is left and none of them can
    take another (BE takes free blocks only): BROS drops the latest admitted BE requests
    (progressive dropping, §5) so the earliest goes on, and every request still finishes."""
    reqs = [
        Request(
            request_id=i,
            arrival_time=0.0,
            num_prompt_tokens=8,
            true_output_tokens=40,
            max_tokens=40,
            request_class=RequestClass.BE,
        )
        for i in range(6)
    ]
    sched = scheduler(name, 96, block_size=8)
    drv = Driver(sched)
    drv.run(reqs)
    assert all(r.status is RequestStatus.FINISHED and r.num_output_tokens == 40 for r in reqs)
    assert sched.num_preemptions > 0
    assert reqs[0].num_preemptions == 0  # the earliest admitted is never the one dropped


def test_be_tokens_by_counts_finished_and_spreads_running_requests():
    """BE throughput window (experiments.bros): finished requests count whole, running ones by
    their tokens spread evenly between their first and last token, unstarted ones not at all."""
    from sloserve.experiments.bros import be_tokens_by

    done, running, unstarted = (Request(i, 0.0, 8, 11, 11, request_class=RequestClass.BE) for i in range(3))
    for t in [1.0 + 0.1 * k for k in range(11)]:  # 11 tokens from 1.0 to 2.0
        done.add_output_token(t)
        running.add_output_token(t + 1.0)  # 2.0 .. 3.0
    done.finish_time, running.finish_time = 2.0, 3.0
    assert be_tokens_by([done, running, unstarted], 2.5) == 11 + 1 + 10 * 0.5
    assert be_tokens_by([done], 1.5) == 1 + 10 * 0.5


def test_bros_reports_its_scheduling_time_by_part():
    """Figure 14's parts are measured inside schedule(): they add up to no more than the step loop's
    scheduling time, and every step queried the cost model."""
    reqs = mixed(num_rt=20, num_be=20, rt_gap=0.02)
    result = simulate(
        reqs,
        lambda: scheduler("bros", 6_400, block_size=16, max_num_batched_tokens=4096),
        llama7b_cost(),
        fast_path=False,
    )
    policy = result.policy_metrics
    parts = [policy[f"sched_{p}_s"] for p in ("rt_ordering", "rt_packing", "be_packing", "kv_blocks")]
    assert all(p > 0 for p in parts)
    assert sum(parts) <= float(result.timeline.column("sched_time_s").sum())
    assert policy["num_schedule_calls"] >= len(result.timeline)
    assert policy["num_cost_model_queries"] >= policy["num_schedule_calls"]


def test_hybrid_workload_has_the_rt_requests_asked_and_enough_be_batches(tmp_path):
    from sloserve.experiments import bros as experiment

    built = experiment.hybrid_workload("bros-sharegpt", 4.0, 60, 2048)
    rt = [r for r in built.requests if r.request_class is RequestClass.RT]
    be = [r for r in built.requests if r.request_class is RequestClass.BE]
    assert len(rt) == 60 and len(built.chains) == 1
    assert len(built.chains[0]) == max(
        experiment.MIN_BE_BATCHES, math.ceil(experiment.BE_BATCHES_PER_RT_SECOND * 60 / 4.0)
    )
    assert len(be) == 128 * len(built.chains[0])
    rows = [
        dict(model="opt-13b", rt_rate=r, **{f"{p}_share": 0.01 for p in (*experiment.PHASES, "other")}) for r in (2, 6)
    ]
    experiment._plot_breakdown(rows, tmp_path / "fig14.png")
    assert (tmp_path / "fig14.png").read_bytes()[:4] == b"\x89PNG"


def test_checkpoint_and_restore_traffic_is_charged_overlapped():
    """§4.1: checkpoints and restores cost host-link time and overlap the forward pass. A step that
    moves KV takes the longer of its compute and its copies, and BROS's estimate of a batch counts
    the restores of the BE requests it packs. The link here is slow (100 MB/s) so that copies dominate."""
    from sloserve.cost import LinearCostModel, get_preset
    from sloserve.cost.base import batch_shape
    from sloserve.sched import make_scheduler
    from sloserve.sim.executor import SimExecutor

    bandwidth = 100e6
    cost = LinearCostModel(get_preset("llama-2-7b-a100"), swap_bandwidth=bandwidth)
    sched = make_scheduler(
        "bros",
        kv_capacity_tokens=6_400,
        max_model_len=4096,
        kv_bytes_per_token=524288,
        options={"block_size": 16, "max_num_batched_tokens": 4096},
        cost_model=cost,
    )
    steps = []

    class Watch(Driver):
        def step(self):
            restored_before, start = sched.kv.restored_bytes, self.now
            out = super().step()
            steps.append((out, sched.kv.restored_bytes - restored_before, sched.last_estimate_s, self.now - start))
            return out

    reqs = mixed(num_rt=12, num_be=12, rt_gap=0.02)
    Watch(sched, SimExecutor(cost)).run(reqs)
    moving = [s for s in steps if s[0].swap_bytes]
    assert moving and any(restored for _, restored, _, _ in moving)
    for out, restored, estimate, duration in moving:
        assert out.swap_overlapped
        t = cost.batch_time(batch_shape(out))
        compute = t.non_attention_s + t.decode_attention_s + t.prefill_attention_s
        assert duration == pytest.approx(max(compute, out.swap_bytes / bandwidth), rel=1e-9)
        assert estimate >= restored / bandwidth * (1 - 1e-9)  # the packer saw the restores coming
    assert all(r.status is RequestStatus.FINISHED for r in reqs)


def test_rt_only_microbenchmark_row():
    """Figure 12's runs: RT requests alone, BROS without BE packing and bidirectional blocks vs vLLM."""
    from sloserve.experiments.bros import run_rt_only

    bros = run_rt_only("bros_nobicache", 6.0, 150)
    vllm = run_rt_only("vllm", 6.0, 150)
    for row in (bros, vllm):
        assert row["rt_rate"] == 6.0 and 0 < row["throughput_tps"] and 0 <= row["slo_attainment"] <= 1
    # Deadline-ordered RT packing against FCFS: no worse normalized latency at the same throughput.
    assert bros["normalized_latency_s"] <= vllm["normalized_latency_s"]
    assert bros["throughput_tps"] == pytest.approx(vllm["throughput_tps"], rel=0.05)


@pytest.mark.parametrize("dropping", ["recompute", "swap"])
def test_progressive_dropping_swaps_out_or_recomputes(dropping):
    """§5 drops requests by swapping their KV out (``dropping=swap``): a dropped request keeps its
    progress and every prompt token is computed once; with ``dropping=recompute``, and in
    bros_nobicache, it is recomputed. While a BE request is swapped out no new BE request starts
    (the re-admission rule)."""
    computed: dict[str, int] = {}
    modes: dict[str, set] = {}
    for name in ("bros", "bros_nobicache"):
        reqs = [
            Request(
                request_id=i,
                arrival_time=0.0 if i < 6 else 0.01 * i,
                num_prompt_tokens=8,
                true_output_tokens=40,
                max_tokens=40,
                request_class=RequestClass.BE,
            )
            for i in range(12)
        ]
        options = {"dropping": dropping} if name == "bros" else {}
        sched = scheduler(name, 96, block_size=8, **options)
        drv = Driver(sched)
        steps = []
        original = drv.step

        def step(original=original, steps=steps, sched=sched):
            waiting = set(sched.waiting)
            out = original()
            be_swapped_out = bool(sched._dropped[RequestClass.BE])
            assert not (be_swapped_out and any(r in waiting for r, _ in out.chunks)), "a new BE request started"
            steps.append(out)
            return out

        drv.step = step
        drv.run(reqs)
        assert all(r.status is RequestStatus.FINISHED and r.num_output_tokens == 40 for r in reqs)
        modes[name] = {p.mode.value for out in steps for p in out.preempted}
        computed[name] = sum(c for out in steps for _, c in out.chunks)
    assert modes == {"bros": {dropping}, "bros_nobicache": {"recompute"}}
    if dropping == "swap":
        assert computed["bros"] == 12 * (8 + 40 - 1)  # each prompt token and each decode once
        assert computed["bros_nobicache"] > computed["bros"]
    else:
        assert computed["bros"] > 12 * (8 + 40 - 1)


def test_a_swapped_out_rt_request_does_not_drop_the_rt_request_that_dropped_it():
    """dropping=swap's re-admission rule: two RT requests whose KV cannot grow side by side. The
    first to need room drops the other; the dropped one then waits for free room instead of
    dropping it back (which would make the two trade places, and their KV, every step)."""
    reqs = [
        Request(
            request_id=i,
            arrival_time=0.0,
            num_prompt_tokens=8,
            true_output_tokens=40,
            max_tokens=40,
            request_class=RequestClass.RT,
        )
        for i in range(2)
    ]
    sched = scheduler("bros", 64, block_size=8)  # 8 blocks: one request's 47 tokens fit, two do not
    Driver(sched).run(reqs)
    assert all(r.status is RequestStatus.FINISHED and r.num_output_tokens == 40 for r in reqs)
    assert sorted(r.num_preemptions for r in reqs) == [0, 1]


def _squeezed(name: str, **options):
    """ShareGPT at 6 req/s, every other request best-effort, in 1,200 tokens of KV (a KV-starved GPU):
    the requests, the scheduler's preemptions per request, once every request finished."""
    from sloserve.core.request import RequestClass
    from sloserve.workload import workload_from_trace

    requests = workload_from_trace("sharegpt", num_requests=30, seed=0, context_len=1024, rate=6.0).requests
    for r in requests[1::2]:
        r.request_class = RequestClass.BE
    simulate(requests, lambda: scheduler(name, 1200, max_model_len=1024, **options), llama7b_cost())
    assert all(r.is_finished for r in requests)
    return sum(r.num_preemptions for r in requests) / len(requests)


@pytest.mark.parametrize("name", ["bros", "bros_nobicache"])
def test_the_anti_thrash_rule_stops_dropped_requests_coming_straight_back(name):
    """KV short: RT requests drop BE requests for room, and a dropped request that came back into the
    last free blocks was dropped again the next step, or traded places with another through the
    liveness rule (100+ drops per request). With the rule (``readmit_horizon_steps``): nothing is
    dropped for a request that would not fit anyway, requests needing new KV wait while an RT one is
    short of room, and a dropped BE request comes back only with room for the RT requests' growth."""
    assert _squeezed(name) <= 2
    if name == "bros_nobicache":  # (the rule off: a second per run; bros's swaps take longer)
        assert _squeezed(name, readmit_horizon_steps=0) > 20


def test_a_request_larger_than_the_kv_cache_is_refused_up_front():
    s = scheduler("bros", 1200)
    with pytest.raises(
        ConfigError, match="KV capacity 1200 tokens .* cannot hold request 7: prompt 1000 \\+ output 300"
    ):
        s.check_fits(Request(7, 0.0, 1000, 300, 300), 1299)


def _packed_both_ways(specs, capacity: int, name: str, **options) -> None:
    """Run ``specs`` ((prompt, output, arrival, BE?, TTFT SLO, TPOT SLO) each) with BROS's runs of
    decodes packed at once (from one request on) and request by request: the same run both ways."""
    runs = {}
    for at_once in (True, False):
        requests = rt_be_requests(specs)

        def make(at_once=at_once):
            sched = scheduler(name, capacity, swap_space_tokens=20_000, **options)
            sched.pack_decode_runs, sched.MIN_DECODE_RUN = at_once, 1
            return sched

        result = simulate(requests, make, llama7b_cost(), fast_path=False)  # (every step packed)
        assert all(r.is_finished for r in requests)
        runs[at_once] = (
            timestamps(requests),
            [r.num_preemptions for r in requests],
            result.policy_metrics["num_cost_model_queries"],
            result.swapped_bytes,
            result.timeline.column("num_requests"),
        )
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    assert runs[True][1:4] == runs[False][1:4]
    np.testing.assert_array_equal(runs[True][4], runs[False][4])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # TPOTs near the step times (3-6 ms here), so that (6) binds inside runs of decodes
    specs=rt_be_specs(st.sampled_from([0.02, 0.1]), st.floats(0.003, 0.01)),
    capacity=st.sampled_from([512, 1024, 4096]),
    horizon=st.sampled_from([0, 16]),
    name=st.sampled_from(["bros", "bros_nobicache"]),
)
def test_packing_a_run_of_decodes_at_once_changes_nothing(specs, capacity, horizon, name):
    """BROS's RT phase checks a run of RT decodes on the GPU at once (``_pack_rt_decodes``), up to the
    first that (6), (7) or (8) would stop or (bidirectional blocks) whose slot may go over another
    request's tokens. Request by request instead, with SLOs that make (6) bind, KV that makes (8) evict
    or drop, RT requests growing over BE tokens and the anti-thrash rule on and off: every timestamp,
    eviction, copied byte, cost-model query and batch is the same."""
    _packed_both_ways(specs, capacity, name, readmit_horizon_steps=horizon)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["bros", "bros_nobicache"])
def test_packing_a_run_of_decodes_at_once_when_free_blocks_run_out(name, seed):
    """RT requests only, arriving together into 512 KV tokens: members of a run take the last free
    blocks, and the next finds none (its room is found by dropping or evicting, request by request)."""
    rng = np.random.default_rng(seed)
    specs = [
        (
            int(rng.integers(8, 200)),
            int(rng.integers(20, 150)),
            float(rng.uniform(0, 0.5)),
            False,
            0.1,
            float(rng.uniform(0.003, 0.01)),
        )
        for _ in range(int(rng.integers(10, 30)))
    ]
    _packed_both_ways(specs, 512, name)


def _prefix_request(
    i: int, arrival: float, prompt: int, ids: tuple[int, ...], cls: RequestClass, ttft: float
) -> Request:
    from sloserve.core.prefix import SegmentedPrompt

    blocks = SegmentedPrompt.uniform(ids, 16, prompt)
    return Request(i, arrival, prompt, 40, 40, cls, SLO(ttft, 1.0), prompt_blocks=blocks)


def test_a_victims_blocks_a_member_found_cached_are_not_room_for_another():
    """Prefix caching, paged KV (bros_nobicache), 10 blocks: BE request X runs with a 64-token prompt; RT
    request W, X's prompt, finds three of its blocks cached (in X's use: W is charged one new block); RT
    request R, later deadline, needs 7 blocks. Evicting X frees 5, but W takes 3 of them: R cannot fit,
    so X is not evicted (the anti-thrash rule evicts only where it makes room). Counted free for R, X
    was evicted, W took them and R's allocation failed (a prefix-caching sweep found this)."""
    x = _prefix_request(0, 0.0, 64, (1, 2, 3, 4), RequestClass.BE, 10.0)
    w = _prefix_request(1, 0.05, 64, (1, 2, 3, 4), RequestClass.RT, 5.0)
    r = _prefix_request(2, 0.05, 100, (7, 8, 9, 10, 11, 12, 13), RequestClass.RT, 50.0)
    drv = Driver(scheduler("bros_nobicache", 160, enable_prefix_caching=True))
    drv.run([x, w, r])
    assert all(q.num_output_tokens == 40 for q in (x, w, r))
    assert x.num_preemptions == 0 and w.num_cached_tokens == 48


def test_an_eviction_while_packing_recharges_members_that_found_the_victims_blocks():
    """As above, but R needs 2 blocks (it fits), Q 4 (evicting X makes room for it beside W's 3), then Z 3:
    once X is evicted W is charged the 3 cached blocks it takes, and Z does not fit. With W's charge of
    before, Z fitted and its allocation failed."""
    x = _prefix_request(0, 0.0, 64, (1, 2, 3, 4), RequestClass.BE, 10.0)
    w = _prefix_request(1, 0.05, 64, (1, 2, 3, 4), RequestClass.RT, 5.0)
    r = _prefix_request(2, 0.05, 30, (7, 8), RequestClass.RT, 50.0)
    q = _prefix_request(3, 0.05, 60, (9, 10, 11, 12), RequestClass.RT, 60.0)
    z = _prefix_request(4, 0.05, 40, (13, 14, 15), RequestClass.RT, 70.0)
    drv = Driver(scheduler("bros_nobicache", 160, enable_prefix_caching=True))
    drv.run([x, w, r, q, z])
    assert all(req.num_output_tokens == 40 for req in (x, w, r, q, z))
    assert x.num_preemptions >= 1 and w.num_cached_tokens == 48


@pytest.mark.parametrize("seed", [1085, 1086, 1092, 3026])
def test_bros_nobicache_with_prefix_caching_allocates_what_it_packed(seed):
    """Workloads where a member's allocation failed after packing (an assertion): 1085, 1086 and 1092 by
    an eviction that left blocks a member found in nobody's use (``_recharge_waiting_members``), 3026 by
    an earlier member's new blocks evicting a block a later one found, and the found blocks after it
    (``_take_batch``). Every request completes, the KV invariants hold every step (the Driver checks)."""
    capacity, requests = shared_prefix_workload(seed)
    Driver(scheduler("bros_nobicache", capacity, max_model_len=1024, enable_prefix_caching=True)).run(requests)
    assert all(r.num_output_tokens == r.true_output_tokens for r in requests)


@pytest.mark.parametrize("seed", [578, 1379])
def test_a_request_alone_that_cannot_grow_in_its_scattered_blocks_is_packed_again(seed):
    """Bidirectional blocks, two replicas: a replica's last request (BE, its prompt and output filling
    the cache to the slot) holds its tokens over blocks with empty slots it cannot take (a side grows in
    its last block only), and there is nobody left to drop. It is dropped itself and restored packed
    into the free blocks; before, the liveness rule looked for another request to drop and failed."""
    capacity, requests = shared_prefix_workload(seed)
    make = functools.partial(scheduler, "bros", capacity, max_model_len=1024, swap_space_tokens=20_000)
    simulate(requests, make, llama7b_cost(), fast_path=False, num_replicas=2, router="least-outstanding")
    assert all(r.num_output_tokens == r.true_output_tokens for r in requests)

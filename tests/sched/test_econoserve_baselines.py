"""EconoServe's baselines (papers/econoserve.md §2.1): SRTF, FastServe (skip-join MLFQ), MultiRes."""

from __future__ import annotations

import math
import random

import pytest

from helpers import Driver, make_requests, scheduler
from sloserve.core.errors import ConfigError
from sloserve.core.request import Request, RequestStatus
from sloserve.sched.fastserve import FastServeScheduler


def random_workload(seed: int, num_requests: int = 120) -> list[Request]:
    """Poisson arrivals, prompts up to 400 tokens, outputs up to 150, max_tokens up to 50 more."""
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(num_requests):
        t += rng.expovariate(30.0)
        out = rng.randint(1, 150)
        reqs.append(
            Request(
                request_id=i,
                arrival_time=t,
                num_prompt_tokens=rng.randint(1, 400),
                true_output_tokens=out,
                max_tokens=out + rng.randint(0, 50),
            )
        )
    return reqs


@pytest.mark.parametrize(
    "name,options",
    [
        ("srtf", {}),
        ("srtf", {"predictor": "histogram"}),
        ("fastserve", {}),
        ("fastserve", {"starvation_limit_s": 0.05}),
        ("multires", {}),
        ("multires", {"predictor": "histogram"}),  # under-predictions: evictions by recompute
    ],
)
def test_random_workload_finishes_with_every_token_and_kv_intact(name, options):
    reqs = random_workload(seed=7)
    sched = scheduler(name, 4000, max_model_len=1024, **options)
    for r in reqs:
        sched.check_fits(r, r.num_prompt_tokens + r.true_output_tokens - 1)
    drv = Driver(sched)  # checks scheduler.check_integrity() after every step
    drv.run(reqs)
    assert all(r.status is RequestStatus.FINISHED and r.num_output_tokens == r.true_output_tokens for r in reqs)
    assert sched.kv.num_free_blocks == sched.kv.gpu.num_blocks and sched.kv.allocated_tokens == 0
    processed = sum(c for step in drv.log for _, c in step.chunks)
    expected = sum(r.num_prompt_tokens + r.true_output_tokens - 1 for r in reqs)
    if name == "multires" and options:
        assert sched.num_preemptions > 0 and processed > expected
    else:  # nothing is evicted: every token is processed exactly once
        assert sched.num_preemptions == 0 and processed == expected
    if name != "multires":
        assert max(len(step.chunks) for step in drv.log) == 8  # ORCA's and FastServe's batch size


def test_srtf_runs_a_later_short_job_ahead_of_a_long_running_one():
    long, short, medium = make_requests([(50, 200), (50, 5), (50, 100)])
    sched = scheduler("srtf", 4096, max_num_seqs=1, block_size=1)
    drv = Driver(sched)
    sched.add_request(long)
    while long.num_output_tokens < 150:
        drv.step()
    # 100 tokens to go is more than the 50 the running job has left: it keeps running.
    sched.add_request(medium)
    assert drv.step().chunks[0].request is long
    # The short job arrives: it runs next, the long one pauses in place holding its max allocation.
    slots = sched.kv.num_slots(long)
    sched.add_request(short)
    for _ in range(5):
        assert [r for r, _ in drv.step().chunks] == [short]
        assert sched.kv.num_slots(long) == slots == 50 + 200 and long.status is RequestStatus.RUNNING
    assert short.is_finished and not long.is_finished
    while sched.has_unfinished():
        drv.step()
    assert short.finish_time < long.finish_time < medium.finish_time
    assert long.num_preemptions == 0 and all(not step.preempted for step in drv.log)


def test_fastserve_skip_join_and_quanta():
    sched = scheduler("fastserve", 8192)
    assert isinstance(sched, FastServeScheduler) and len(sched.quanta) == 5
    assert all(math.isclose(b, 2 * a) for a, b in zip(sched.quanta, sched.quanta[1:]))
    short_prompt, long_prompt = make_requests([(10, 20), (1000, 20)])
    sched.add_request(short_prompt)
    sched.add_request(long_prompt)
    # A long prompt's first iteration outlasts every quantum above the last: it skips to the bottom.
    assert sched.level[long_prompt] == 4
    level = sched.level[short_prompt]
    first = sched.first_iteration_s(short_prompt)
    assert 0 < level < 4 and sched.quanta[level - 1] < first <= sched.quanta[level]


def test_fastserve_demotes_a_long_job_and_lets_a_new_one_run_first():
    long, newcomer = make_requests([(10, 300), (10, 5)])
    sched = scheduler("fastserve", 8192, max_num_seqs=1)
    drv = Driver(sched)
    sched.add_request(long)
    entry = sched.level[long]
    levels = [entry]
    while sched.level[long] < 4:
        drv.step()
        levels.append(sched.level[long])
    assert levels == sorted(levels) and set(levels) == set(range(entry, 5))  # one level at a time
    for _ in range(3):  # the last level keeps it
        drv.step()
    assert sched.level[long] == 4
    slots = sched.kv.num_slots(long)
    sched.add_request(newcomer)  # skip-joins a higher level than the demoted job
    assert sched.level[newcomer] == entry < 4
    assert [r for r, _ in drv.step().chunks] == [newcomer]
    assert sched.kv.num_slots(long) == slots  # paused in place
    while sched.has_unfinished():
        drv.step()
    assert newcomer.finish_time < long.finish_time
    assert long.num_output_tokens == 300 and long.num_preemptions == 0


def test_fastserve_starvation_limit_promotes_a_waiting_job():
    def first_steps(**options):
        a, b = make_requests([(10, 300), (1000, 10)])
        sched = scheduler("fastserve", 8192, max_num_seqs=1, **options)
        sched.add_request(a)
        sched.add_request(b)
        drv = Driver(sched)
        while drv.now < 0.01:
            drv.step()
        assert not b.num_computed_tokens  # b (bottom level) waited behind a so far
        drv.step()
        return sched, b, drv.log[-1].chunks

    _, b, chunks = first_steps()
    assert chunks[0][0] != b.request_id  # no limit: a still runs
    sched, b, chunks = first_steps(starvation_limit_s=0.01)
    assert chunks == [(b.request_id, 1000)]  # promoted to the top level and run
    assert sched.level[b] == 1  # its prompt outran the top quantum: demoted one level


def test_multires_picks_the_request_nearest_to_the_free_resources():
    # TFS 2048 tokens, KV 4096 slots. Demands (tokens, KV) of A, B, C, D: (100, 199), (1000, 1899),
    # (1800, 3799), (50, 59). Nearest to the free (2048, 4096) is C; after it (248, 297) is left, where A
    # (distance 0.076) beats D (0.113) and B does not fit; then D still fits. FCFS would take A and B.
    reqs = make_requests([(100, 100), (1000, 900), (1800, 2000), (50, 10)])
    sched = scheduler("multires", 4096, max_model_len=2048, block_size=1)
    assert sched.config.target_forward_size == 2048
    drv = Driver(sched)
    for r in reqs:
        sched.add_request(r)
    first = drv.step()
    assert [(r.request_id, c) for r, c in first.chunks] == [(2, 1800), (0, 100), (3, 50)]
    assert sched.kv.num_slots(reqs[2]) == 1800 + 2000 - 1  # exact allocation: I + O - 1
    assert [r.request_id for r in sched.waiting] == [1]
    second = drv.step()
    assert sorted(r.request_id for r, _ in second.chunks) == [0, 2, 3]  # running requests decode on
    drv.run([])
    assert all(r.num_output_tokens == r.true_output_tokens for r in reqs) and sched.num_preemptions == 0


@pytest.mark.parametrize(
    "name,options,message",
    [
        ("srtf", {"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ("srtf", {"kv_manager": "paged"}, "expected one of max"),
        ("srtf", {"max_num_batched_tokens": 512}, "below the model length 4096"),
        ("srtf", {"predictor": "none"}, "expected one of oracle, histogram"),
        ("fastserve", {"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ("fastserve", {"num_levels": 0}, "num_levels must be >= 1, got 0"),
        ("fastserve", {"quantum_ratio": 0.5}, "quantum_ratio must be >= 1"),
        ("fastserve", {"base_quantum_s": 0}, "base_quantum_s must be > 0"),
        ("fastserve", {"starvation_limit_s": -1}, "starvation_limit_s must be > 0"),
        ("multires", {"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ("multires", {"target_forward_size": 1024}, "target_forward_size=1024 is below the model length"),
        ("multires", {"max_num_seqs": 5000}, "exceeds target_forward_size"),
        ("multires", {"kv_manager": "max"}, "expected one of exact"),
        ("multires", {"block_size": 0}, "block_size must be >= 1"),
    ],
)
def test_bad_configuration(name, options, message):
    with pytest.raises(ConfigError, match=message):
        scheduler(name, 10_000, **options)


def test_fastserve_needs_a_cost_model_and_max_allocation_must_fit():
    from sloserve.sched import make_scheduler

    with pytest.raises(ConfigError, match="needs a cost model"):
        make_scheduler("fastserve", kv_capacity_tokens=10_000, max_model_len=4096)
    (r,) = make_requests([(20, 10)])
    r.max_tokens = 4000
    for name in ("srtf", "fastserve"):
        with pytest.raises(ConfigError, match="cannot hold request 0: prompt 20 \\+ max_tokens 4000"):
            scheduler(name, 2048).check_fits(r, 29)
    big = make_requests([(1000, 1500)])[0]
    with pytest.raises(ConfigError, match="prompt 1000 \\+ output 1500 - 1 = 2499"):
        scheduler("multires", 2048).check_fits(big, 2499)

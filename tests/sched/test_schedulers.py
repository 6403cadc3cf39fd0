"""vLLM, Sarathi-Serve and ORCA on hand-made workloads: the behaviour each one is defined by."""

from __future__ import annotations

import pytest

from helpers import Driver, llama7b_cost, make_requests, scheduler
from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.core.request import RequestStatus
from sloserve.sched import UnifiedScheduler, scheduler_names
from sloserve.sim import simulate


def test_infermax_figure1_eviction_and_refill():
    """InferMax Figure 1: with a KV cache of 8, R3 is evicted in B2 (4 + 2 + 3 > 8) and refilled in B3."""
    r1, r2, r3 = reqs = make_requests([(3, 2), (1, 2), (2, 2)])
    drv = Driver(scheduler("vllm", capacity=8, max_model_len=8, block_size=1, watermark=0))
    drv.run(reqs)
    b1, b2, b3 = drv.log
    assert b1.chunks == [(0, 3), (1, 1), (2, 2)] and b1.decodes == []
    assert b2.preempted == [(2, "recompute")]
    assert b2.decodes == [0, 1] and b2.chunks == []
    # B3 refills R3: its prompt (2) plus its generated token (1) are processed again.
    assert b3.chunks == [(2, 3)] and b3.decodes == []
    assert len(drv.log) == 3
    for r in reqs:
        assert r.status is RequestStatus.FINISHED and r.num_output_tokens == r.true_output_tokens
    assert r3.num_preemptions == 1 and r1.num_preemptions == r2.num_preemptions == 0
    # R3's second token comes after the refill, so its token gap spans B2 and B3.
    assert r3.finish_time > r1.finish_time == r2.finish_time


class CountingVLLM(UnifiedScheduler):
    """Records KV lost to recompute evictions (tokens that will be processed twice)."""

    recomputed = 0

    def _preempt(self, request, mode, output, **kwargs):
        if mode.value == "recompute" and self.kv.swap_in_blocks_needed(request) == 0:
            self.recomputed += request.num_computed_tokens
        super()._preempt(request, mode, output, **kwargs)


def _counting(name: str, capacity: int, **options) -> CountingVLLM:
    base = scheduler(name, capacity, **options)
    counting = CountingVLLM(base.kv, base.config)
    counting.name = base.name
    return counting


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", ["vllm", "sarathi"])
def test_preemption_when_memory_runs_out(name, mode):
    """Eight requests that cannot all grow in 1024 slots: the latest admitted are preempted and still
    finish with exactly their tokens; no token is processed twice except by recompute."""
    lengths = [(100, 120)] * 8
    reqs = make_requests(lengths)
    sched = _counting(name, 1024, preemption_mode=mode, swap_space_tokens=4096)
    drv = Driver(sched)
    drv.run(reqs)
    preempted = [p for step in drv.log for p in step.preempted]
    assert preempted and {m for _, m in preempted} == {mode}
    # The victim is always the most recently admitted running request.
    assert preempted[0][0] == max(rid for step in drv.log[:1] for rid, _ in step.chunks) or name == "sarathi"
    for r in reqs:
        assert r.status is RequestStatus.FINISHED
        assert r.num_output_tokens == r.true_output_tokens
    processed = sum(c for step in drv.log for _, c in step.chunks) + sum(len(s.decodes) for s in drv.log)
    expected = sum(p + o - 1 for p, o in lengths)
    if mode == "swap":
        assert processed == expected and sched.recomputed == 0
        assert sum(s.swap_out for s in drv.log) > 0 and sum(s.swap_in for s in drv.log) > 0
    else:
        assert sched.recomputed > 0 and processed == expected + sched.recomputed


def test_swap_needs_swap_space_and_counts_its_fallbacks_to_recompute():
    with pytest.raises(ConfigError, match="preemption_mode=swap needs CPU swap space"):
        scheduler("vllm", 1024, preemption_mode="swap", swap_space_tokens=0)
    reqs = make_requests([(100, 120)] * 8)
    sched = scheduler("vllm", 1024, preemption_mode="swap", swap_space_tokens=256)  # room for one request
    drv = Driver(sched)
    drv.run(reqs)
    modes = [m for step in drv.log for _, m in step.preempted]
    assert "swap" in modes and "recompute" in modes
    assert sched.policy_metrics() == {"num_swap_fallbacks": modes.count("recompute")}
    assert all(r.num_output_tokens == r.true_output_tokens for r in reqs)


def test_vllm_runs_prefills_first_and_never_mixes_phases():
    reqs = make_requests([(50, 20)] * 4, arrivals=[0.0, 0.0, 0.05, 0.3])
    drv = Driver(scheduler("vllm", 100_000))
    drv.run(reqs)
    for step in drv.log:
        assert not (step.chunks and step.decodes), "vLLM v0 batches are prefill-only or decode-only"
    # The request arriving mid-run is prefilled in the first step after its arrival, before decodes.
    first_steps = [i for i, s in enumerate(drv.log) if any(rid == 2 for rid, _ in s.chunks)]
    assert len(first_steps) == 1


@pytest.mark.parametrize("budget", [64, 256])
def test_sarathi_chunks_respect_p_and_c(budget):
    reqs = make_requests([(700, 30), (300, 40), (1500, 10), (90, 60)] * 3, arrivals=[i * 0.01 for i in range(12)])
    drv = Driver(scheduler("sarathi", 100_000, prefill_token_budget=budget, max_num_batched_tokens=4096))
    drv.run(reqs)
    chunked = 0
    for step in drv.log:
        prefill = sum(c for _, c in step.chunks)
        batch = prefill + len(step.decodes)
        if step.chunks:
            assert batch <= budget, "Sarathi never exceeds P tokens once a prefill joins"
        assert batch <= 4096
        chunked += any(c < 90 for _, c in step.chunks)
    assert chunked, "long prompts were split into chunks"
    # Decode-first: every running decode is in every step (hybrid batches).
    assert any(s.chunks and s.decodes for s in drv.log)
    assert all(r.num_output_tokens == r.true_output_tokens for r in reqs)


def test_orca_max_allocation_and_fixed_batch():
    reqs = make_requests([(20, 10)] * 20)
    for r in reqs:
        r.max_tokens = 100
    sched = scheduler("orca", 100 * 120 * 4, max_model_len=2048)
    drv = Driver(sched)
    drv.run(reqs)
    assert max(len(s.decodes) + len(s.chunks) for s in drv.log) == 8
    assert all(not s.preempted for s in drv.log)
    # Each admitted request reserved prompt + max_tokens slots.
    assert all(r.num_output_tokens == 10 for r in reqs)


def test_orca_capacity_below_longest_request_is_an_error():
    reqs = make_requests([(20, 10)])
    reqs[0].max_tokens = 4000
    sched = scheduler("orca", 2048, max_model_len=4096)
    with pytest.raises(ConfigError, match="cannot hold request 0: prompt 20 \\+ max_tokens 4000"):
        sched.check_fits(reqs[0], 29)


@pytest.mark.parametrize("name", scheduler_names())
def test_every_policy_refuses_a_request_it_could_never_hold(name):
    """A run refuses up front a request whose KV would not fit even alone (instead of stalling on it)."""
    requests = make_requests([(700, 200), (10, 10)])
    what = r"(output 200 - 1 = 899|max_tokens 200 \(max allocation\) = 900) tokens"
    with pytest.raises(ConfigError, match=r"cannot hold request 0: prompt 700 \+ " + what):
        simulate(requests, lambda: scheduler(name, 800, max_model_len=1024), llama7b_cost())


def test_unknown_scheduler_and_option_errors():
    with pytest.raises(
        UnknownNameError,
        match="valid: bros, bros_nobicache, .*fastserve, infermax, multires, orca, rank_i, rank_o, rank_org, rr, sarathi, .*srtf, .*vllm_hy_ef",
    ):
        scheduler("fcfs", 1000)
    with pytest.raises(ConfigError, match="no option 'bogus'; valid: .*block_size"):
        scheduler("vllm", 1000, bogus="1")
    with pytest.raises(ConfigError, match="block_size='x': expected an integer"):
        scheduler("vllm", 1000, block_size="x")
    with pytest.raises(ConfigError, match="exceeds max_num_batched_tokens"):
        scheduler("sarathi", 1000, prefill_token_budget="8192", max_num_batched_tokens="4096")
    with pytest.raises(ConfigError, match="below one block of 16 tokens"):
        scheduler("vllm", 8)
    with pytest.raises(ConfigError, match="chunked prefill needs hybrid"):
        scheduler("vllm", 1000, chunked_prefill="true")


@pytest.mark.parametrize("name", scheduler_names())
def test_every_policy_refuses_a_block_of_no_tokens(name):
    """(BROS's and RR's configs did not check it: a ZeroDivisionError once)"""
    with pytest.raises(ConfigError, match="block_size.* must be >= 1"):
        scheduler(name, 1000, block_size="0")


def test_a_presets_prefill_budget_is_capped_by_a_smaller_token_budget_the_caller_set():
    """Sarathi's P = 512 under C = 256 chunks at 256, as vLLM's chunks are at max_num_batched_tokens (once "P=512
    exceeds C=256", a budget the caller never set: `sloserve bound --max-num-batched-tokens 256` failed so)."""
    assert scheduler("sarathi", 4096, max_num_batched_tokens="256").config.prefill_token_budget == 256
    assert scheduler("sarathi", 4096, max_num_batched_tokens="1024").config.prefill_token_budget == 512
    assert scheduler("sarathi_pc", 4096, max_num_batched_tokens="256").config.prefill_token_budget == 256


def test_a_policy_gets_only_the_kv_managers_its_spec_names():
    # RR shares BROS's config, whose kv_manager may be bidirectional; RR's spec does not name it.
    with pytest.raises(
        ConfigError, match="rr: kv_manager bidirectional does not work with it; valid: paged, max, exact"
    ):
        scheduler("rr", 4096, kv_manager="bidirectional")
    with pytest.raises(ConfigError, match="kv_manager='pipelined': expected one of paged, max, exact"):
        scheduler("sarathi", 4096, kv_manager="pipelined")
    assert scheduler("bros", 4096, kv_manager="bidirectional").kv.__class__.__name__ == "BidirectionalKVManager"
    assert scheduler("econoserve", 4096, kv_manager="pipelined").kv.__class__.__name__ == "PipelinedKVManager"


@pytest.mark.parametrize("where", ["front", "back"])
def test_a_recomputed_request_waits_at_the_front_or_the_back(where):
    """vLLM v0 puts a recomputed request back at the front of the queue; InferMax's Algorithm 1
    appends it to R_w (``evicted_to=back``)."""
    from sloserve.core.request import RequestStatus

    reqs = make_requests([(16, 40)] * 12)
    sched = scheduler("vllm", 256, block_size=16, evicted_to=where)
    drv = Driver(sched)
    seen = 0
    original = drv.step

    def step():
        nonlocal seen
        out = original()
        evicted = [p.request for p in out.preempted if p.request.status is RequestStatus.WAITING]
        if evicted:
            seen += 1
            waiting = list(sched.waiting)
            k = len(evicted)
            assert set(waiting[:k] if where == "front" else waiting[-k:]) == set(evicted)
        return out

    drv.step = step
    drv.run(reqs)
    assert seen > 0 and all(r.status is RequestStatus.FINISHED for r in reqs)

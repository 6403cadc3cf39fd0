"""vLLM's priority scheduling (``--set waiting_order=priority`` on the unified presets): waiting
requests admitted by (priority, arrival), the running request with the largest of those evicted
first; a workload stream's ``priority`` reaches its requests."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import Driver, llama7b_cost, scheduler
from sloserve.core.errors import ConfigError
from sloserve.core.request import Request
from sloserve.sim import simulate
from sloserve.workload import build_workload, parse_workload_spec


def request(request_id: int, priority: int, arrival: float = 0.0, prompt: int = 200, output: int = 40) -> Request:
    return Request(request_id=request_id, arrival_time=arrival, num_prompt_tokens=prompt, true_output_tokens=output,
                   max_tokens=400, priority=priority)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=2, max_size=12))
def test_requests_are_admitted_by_priority_then_arrival(priorities):
    """One request at a time (max_num_seqs 1): the admission order is the (priority, arrival) order,
    whatever order they arrived in; FCFS ignores the priorities."""
    requests = [request(i, p, arrival=0.001 * i) for i, p in enumerate(priorities)]
    drv = Driver(scheduler("vllm", 20_000, max_num_seqs=1, waiting_order="priority"))
    # NOTE: the first request is admitted on its own, before the others arrive
    drv.run(requests)
    admitted = [rid for step in drv.log for rid, _ in step.chunks]
    rest = sorted(requests[1:], key=lambda r: (r.priority, r.arrival_time))
    assert admitted == [0, *(r.request_id for r in rest)]
    fcfs = Driver(scheduler("vllm", 20_000, max_num_seqs=1))
    fcfs.run([request(i, p, arrival=0.001 * i) for i, p in enumerate(priorities)])
    assert [rid for step in fcfs.log for rid, _ in step.chunks] == list(range(len(priorities)))


def test_the_lowest_priority_running_request_is_evicted_first():
    """KV for three prompts but two requests' growth: the running request with the largest priority
    is evicted (the first admitted here), where FCFS evicts the latest admitted; all complete."""
    evicted = {}
    for order in ("priority", "fcfs"):
        requests = [request(0, 5, arrival=0.0, prompt=512, output=400), request(1, 0, arrival=0.01, prompt=512,
                    output=400), request(2, 1, arrival=0.02, prompt=512, output=400)]  # fmt: skip
        drv = Driver(scheduler("vllm", 2_000, waiting_order=order))
        drv.run(requests)
        evicted[order] = [rid for step in drv.log for rid, _ in step.preempted]
        assert all(r.num_output_tokens == r.true_output_tokens for r in requests)
    assert evicted == {"priority": [0], "fcfs": [2]}


def test_a_streams_priority_reaches_its_requests_and_shortens_their_wait():
    """Two streams of the same requests under overload: the one with the lower priority value waits
    less under waiting_order=priority; under FCFS the two wait alike."""
    stream = {"source": {"fixed": {"prompt": 300, "output": 60}}, "arrival": {"process": "poisson", "rate": 40},
              "num_requests": 150}  # fmt: skip
    spec = parse_workload_spec({"name": "two", "streams": [{**stream, "name": "low", "priority": 3},
                                                          {**stream, "name": "high", "priority": -1}]}, origin="two.yaml")  # fmt: skip
    assert [s.priority for s in spec.streams] == [3, -1]
    waits = {}
    for order in ("priority", "fcfs"):
        built = build_workload(spec, seed=0, context_len=4096)
        result = simulate(built.requests, lambda o=order: scheduler("vllm", 6_000, max_num_seqs=16, waiting_order=o),
                          llama7b_cost())  # fmt: skip
        assert all(r.is_finished for r in result.requests) and {r.priority for r in result.requests} == {3, -1}
        waits[order] = {p: sum(r.first_scheduled_time - r.arrival_time for r in result.requests if r.priority == p)
                        for p in (3, -1)}  # fmt: skip
    assert waits["priority"][-1] < 0.5 * waits["priority"][3]
    assert waits["fcfs"][-1] == pytest.approx(waits["fcfs"][3], rel=0.5)


def test_simulate_reports_each_priority_level_of_a_workload(tmp_path):
    """``sloserve simulate --workload`` with streams of two priorities: ``summary.json`` gains
    ``priorities``, each level's metrics, and its requests.csv their priority."""
    spec = tmp_path / "two.yaml"
    stream = (
        "source: {fixed: {prompt: 300, output: 60}}\n    arrival: {process: poisson, rate: 40}\n    num_requests: 100"
    )
    spec.write_text(f"name: two\nstreams:\n  - name: low\n    priority: 3\n    {stream}\n"
                    f"  - name: high\n    priority: -1\n    {stream}\n")  # fmt: skip
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "sloserve.cli", "simulate", "--workload", str(spec), "--scheduler", "vllm",
         "--set", "waiting_order=priority", "--set", "max_num_seqs=16", "--kv-capacity-tokens", "6000", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    levels = json.loads((out / "summary.json").read_text())["priorities"]
    assert sorted(levels) == ["-1", "3"] and levels["-1"]["num_requests"] == levels["3"]["num_requests"] == 100
    assert levels["-1"]["ttft_s"]["mean"] < 0.5 * levels["3"]["ttft_s"]["mean"]
    with open(out / "requests.csv") as f:
        assert sorted({row["priority"] for row in csv.DictReader(f)}) == ["-1", "3"]


def test_an_unknown_waiting_order_or_one_a_scheduler_would_ignore_is_refused():
    with pytest.raises(ConfigError, match="waiting_order='lifo': expected one of fcfs, lpm, priority"):
        scheduler("vllm", 10_000, waiting_order="lifo")
    with pytest.raises(ConfigError, match="waiting_order=priority does not apply to the rank schedulers"):
        scheduler("rank_i", 10_000, waiting_order="priority")

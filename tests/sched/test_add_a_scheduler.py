"""The "Add a scheduler" guide in docs/schedulers.md is true: its policy, run from the page as it
stands, is under 80 lines, registers, simulates to completion and does what it says."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from helpers import Driver, llama7b_cost, make_requests
from sloserve.core.errors import ConfigError
from sloserve.sched import make_scheduler
from sloserve.sched.registry import SCHEDULERS
from sloserve.sim import simulate
from sloserve.workload import workload_from_trace

GUIDE = Path(__file__).parents[2] / "docs" / "schedulers.md"


def _guide_code() -> str:
    section = GUIDE.read_text().split("## Add a scheduler", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the guide has one policy"
    return blocks[0]


@pytest.fixture
def spf():
    """The guide's policy, registered as ``spf`` for the test and unregistered after it."""
    module = types.ModuleType("guide_policy")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        exec(compile(_guide_code(), str(GUIDE), "exec"), module.__dict__)
        yield module
    finally:
        SCHEDULERS.pop("spf", None)
        del sys.modules[module.__name__]


def test_the_guides_policy_is_under_80_lines():
    lines = [line for line in _guide_code().splitlines() if line.strip()]
    assert len(lines) < 80, len(lines)


def test_the_guides_policy_registers_and_simulates(spf):
    workload = workload_from_trace("sharegpt", num_requests=300, seed=2, context_len=4096, offline=True)
    result = simulate(
        workload.requests,
        lambda: make_scheduler("spf", kv_capacity_tokens=30_000, max_model_len=4096),
        llama7b_cost(),
    )
    requests = workload.requests
    assert all(r.is_finished and r.num_output_tokens == r.true_output_tokens for r in requests)
    assert result.num_preemptions > 0, "the KV cache is meant to run short"
    # Everyone waits from time 0: a shorter prompt never starts after a longer one.
    by_length = sorted(requests, key=lambda r: (r.num_prompt_tokens, r.first_scheduled_time))
    starts = [r.first_scheduled_time for r in by_length]
    assert np.all(np.diff(starts) >= 0) and starts[-1] > starts[0]


def test_the_guides_policy_keeps_the_invariants_step_by_step(spf):
    requests = make_requests([(300, 40), (20, 90), (100, 10), (20, 5)], arrivals=[0.0, 0.0, 0.01, 0.02])
    driver = Driver(make_scheduler("spf", kv_capacity_tokens=512, max_model_len=512))
    driver.run(requests)  # checks the scheduler's integrity after every step
    assert [s.chunks for s in driver.log[:1]] == [[(1, 20), (0, 300)]]  # shortest first
    assert all(r.is_finished for r in requests)


def test_the_guides_option_is_a_set_option(spf):
    scheduler = make_scheduler(
        "spf", kv_capacity_tokens=8192, max_model_len=1024, options={"max_num_batched_tokens": "2048"}
    )
    assert scheduler.config.max_num_batched_tokens == 2048
    with pytest.raises(ConfigError, match="cannot hold a prompt"):
        make_scheduler("spf", kv_capacity_tokens=8192, max_model_len=4096, options={"max_num_batched_tokens": "512"})

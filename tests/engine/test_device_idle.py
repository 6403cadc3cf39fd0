"""The device's waits for the host between steps (``engine/device_idle.py``): a GPU left without work while
the host sleeps is counted; one still busy with the step before is not; nor the time an engine without
requests waits for them. On the CPU nothing is counted (the host is the device)."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.engine.device_idle import DeviceIdleTime  # noqa: E402

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events: needs a GPU")
HOST_WORK_S = 0.05
BETWEEN_RUNS_S = 0.5  # (longer than a tiny model's 16 steps' waits for the host, each a few ms)


@CUDA
def test_a_wait_counts_only_while_the_device_has_nothing_queued_and_the_engine_has_work():
    idle = DeviceIdleTime(torch.device("cuda"))
    idle.step_ended()  # (nothing queued: the device is idle from here)
    time.sleep(HOST_WORK_S)  # the host's work between two steps
    idle.forward_launched()
    torch.cuda.synchronize()
    waited = idle.seconds
    assert waited >= 0.9 * HOST_WORK_S
    torch.cuda._sleep(200_000_000)  # a step the device is still running (spins that many clock cycles)
    idle.step_ended()
    time.sleep(HOST_WORK_S)
    idle.forward_launched()  # launched while the device is still busy: no wait
    idle.step_ended()
    idle.engine_idle()  # no requests: the clients' time follows
    time.sleep(HOST_WORK_S)
    idle.forward_launched()
    torch.cuda.synchronize()
    assert idle.seconds - waited < HOST_WORK_S / 2


@CUDA
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_engine_counts_its_waits_between_steps_and_none_after_its_last(async_scheduling):
    llm = LLM(
        "random:tiny-llama",
        "vllm",
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        kv_capacity_tokens=4096,
        async_scheduling=async_scheduling,
    )
    idle = llm.engine.executor.device_idle
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}] * 4, params)
    torch.cuda.synchronize()
    first = idle.seconds
    assert 0 < first and idle._last_end is None  # (a tiny model's device waits for the host every step)
    time.sleep(BETWEEN_RUNS_S)  # between runs: the clients' time
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 4, params)
    torch.cuda.synchronize()
    assert idle.seconds - first < BETWEEN_RUNS_S


def test_on_the_cpu_nothing_is_counted():
    llm = LLM("random:tiny-llama", "vllm", kv_capacity_tokens=1024, async_scheduling=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8))
    assert not llm.engine.executor.device_idle.enabled and llm.engine.executor.device_idle.seconds == 0.0

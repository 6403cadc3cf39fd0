"""The served engine's step log (``sloserve serve --step-log``, ``engine/step_log.py``): every step the engine
process ran, once, in order, as a profile CSV that the cost model's reader takes, with the loop's parts."""

from __future__ import annotations

import asyncio
import csv

import pytest

torch = pytest.importorskip("torch")

from sloserve.cost.fit import read_profile_csv  # noqa: E402
from sloserve.engine.async_engine import AsyncLLMEngine  # noqa: E402
from sloserve.engine.engine_core import EngineSpec  # noqa: E402
from sloserve.engine.executor import EngineExecutor  # noqa: E402
from sloserve.engine.sampler import SamplingParams  # noqa: E402
from sloserve.engine.step_log import STEP_LOG_HEADER  # noqa: E402

PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(10 + 9 * i)] for i in range(8)]
MAX_TOKENS = [12, 20, 8, 16, 24, 10, 14, 18]


def test_the_step_log_has_every_token_the_served_engine_computed_once_and_each_step_s_parts(tmp_path):
    path = tmp_path / "steps.csv"
    spec = EngineSpec("random:tiny-llama", kv_capacity_tokens=2048, enable_prefix_caching=False, step_log=str(path))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]

    async def serve() -> None:
        online = AsyncLLMEngine(spec)
        online.start()
        try:
            for prompt, p in zip(PROMPTS, params, strict=True):
                async for _ in online.submit(prompt, p):
                    pass
                await asyncio.sleep(0.01)  # (idle between requests: the log is flushed there)
        finally:
            await asyncio.to_thread(online.drain, 5.0)

    asyncio.run(serve())
    shapes, times = read_profile_csv(path)
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == STEP_LOG_HEADER and len(rows) == len(shapes)
    # Each prompt's tokens, then one a generated token but its last (no prefix cache, no preemption)
    assert sum(s.num_tokens for s in shapes) == sum(len(p) + n - 1 for p, n in zip(PROMPTS, MAX_TOKENS, strict=True))
    assert sum(s.num_prefill for s in shapes) == len(PROMPTS)
    ends = 0.0
    for row, time_s in zip(rows, times, strict=True):
        start, engine_step, publish, between = (float(row[c]) for c in STEP_LOG_HEADER[-4:])
        assert time_s <= engine_step  # NOTE: on the CPU the executor's step is inside the engine's
        assert publish >= 0 and between >= 0
        assert start >= ends - 1e-9  # one step after another, the step before's publishing done
        ends = start + engine_step + publish


class _Event:  # (a CUDA event's place in the tuple; ``take_step_log`` does not read it)
    pass


def test_taking_the_final_entries_leaves_a_step_in_flight_where_its_time_will_come_back():
    executor = EngineExecutor.__new__(EngineExecutor)
    started, sampled_at = _Event(), _Event()
    executor.step_log = [("a", 1.0), ("b", 2.0), ("c", 0.1)]
    executor._timed = (2, started, sampled_at)  # "c" launched early on a GPU: its device time comes later
    assert executor.take_step_log() == [("a", 1.0), ("b", 2.0)]
    assert executor.step_log == [("c", 0.1)] and executor._timed == (0, started, sampled_at)
    assert executor.take_step_log() == []
    executor._timed = None  # (its tokens came back: ``resolve`` wrote its time at the index kept)
    executor.step_log[0] = ("c", 3.0)
    assert executor.take_step_log() == [("c", 3.0)] and executor.step_log == []

"""Our vLLM preset against an independent, step-by-step loop of InferMax's Algorithm 1 for vLLM, as
the paper's authors run it in their public simulator (a Vidur fork; read, not copied): offline
requests, token-granular KV, no watermark, prefill-only batches while the waiting queue admits,
the latest running request evicted and put at the queue's front, recomputed whole; the eviction-free
variant reserves I + O - 1 at admission. Same evictions, same steps, same latency."""

from __future__ import annotations

import pytest

from sloserve.cost import LinearCostModel, get_preset
from sloserve.cost.base import BatchShape
from sloserve.experiments.infermax import PRESET, run_fixed

C = 4096


class _Req:
    def __init__(self, prompt: int, output: int) -> None:
        self.prefill_tokens = prompt  # tokens the next (re)fill processes
        self.total_tokens = prompt + output
        self.processed = 0  # the sampled token counts as processed (Vidur's convention)
        self.prefill_done = False


def reference_vllm(prompt: int, output: int, num_requests: int, capacity: int, eviction_free: bool):
    """(latency s, evictions, prefill steps, decode steps) of the authors' vLLM loop."""
    cost = LinearCostModel(get_preset(PRESET))
    waiting = [_Req(prompt, output) for _ in range(num_requests)]
    running: list[_Req] = []
    held: dict[_Req, int] = {}
    now, finished, evictions, prefill_steps, decode_steps = 0.0, 0, 0, 0, 0

    def evict(r: _Req) -> None:
        nonlocal evictions
        r.prefill_tokens = max(r.prefill_tokens, r.processed)
        r.processed, r.prefill_done = 0, False
        del held[r]
        waiting.insert(0, r)
        evictions += 1

    while finished < num_requests:
        batch: list[tuple[_Req, int]] = []
        tokens = 0
        while waiting:  # prefills first, while C and M allow
            r = waiting[0]
            need = r.total_tokens - 1 if eviction_free else r.prefill_tokens
            todo = r.prefill_tokens - r.processed
            if capacity - sum(held.values()) < need or tokens + todo > C:
                break
            waiting.pop(0)
            held[r] = need
            batch.append((r, todo))
            tokens += todo
        if batch:
            prefill_steps += 1
        else:
            decode_steps += 1
            while running:
                r = running.pop(0)
                while not eviction_free and capacity - sum(held.values()) < 1:
                    if not running:
                        evict(r)
                        break
                    evict(running.pop())
                else:
                    held[r] = max(held[r], r.processed)  # the slot of the token processed now
                    batch.append((r, 1))
        prefills = [(c, r.processed) for r, c in batch if not r.prefill_done]
        decodes = [r.processed - 1 for r, _ in batch if r.prefill_done]  # KV read: all but the new token
        now += cost.batch_time(BatchShape.of(prefills, decodes)).total_s
        for r, c in batch:
            r.processed += c
            if not r.prefill_done and r.processed == r.prefill_tokens:
                r.prefill_done = True
                r.processed += 1  # the prefill samples a token
            if r.processed == r.total_tokens:
                finished += 1
                del held[r]
            else:
                running.append(r)
    return now, evictions, prefill_steps, decode_steps


@pytest.mark.parametrize(("prompt", "capacity"), [(2, 300), (16, 1_000), (64, 1_000), (200, 2_000)])
@pytest.mark.parametrize("name", ["vllm", "vllm_ef"])
def test_vllm_matches_the_authors_loop(name, prompt, capacity):
    latency, evictions, _, _ = reference_vllm(prompt, 32, 256, capacity, eviction_free=name == "vllm_ef")
    ours = run_fixed(name, prompt, 32, 256, capacity)
    assert ours["evictions"] == evictions
    assert ours["latency_s"] == pytest.approx(latency, rel=1e-9)
    if name == "vllm" and prompt <= 64:
        assert evictions > 0  # the cases exercise evictions

"""Nine prompts of different lengths, each with its own output length, generated greedily: the run the
graph tests compare between an engine's paths (eager, decode graphs, piecewise graphs)."""

from __future__ import annotations

import numpy as np

from sloserve import LLM, SamplingParams

PROMPT_LENS = [7, 3, 30, 12, 5, 17, 9, 21, 4]
MAX_TOKENS = [12, 5, 20, 8, 16, 10, 3, 14, 9]


def generate_greedy(llm: LLM) -> list[list[int]]:
    """Each prompt's output tokens (random token ids below 256, seed 0)."""
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 256, size=n).tolist()} for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

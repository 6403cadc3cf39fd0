"""What a step spends on one request's score controls, by their size: ``allowed_token_ids``, ``logit_bias``,
``bad_words`` and ``stop_token_ids`` (held back by ``min_tokens``) of 10, 1,000 and 100,000 entries, and the
penalties over a context of that many tokens, applied to one row of Llama 3's vocabulary as the engine
applies them (``apply_controls``, then ``PenaltyCounts.apply``; the best of --repeats steps, each a token
longer, after a first that builds what is kept per request).

    python benchmarks/controls_per_step.py                 # the CPU
    python benchmarks/controls_per_step.py --device cuda

The table gives the milliseconds of a step and their ratio to the same control of 10 entries: a step's
cost should not grow with a request's controls (a request may send 100,000 of them), since the step of
every other request waits for it.
"""

from __future__ import annotations

import argparse
import time

import torch

from sloserve.engine.penalties import PenaltyCounts
from sloserve.engine.sampler import SamplingParams, apply_controls

VOCAB = 128_256  # Llama 3's
SIZES = (10, 1_000, 100_000)


def controls(kind: str, size: int) -> SamplingParams:
    if kind == "allowed_token_ids":
        return SamplingParams(allowed_token_ids=list(range(size)))
    if kind == "logit_bias":
        return SamplingParams(logit_bias={token: 1.0 for token in range(size)})
    if kind == "stop_token_ids":  # barred by min_tokens at every step measured
        return SamplingParams(stop_token_ids=tuple(range(1000, 1000 + size)), min_tokens=10_000, max_tokens=20_000)
    if kind == "penalties":
        return SamplingParams(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)
    # words of two and three tokens, none of them ending the output below
    words = tuple((1000 + i % 5000, 2000 + i, 3000) if i % 2 else (1000 + i % 5000, 2000 + i) for i in range(size))
    return SamplingParams(bad_words=["-"], bad_words_token_ids=words)


def step_ms(kind: str, size: int, device: torch.device, repeats: int) -> float:
    params = controls(kind, size)
    # a 32-token prompt and 32 output tokens; for the penalties, ``size`` tokens, half of them output
    num_prompt_tokens = size // 2 if kind == "penalties" else 32
    history = [10 + i % 50_000 for i in range(2 * num_prompt_tokens if kind != "penalties" else size)]
    logits = torch.zeros(1, VOCAB, device=device)
    penalties = PenaltyCounts(device)
    best = float("inf")
    for _ in range(repeats + 1):  # NOTE: the first builds what a request keeps for its steps
        history.append(7)  # the token the step before sampled
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        apply_controls(logits, [params], [history], [num_prompt_tokens], frozenset({2}))
        penalties.apply(logits, ["request"], [params], [history], [num_prompt_tokens])
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"| control ({args.device}, vocab {VOCAB:,}) | " + " | ".join(f"{n:,} entries" for n in SIZES) + " |")
    print("| --- |" + " --- |" * len(SIZES))
    for kind in ("allowed_token_ids", "logit_bias", "bad_words", "stop_token_ids", "penalties"):
        times = [step_ms(kind, n, device, args.repeats) for n in SIZES]
        cells = [f"{t:.2f} ms ({t / times[0]:.1f}x)" for t in times]
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

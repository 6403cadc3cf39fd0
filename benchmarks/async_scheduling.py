"""Async scheduling (issue 43 item 1) A/B on one engine: the same offline batches with each step launched
after the step before's tokens are on the host (off, the default) and before them (on), in alternating
order; the tokens are checked equal.

    python benchmarks/async_scheduling.py                # random:tiny-llama on the CPU: nothing to hide there
    python benchmarks/async_scheduling.py --model random:llama-3-8b --device cuda --dtype bfloat16
    python benchmarks/async_scheduling.py --model SmolLM2-135M-Instruct.Q4_1.gguf --grammar-every 16

Each batch is BATCH requests of --prompt-len random tokens, greedy, forced to --output-len tokens
(ignore_eos), all at t=0 under vLLM's policy: a prefill, then decode steps of the whole batch, the steps
whose host work (scheduling, inputs, sampling's bookkeeping, the tokens' return) async scheduling puts
behind the device's. With --logprobs K every request asks for its tokens' log-probabilities and the K
likeliest (computed on the device, brought back with the tokens). With --grammar-every N every Nth
request is held to a regular expression of --output-len letters (a model with a tokenizer: a GGUF file
or an HF directory): its matcher takes each token on the host before the next step samples. The table
gives the output tokens per second of each mode (the best of --repeats), on / off, and the share of
steps launched early.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from figures import record
from sloserve.engine.llm_engine import LLMEngine
from sloserve.engine.loader import load_model
from sloserve.engine.sampler import SamplingParams, StructuredOutputsParams


def run_batch(
    engine: LLMEngine,
    prompts: list[list[int]],
    output_len: int,
    logprobs: int | None = None,
    grammar_every: int | None = None,
) -> tuple[float, list[list[int]], int]:
    """Seconds to generate every prompt's tokens, the tokens, and the steps taken."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, logprobs=logprobs)
    guided = params  # (its grammar compiled once, outside the time)
    if grammar_every:
        guided = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(regex=f"[a-z]{{{output_len}}}"))
    start = time.perf_counter()
    requests = [
        engine.add_request(p, guided if grammar_every and i % grammar_every == 0 else params)
        for i, p in enumerate(prompts)
    ]
    tokens, steps = {}, 0
    while engine.has_unfinished():
        for request in engine.step():
            tokens[request.request_id] = engine.release(request).output_token_ids
        steps += 1
    return time.perf_counter() - start, [tokens[r.request_id] for r in requests], steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="16,64", help="requests per batch, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logprobs", type=int, default=None, help="each token's log-probability and the K best")
    parser.add_argument("--grammar-every", type=int, default=None, help="every Nth request held to a grammar")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, seed=args.seed)
    context = args.prompt_len + args.output_len
    engine = LLMEngine(loaded, "vllm", kv_capacity_tokens=max(batches) * context + 64, max_model_len=context)
    executor = engine.executor
    rng = np.random.default_rng(args.seed)
    vocab = loaded.config.vocab_size
    asked = "" if args.logprobs is None else f", logprobs {args.logprobs}"
    asked += "" if args.grammar_every is None else f", a grammar every {args.grammar_every} requests"
    print(
        f"{args.model} on {args.device} ({loaded.dtype}), prompts {args.prompt_len}, outputs {args.output_len}{asked}"
    )
    print("| batch | off tok/s | on tok/s | on / off | steps launched early |")
    print("| --- | --- | --- | --- | --- |")
    for batch in batches:
        prompts = [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(batch)]
        best = {False: 0.0, True: 0.0}
        outputs, early = {}, 0.0
        for mode in (False, True):  # NOTE: a warm-up of each mode (kernels compiled, memory pools grown)
            executor.async_scheduling = mode
            run_batch(engine, prompts[: min(batch, 8)], 8, args.logprobs, args.grammar_every)
        for repeat in range(args.repeats):
            for mode in (False, True) if repeat % 2 == 0 else (True, False):
                executor.async_scheduling = mode
                launched = executor.num_early_launches
                seconds, tokens, steps = run_batch(engine, prompts, args.output_len, args.logprobs, args.grammar_every)
                best[mode] = max(best[mode], batch * args.output_len / seconds)
                outputs.setdefault(mode, tokens)
                if mode:
                    early = (executor.num_early_launches - launched) / steps
        assert outputs[True] == outputs[False], f"batch {batch}: async scheduling changed the tokens"
        if args.logprobs is None and args.grammar_every is None:  # (issue 43's table: plain requests)
            record("async_on_off", best[True] / best[False], batch=batch)
        print(f"| {batch} | {best[False]:,.0f} | {best[True]:,.0f} | {best[True] / best[False]:.3f} | {early:.0%} |")


if __name__ == "__main__":
    main()

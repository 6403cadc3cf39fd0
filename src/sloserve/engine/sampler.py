"""Sampling parameters (as in vLLM's ``SamplingParams``) and the sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sloserve.core.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    ``temperature`` 0 is greedy (vLLM's default is 1.0, and so is ours). ``seed`` makes a sampled
    request reproducible on its own, whatever it is batched with. ``ignore_eos`` keeps generating
    until ``max_tokens`` (benchmarks force output lengths this way, as the papers do).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ConfigError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(
    logits: torch.Tensor,  # (N, vocab) float32, one row per request that samples this step
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row: argmax for greedy rows; otherwise temperature, then top-p (nucleus), then
    a draw from the row's own generator."""
    greedy_ids = logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for i, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            tokens.append(greedy_ids[i])
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)  # (vocab,)
        if p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokens

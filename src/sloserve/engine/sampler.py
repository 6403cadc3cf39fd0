"""Sampling parameters (as in vLLM's ``SamplingParams``) and the sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
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
        if not 0 <= self.temperature < math.inf:  # NOTE: inf would sample uniformly, NaN nothing sensible
            raise ConfigError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(
    logits: torch.Tensor,  # (N, vocab) float32, one row per request that samples this step
    params: list[SamplingParams],
    generators: list[np.random.Generator | None],
) -> list[int]:
    """One token per row: argmax for greedy rows; the others at temperature, then top-p (nucleus),
    drawn by inverse CDF with one uniform number per row from the row's own host generator.

    NOTE: rows are sampled in two batches (without and with top-p), whatever their number: a loop
    over rows would launch about ten kernels a row, thousands a step at batch 256, longer than the
    forward pass. A row's token depends only on its logits, its params and its generator, so a
    seeded request samples the same tokens in any batch.
    """
    tokens = logits.argmax(dim=-1)  # (N,)
    plain = [i for i, p in enumerate(params) if not p.greedy and p.top_p == 1]
    nucleus = [i for i, p in enumerate(params) if not p.greedy and p.top_p < 1]
    for rows, top_p in ((plain, False), (nucleus, True)):
        if rows:
            index = torch.tensor(rows, device=logits.device)  # (R,)
            tokens[index] = _draw(logits[index], [params[i] for i in rows], [generators[i] for i in rows], top_p)
    return tokens.tolist()


def _draw(
    logits: torch.Tensor,  # (R, vocab)
    params: list[SamplingParams],
    generators: list[np.random.Generator | None],
    top_p: bool,
) -> torch.Tensor:  # (R,) token ids
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]  # (R, 1)
    uniform = torch.tensor([g.random() for g in generators], device=device)[:, None]  # (R, 1) in [0, 1)
    probs = torch.softmax(logits / temperature, dim=-1)  # (R, vocab)
    if top_p:
        probs, order = probs.sort(dim=-1, descending=True)  # (R, vocab)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= torch.tensor([p.top_p for p in params], device=device)[:, None], 0)
    cdf = probs.cumsum(dim=-1)  # (R, vocab)
    # The first token whose CDF passes u x mass. Held below the mass (u can round to 1.0 in
    # float32), the target is always passed where the CDF rises: at a token of probability > 0.
    mass = cdf[:, -1:]
    target = torch.minimum(uniform * mass, torch.nextafter(mass, torch.zeros_like(mass)))  # (R, 1)
    pick = torch.searchsorted(cdf, target, right=True)  # (R, 1)
    return (order.gather(1, pick) if top_p else pick)[:, 0]

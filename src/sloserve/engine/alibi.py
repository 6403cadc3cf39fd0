"""ALiBi (Press, Smith and Lewis, "Train Short, Test Long: Attention with Linear Biases Enables Input Length
Extrapolation", 2022): no position embedding; head h adds m_h (j - p) to the score of key j at query position p, a
penalty that grows with the distance. The slopes m_h are a geometric sequence, fixed, not learned.

- Press et al.'s, BLOOM's and Falcon-RW's (``alibi_slopes(n)``): for n a power of two, m_h = 2^(-8 h / n), h = 1..n;
  otherwise the power of two c below n gives its n slopes, and the rest are every other slope of 2c's (2^(-4 h / c),
  h odd), as the paper's code and transformers' ``_get_alibi_slopes`` do.
- MPT's (``alibi_slopes(n, bias_max)``): the power of two c at or above n, m_h = 2^(-bias_max h / c), h = 1..c; for
  n below c, the odd-numbered slopes then the even-numbered ones, the first n of them (``build_mpt_alibi_tensor``).

Both as transformers computes them in float32. The attention backends add the biases (``attention.py``).
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int, bias_max: float | None = None) -> torch.Tensor:  # (num_heads,) float32
    """Each head's slope m_h: Press et al.'s (``bias_max`` None), or MPT's with its ``alibi_bias_max``."""
    if bias_max is not None:
        padded = 2 ** math.ceil(math.log2(num_heads))
        slopes = 1.0 / torch.pow(2, torch.arange(1, padded + 1).float() * (bias_max / padded))
        if padded != num_heads:
            slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
        return slopes
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        remaining = min(closest, num_heads - closest)
        slopes = torch.cat([slopes, torch.pow(extra_base, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))])
    return slopes


class AlibiSlopes:
    """A layer's slopes (``alibi_slopes``, times ``scale``), built on the device of the first step that asks for them
    and kept there: a model is created on the meta device."""

    def __init__(self, num_heads: int, bias_max: float | None = None, scale: float = 1.0) -> None:
        self.num_heads, self.bias_max, self.scale = num_heads, bias_max, scale
        self._slopes: torch.Tensor | None = None  # (nh,) float32

    def on(self, device: torch.device) -> torch.Tensor:  # (nh,) float32
        if self._slopes is None or self._slopes.device != device:
            self._slopes = (alibi_slopes(self.num_heads, self.bias_max) * self.scale).to(device)
        return self._slopes

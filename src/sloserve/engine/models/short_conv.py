"""LFM2's gated short convolution (Liquid AI, 2025): the layers of an LFM2 model that mix their tokens through a
causal depthwise convolution of a few taps (``short_conv["width"]``, 3) instead of attention. HF parameter names.

A token's input projection gives B, C and x (each hidden-size wide); B * x goes through the convolution (no
activation), C gates its output, and the product is projected back. A request carries the convolution's last
``width - 1`` inputs from one step to the next, in its slot of ``state_cache.StateCache`` (``causal_conv``, which
Mamba-2's mixers run too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.state_cache import StateMetadata


def causal_conv(
    inputs: torch.Tensor,  # (T, C) the step's flat tokens' inputs
    meta: StateMetadata,
    states: torch.Tensor,  # (slots, C, width - 1) this layer's: each request's last inputs, updated
    conv: nn.Conv1d,  # depthwise: weight (C, 1, width)
) -> torch.Tensor:  # (T, C), in the weight's dtype; zeros on rows of no request (padding)
    """Each request's causal depthwise convolution over its tokens of the step, after the ``width - 1`` inputs
    before them (its states; zeros before a prompt's first chunk), no activation. A prefill's window is its
    states and its tokens; a decode's, its states and its one token. The states become the last inputs seen
    (and, where ``meta.saves`` says, those before a prefill's k-th token go to another slot too)."""
    keep = conv.weight.shape[-1] - 1
    out = torch.zeros_like(inputs, dtype=conv.weight.dtype)
    for start, length, slot, goes_on in meta.prefills:
        rows = slice(start, start + length)
        before = states[slot] if goes_on else states.new_zeros(states.shape[1:])
        window = torch.cat((before, inputs[rows].T.to(before.dtype)), dim=1)  # (C, width - 1 + c)
        states[slot] = window[:, window.shape[1] - keep :]
        if start in meta.saves:  # (the inputs before token k: prefix caching's saved states)
            k, saved = meta.saves[start]
            states[saved] = window[:, k : k + keep]
        out[rows] = _depthwise(window[None], conv)[0].T
    if meta.decode_slots.numel():
        rows, slots = meta.decode_rows, meta.decode_slots
        window = torch.cat((states[slots], inputs[rows, :, None].to(states.dtype)), dim=2)  # (b, C, width)
        states[slots] = window[:, :, 1:]
        out[rows] = _depthwise(window, conv)[:, :, -1]
    return out


def _depthwise(window: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:  # (b, C, width - 1 + c) -> (b, C, c)
    return F.conv1d(window.to(conv.weight.dtype), conv.weight, conv.bias, groups=conv.weight.shape[0])


class ShortConv(nn.Module):
    """Layer ``layer``'s gated short convolution (module docstring); ``state_index``: its place among the
    model's state layers (its states in ``StateCache``)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        h, width, bias = config.hidden_size, config.short_conv["width"], config.short_conv["bias"]
        self.state_index = config.state_layer_index(layer)
        self.in_proj = nn.Linear(h, 3 * h, bias=bias)
        self.conv = nn.Conv1d(h, h, width, groups=h, bias=bias)
        self.out_proj = nn.Linear(h, h, bias=bias)

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:  # (T, H) normalized -> (T, H)
        b, c, values = self.in_proj(x).chunk(3, dim=-1)  # (T, H) each
        mixed = causal_conv(b * values, meta, meta.cache.conv[self.state_index], self.conv)
        return self.out_proj(c * mixed.to(c.dtype))

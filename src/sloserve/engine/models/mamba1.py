"""Mamba's (Gu and Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2023) selective state
space mixer: the Mamba layers of Jamba (``jamba``: Jamba 1.5 and 1.7, Mini and Large), and every layer of Mamba's and
Falcon Mamba's models (``models/mamba.py``). HF parameter names.

A token's input projection gives x and a gate z. x goes through a causal depthwise convolution of ``d_conv`` taps
and SiLU; ``x_proj`` gives from it a step of rank ``dt_rank`` and B and C (``d_state`` each), RMS-normalized in
Jamba and Falcon Mamba (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``; Falcon Mamba's of no weight);
``dt_proj`` lifts the step to a channel's, dt = softplus(dt_proj(step) + its bias). Each channel d keeps a state
h_d of ``d_state`` numbers: h_t = exp(dt_t A) h_(t-1) + dt_t x_t B_t (A = -exp(A_log), a number a channel and
state), y_t = h_t . C_t + D x_t, and y * SiLU(z) is projected back (S6, the paper's Algorithm 2).

A request carries the convolution's last ``d_conv - 1`` inputs and the states h (``state_cache.StateCache``: its
recurrence shape (1, d_inner, d_state), float32). A prefill runs ``selective_scan``: chunks of tokens at once (the
states' decays within a chunk as cumulative sums), from zeros or the state an earlier chunk left; a decode one
recurrence step.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.models.short_conv import causal_conv
from sloserve.engine.state_cache import StateMetadata

# The most numbers a chunk's pairwise decays take (``selective_scan``): 512 MB of float32
SCAN_NUMBERS = 1 << 27


def selective_scan(
    x: torch.Tensor,  # (T, D) float32: the convolved inputs
    dt: torch.Tensor,  # (T, D) float32: the steps
    a: torch.Tensor,  # (D, N) A (negative)
    b: torch.Tensor,  # (T, N)
    c: torch.Tensor,  # (T, N)
    initial: torch.Tensor | None = None,  # (D, N) the state before the first token
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (T, D) outputs (without D's), (D, N) the last state
    """h_t = exp(dt_t a) h_(t-1) + dt_t x_t b_t, y_t = h_t . c_t, ``chunk_size`` tokens at once (default: as many as
    SCAN_NUMBERS allows, 64 at most): within a chunk h_t = exp(cum_t) h_start + sum_(s <= t) exp(cum_t - cum_s)
    dt_s x_s b_s, cum the cumulative sum of dt a. Equal to the token-by-token recurrence up to the order of sums."""
    t, d = x.shape
    n = a.shape[1]
    if chunk_size is None:
        chunk_size = max(1, min(64, int((SCAN_NUMBERS // (d * n)) ** 0.5)))
    state = x.new_zeros(d, n) if initial is None else initial.to(x.dtype)
    outputs = []
    for start in range(0, t, chunk_size):
        rows = slice(start, start + chunk_size)
        cum = (dt[rows, :, None] * a).cumsum(0)  # (L, D, N) log decays from the chunk's start
        inputs = (dt[rows] * x[rows])[:, :, None] * b[rows, None, :]  # (L, D, N): dt_s x_s b_s
        length = cum.shape[0]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()[:, :, None, None]
        gaps = (cum[:, None] - cum[None, :]).masked_fill(~causal, float("-inf"))  # (L, L, D, N): t, s
        states = torch.exp(cum) * state + torch.einsum("tsdn,sdn->tdn", torch.exp(gaps), inputs)  # (L, D, N)
        outputs.append(torch.einsum("tdn,tn->td", states, c[rows]))
        state = states[-1]
    return torch.cat(outputs) if outputs else x.new_zeros(0, d), state


class Mamba1Mixer(nn.Module):
    """Layer ``layer``'s mixer (module docstring); its states in ``StateCache`` at ``state_index``."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        m, h = config.mamba, config.hidden_size
        self.d_inner, self.d_state, self.dt_rank = m["d_inner"], m["d_state"], m["dt_rank"]
        self.state_index = config.state_layer_index(layer)
        self.in_proj = nn.Linear(h, 2 * self.d_inner, bias=m["proj_bias"])
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, m["d_conv"], groups=self.d_inner, bias=m["conv_bias"])
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * self.d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, self.d_state))
        self.D = nn.Parameter(torch.empty(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, h, bias=m["proj_bias"])
        # (Jamba's: the step, B and C RMS-normalized, by weights; Falcon Mamba's: without, at an epsilon of their own)
        self.normed = m["dt_bc_norms"]
        if self.normed:
            eps = config.norm_eps if m["dt_bc_norm_eps"] is None else m["dt_bc_norm_eps"]
            norm = functools.partial(nn.RMSNorm, eps=eps, elementwise_affine=m["dt_bc_norm_weights"])
            self.dt_layernorm, self.b_layernorm, self.c_layernorm = (
                norm(self.dt_rank),
                norm(self.d_state),
                norm(self.d_state),
            )

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:  # (T, H) normalized -> (T, H)
        xs, z = self.in_proj(x).chunk(2, dim=-1)  # (T, D) each
        mixed = F.silu(causal_conv(xs, meta, meta.cache.conv[self.state_index], self.conv1d))  # (T, D)
        step, b, c = self.x_proj(mixed).split((self.dt_rank, self.d_state, self.d_state), dim=-1)
        if self.normed:
            step, b, c = self.dt_layernorm(step), self.b_layernorm(b), self.c_layernorm(c)
        dt = F.softplus(F.linear(step, self.dt_proj.weight).float() + self.dt_proj.bias.float())  # (T, D)
        a = -torch.exp(self.A_log.float())  # (D, N)
        states = meta.cache.ssm[self.state_index]  # (slots, 1, D, N)
        y = torch.zeros_like(mixed, dtype=torch.float32)  # (T, D); NOTE: padding rows, of no request, stay zero
        inputs, b, c = mixed.float(), b.float(), c.float()

        def scan(rows: slice, initial: torch.Tensor | None) -> torch.Tensor:  # (1, D, N) states, as the cache's
            before = None if initial is None else initial[0]
            y[rows], last = selective_scan(inputs[rows], dt[rows], a, b[rows], c[rows], before)
            return last[None]

        meta.scan_prefills(states, scan)
        if meta.decode_slots.numel():
            rows, slots = meta.decode_rows, meta.decode_slots
            h = states[slots, 0] * torch.exp(dt[rows, :, None] * a)  # (b, D, N)
            h = h + (dt[rows] * inputs[rows])[:, :, None] * b[rows, None, :]
            states[slots, 0] = h
            y[rows] = torch.einsum("bdn,bn->bd", h, c[rows])
        y = y + self.D.float() * inputs
        return self.out_proj((y * F.silu(z.float())).to(x.dtype))

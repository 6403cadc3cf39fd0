"""Mamba-2's mixer (Dao and Gu, "Transformers are SSMs", 2024): the layers of a hybrid model that mix their
tokens through a state space model instead of attention (Granite 4.0-H's, Nemotron-H's, Bamba's). HF parameter
names.

A token's input projection gives z (the gate), xBC (the values x, B and C of its state update) and dt (a step a
head). xBC goes through a causal depthwise convolution of ``d_conv`` taps and SiLU; then each head's state
h (head_dim x d_state) follows h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T and emits y_t = h_t C_t + D x_t
(dt_t = softplus(dt + dt_bias), clamped to ``time_step_limit``; A = -exp(A_log); B and C shared by the heads of
a group). y, gated by SiLU(z), is RMS-normalized by group (Falcon-H1's: normalized then gated, or only gated)
and projected back.

A request carries two states from one step to the next, in its slot of ``state_cache.StateCache``
(``StateMetadata``): the convolution's last ``d_conv - 1`` inputs (``short_conv.causal_conv``) and each head's h.
A prefill runs the scan in chunks (the paper's SSD:
``ssd_scan``, as transformers' and the reference kernels' chunked form), from zeros or, for a chunk after
others (chunked prefill), from the state the chunk before left; a decode takes one recurrence step. The states
are float32 (the convolution's in the model's dtype, as its inputs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.models.short_conv import causal_conv
from sloserve.engine.state_cache import StateMetadata

# The most numbers the scan's within-chunk weights take at once (``ssd_scan``): 512 MB of float32
SCAN_NUMBERS = 1 << 27


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * SiLU(z) over groups of ``group_size`` numbers, in float32 (Mamba-2's ``norm``); with
    ``norm_before_gate``, the norm of y times SiLU(z) (Falcon-H1's option, gated DeltaNets'); ``gate``: the function
    of z (Kimi's KDA: a sigmoid)."""

    def __init__(
        self, size: int, group_size: int, eps: float, norm_before_gate: bool = False, gate: Callable = F.silu
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps, self.norm_before_gate, self.gate = group_size, eps, norm_before_gate, gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # (T, d_inner) each
        gate = self.gate(z.float())
        x = y.float() if self.norm_before_gate else y.float() * gate
        groups = x.view(*x.shape[:-1], -1, self.group_size)
        normed = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).view_as(x)
        if self.norm_before_gate:
            return (self.weight.float() * normed * gate).to(y.dtype)
        return self.weight * normed.to(y.dtype)


def gated(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # (T, d_inner) each
    """y * SiLU(z), no norm (Falcon-H1's mixers without ``mamba_rms_norm``)."""
    return (y.float() * F.silu(z.float())).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """Layer ``layer``'s mixer (module docstring); ``state_index``: its place among the model's state layers
    (its states in ``StateCache``)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        m, h = config.mamba, config.hidden_size
        self.num_heads, self.head_dim, self.n_groups = m["n_heads"], m["head_dim"], m["n_groups"]
        self.d_state, self.d_inner, self.d_conv, self.chunk_size = (
            m["d_state"],
            m["d_inner"],
            m["d_conv"],
            m["chunk_size"],
        )
        self.conv_dim = config.mamba_conv_dim
        self.time_step_limit = m["time_step_limit"]
        self.state_index = config.state_layer_index(layer)
        self.in_proj = nn.Linear(h, self.d_inner + self.conv_dim + self.num_heads, bias=m["proj_bias"])
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.d_conv, groups=self.conv_dim, bias=m["conv_bias"])
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = (
            GatedRMSNorm(self.d_inner, self.d_inner // self.n_groups, config.norm_eps, m["norm_before_gate"])
            if m["rms_norm"]
            else gated
        )
        self.out_proj = nn.Linear(self.d_inner, h, bias=m["out_proj_bias"])

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:  # (T, H) normalized -> (T, H)
        z, xbc, dt = self.in_proj(x).split((self.d_inner, self.conv_dim, self.num_heads), dim=-1)
        ssm_states = meta.cache.ssm[self.state_index]
        mixed = F.silu(causal_conv(xbc, meta, meta.cache.conv[self.state_index], self.conv1d))  # (T, conv_dim)
        y = torch.zeros_like(z)  # (T, d_inner); NOTE: zeros: padding rows, of no request, stay finite

        def scan(rows: slice, initial: torch.Tensor | None) -> torch.Tensor:
            y[rows], state = self._scan(mixed[rows], dt[rows], initial)
            return state

        meta.scan_prefills(ssm_states, scan)
        if meta.decode_slots.numel():
            rows, slots = meta.decode_rows, meta.decode_slots
            y[rows], ssm_states[slots] = self._step(mixed[rows], dt[rows], ssm_states[slots])
        return self.out_proj(self.norm(y, z))

    def _split(self, mixed: torch.Tensor):
        """(x (T, heads, head_dim), B (T, heads, d_state), C (T, heads, d_state)) float32, B and C of each head's group."""
        x, b, c = mixed.float().split((self.d_inner, self.n_groups * self.d_state, self.n_groups * self.d_state), -1)
        per_group = self.num_heads // self.n_groups

        def by_head(t: torch.Tensor) -> torch.Tensor:
            return t.view(t.shape[0], self.n_groups, 1, self.d_state).expand(-1, -1, per_group, -1).flatten(1, 2)

        return x.view(x.shape[0], self.num_heads, self.head_dim), by_head(b), by_head(c)

    def _steps(self, dt: torch.Tensor) -> torch.Tensor:  # (T, heads) -> (T, heads) float32: dt_t
        dt = F.softplus(dt.float() + self.dt_bias.float())
        return dt.clamp(self.time_step_limit[0], self.time_step_limit[1])

    def _scan(self, mixed: torch.Tensor, dt: torch.Tensor, initial: torch.Tensor | None):
        """A prefill's outputs (c, d_inner) and its last state (heads, head_dim, d_state) (``ssd_scan``)."""
        x, b, c = self._split(mixed)
        a = -torch.exp(self.A_log.float())  # (heads,)
        y, state = ssd_scan(x, self._steps(dt), a, b, c, self.chunk_size, initial)
        y = y + self.D.float()[:, None] * x
        return y.flatten(1).to(mixed.dtype), state

    def _step(self, mixed: torch.Tensor, dt: torch.Tensor, states: torch.Tensor):
        """One token of each decode: outputs (b, d_inner) and the states after it (b, heads, head_dim, d_state)."""
        x, b, c = self._split(mixed)
        steps = self._steps(dt)  # (b, heads)
        decay = torch.exp(steps * -torch.exp(self.A_log.float()))  # (b, heads)
        states = states * decay[:, :, None, None] + (steps[:, :, None] * x)[..., None] * b[:, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", states, c) + self.D.float()[:, None] * x
        return y.flatten(1).to(mixed.dtype), states


def ssd_scan(
    x: torch.Tensor,  # (T, heads, head_dim) float32
    dt: torch.Tensor,  # (T, heads) the steps
    a: torch.Tensor,  # (heads,) A (negative)
    b: torch.Tensor,  # (T, heads, d_state)
    c: torch.Tensor,  # (T, heads, d_state)
    chunk_size: int,
    initial: torch.Tensor | None = None,  # (heads, head_dim, d_state) the state before the first token
) -> tuple[torch.Tensor, torch.Tensor]:  # (T, heads, head_dim) outputs (without D's), (heads, head_dim, d_state)
    """The state space recurrence h_t = exp(dt_t a) h_{t-1} + dt_t x_t b_t^T, y_t = h_t c_t, in chunks of
    ``chunk_size`` tokens (the SSD paper's §6 algorithm): within a chunk as a masked matrix product (its
    "attention" form), across chunks through the states at their ends. Equal to the token-by-token recurrence
    up to the order of the sums."""
    t, heads, head_dim = x.shape
    pad = -t % chunk_size
    chunks = (t + pad) // chunk_size

    def chunked(v: torch.Tensor) -> torch.Tensor:  # (T, ...) -> (chunks, L, ...), zeros past the end
        return F.pad(v, (0, 0) * (v.dim() - 1) + (0, pad)).view(chunks, chunk_size, *v.shape[1:])

    xs, bs, cs = chunked(x * dt[..., None]), chunked(b), chunked(c)  # x discretized: dt_t x_t
    log_decay = chunked(dt * a).permute(0, 2, 1)  # (chunks, heads, L): dt_t a, 0 on padding
    cumulative = log_decay.cumsum(-1)  # (chunks, heads, L)
    # within a chunk: y_l = sum_{s <= l} exp(cum_l - cum_s) (c_l . b_s) dt_s x_s; NOTE: a few chunks at a time,
    # their (heads, L, L) weights within SCAN_NUMBERS (a long prompt's whole would not fit: 32K tokens, 128 heads
    # and chunks of 256: 4 GB)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    step = max(1, SCAN_NUMBERS // (heads * chunk_size * chunk_size))
    parts = []
    for k in range(0, chunks, step):
        cum = cumulative[k : k + step]
        gaps = cum[..., :, None] - cum[..., None, :]  # (k, heads, L, L)
        weights = torch.exp(gaps.masked_fill(~causal, float("-inf")))
        scores = torch.einsum("klhn,kshn->khls", cs[k : k + step], bs[k : k + step]) * weights
        parts.append(torch.einsum("khls,kshp->klhp", scores, xs[k : k + step]))
    y = torch.cat(parts)  # (chunks, L, heads, head_dim)
    # each chunk's contribution to the state at its end: sum_s exp(cum_end - cum_s) dt_s x_s b_s^T
    to_end = torch.exp(cumulative[..., -1:] - cumulative)  # (chunks, heads, L)
    contributions = torch.einsum("khl,klhp,klhn->khpn", to_end, xs, bs)  # (chunks, heads, head_dim, d_state)
    # the states at the chunks' starts: each the one before, decayed over its chunk, plus its contribution
    state = x.new_zeros(heads, head_dim, b.shape[-1]) if initial is None else initial.to(x.dtype)
    starts = []
    chunk_decay = torch.exp(cumulative[..., -1])  # (chunks, heads)
    for k in range(chunks):
        starts.append(state)
        state = state * chunk_decay[k][:, None, None] + contributions[k]
    starts = torch.stack(starts)  # (chunks, heads, head_dim, d_state)
    # and each token's share of the state at its chunk's start: y_l += exp(cum_l) h_start c_l
    y = y + torch.einsum("klhn,khpn->klhp", cs, starts) * torch.exp(cumulative).permute(0, 2, 1)[..., None]
    return y.reshape(chunks * chunk_size, heads, head_dim)[:t], state

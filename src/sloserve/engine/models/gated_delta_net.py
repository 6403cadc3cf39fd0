"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", 2025):
the layers of Qwen3-Next, Qwen3.5 and OLMo Hybrid that mix their tokens by a linear attention of the delta rule
instead of softmax attention. HF parameter names (Qwen3.5's; Qwen3-Next's grouped projections are the same rows in
another order, ``models/qwen3_next.py`` reorders them as they load; OLMo Hybrid's each apart).

A token's input projection gives q, k and v (through a causal depthwise convolution of ``width`` taps and SiLU),
the gate z, and b and a (one of each a value head). Each value head keeps a state S (head_k_dim x head_v_dim)
that follows the gated delta rule

    S_t = alpha_t S_{t-1} + beta_t k_t (v_t - alpha_t S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

with alpha_t = exp(g_t), g_t = -exp(A_log) softplus(a_t + dt_bias) (the decay, in log space), beta_t = sigmoid(b_t)
(how strongly the token overwrites what S recalls for k_t; OLMo Hybrid's twice that, so that S's eigenvalues may be
negative: ``beta_scale``); q and k L2-normalized, q scaled by head_k_dim ** -0.5;
each query/key head serves num_v_heads / num_k_heads consecutive value heads. o, RMS-normalized by head and gated
by SiLU(z), is projected back.

A request carries two states from one step to the next, in its slot of ``state_cache.StateCache``: the
convolution's last ``width - 1`` inputs (``short_conv.causal_conv``) and each value head's S (float32). A prefill
runs the rule in chunks (``chunked_delta_rule``: the paper's WY form), from zeros or from the state a chunk before
left; a decode takes one step (``delta_rule_step``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.models.llama import MergedLinear, MergedParts
from sloserve.engine.models.mamba2 import SCAN_NUMBERS, GatedRMSNorm
from sloserve.engine.models.short_conv import causal_conv
from sloserve.engine.state_cache import StateMetadata

# The tokens of a chunk of the prefill's rule (the reference kernels' and transformers' 64)
CHUNK_SIZE = 64
# q's and k's L2 norm: x / sqrt(|x|^2 + eps), the reference kernels' epsilon
L2_NORM_EPS = 1e-6


class GatedDeltaNet(nn.Module):
    """Layer ``layer``'s gated DeltaNet (module docstring); ``state_index``: its place among the model's state
    layers (its states in ``StateCache``). ``in_proj`` is the checkpoint's projections as one: Qwen3.5's
    ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``
    (the same rows, reordered as they load); OLMo Hybrid's ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` (z),
    ``b_proj``, ``a_proj``."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        net, h = config.gated_delta_net, config.hidden_size
        self.num_k_heads, self.num_v_heads = net["num_k_heads"], net["num_v_heads"]
        self.head_k_dim, self.head_v_dim = net["head_k_dim"], net["head_v_dim"]
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = config.state_conv_dim  # (q, k and v: 2 key_dim + value_dim)
        self.state_index = config.state_layer_index(layer)
        self.beta_scale = net["beta_scale"]
        nv, key_dim, value_dim = self.num_v_heads, self.key_dim, self.value_dim
        parts = {"in_proj_qkv": self.conv_dim, "in_proj_z": value_dim, "in_proj_b": nv, "in_proj_a": nv}
        if config.model_type == "qwen3_next":
            parts = {"in_proj_qkvz": self.conv_dim + value_dim, "in_proj_ba": 2 * nv}
        elif config.model_type == "olmo_hybrid":
            parts = {"q_proj": key_dim, "k_proj": key_dim, "v_proj": value_dim, "g_proj": value_dim, "b_proj": nv,
                     "a_proj": nv}  # fmt: skip
        self.in_proj = MergedLinear(h, parts, bias=False)  # rows: q, k, v, z, b, a
        convolved = {"conv1d": self.conv_dim}  # (OLMo Hybrid's checkpoints: q's, k's and v's apart)
        if config.model_type == "olmo_hybrid":
            convolved = {"q_conv1d": key_dim, "k_conv1d": key_dim, "v_conv1d": value_dim}
        self.conv1d = MergedConv1d(convolved, net["width"])
        self.dt_bias = nn.Parameter(torch.empty(nv))
        self.A_log = nn.Parameter(torch.empty(nv))
        self.norm = GatedRMSNorm(self.head_v_dim, self.head_v_dim, net["norm_eps"], norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:  # (T, H) normalized -> (T, H)
        t, nv = x.shape[0], self.num_v_heads
        qkv, z, b, a = self.in_proj(x).split((self.conv_dim, self.value_dim, nv, nv), dim=-1)
        mixed = F.silu(causal_conv(qkv, meta, meta.cache.conv[self.state_index], self.conv1d))  # (T, conv_dim)
        q, k, v = self._heads(mixed)
        decay = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())  # (T, nv): g_t
        beta = (torch.sigmoid(b) * self.beta_scale).float()  # (T, nv) NOTE: in the model's dtype, as transformers
        y = delta_rule(q, k, v, decay, beta, meta, meta.cache.ssm[self.state_index])
        gated = self.norm(y.to(x.dtype), z.view(t, nv, self.head_v_dim))  # (T, nv, head_v_dim)
        return self.out_proj(gated.reshape(t, self.value_dim))

    def _heads(self, mixed: torch.Tensor):
        """(q, k, v) float32 of each value head: q (T, nv, head_k_dim) L2-normalized and scaled by head_k_dim ** -0.5,
        k (T, nv, head_k_dim) L2-normalized, v (T, nv, head_v_dim); a query/key head repeated for its value heads."""
        q, k, v = mixed.float().split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        repeats = self.num_v_heads // self.num_k_heads

        def heads(x: torch.Tensor) -> torch.Tensor:  # (T, key_dim) -> (T, nv, head_k_dim)
            return x.view(x.shape[0], self.num_k_heads, self.head_k_dim).repeat_interleave(repeats, dim=1)

        q, k = l2_normalized(heads(q)), l2_normalized(heads(k))
        return q * self.head_k_dim**-0.5, k, v.view(v.shape[0], self.num_v_heads, -1)


def l2_normalized(x: torch.Tensor) -> torch.Tensor:  # (..., d)
    """x / sqrt(|x|^2 + eps) over its last dimension (the reference kernels' form, their epsilon)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)


def delta_rule(
    q: torch.Tensor,  # (T, heads, dk) float32, the step's flat tokens'
    k: torch.Tensor,  # (T, heads, dk)
    v: torch.Tensor,  # (T, heads, dv)
    decay: torch.Tensor,  # (T, heads) or (T, heads, dk)
    beta: torch.Tensor,  # (T, heads)
    meta: StateMetadata,
    states: torch.Tensor,  # (slots, heads, dk, dv) this layer's S of each slot, updated
) -> torch.Tensor:  # (T, heads, dv) float32; zeros on rows of no request (padding)
    """The rule over a step's requests: each prefill in chunks (``chunked_delta_rule``: ``meta.scan_prefills``), the
    decodes one step each, batched. Each slot's state becomes its request's last."""
    y = v.new_zeros(v.shape)  # NOTE: zeros: padding rows, of no request, stay finite

    def scan(rows: slice, initial: torch.Tensor | None) -> torch.Tensor:
        y[rows], state = chunked_delta_rule(q[rows], k[rows], v[rows], decay[rows], beta[rows], initial)
        return state

    meta.scan_prefills(states, scan)
    if meta.decode_slots.numel():
        rows, slots = meta.decode_rows, meta.decode_slots
        y[rows], states[slots] = delta_rule_step(q[rows], k[rows], v[rows], decay[rows], beta[rows], states[slots])
    return y


class MergedConv1d(MergedParts, nn.Conv1d):
    """A causal depthwise convolution (no bias) of ``width`` taps over several projections' channels, each part's
    rows its checkpoint tensor's (``MergedParts``)."""

    def __init__(self, parts: dict[str, int], width: int) -> None:
        channels = sum(parts.values())
        super().__init__(channels, channels, width, groups=channels, bias=False)
        self.parts = parts


def delta_rule_step(
    q: torch.Tensor,  # (b, heads, dk)
    k: torch.Tensor,  # (b, heads, dk)
    v: torch.Tensor,  # (b, heads, dv)
    decay: torch.Tensor,  # (b, heads) g_t, log space; or (b, heads, dk): a decay a key channel (Kimi's KDA)
    beta: torch.Tensor,  # (b, heads)
    states: torch.Tensor,  # (b, heads, dk, dv) S_{t-1}
) -> tuple[torch.Tensor, torch.Tensor]:  # (b, heads, dv) o_t, (b, heads, dk, dv) S_t
    """One token of each of ``b`` requests: the rule's recurrence as the module docstring writes it (with a decay a
    key channel, diag(alpha_t) S_{t-1} for alpha_t S_{t-1})."""
    channels = decay if decay.dim() == 3 else decay[..., None]  # (b, heads, dk | 1)
    decayed = states * torch.exp(channels)[..., None]  # alpha_t S_{t-1}
    recalled = torch.einsum("bhkv,bhk->bhv", decayed, k)  # what the state holds for k_t
    states = decayed + k[..., None] * (beta[..., None] * (v - recalled))[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", states, q), states


def chunked_delta_rule(
    q: torch.Tensor,  # (T, heads, dk)
    k: torch.Tensor,  # (T, heads, dk)
    v: torch.Tensor,  # (T, heads, dv)
    decay: torch.Tensor,  # (T, heads) g_t, log space (<= 0); or (T, heads, dk): a decay a key channel (KDA)
    beta: torch.Tensor,  # (T, heads)
    initial: torch.Tensor | None = None,  # (heads, dk, dv) the state before the first token (None: zeros)
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:  # (T, heads, dv) outputs, (heads, dk, dv) the last state
    """The gated delta rule over a prompt, ``chunk_size`` tokens at a time (the paper's §3.3, its WY form of the
    rule's products of Householder-like matrices). Within a chunk, with gamma_i the decays' running sum from its
    start and S_0 the state before it, each token's correction delta_i = beta_i (v_i - alpha-decayed S^T k_i) is
    delta = U - W S_0, where (I + A) U = beta v and (I + A) W = beta exp(gamma) k, A_ij = beta_i exp(gamma_i -
    gamma_j) k_i . k_j for j < i (a triangular solve); then o_i = exp(gamma_i) S_0^T q_i + sum_{j <= i}
    exp(gamma_i - gamma_j) (q_i . k_j) delta_j, and the state after the chunk exp(gamma_C) S_0 + sum_j
    exp(gamma_C - gamma_j) k_j delta_j^T. Equal to ``delta_rule_step`` token by token up to the order of the sums.
    With a decay a key channel (Kimi Delta Attention, Kimi Linear §2), gamma is a vector a token and each product
    k_i . k_j (q_i . k_j) weighs channel d by exp(gamma_i,d - gamma_j,d): a (C, C, dk) tensor a chunk and head.
    NOTE: every exponent is of a later running sum minus an earlier one, so <= 0: nothing overflows."""
    t, heads, dk = k.shape
    pad = -t % chunk_size
    chunks = (t + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # (T, heads, ...) -> (heads, chunks, C, ...), zeros past the end
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.view(chunks, chunk_size, heads, *x.shape[2:]).transpose(0, 2).transpose(1, 2)

    qs, ks, vs = chunked(q), chunked(k), chunked(v)  # (heads, chunks, C, d)
    betas = chunked(beta[..., None])  # (heads, chunks, C, 1): 0 past the end, so padding writes nothing
    channels = decay.shape[-1] if decay.dim() == 3 else 1
    gamma = chunked(decay.view(t, heads, channels)).cumsum(2)  # (heads, chunks, C, dk | 1)
    ones = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device)
    causal, earlier = ones.tril(), ones.tril(-1)  # j <= i, j < i
    eye = torch.eye(chunk_size, dtype=k.dtype, device=k.device)
    state = k.new_zeros(heads, dk, v.shape[-1]) if initial is None else initial.to(k.dtype)
    outputs = []
    # NOTE: a few chunks' (C, C) matrices at a time, within SCAN_NUMBERS (a long prompt's all at once would not fit)
    step = max(1, SCAN_NUMBERS // (heads * chunk_size * chunk_size * channels))
    for first in range(0, chunks, step):
        part = slice(first, first + step)
        g, kc, qc = gamma[:, part], ks[:, part], qs[:, part]
        gaps = g[..., :, None, :] - g[..., None, :, :]  # (heads, n, C, C, dk | 1): gamma_i - gamma_j
        within = torch.exp(gaps.masked_fill(~causal[..., None], float("-inf")))  # for j <= i, else 0
        a = betas[:, part] * decayed_products(kc, kc, within) * earlier  # A, strictly lower
        solve = torch.linalg.solve_triangular
        u = solve(eye + a, betas[:, part] * vs[:, part], upper=False, unitriangular=True)  # (heads, n, C, dv)
        w = solve(eye + a, betas[:, part] * torch.exp(g) * kc, upper=False, unitriangular=True)
        scores = decayed_products(qc, kc, within)  # (heads, n, C, C)
        reads = qc * torch.exp(g)  # (heads, n, C, dk): q_i decayed from the chunk's start
        to_end = kc * torch.exp(g[..., -1:, :] - g)  # (heads, n, C, dk): k_j decayed to the chunk's end
        for c in range(g.shape[1]):
            delta = u[:, c] - w[:, c] @ state  # (heads, C, dv)
            outputs.append(reads[:, c] @ state + scores[:, c] @ delta)
            state = state * torch.exp(g[:, c, -1])[..., None] + to_end[:, c].transpose(-1, -2) @ delta
    y = torch.stack(outputs, dim=1)  # (heads, chunks, C, dv)
    return y.flatten(1, 2).transpose(0, 1)[:t], state


def decayed_products(
    x: torch.Tensor,  # (heads, n, C, dk)
    y: torch.Tensor,  # (heads, n, C, dk)
    within: torch.Tensor,  # (heads, n, C, C, dk | 1) exp(gamma_i - gamma_j), 0 for j > i
) -> torch.Tensor:  # (heads, n, C, C): sum_d x_i,d y_j,d exp(gamma_i,d - gamma_j,d)
    """Each pair's product within a chunk, decayed from j to i (one decay a token: the product times it)."""
    if within.shape[-1] == 1:
        return (x @ y.transpose(-1, -2)) * within[..., 0]
    return torch.einsum("hnid,hnjd,hnijd->hnij", x, y, within)

"""Kimi Linear (``kimi_linear``: Moonshot AI's Kimi-Linear-48B-A3B): DeepSeek-V3's outline (``models/deepseek_v2.py``:
multi-head latent attention, experts chosen by sigmoid scores plus a bias beside a shared one, the first MLP dense)
with its attention, without a position embedding, in one layer of four, and Kimi Delta Attention (KDA, Kimi Linear
§2) in the others: a gated DeltaNet (``models/gated_delta_net.py``) whose decay is a vector, one a key channel. HF
parameter names (the Hub's: a KDA layer's mixer is ``self_attn`` too, its MLPs ``block_sparse_moe``).

A KDA layer: q, k and v projected (one head of ``linear_head_dim`` for each of ``linear_num_heads``), each through
its causal depthwise convolution and SiLU; a decay a channel, g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias) (a
low-rank projection, A_log a head); beta = sigmoid(b_proj(x)); the delta rule with diag(exp(g_t)) for the scalar
decay; the output RMS-normalized by head and gated by a sigmoid of another low-rank projection (g_a, g_b); o_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.deepseek_v2 import DeepseekV2DecoderLayer
from sloserve.engine.models.deepseek_v2 import checkpoint_tensor as deepseek_tensor
from sloserve.engine.models.gated_delta_net import MergedConv1d, delta_rule, l2_normalized
from sloserve.engine.models.llama import LlamaForCausalLM, LlamaModel, MergedLinear
from sloserve.engine.models.mamba2 import GatedRMSNorm
from sloserve.engine.models.short_conv import causal_conv
from sloserve.engine.state_cache import StateMetadata


class KimiDeltaAttention(nn.Module):
    """Layer ``layer``'s KDA (module docstring); ``state_index``: its place among the model's state layers."""

    # (transformers' and the Hub's dt_bias is float32 in a bf16 model; A_log's too, for the decay's exponent)
    float32_parameters = ("dt_bias", "A_log")

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        net, h = config.gated_delta_net, config.hidden_size
        self.num_heads, self.head_dim = net["num_k_heads"], net["head_k_dim"]
        width = self.qkv_dim = self.num_heads * self.head_dim
        self.state_index = config.state_layer_index(layer)
        self.in_proj = MergedLinear(h, {"q_proj": width, "k_proj": width, "v_proj": width}, bias=False)
        self.conv1d = MergedConv1d({"q_conv1d": width, "k_conv1d": width, "v_conv1d": width}, net["width"])
        self.f_a_proj = nn.Linear(h, self.head_dim, bias=False)  # (the decay's low-rank projection)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))  # (the Hub's (1, 1, heads, 1): ``checkpoint_tensor``)
        self.b_proj = nn.Linear(h, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(h, self.head_dim, bias=False)  # (the output gate's low-rank projection)
        self.g_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, self.head_dim, net["norm_eps"], True, gate=torch.sigmoid)
        self.o_proj = nn.Linear(width, h, bias=False)

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:  # (T, H) normalized -> (T, H)
        t, heads = x.shape[0], self.num_heads
        mixed = F.silu(causal_conv(self.in_proj(x), meta, meta.cache.conv[self.state_index], self.conv1d))
        q, k, v = mixed.float().view(t, 3, heads, self.head_dim).unbind(1)  # (T, heads, head_dim) each
        q, k = l2_normalized(q) * self.head_dim**-0.5, l2_normalized(k)
        forget = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()  # (T, heads x head_dim)
        decay = -torch.exp(self.A_log.float())[:, None] * F.softplus(forget.view(t, heads, self.head_dim))
        beta = torch.sigmoid(self.b_proj(x)).float()  # (T, heads) NOTE: in the model's dtype, as transformers
        y = delta_rule(q, k, v, decay, beta, meta, meta.cache.ssm[self.state_index])  # (T, heads, head_dim)
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, heads, self.head_dim)
        return self.o_proj(self.o_norm(y.to(x.dtype), gate).reshape(t, self.qkv_dim))


class KimiLinearDecoderLayer(DeepseekV2DecoderLayer):
    """DeepSeek-V2's layer (MLA, DeepSeek's MLPs), its mixer (``self_attn``) a KDA where the config says
    ``linear_attention``."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__(config, backend, layer)
        self.linear = config.layer_has_states(layer)
        if self.linear:
            self.self_attn = KimiDeltaAttention(config, layer)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        if not self.linear:
            return super().forward(x, residual, cos, sin, k_cache, v_cache, meta)
        h, residual = self._input_norm(x, residual)
        return self._after_mixing(self.self_attn(h, meta.states), residual)


class KimiLinearModel(LlamaModel):
    layer_class = KimiLinearDecoderLayer


class KimiLinearForCausalLM(LlamaForCausalLM):
    model_class = KimiLinearModel


def checkpoint_tensor(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor] | None:
    """DeepSeek's reading (``deepseek_v2.checkpoint_tensor``), a KDA's A_log as a vector (the Hub's (1, 1, heads,
    1))."""
    if key.endswith(".self_attn.A_log"):
        return key, tensor.reshape(-1)
    return deepseek_tensor(key, tensor, config)

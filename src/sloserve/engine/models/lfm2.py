"""LFM2 (``lfm2``: Liquid AI's LFM2 350M-2.6B; ``lfm2_moe``: LFM2-8B-A1B): Llama's layers (Qwen3's query and key
norms) where they attend, and in the others a gated short convolution (``models/short_conv.py``) in attention's
place, its states a request's (``state_cache.py``). LFM2-MoE's MLPs after the first ``num_dense_layers`` are
experts routed as DeepSeek-V3's (``moe.DeepseekMoE``: sigmoid scores, the choice by scores plus a bias, one
group, no shared expert). HF parameter names; the Hub's names of the norms, the MLP and the attention's output
projection renamed to Llama's (``CHECKPOINT_NAMES``).

LFM3 (``lfm3``): those layers (convolutions of 7 taps), some attention layers sliding (a rope of their own,
plain; the full layers' turns half of each head's pairs: ``rope_inv_freq``'s proportional), each head's output
gated by a sigmoid of the layer's input (``g_proj``), and each operator's and MLP's output normalized before it
joins the stream (``post_operator_norm``, ``post_ffn_norm``: ``use_sandwich_norm``); its norms' and
attention's names are the engine's (``LFM3_CHECKPOINT_NAMES``: the MLP's, the final norm's, the gate's).
"""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    RMSNorm,
    StreamLayersForCausalLM,
)
from sloserve.engine.models.short_conv import ShortConv

# The checkpoint's names of the modules the engine names as Llama's (the short convolution's are its own: ``conv``)
CHECKPOINT_NAMES = {
    ".operator_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
    ".feed_forward.w1.": ".mlp.gate_proj.",
    ".feed_forward.w3.": ".mlp.up_proj.",
    ".feed_forward.w2.": ".mlp.down_proj.",
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    "model.embedding_norm.": "model.norm.",
    # LFM2-MoE's experts (the Hub's tensor an expert; transformers 5's stacked ones split as they load), router
    # and its bias
    ".feed_forward.experts.": ".mlp.experts.",
    ".feed_forward.gate.": ".mlp.gate.",
    ".feed_forward.expert_bias": ".mlp.gate.e_score_correction_bias",
    ".w1.weight": ".gate_proj.weight",
    ".w3.weight": ".up_proj.weight",
    ".w2.weight": ".down_proj.weight",
}


class Lfm2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer, or, where the config says ``conv``, the same with a short convolution (``conv``) mixing its
    tokens instead of attention."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__(config, backend, layer)
        self.conv = ShortConv(config, layer) if config.layer_has_states(layer) else None

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        if self.conv is None:
            return super().forward(x, residual, cos, sin, k_cache, v_cache, meta)
        h, residual = self._input_norm(x, residual)
        return self._after_mixing(self.conv(h, meta.states), residual)


class Lfm2Model(LlamaModel):
    layer_class = Lfm2DecoderLayer


class Lfm2ForCausalLM(LlamaForCausalLM):
    model_class = Lfm2Model


# LFM3's checkpoint names of the modules the engine names otherwise (its norms and attention are the engine's)
LFM3_CHECKPOINT_NAMES = {
    ".feed_forward.w1.": ".mlp.gate_proj.",
    ".feed_forward.w3.": ".mlp.up_proj.",
    ".feed_forward.w2.": ".mlp.down_proj.",
    "model.embedding_norm.": "model.norm.",
    ".self_attn.gate_proj.": ".self_attn.g_proj.",  # (the Hub's name of the heads' gate; transformers' g_proj)
}


class Lfm3DecoderLayer(nn.Module):
    """A norm, the operator (a short convolution, ``conv``, or attention, ``self_attn``, each head's output gated
    by ``self_attn.g_proj``), its output's norm; a norm, the MLP, its output's norm (those of the outputs
    ``nn.Identity`` without ``use_sandwich_norm``). Takes the residual stream and returns it."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.norm_eps
        self.conv = ShortConv(config, layer) if config.layer_has_states(layer) else None
        self.self_attn = None if self.conv is not None else LlamaAttention(config, backend, layer)
        if self.self_attn is not None and config.extra["use_attention_gate"]:
            self.self_attn.g_proj = nn.Linear(h, config.num_attention_heads, bias=False)
        self.mlp = LlamaMLP(config)
        sandwich = config.extra["use_sandwich_norm"]
        self.operator_norm, self.ffn_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.post_operator_norm = RMSNorm(h, eps) if sandwich else nn.Identity()
        self.post_ffn_norm = RMSNorm(h, eps) if sandwich else nn.Identity()

    def forward(self, x, cos, sin, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        h = self.operator_norm(x)
        if self.conv is not None:
            mixed = self.conv(h, meta.states)
        else:
            attention = self.self_attn
            attended = attention.attend(*attention.project(h, cos, sin), k_cache, v_cache, meta)  # (T, nh, hd)
            if hasattr(attention, "g_proj"):
                attended = attended * torch.sigmoid(attention.g_proj(h))[..., None]
            mixed = attention.output(attended)
        x = x + self.post_operator_norm(mixed)
        return x + self.post_ffn_norm(self.mlp(self.ffn_norm(x)))


class Lfm3Model(LlamaModel):
    layer_class = Lfm3DecoderLayer


class Lfm3ForCausalLM(StreamLayersForCausalLM):
    model_class = Lfm3Model

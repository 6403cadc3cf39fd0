"""Cohere's Command R (``cohere``: 35B) and Command R7B and A (``cohere2``): attention and the MLP in parallel
from one LayerNorm of the stream (mean-centred, a weight and no bias), every head rotated by adjacent pairs
(``ModelConfig.rotary_interleaved``: Q and K rows reordered as they load), the logits scaled by
``logit_scale``; Command R7B's and A's three layers of four see the last ``sliding_window`` positions with
rope, the fourth everything without."""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import LlamaAttention, LlamaMLP, LlamaModel, StreamLayersForCausalLM


class CohereLayerNorm(nn.Module):
    """Cohere's LayerNorm: mean-centred, scaled by a weight, no bias; in float32, as transformers'."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        h = x.float()
        centred = h - h.mean(-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class CohereDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, layer)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = CohereLayerNorm(config.hidden_size, config.norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        h = self.input_layernorm(x)
        return x + self.self_attn(h, cos, sin, k_cache, v_cache, meta) + self.mlp(h)  # (transformers' order)


class CohereModel(LlamaModel):
    layer_class = CohereDecoderLayer
    norm_class = CohereLayerNorm


class CohereForCausalLM(StreamLayersForCausalLM):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores (times
    ``logit_scale``: ``ModelConfig.logits_scaling`` is its inverse)."""

    model_class = CohereModel

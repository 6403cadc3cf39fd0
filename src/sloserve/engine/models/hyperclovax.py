"""HyperCLOVA X SEED (``hyperclovax``: Naver's 0.5B-32B): Granite's scaled layers (``ModelConfig``'s multipliers)
with each part's output RMS-normalized before it is scaled and joins the stream (``post_norm1`` after attention,
``post_norm2`` after the MLP, where ``use_post_norm``). HF parameter names; piecewise graphs as Llama's."""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm


class HyperClovaXDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__(config, backend, layer)
        post_norm = config.extra["use_post_norm"]
        self.post_norm1 = RMSNorm(config.hidden_size, config.norm_eps) if post_norm else nn.Identity()
        self.post_norm2 = RMSNorm(config.hidden_size, config.norm_eps) if post_norm else nn.Identity()

    def _after_mixing(self, attended: torch.Tensor, residual: torch.Tensor):
        """(this layer's MLP output, normalized and scaled, and the stream before it) from its attention's (T, H)."""
        h, residual = self.post_attention_layernorm.add_and_norm(
            self.post_norm1(attended) * self.residual_multiplier, residual
        )
        return self.post_norm2(self.mlp(h)) * self.residual_multiplier, residual


class HyperClovaXModel(LlamaModel):
    layer_class = HyperClovaXDecoderLayer


class HyperClovaXForCausalLM(LlamaForCausalLM):
    model_class = HyperClovaXModel

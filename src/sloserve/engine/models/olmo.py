"""OLMo (``olmo``: OLMo 1B, 7B, 1.7-7B): Llama's layers with LayerNorms that have no weight or bias (in
float32), q, k and v clamped to [-``clip_qkv``, ``clip_qkv``] where the config says (Llama's attention
does it, as OLMoE's). HF parameter names; piecewise graphs as Llama's. (OLMo 2 and 3: olmo2.py.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.engine.models.llama import AddAndNorm, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# transformers' OlmoLayerNorm's epsilon (its configs do not say one)
OLMO_NORM_EPS = 1e-5


class OlmoLayerNorm(AddAndNorm, nn.Module):
    """A LayerNorm without a weight or a bias, in float32, rounded to x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H)
        return F.layer_norm(x.float(), (self.size,), None, None, eps=OLMO_NORM_EPS).to(x.dtype)


class OlmoDecoderLayer(LlamaDecoderLayer):
    norm_class = OlmoLayerNorm


class OlmoModel(LlamaModel):
    layer_class = OlmoDecoderLayer
    norm_class = OlmoLayerNorm


class OlmoForCausalLM(LlamaForCausalLM):
    model_class = OlmoModel

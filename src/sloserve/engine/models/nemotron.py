"""Nemotron (``nemotron``: Nemotron-4 Minitron 4B and 8B, Nemotron-Mini-4B): Llama's layers with LayerNorms
that scale by 1 + weight (``LayerNorm1P``), a two-matrix MLP of squared ReLU (``up_proj``, ``down_proj``:
``UpDownMLP``, Arcee's too), the rotary embedding on the first half of each head. HF parameter names;
piecewise graphs as Llama's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.models.gpt2 import ACTIVATIONS
from sloserve.engine.models.llama import AddAndNorm, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class LayerNorm1P(AddAndNorm, nn.LayerNorm):
    """A LayerNorm whose scale is 1 + weight (a bias too), in x's dtype, as transformers'."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H)
        return F.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


class UpDownMLP(nn.Module):
    """down(act(up(x))): Nemotron's and Arcee's MLP (their squared ReLU, ``hidden_act``), Apertus's (``act``: its
    xIELU, a module with parameters of its own)."""

    def __init__(self, config: ModelConfig, act: nn.Module | None = None, intermediate_size: int | None = None) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, intermediate_size or config.intermediate_size, config.mlp_bias
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act = ACTIVATIONS[config.hidden_act] if act is None else act

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, I) -> (T, H)
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm1P

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return UpDownMLP(config)


class NemotronModel(LlamaModel):
    layer_class = NemotronDecoderLayer
    norm_class = LayerNorm1P


class NemotronForCausalLM(LlamaForCausalLM):
    model_class = NemotronModel

"""Apertus (``apertus``: Apertus 8B and 70B): Llama's layers with query and key norms (Qwen3's, each head) and a
two-matrix MLP of xIELU (``UpDownMLP``); its norms named ``attention_layernorm`` and ``feedforward_layernorm``
(``CHECKPOINT_NAMES``). HF parameter names; piecewise graphs as Llama's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from sloserve.engine.models.nemotron import UpDownMLP

# The checkpoint's names of the modules the engine names as Llama's
CHECKPOINT_NAMES = {
    ".attention_layernorm.": ".input_layernorm.",
    ".feedforward_layernorm.": ".post_attention_layernorm.",
    ".mlp.act_fn.": ".mlp.act.",
}


class XIELU(nn.Module):
    """xIELU (Huang and Schlag, arXiv 2411.13010), one a layer: alpha_p x^2 + beta x where x > 0, else
    alpha_n (expm1(min(x, eps)) - x) + beta x, with alpha_p = softplus(a_p) and alpha_n = beta + softplus(a_n)
    from its learned ``alpha_p`` and ``alpha_n`` (a_p, a_n); ``beta`` and ``eps`` are stored beside them
    (transformers' buffers). In x's dtype, as transformers' Python form."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1))
        self.alpha_n = nn.Parameter(torch.empty(1))
        self.beta = nn.Parameter(torch.empty(()))
        self.eps = nn.Parameter(torch.empty(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x, negative) + self.beta * x


class ApertusDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return UpDownMLP(config, XIELU())


class ApertusModel(LlamaModel):
    layer_class = ApertusDecoderLayer


class ApertusForCausalLM(LlamaForCausalLM):
    model_class = ApertusModel

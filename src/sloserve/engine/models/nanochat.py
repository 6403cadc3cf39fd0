"""nanochat (``nanochat``: Karpathy's nanochat models, as transformers holds them): Llama's layers with RMSNorms of no
weight (before attention and the MLP, the final one, and each rotated query and key head's: Llama 4's
``unweighted_rms_norm``), a two-matrix MLP of squared ReLU (``fc1``, ``fc2``: Nemotron's ``UpDownMLP``), the rotary
embedding turned the other way (transformers' NanoChat rotates by -theta: its rotate_half gives (x2, -x1), Llama's
(-x2, x1)), and the logits capped by tanh (``final_logit_softcapping``). HF parameter names but the MLP's
(``CHECKPOINT_NAMES``); the embeddings normed before the first layer; piecewise graphs as Llama's."""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import AddAndNorm, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, Rotary
from sloserve.engine.models.llama4 import Llama4Attention, unweighted_rms_norm
from sloserve.engine.models.nemotron import UpDownMLP

# Its checkpoints' names of the MLP's matrices
CHECKPOINT_NAMES = {".mlp.fc1.": ".mlp.up_proj.", ".mlp.fc2.": ".mlp.down_proj."}


class UnweightedRMSNorm(AddAndNorm, nn.Module):
    """x / sqrt(mean(x^2) + eps), no weight (transformers' NanoChatRMSNorm, Llama 4's L2 norm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H)
        return unweighted_rms_norm(x, self.eps)


class NanoChatRotary(Rotary):
    """Llama's rotary embedding turned by -theta (the module docstring): its sines negated."""

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().for_positions(positions, dtype)
        return cos, -sin


class NanoChatDecoderLayer(LlamaDecoderLayer):
    norm_class = UnweightedRMSNorm

    def make_attention(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> nn.Module:
        # (its rotated heads normed without a weight: qk_unweighted_norm)
        return Llama4Attention(config, backend, layer)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return UpDownMLP(config)


class NanoChatModel(LlamaModel):
    layer_class = NanoChatDecoderLayer
    norm_class = UnweightedRMSNorm


class NanoChatForCausalLM(LlamaForCausalLM):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores, capped."""

    model_class = NanoChatModel

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.rotary = NanoChatRotary(config)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Llama's, the embeddings normed (by the final norm, as transformers' NanoChatModel does before the layers)."""
        x, cos, sin = super().embed(input_ids, positions)
        return self.model.norm(x), cos, sin

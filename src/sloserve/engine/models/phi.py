"""Phi-1, Phi-1.5 and Phi-2 (``phi``): attention and a GELU MLP in parallel from one LayerNorm of the stream
(x + attn(ln(x)) + mlp(ln(x))), biases everywhere (the LM head's too), the rotary embedding on the leading
part of each head (``partial_rotary_factor``: 0.4 of Phi-2's 80 dimensions, 0.5 of Phi-1's 64), a final
LayerNorm. Llama's attention with HF's names (``q_proj``, ``k_proj``, ``v_proj``), but for its output
projection and final norm (``CHECKPOINT_NAMES``: ``dense``, ``final_layernorm``)."""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.gpt2 import ACTIVATIONS
from sloserve.engine.models.llama import LlamaAttention, LlamaModel, StreamLayersForCausalLM

# The checkpoint's names of the modules the engine names as Llama's
CHECKPOINT_NAMES = {".self_attn.dense.": ".self_attn.o_proj.", "model.final_layernorm.": "model.norm."}


class PhiMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, I) -> (T, H)
        return self.fc2(self.act(self.fc1(x)))


class PhiDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, layer)
        self.mlp = PhiMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        h = self.input_layernorm(x)
        return self.self_attn(h, cos, sin, k_cache, v_cache, meta) + self.mlp(h) + x  # (transformers' order)


class PhiModel(LlamaModel):
    layer_class = PhiDecoderLayer
    norm_class = nn.LayerNorm


class PhiForCausalLM(StreamLayersForCausalLM):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores (an LM
    head with a bias)."""

    model_class = PhiModel

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

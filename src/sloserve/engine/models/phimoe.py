"""Phi-3.5-MoE (``phimoe``: 42B-A6.6B): Llama's layers with LayerNorms (with biases), q/k/v and o biases, an LM
head with a bias where ``lm_head_bias`` says, and every MLP Mixtral's experts (the Hub's names,
``block_sparse_moe.experts.E.w1``...) routed by SparseMixer (Liu et al. 2024) as it infers:

- the first expert: the best router logit's; its weight the softmax, at it, of the logits within 2 jitter_eps of it
  (relative: (max - s) / max(|s|, max) <= 2 jitter_eps; the others masked);
- the second: the best of the others; its weight the softmax, at it, of the others within 2 jitter_eps of it
  (relative to max(|s|, that best)), the first masked.

The two weights are not renormalized. Its LongRoPE scales cos and sin by the config's ``short_mscale`` or
``long_mscale`` with the short or the long factors, the set the engine serves (``llama.rope_attention_factor``), as
Microsoft's code and vLLM do (transformers 5.24's Phimoe turns by the short factors at every length, its mscale
alone switching). HF parameter names."""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import LayerNorm, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from sloserve.engine.models.moe import Experts


def _far(logits: torch.Tensor, best: torch.Tensor, jitter_eps: float) -> torch.Tensor:  # (T, E) bool
    """The logits too far from ``best`` (T, 1) to share its softmax: (best - s) / max(|s|, best) > 2 jitter_eps."""
    return (best - logits) / logits.abs().clamp(min=best) > 2 * jitter_eps


def sparsemixer_top2(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts), each (T, 2), of router ``logits`` (T, E) (module docstring; transformers' ``sparsemixer``
    out of training)."""
    best, first = logits.max(dim=-1, keepdim=True)  # (T, 1) each
    gates = logits.masked_fill(_far(logits, best, jitter_eps), float("-inf")).softmax(dim=-1)  # (T, E)
    others = logits.scatter(-1, first, float("-inf"))  # (T, E) the first one masked
    second_best, second = others.max(dim=-1, keepdim=True)
    gates_2 = others.masked_fill(_far(logits, second_best, jitter_eps), float("-inf")).softmax(dim=-1)
    weights = torch.cat((gates.gather(-1, first), gates_2.gather(-1, second)), dim=-1)
    return weights, torch.cat((first, second), dim=-1)


class PhimoeMoE(nn.Module):
    """The router (``gate``) and the experts, routed by ``sparsemixer_top2``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        self.jitter_eps = moe["router_jitter_noise"]
        self.gate = nn.Linear(config.hidden_size, moe["num_experts"], bias=False)
        self.experts = Experts(moe["num_experts"], config.hidden_size, moe["moe_intermediate_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        weights, experts = sparsemixer_top2(self.gate(x), self.jitter_eps)  # (T, 2) each
        return self.experts(x, experts, weights)


class PhimoeDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return PhimoeMoE(config)


class PhimoeModel(LlamaModel):
    layer_class = PhimoeDecoderLayer
    norm_class = LayerNorm


class PhimoeForCausalLM(LlamaForCausalLM):
    model_class = PhimoeModel

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        if config.lm_head_bias:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

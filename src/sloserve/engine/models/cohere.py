"""Cohere's Command R (``cohere``: 35B), Command R7B and A (``cohere2``) and Command A+ (``cohere2_moe``):
attention and the MLP in parallel from one LayerNorm of the stream (mean-centred, a weight and no bias), every
head rotated by adjacent pairs (``ModelConfig.rotary_interleaved``: Q and K rows reordered as they load), the
logits scaled by ``logit_scale``; Command R7B's and A's three layers of four see the last ``sliding_window``
positions with rope, the fourth everything without. Command A+'s MLPs are experts after its first dense ones,
beside a shared MLP (``Cohere2MoE``), its norms RMSNorms where its config gives their epsilon."""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import LlamaAttention, LlamaMLP, LlamaModel, RMSNorm, StreamLayersForCausalLM
from sloserve.engine.models.moe import Experts


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


def cohere_norm(config: ModelConfig) -> nn.Module:
    """The model's norm: Cohere's LayerNorm, or an RMSNorm (Command A+'s, where its config gives rms_norm_eps)."""
    return (RMSNorm if config.extra.get("rms_norm") else CohereLayerNorm)(config.hidden_size, config.norm_eps)


class Cohere2MoE(nn.Module):
    """Command A+'s MoE MLP (transformers' ``Cohere2MoeSparseMoeBlock``): each token's top k router logits (``gate``)
    weigh their experts by their softmax, or by their sigmoids (renormalized where ``norm_topk_prob``); a shared
    MLP (``shared_experts``: its ``num_shared_experts`` as one, or none) runs for every token, its output added to
    the routed one's or averaged with it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        self.top_k, self.selection, self.norm_topk_prob = (
            moe["num_experts_per_tok"], moe["expert_selection"], moe["norm_topk_prob"])  # fmt: skip
        self.average = moe["shared_expert_combination"] == "average"
        self.gate = nn.Linear(config.hidden_size, moe["num_experts"], bias=False)
        self.experts = Experts(moe["num_experts"], config.hidden_size, moe["moe_intermediate_size"])
        shared = moe["shared_expert_intermediate_size"]
        self.shared_experts = LlamaMLP(config, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        scores, experts = self.gate(x).topk(self.top_k, dim=-1)  # (T, k) each, of the logits in x's dtype
        if self.selection == "softmax":
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
        else:
            weights = torch.sigmoid(scores)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = self.experts(x, experts, weights.to(x.dtype))
        if self.shared_experts is None:
            return routed
        out = routed + self.shared_experts(x)
        return out / 2 if self.average else out


class CohereDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, layer)
        self.mlp = Cohere2MoE(config) if config.layer_is_moe(layer) else LlamaMLP(config)
        self.input_layernorm = cohere_norm(config)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        h = self.input_layernorm(x)
        return x + self.self_attn(h, cos, sin, k_cache, v_cache, meta) + self.mlp(h)  # (transformers' order)


class CohereModel(LlamaModel):
    layer_class = CohereDecoderLayer

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.norm = cohere_norm(config)


class CohereForCausalLM(StreamLayersForCausalLM):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores (times
    ``logit_scale``: ``ModelConfig.logits_scaling`` is its inverse)."""

    model_class = CohereModel

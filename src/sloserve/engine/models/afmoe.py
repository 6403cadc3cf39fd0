"""AFMoE (``afmoe``: Arcee's Trinity Nano, Mini and Large): a norm before and after each of a layer's parts (attention,
MLP), each output normalized before it joins the residual stream; three layers of four sliding (``sliding_window``)
and rotated, the fourth global and unrotated; queries and keys normalized by head; each head's output times
sigmoid(``gate_proj``(x)), one gate a number; a dense first MLP (``num_dense_layers``), then DeepSeek-V3's experts
(sigmoid scores, chosen with a bias, renormalized, times ``route_scale``) beside shared ones; with ``mup_enabled``
the embeddings scaled by sqrt(hidden_size). The Hub's names (``mlp.router.gate``, ``mlp.expert_bias``) load into the
router's (``CHECKPOINT_NAMES``)."""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import LlamaAttention, LlamaModel, RMSNorm, StreamLayersForCausalLM, mlp

CHECKPOINT_NAMES = {
    ".mlp.router.gate.weight": ".mlp.gate.weight",
    ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
}


class AfmoeDecoderLayer(nn.Module):
    """A norm, the gated attention, its output's norm; a norm, the MLP, its output's norm. Takes the residual stream
    and returns it."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.norm_eps
        self.self_attn = LlamaAttention(config, backend, layer)
        self.self_attn.gate_proj = nn.Linear(h, config.num_attention_heads * config.head_dim, bias=False)
        self.mlp = mlp(config, layer)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.pre_mlp_layernorm, self.post_mlp_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        h = self.input_layernorm(x)
        attention = self.self_attn
        attended = attention.attend(*attention.project(h, cos, sin), k_cache, v_cache, meta)  # (T, nh, hd)
        gated = attended.reshape(x.shape[0], -1) * torch.sigmoid(attention.gate_proj(h))  # (T, nh hd)
        x = x + self.post_attention_layernorm(attention.o_proj(gated))
        return x + self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(x)))


class AfmoeModel(LlamaModel):
    layer_class = AfmoeDecoderLayer


class AfmoeForCausalLM(StreamLayersForCausalLM):
    model_class = AfmoeModel

    def embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, H)
        x = self.model.embed_tokens(input_ids)
        return x if self.config.embedding_multiplier == 1.0 else x * self.config.embedding_multiplier

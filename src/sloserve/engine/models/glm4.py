"""GLM-4-0414 (``glm4``: Zhipu's GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): Llama's parts, each sublayer's
output normalized again before it joins the residual stream.

- A layer normalizes its input (``input_layernorm``), attends, normalizes the attention's output
  (``post_self_attn_layernorm``) and adds it to the stream; then normalizes the stream
  (``post_attention_layernorm``, HF's name for the norm before the MLP), runs the MLP, normalizes its
  output (``post_mlp_layernorm``) and adds it.
- The rotary embedding turns half of each head, by adjacent pairs (``ModelConfig.rotary_interleaved``: the
  checkpoint's Q and K rows are reordered as they load, ``models.deinterleave_rotary_rows``); q/k/v have
  biases; gate and up are stored fused.
"""

from __future__ import annotations

from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import LlamaAttention, LlamaMLP, LlamaModel, RMSNorm, StreamLayersForCausalLM


class Glm4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, layer)
        self.mlp = LlamaMLP(config)
        h, eps = config.hidden_size, config.norm_eps
        self.input_layernorm, self.post_self_attn_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.post_attention_layernorm, self.post_mlp_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        x = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta))
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))


class Glm4Model(LlamaModel):
    layer_class = Glm4DecoderLayer


class Glm4ForCausalLM(StreamLayersForCausalLM):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores."""

    model_class = Glm4Model

"""OLMo 2 (``olmo2``: AI2's 1B-32B), OLMo 3 (``olmo3``: 7B, 32B) and EXAONE 4 (``exaone4``): Llama's parts
in another order.

- Each layer normalizes its attention's and its MLP's outputs before they join the residual stream
  (``post_attention_layernorm``, ``post_feedforward_layernorm``), not their inputs: a layer's input is the
  stream itself.
- Queries and keys are normalized over the whole projection (RMSNorm of width heads x head_dim), before
  they are cut into heads and rotated (Qwen3 normalizes each head).
- OLMo 3: three layers of four see the last ``sliding_window`` positions, with a rope of their own (the
  others' rope scaling, YaRN in the long-context models, is not theirs).
- EXAONE 4: each query and key head normalized (as Qwen3's); three layers of four sliding, the fourth
  global and without a rotary embedding.
"""

from __future__ import annotations

from torch import nn

from sloserve.checkpoint.config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import LlamaAttention, LlamaMLP, LlamaModel, RMSNorm, StreamLayersForCausalLM


class Olmo2DecoderLayer(nn.Module):
    """Llama's attention (OLMo's query and key norms over the whole projections, ``qk_norm_whole_projection``;
    EXAONE's per head) and MLP, each output normalized before it joins the stream."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, layer)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, k_cache, v_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(LlamaModel):
    layer_class = Olmo2DecoderLayer


class Olmo2ForCausalLM(StreamLayersForCausalLM):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores."""

    model_class = Olmo2Model

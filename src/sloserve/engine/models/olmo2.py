"""OLMo 2 (``olmo2``: AI2's 1B-32B), OLMo 3 (``olmo3``: 7B, 32B), FlexOlmo (``flex_olmo``) and EXAONE 4 (``exaone4``):
Llama's parts in another order.

- Each layer normalizes its attention's and its MLP's outputs before they join the residual stream
  (``post_attention_layernorm``, ``post_feedforward_layernorm``), not their inputs: a layer's input is the
  stream itself.
- Queries and keys are normalized over the whole projection (RMSNorm of width heads x head_dim), before
  they are cut into heads and rotated (Qwen3 normalizes each head).
- FlexOlmo (``flex_olmo``: 7x7B): OLMo 2's layers, each MLP a mixture of experts (OLMoE's: a softmax's top k,
  not renormalized where ``norm_topk_prob`` is false, its default).
- OLMo 3: three layers of four see the last ``sliding_window`` positions, with a rope of their own (the
  others' rope scaling, YaRN in the long-context models, is not theirs).
- EXAONE 4: each query and key head normalized (as Qwen3's); three layers of four sliding, the fourth
  global and without a rotary embedding.
- OLMo Hybrid (``olmo_hybrid``: 7B): those attention layers (without a rotary embedding as released), one of
  four; in the others a gated DeltaNet (``models/gated_delta_net.py``, its states a request's) in Llama's order:
  a norm of the stream, the DeltaNet, added; a norm, the MLP, added. Its DeltaNet's output projection and norm
  are ``o_proj`` and ``o_norm`` in its checkpoints (``HYBRID_CHECKPOINT_NAMES``).
"""

from __future__ import annotations

from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.gated_delta_net import GatedDeltaNet
from sloserve.engine.models.llama import LlamaAttention, LlamaMLP, LlamaModel, RMSNorm, StreamLayersForCausalLM, mlp


class Olmo2DecoderLayer(nn.Module):
    """Llama's attention (OLMo's query and key norms over the whole projections, ``qk_norm_whole_projection``;
    EXAONE's per head) and MLP (FlexOlmo's experts), each output normalized before it joins the stream."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, layer)
        self.mlp = mlp(config, layer)
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


# OLMo Hybrid's checkpoint names (OLMo-core's, as transformers saves them too) of its layers' norms before the mixer
# and the MLP (an attention layer's "post_attention_layernorm" is saved as its "feedforward_layer_norm": the same
# renaming), and of its DeltaNets' output projection and norm (the engine's: Qwen3.5's)
HYBRID_CHECKPOINT_NAMES = {
    ".attention_layer_norm.": ".input_layernorm.",
    ".feedforward_layer_norm.": ".post_attention_layernorm.",
    ".linear_attn.o_proj.": ".linear_attn.out_proj.",
    ".linear_attn.o_norm.": ".linear_attn.norm.",
}


class OlmoHybridDecoderLayer(nn.Module):
    """OLMo 2's layer (``self_attn``, each output normalized) or, where the config says ``linear_attention``, a gated
    DeltaNet (``linear_attn``) and the MLP each after a norm of the stream. Takes the residual stream and returns it."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.norm_eps
        self.linear_attn = GatedDeltaNet(config, layer) if config.layer_has_states(layer) else None
        self.self_attn = None if self.linear_attn is not None else LlamaAttention(config, backend, layer)
        self.mlp = LlamaMLP(config)
        if self.linear_attn is not None:
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        else:
            self.post_attention_layernorm, self.post_feedforward_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        if self.linear_attn is None:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, k_cache, v_cache, meta))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        x = x + self.linear_attn(self.input_layernorm(x), meta.states)
        return x + self.mlp(self.post_attention_layernorm(x))


class OlmoHybridModel(LlamaModel):
    layer_class = OlmoHybridDecoderLayer


class OlmoHybridForCausalLM(StreamLayersForCausalLM):
    model_class = OlmoHybridModel

"""LFM2 (``lfm2``: Liquid AI's LFM2 350M-2.6B; ``lfm2_moe``: LFM2-8B-A1B): Llama's layers (Qwen3's query and key
norms) where they attend, and in the others a gated short convolution (``models/short_conv.py``) in attention's
place, its states a request's (``state_cache.py``). LFM2-MoE's MLPs after the first ``num_dense_layers`` are
experts routed as DeepSeek-V3's (``moe.DeepseekMoE``: sigmoid scores, the choice by scores plus a bias, one
group, no shared expert). HF parameter names; the Hub's names of the norms, the MLP and the attention's output
projection renamed to Llama's (``CHECKPOINT_NAMES``).
"""

from __future__ import annotations

from sloserve.checkpoint.config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from sloserve.engine.models.short_conv import ShortConv

# The checkpoint's names of the modules the engine names as Llama's (the short convolution's are its own: ``conv``)
CHECKPOINT_NAMES = {
    ".operator_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
    ".feed_forward.w1.": ".mlp.gate_proj.",
    ".feed_forward.w3.": ".mlp.up_proj.",
    ".feed_forward.w2.": ".mlp.down_proj.",
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    "model.embedding_norm.": "model.norm.",
    # LFM2-MoE's experts (the Hub's tensor an expert; transformers 5's stacked ones split as they load), router
    # and its bias
    ".feed_forward.experts.": ".mlp.experts.",
    ".feed_forward.gate.": ".mlp.gate.",
    ".feed_forward.expert_bias": ".mlp.gate.e_score_correction_bias",
    ".w1.weight": ".gate_proj.weight",
    ".w3.weight": ".up_proj.weight",
    ".w2.weight": ".down_proj.weight",
}


class Lfm2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer, or, where the config says ``conv``, the same with a short convolution (``conv``) mixing its
    tokens instead of attention."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__(config, backend, layer)
        self.conv = ShortConv(config, layer) if config.layer_has_states(layer) else None

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        if self.conv is None:
            return super().forward(x, residual, cos, sin, k_cache, v_cache, meta)
        h, residual = self._input_norm(x, residual)
        return self._after_mixing(self.conv(h, meta.states), residual)


class Lfm2Model(LlamaModel):
    layer_class = Lfm2DecoderLayer


class Lfm2ForCausalLM(LlamaForCausalLM):
    model_class = Lfm2Model

"""Hunyuan dense (``hunyuan_v1_dense``: Hunyuan 0.5B, 1.8B, 4B, 7B) and MoE (``hunyuan_v1_moe``: Hunyuan-A13B):
Llama's layers whose query and key heads are normalized (RMSNorm) after the rotary embedding, not before as
Qwen3's (``ModelConfig.qk_norm_after_rotary``, in ``LlamaAttention``), the rope base stretched by its fixed NTK
alpha (config.py); the MoE's every MLP a softmax-routed mixture of experts (renormalized top k) beside an ungated
shared expert (``moe.DeepseekMoE``'s greedy routing). Its checkpoints name those norms ``query_layernorm`` and
``key_layernorm``, the router ``gate.wg`` and the shared expert ``shared_mlp``: they load under Llama's and
DeepSeek's names."""

from __future__ import annotations

# The checkpoint's names of the modules the engine names as Llama's (and DeepSeek's MoE's)
CHECKPOINT_NAMES = {
    ".self_attn.query_layernorm.": ".self_attn.q_norm.",
    ".self_attn.key_layernorm.": ".self_attn.k_norm.",
    ".mlp.gate.wg.": ".mlp.gate.",
    ".mlp.shared_mlp.": ".mlp.shared_experts.",
}

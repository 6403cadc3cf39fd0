"""Hunyuan dense (``hunyuan_v1_dense``: Hunyuan 0.5B, 1.8B, 4B, 7B): Llama's layers whose query and key heads
are normalized (RMSNorm) after the rotary embedding, not before as Qwen3's (``ModelConfig.qk_norm_after_rotary``,
in ``LlamaAttention``), the rope base stretched by its fixed NTK alpha (config.py). Its checkpoints name those
norms ``query_layernorm`` and ``key_layernorm``: they load as Llama's ``q_norm`` and ``k_norm``."""

from __future__ import annotations

# The checkpoint's names of the modules the engine names as Llama's
CHECKPOINT_NAMES = {
    ".self_attn.query_layernorm.": ".self_attn.q_norm.",
    ".self_attn.key_layernorm.": ".self_attn.k_norm.",
}

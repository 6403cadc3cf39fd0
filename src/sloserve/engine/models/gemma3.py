"""Gemma 3 text models (``gemma3_text``), Gemma 2 (``gemma2``) and Gemma (``gemma``: Gemma 1, CodeGemma): the
Llama layout with Gemma's differences.

- The embeddings are scaled by sqrt(hidden_size) (in the weights' dtype, as transformers does).
- RMSNorms scale by (1 + weight), computed in float32 and rounded once (``GemmaRMSNorm``).
- Each layer has four norms: before and after attention, before and after the MLP, each output
  normalized before it joins the residual stream (Gemma 1's two: Llama's, ``GemmaForCausalLM``).
- Queries and keys are normalized per head (``q_norm``, ``k_norm``; Gemma 3 only) before the rotary
  embedding; scores are scaled by ``query_pre_attn_scalar ** -0.5`` (and capped by tanh: Gemma 2's
  ``attn_logit_softcapping``).
- The MLP is GeGLU: down(gelu_tanh(gate) * up).
- Sliding-window layers (``ModelConfig.layer_types``) see the last ``sliding_window`` positions, with
  their own rope base (``rope_local_theta``; Gemma 2's is ``rope_theta``); the others see everything,
  with ``rope_theta`` and its scaling.

NOTE: the KV cache keeps every layer's K/V for the whole context: the KV manager has one block
table for all layers, and the global layers need all of it. A sliding layer's attention reads only
its window (attention.py), so the memory its older positions hold is what a per-layer manager would
free; the schedulers size requests as for full attention (an upper bound on what Gemma 3 needs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend, AttentionMetadata
from sloserve.engine.models.llama import (
    AddAndNorm,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    MergedLinear,
    StreamLayersForCausalLM,
    apply_rotary,
    qkv_projection,
)


class GemmaRMSNorm(AddAndNorm, nn.Module):
    """x / rms(x) * (1 + weight), in float32, rounded to x's dtype once."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., size)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        hd, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.qkv_proj = qkv_projection(config)
        self.o_proj = nn.Linear(nh * hd, config.hidden_size, bias=config.attention_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(hd, config.norm_eps)
            self.k_norm = GemmaRMSNorm(hd, config.norm_eps)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcapping
        self.window = config.layer_window(layer)
        self.backend = backend

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        t, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, nh + 2 * nkv, self.head_dim)  # (T, nh + 2 nkv, hd)
        qk = qkv[:, : nh + nkv]  # (T, nh + nkv, hd)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])), dim=1)
        qk = apply_rotary(qk, cos, sin)
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]
        out = self.backend.forward(
            q, k, v, k_cache, v_cache, meta, scale=self.scale, window=self.window, softcap=self.softcap
        )
        return self.o_proj(out.reshape(t, -1))


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.intermediate_size = i
        self.gate_up_proj = MergedLinear(h, {"gate_proj": i, "up_proj": i}, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 I)
        i = self.intermediate_size
        return self.down_proj(F.gelu(gate_up[:, :i], approximate="tanh") * gate_up[:, i:])


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.norm_eps
        self.self_attn = Gemma3Attention(config, backend, layer)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        # (the norms of each part's output; VaultGemma's layers have none)
        output_norms = config.extra.get("output_norms", True)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps) if output_norms else nn.Identity()
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps) if output_norms else nn.Identity()

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        attended = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(LlamaModel):
    layer_class = Gemma3DecoderLayer
    norm_class = GemmaRMSNorm


def scaled_embeddings(x: torch.Tensor, hidden_size: int) -> torch.Tensor:  # (T, H)
    """Gemma's embeddings times sqrt(hidden_size), the scale rounded to their dtype first (as transformers)."""
    return x * torch.tensor(math.sqrt(hidden_size), dtype=x.dtype)


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Gemma 1's layer: Llama's, with Gemma's norms and its GeGLU MLP."""

    norm_class = GemmaRMSNorm

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return Gemma3MLP(config)


class GemmaModel(LlamaModel):
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1: Llama's outline (and its piecewise graphs), the embeddings scaled."""

    model_class = GemmaModel

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        x, cos, sin = super().embed(input_ids, positions)
        return scaled_embeddings(x, self.config.hidden_size), cos, sin


class Gemma3ForCausalLM(StreamLayersForCausalLM):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores
    (capped by tanh where the config says so). Its rotary embedding is the global layers', ``local_rotary``
    the sliding ones'."""

    model_class = Gemma3Model

    def embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, H)
        return scaled_embeddings(self.model.embed_tokens(input_ids), self.config.hidden_size)

"""Llama 4's language model (``llama4_text``: Scout 17B-16E, Maverick 17B-128E; ``llama4`` multimodal checkpoints
served as text). Llama's layers (a norm before attention and before the MLP), HF parameter names (the MLP's,
``feed_forward``, renamed to ``mlp`` as it loads).

- Three layers of four rotate their queries and keys (adjacent pairs, transformers' complex product: the rows load
  reordered to halves, ``ModelConfig.rotary_interleaved``), see only the positions of their own chunk of 8,192
  (``ModelConfig.attention_chunk_size``: a query at p sees p - p % 8192 .. p, the backend's ``chunk``) and divide
  each rotated query and key head by its root mean square (``use_qk_norm``, no weight; Maverick's are not).
- The fourth neither rotates nor is chunked: it sees every position, its queries scaled by
  1 + attn_scale ln(1 + floor((p + 1) / floor_scale)) (``attn_temperature_tuning``: 1 up to position 8,190).
- The MLPs are dense (of ``intermediate_size_mlp``) or experts (every layer of Scout's, every other of Maverick's):
  each token's top k by router logit (one, in both), the token scaled by the sigmoid of that logit before each
  expert (its input, not its output), beside a shared expert every token runs unscaled.

NOTE: transformers rotates Llama 4's queries and keys in float32 and scales the queries in float32 before casting
them back; so does the engine (``Llama4Rotary``'s tables stay float32), so that a bf16 model's rotated heads are
transformers' bit for bit. The cost model prices a chunked layer's attention as a full one's (an upper bound).
"""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    Rotary,
    apply_rotary,
)
from sloserve.engine.models.moe import Experts

# Llama 4's checkpoint names of the modules the engine names as Llama's: the MLP's, and the router's in it
CHECKPOINT_NAMES = {".feed_forward.router.": ".mlp.gate.", ".feed_forward.": ".mlp."}


class Llama4Rotary(Rotary):
    """Llama 4's rotary tables (T, 2, rotary_dim), float32: row 0 the rotation's; row 1 the query scale of the
    layers that do not rotate, as cos (sin 0), where ``attn_scale`` says (else one row)."""

    table_dtype = torch.float32

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().for_positions(positions, torch.float32)  # (T, 1, rotary_dim) each
        if self.config.attn_scale is None:
            return cos, sin
        floors = torch.floor((positions.float() + 1) / self.config.floor_scale)  # (T,)
        scale = torch.log1p(floors) * self.config.attn_scale + 1  # (T,)
        return torch.cat((cos, scale[:, None, None].expand_as(cos)), dim=1), torch.cat((sin, torch.zeros_like(sin)), 1)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:  # (..., hd) -> (..., hd)
    """x / sqrt(mean(x^2) + eps) over the last dimension, in float32 (transformers' Llama4TextL2Norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(LlamaAttention):
    """Llama 4's attention (module docstring): rotated, chunked and normalized in three layers of four, its queries
    scaled by position in the fourth. The backend sees its chunk (``LlamaAttention.chunk``)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__(config, backend, layer)
        self.norm_eps = config.norm_eps
        self.unweighted_norm = config.qk_unweighted_norm and self.rotates
        self.temperature = config.attn_scale is not None and not self.rotates

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q, k, v): (T, nh, hd), (T, nkv, hd), (T, nkv, hd); ``cos``, ``sin``: ``Llama4Rotary``'s tables."""
        t, nh, nkv, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(t, nh + 2 * nkv, hd)  # (T, nh + 2 nkv, hd)
        qk, v = qkv[:, : nh + nkv], qkv[:, nh + nkv :]
        if self.rotates:  # (in float32, as transformers turns them)
            qk = apply_rotary(qk.float(), cos[:, :1], sin[:, :1]).to(x.dtype)
            if self.unweighted_norm:
                qk = unweighted_rms_norm(qk, self.norm_eps)
            return qk[:, :nh], qk[:, nh:], v
        q = qk[:, :nh]
        if self.temperature:
            q = (q.float() * cos[:, 1:, :1]).to(x.dtype)  # (T, nh, hd) * (T, 1, 1) in float32
        return q, qk[:, nh:], v


class Llama4MoE(nn.Module):
    """Llama 4's MLP of experts: the router (``gate``; the checkpoint's ``router``) picks each token's top k experts
    by logit; the token goes to each scaled by the sigmoid of that logit (transformers' Llama4TextMoe: the expert's
    input scaled, not its output), the outputs summed in the experts' order, beside the shared expert every token
    runs unscaled."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        self.top_k = moe["num_experts_per_tok"]
        self.gate = nn.Linear(config.hidden_size, moe["num_experts"], bias=False)
        self.experts = Experts(moe["num_experts"], config.hidden_size, moe["moe_intermediate_size"])
        self.shared_expert = LlamaMLP(config, moe["shared_expert_intermediate_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        logits, experts = self.gate(x).topk(self.top_k, dim=-1)  # (T, k) each
        experts, order = experts.sort(dim=-1)  # (T, k) in the experts' order, as transformers sums them
        scores = torch.sigmoid(logits.gather(1, order).float()).to(x.dtype)  # (T, k)
        t, k = experts.shape
        inputs = (x[:, None, :] * scores[..., None]).flatten(0, 1)  # (T k, H): the token once for each expert
        routed = self.experts(inputs, experts.reshape(t * k, 1), scores.new_ones(t * k, 1))  # (T k, H)
        return self.shared_expert(x) + routed.view(t, k, -1).sum(dim=1)


class Llama4DecoderLayer(LlamaDecoderLayer):
    def make_attention(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> nn.Module:
        return Llama4Attention(config, backend, layer)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return Llama4MoE(config) if config.layer_is_moe(layer) else LlamaMLP(config)


class Llama4Model(LlamaModel):
    layer_class = Llama4DecoderLayer


class Llama4ForCausalLM(LlamaForCausalLM):
    model_class = Llama4Model

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.rotary = Llama4Rotary(config)

"""Qwen3-Next (``qwen3_next``: Qwen3-Next-80B-A3B) and Qwen3.5's language models (``qwen3_5_text``: 0.8B-27B;
``qwen3_5_moe_text``: 35B-A3B-397B-A17B): most layers mix their tokens by gated DeltaNet
(``models/gated_delta_net.py``, its states a request's: ``state_cache.py``), every fourth by attention. HF
parameter names.

- Attention is Qwen3's (each query and key head normalized, a quarter of each head rotated) with each query's
  output gated: ``q_proj`` gives a head's query and its gate side by side, and the heads' attention is multiplied
  by sigmoid(gate) before ``o_proj``.
- Every RMSNorm scales by (1 + weight) (``GemmaRMSNorm``), the query and key norms too.
- The MLPs are dense (Qwen3.5's small models) or experts beside a shared one gated by a sigmoid of the token
  (Qwen2-MoE's: ``moe.SparseMoE``), the top weights renormalized.
- Qwen3-Next's checkpoints hold the DeltaNet's projections grouped by query/key head (each head's q, k, its value
  heads' v, then z; its value heads' b, then a: ``in_proj_qkvz``, ``in_proj_ba``); the engine's rows are Qwen3.5's
  (all q, all k, all v, all z; all b, all a), so they are reordered as they load (``checkpoint_tensor``). The
  multi-token-prediction layers (``mtp.``) are not read, as vLLM serves these models without them.
"""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.gated_delta_net import GatedDeltaNet
from sloserve.engine.models.gemma3 import GemmaRMSNorm
from sloserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, MergedLinear, apply_rotary


class Qwen3NextAttention(nn.Module):
    """Layer ``layer``'s attention (module docstring): Q (with each head's gate), K and V as one projection."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        hd, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        parts = {"q_proj": 2 * nh * hd, "k_proj": nkv * hd, "v_proj": nkv * hd}  # (q_proj: each head's query, gate)
        self.qkv_proj = MergedLinear(config.hidden_size, parts, bias=config.attention_bias)
        self.o_proj = nn.Linear(nh * hd, config.hidden_size, bias=config.attention_bias)
        self.q_norm, self.k_norm = GemmaRMSNorm(hd, config.norm_eps), GemmaRMSNorm(hd, config.norm_eps)
        self.backend = backend

    def forward(self, x, cos, sin, k_cache, v_cache, meta) -> torch.Tensor:  # (T, H) normalized -> (T, H)
        t, nh, nkv, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q_and_gate, k, v = self.qkv_proj(x).split((2 * nh * hd, nkv * hd, nkv * hd), dim=-1)
        q, gate = q_and_gate.view(t, nh, 2 * hd).chunk(2, dim=-1)  # (T, nh, hd) each
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k.view(t, nkv, hd)), cos, sin)
        attended = self.backend.forward(q, k, v.view(t, nkv, hd), k_cache, v_cache, meta)  # (T, nh, hd)
        return self.o_proj((attended * torch.sigmoid(gate)).reshape(t, nh * hd))


class Qwen3NextDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with (1 + weight) norms, mixing by a gated DeltaNet (``linear_attn``) where the config says
    ``linear_attention``, else by the gated attention."""

    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__(config, backend, layer)
        self.linear_attn = GatedDeltaNet(config, layer) if config.layer_has_states(layer) else None

    def make_attention(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> nn.Module:
        return Qwen3NextAttention(config, backend, layer)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        h, residual = self._input_norm(x, residual)
        if self.linear_attn is not None:
            return self._after_mixing(self.linear_attn(h, meta.states), residual)
        return self._after_mixing(self.self_attn(h, cos, sin, k_cache, v_cache, meta), residual)


class Qwen3NextModel(LlamaModel):
    layer_class = Qwen3NextDecoderLayer
    norm_class = GemmaRMSNorm


class Qwen3NextForCausalLM(LlamaForCausalLM):
    model_class = Qwen3NextModel


def checkpoint_tensor(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor] | None:
    """A checkpoint tensor as the engine holds it: Qwen3-Next's grouped DeltaNet projections in Qwen3.5's row
    order (module docstring); the multi-token-prediction layers' (``mtp.``) not read."""
    if key.startswith("mtp."):
        return None
    if config.model_type != "qwen3_next" or not key.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
        return key, tensor
    net = config.gated_delta_net
    groups, per_group = net["num_k_heads"], net["num_v_heads"] // net["num_k_heads"]
    grouped = tensor.view(groups, -1, tensor.shape[-1])  # (k heads, the group's rows, H)
    if key.endswith("in_proj_ba.weight"):  # each group's b rows, then its a rows
        sizes = (per_group, per_group)
    else:  # each group's q, k, then its value heads' v and z
        dk, dv = net["head_k_dim"], net["head_v_dim"]
        sizes = (dk, dk, per_group * dv, per_group * dv)
    return key, torch.cat([part.reshape(-1, tensor.shape[-1]) for part in grouped.split(sizes, dim=1)])

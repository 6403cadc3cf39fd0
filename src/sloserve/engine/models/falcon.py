"""Falcon (``falcon``: Falcon 7B, 40B, 180B, Falcon 2 11B, Falcon-RW) and BLOOM (``bloom``): LayerNorms with biases,
whole heads rotated, a GELU MLP of two matrices (``dense_h_to_4h``, ``dense_4h_to_h``), attention and MLP in parallel
from the stream (``parallel_attn``: x + (mlp(ln(x)) + attn(ln(x))), transformers' order of the sum), biases where
``bias`` says. HF parameter names (``transformer.h.N.self_attention.query_key_value``...).

- Falcon 7B: one KV head (``multi_query``), one norm a layer (``input_layernorm``).
- Falcon 40B, 180B (``new_decoder_architecture``): ``num_kv_heads`` KV heads and two norms, one before attention
  (``ln_attn``), one before the MLP (``ln_mlp``); Falcon 2 11B's one norm for both (``num_ln_in_parallel_attn`` 1).
- A layer not in parallel (``parallel_attn`` false, Falcon-RW's outline): the MLP after attention, from
  ``post_attention_layernorm``.
- ALiBi (``alibi``: Falcon-RW's) in place of the rotary embedding (``engine/alibi.py``: Press et al.'s slopes), scaled
  as transformers adds it: to the dot products before their 1/sqrt(head_dim), so a slope m_h / sqrt(head_dim) (BLOOM's
  after the scale: m_h).
- BLOOM: Falcon-RW's layers with ALiBi, a LayerNorm of the embeddings (``word_embeddings_layernorm``) and GELU by
  tanh's approximation; the Hub's checkpoints name the tensors without ``transformer.`` (BloomModel's).

NOTE: the checkpoint's ``query_key_value`` rows are grouped as its attention splits them: by KV head, its queries
then its key and value (``new_decoder_architecture``; ``multi_query``: one group; neither: a group a head, [q k v]);
they load reordered to all the queries', then the keys', then the values' (``checkpoint_tensor``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.alibi import AlibiSlopes
from sloserve.engine.attention import AttentionBackend, AttentionMetadata
from sloserve.engine.kv_cache import layer_caches
from sloserve.engine.models.gpt_neox import qkv_rows_by_kind
from sloserve.engine.models.llama import Rotary, apply_rotary


class FalconAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h, bias = config.hidden_size, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.query_key_value = nn.Linear(h, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=bias)
        self.dense = nn.Linear(h, h, bias=bias)
        self.backend = backend
        # ALiBi's slopes, as transformers adds the biases: Falcon's before the scores' 1/sqrt(head_dim), BLOOM's after
        # (None: the layer rotates instead)
        scale = 1.0 if config.model_type == "bloom" else 1 / math.sqrt(self.head_dim)
        self.alibi = AlibiSlopes(self.num_heads, scale=scale) if config.alibi else None

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:  # (T, H) -> (T, H)
        t, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.query_key_value(x).view(t, nh + 2 * nkv, self.head_dim)  # (T, nh + 2 nkv, hd)
        qk = qkv[:, : nh + nkv] if self.alibi is not None else apply_rotary(qkv[:, : nh + nkv], cos, sin)
        alibi = None if self.alibi is None else self.alibi.on(x.device)
        out = self.backend.forward(qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :], k_cache, v_cache, meta, alibi=alibi)
        return self.dense(out.reshape(t, -1))


class FalconMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.dense_h_to_4h, self.dense_4h_to_h = nn.Linear(h, i, bias=bias), nn.Linear(i, h, bias=bias)
        # (Falcon's "gelu" exact; BLOOM's by tanh's approximation)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate=self.approximate))


class FalconDecoderLayer(nn.Module):
    """The module docstring's layer: its norms by ``ModelConfig.extra["falcon_norms"]``: "ln_attn, ln_mlp" (two
    before the parallel parts), "input" (one for both), or "input, post_attention" (one before each, in turn)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.norm_eps
        self.norms = config.extra["falcon_norms"]
        if self.norms == "ln_attn, ln_mlp":
            self.ln_attn, self.ln_mlp = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(h, eps=eps)
        if self.norms == "input, post_attention":
            self.post_attention_layernorm = nn.LayerNorm(h, eps=eps)
        self.self_attention = FalconAttention(config, backend)
        self.mlp = FalconMLP(config)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        if self.norms == "ln_attn, ln_mlp":
            to_attention, to_mlp = self.ln_attn(x), self.ln_mlp(x)
        else:
            to_attention = to_mlp = self.input_layernorm(x)
        attended = self.self_attention(to_attention, cos, sin, k_cache, v_cache, meta)
        if self.norms == "input, post_attention":  # (not in parallel: the MLP after attention)
            x = attended + x
            return self.mlp(self.post_attention_layernorm(x)) + x
        return (self.mlp(to_mlp) + attended) + x


class FalconModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.extra["embedding_norm"]:  # (BLOOM's)
            self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.h = nn.ModuleList(FalconDecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class FalconForCausalLM(nn.Module):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores."""

    supports_piecewise_graphs = False  # (its own forward)

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.transformer = FalconModel(config, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.word_embeddings.weight
        self.rotary = Rotary(config)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_cache: torch.Tensor,  # (2, layers, num_slots, nkv, hd)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H)
        x = self.transformer.word_embeddings(input_ids)
        if self.config.extra["embedding_norm"]:
            x = self.transformer.word_embeddings_layernorm(x)
        cos, sin = self.rotary.for_positions(positions, x.dtype)  # (T, 1, hd) each (unread with ALiBi)
        for i, layer in enumerate(self.transformer.h):
            x = layer(x, cos, sin, *layer_caches(kv_cache, i), meta)
        return self.transformer.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N, vocab)
        return self.lm_head(hidden)


def checkpoint_tensor(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor]:
    """A Falcon checkpoint's tensor as the engine holds it: ``query_key_value``'s rows by kind (module docstring);
    BLOOM's under ``transformer.`` where the checkpoint has its base model's names."""
    if config.model_type == "bloom" and not key.startswith(("transformer.", "lm_head.")):
        key = "transformer." + key
    if ".query_key_value." in key:
        tensor = qkv_rows_by_kind(tensor, config.num_attention_heads, config.num_key_value_heads)
    return key, tensor

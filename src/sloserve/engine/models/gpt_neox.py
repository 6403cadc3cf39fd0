"""GPT-NeoX (``gpt_neox``: EleutherAI's Pythia suite, 14M-12B, and GPT-NeoX-20B): LayerNorms with biases,
a GELU MLP, biases everywhere, the rotary embedding on the leading quarter of each head
(``partial_rotary_dim``), and, in most of them, attention and MLP in parallel from the same stream
(``parallel_residual``: x + attn(ln1(x)) + mlp(ln2(x))). HF parameter names.

NOTE: the checkpoint's ``query_key_value`` rows are per head, [q k v] for head 0, then head 1...; they
load reordered to all the queries', then the keys', then the values' (``checkpoint_tensor``), so that the
step splits them as the other models' projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend, AttentionMetadata
from sloserve.engine.kv_cache import layer_caches
from sloserve.engine.models.llama import Rotary, apply_rotary


class GPTNeoXAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h, bias = config.hidden_size, config.attention_bias
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.query_key_value = nn.Linear(h, 3 * self.num_heads * self.head_dim, bias=bias)  # rows: q, k, v
        self.dense = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.backend = backend

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        t, nh = x.shape[0], self.num_heads
        qkv = self.query_key_value(x).view(t, 3 * nh, self.head_dim)  # (T, 3 nh, hd)
        qk = apply_rotary(qkv[:, : 2 * nh], cos, sin)  # (T, 2 nh, hd) Q and K rotated together
        out = self.backend.forward(qk[:, :nh], qk[:, nh:], qkv[:, 2 * nh :], k_cache, v_cache, meta)
        return self.dense(out.reshape(t, -1))


class GPTNeoXMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))  # (exact GELU: HF's "gelu")


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = nn.LayerNorm(h, eps=config.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=config.norm_eps)
        self.attention = GPTNeoXAttention(config, backend)
        self.mlp = GPTNeoXMLP(config)
        self.parallel = config.parallel_residual

    def forward(self, x, cos, sin, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        attended = self.attention(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        if self.parallel:  # (HF's order of the sum)
            return self.mlp(self.post_attention_layernorm(x)) + attended + x
        x = attended + x
        return self.mlp(self.post_attention_layernorm(x)) + x


class GPTNeoXModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GPTNeoXLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class GPTNeoXForCausalLM(nn.Module):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores."""

    supports_piecewise_graphs = False  # (its own forward)

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.gpt_neox = GPTNeoXModel(config, backend)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.embed_out.weight = self.gpt_neox.embed_in.weight
        self.rotary = Rotary(config)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_cache: torch.Tensor,  # (2, layers, num_slots, nkv, hd)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H)
        x = self.gpt_neox.embed_in(input_ids)
        cos, sin = self.rotary.for_positions(positions, x.dtype)  # (T, 1, rotary_dim) each
        for i, layer in enumerate(self.gpt_neox.layers):
            x = layer(x, cos, sin, *layer_caches(kv_cache, i), meta)
        return self.gpt_neox.final_layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N, vocab)
        return self.embed_out(hidden)


def checkpoint_tensor(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor]:
    """A GPT-NeoX checkpoint's tensor as the engine holds it: ``query_key_value``'s rows by kind."""
    if ".query_key_value." in key:
        tensor = qkv_rows_by_kind(tensor, config.num_attention_heads)
    return key, tensor


def qkv_rows_by_kind(tensor: torch.Tensor, num_heads: int, num_kv_heads: int | None = None) -> torch.Tensor:
    """A checkpoint's ``query_key_value`` weight ((nh + 2 nkv) x hd, H) or bias, its rows grouped by KV head: each
    group's nh / nkv queries, then its key and value (GPT-NeoX's, nkv = nh: [q k v] a head; Falcon's groups), as the
    engine holds it: every query's rows, then the keys', then the values'."""
    nkv = num_heads if num_kv_heads is None else num_kv_heads
    rest = tensor.shape[1:]  # ((H,) for a weight, () for a bias)
    groups = tensor.reshape(nkv, num_heads // nkv + 2, -1, *rest)  # (nkv, its queries + k + v, hd, ...)
    queries, keys, values = groups[:, :-2].flatten(0, 2), groups[:, -2].flatten(0, 1), groups[:, -1].flatten(0, 1)
    return torch.cat((queries, keys, values))

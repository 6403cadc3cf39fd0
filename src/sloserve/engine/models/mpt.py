"""MPT (``mpt``: MosaicML's MPT-7B, MPT-30B and their Instruct and Chat models): ALiBi in place of position embeddings
(``engine/alibi.py``: MPT's slopes, by ``alibi_bias_max``), LayerNorms without biases, no biases anywhere, Q/K/V from one
projection (``Wqkv``: the queries', then the keys', then the values' rows), clamped to [-clip_qkv, clip_qkv] where the
config says, and a GELU MLP of two matrices ``expansion_ratio`` (4) times as wide; attention then the MLP, each from its
norm. The LM head is the embeddings'. HF parameter names (``transformer.blocks.N.attn.Wqkv``...), which are the Hub's.

Settings that transformers' MPT does not read (learned positions instead of ALiBi, biases, QK LayerNorms, a logit
scale, prefix LM, other attention types) are refused by name (config.py).
"""

from __future__ import annotations

import torch
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.alibi import AlibiSlopes
from sloserve.engine.attention import AttentionBackend, AttentionMetadata
from sloserve.engine.kv_cache import layer_caches
from sloserve.engine.models.nemotron import UpDownMLP


class MptAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.Wqkv = nn.Linear(h, 3 * h, bias=False)
        self.out_proj = nn.Linear(h, h, bias=False)
        self.clip_qkv = config.clip_qkv
        self.scale = config.attention_multiplier  # (the config's softmax_scale; None: 1/sqrt(head_dim))
        self.alibi = AlibiSlopes(self.num_heads, config.alibi_bias_max)
        self.backend = backend

    def forward(self, x, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:  # (T, H) -> (T, H)
        t = x.shape[0]
        qkv = self.Wqkv(x)  # (T, 3H)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.view(t, 3, self.num_heads, self.head_dim).unbind(1)  # (T, nh, hd) each
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta, scale=self.scale, alibi=self.alibi.on(x.device))
        return self.out_proj(out.reshape(t, -1))


class MptBlock(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.norm_eps
        self.norm_1, self.norm_2 = nn.LayerNorm(h, eps=eps, bias=False), nn.LayerNorm(h, eps=eps, bias=False)
        self.attn = MptAttention(config, backend)
        self.ffn = UpDownMLP(config)  # (up_proj, down_proj: its exact GELU, no biases)

    def forward(self, x, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        x = self.attn(self.norm_1(x), k_cache, v_cache, meta) + x
        return self.ffn(self.norm_2(x)) + x


class MptModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(MptBlock(config, backend) for _ in range(config.num_hidden_layers))
        self.norm_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)


class MptForCausalLM(nn.Module):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores."""

    supports_piecewise_graphs = False  # (its own forward)

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.transformer = MptModel(config, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,) (unread: ALiBi's distances come from the attention's slot tables)
        kv_cache: torch.Tensor,  # (2, layers, num_slots, nh, hd)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H)
        x = self.transformer.wte(input_ids)
        for i, block in enumerate(self.transformer.blocks):
            x = block(x, *layer_caches(kv_cache, i), meta)
        return self.transformer.norm_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N, vocab)
        return self.lm_head(hidden)

"""OPT (the EconoServe and BROS papers' model): learned positions (offset 2), LayerNorm, ReLU MLP,
biases everywhere, tied LM head. Token-major, HF parameter names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.checkpoint.model_types import OPT_POSITION_OFFSET as POSITION_OFFSET
from sloserve.engine.attention import AttentionBackend, AttentionMetadata
from sloserve.engine.kv_cache import layer_caches


class OPTAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h, bias = config.hidden_size, config.enable_bias
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.q_proj = nn.Linear(h, h, bias=bias)
        self.k_proj = nn.Linear(h, h, bias=bias)
        self.v_proj = nn.Linear(h, h, bias=bias)
        self.out_proj = nn.Linear(h, h, bias=bias)
        self.backend = backend

    def forward(self, x, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # (T, nh, hd)
        k = self.k_proj(x).view(t, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_heads, self.head_dim)
        return self.out_proj(self.backend.forward(q, k, v, k_cache, v_cache, meta).reshape(t, -1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h, bias = config.hidden_size, config.enable_bias
        self.self_attn = OPTAttention(config, backend)
        self.self_attn_layer_norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, config.intermediate_size, bias=bias)
        self.fc2 = nn.Linear(config.intermediate_size, h, bias=bias)
        self.final_layer_norm = nn.LayerNorm(h)
        self.act = F.relu if config.hidden_act == "relu" else F.gelu
        self.pre_norm = config.do_layer_norm_before

    def forward(self, x, k_cache, v_cache, meta):
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), k_cache, v_cache, meta)
            return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        # OPT-350m: post-norm
        x = self.self_attn_layer_norm(x + self.self_attn(x, k_cache, v_cache, meta))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class OPTDecoder(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h, proj = config.hidden_size, config.word_embed_proj_dim or config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, proj)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, h)
        self.project_in = nn.Linear(proj, h, bias=False) if proj != h else None
        self.project_out = nn.Linear(h, proj, bias=False) if proj != h else None
        has_final_norm = config.do_layer_norm_before and not config.extra.get("remove_final_layer_norm", False)
        self.final_layer_norm = nn.LayerNorm(h) if has_final_norm else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, backend) for _ in range(config.num_hidden_layers))


class OPTModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, backend)


class OPTForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config, backend)
        proj = config.word_embed_proj_dim or config.hidden_size
        self.lm_head = nn.Linear(proj, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_cache: torch.Tensor,  # (2, layers, num_slots, nh, hd)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, proj)
        d = self.model.decoder
        x = d.embed_tokens(input_ids)
        if d.project_in is not None:
            x = d.project_in(x)
        x = x + d.embed_positions(positions + POSITION_OFFSET)
        for i, layer in enumerate(d.layers):
            x = layer(x, *layer_caches(kv_cache, i), meta)
        if d.final_layer_norm is not None:
            x = d.final_layer_norm(x)
        if d.project_out is not None:
            x = d.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, proj) -> (N, vocab)
        return self.lm_head(hidden)

"""GPT-2 (``gpt2``: OpenAI's GPT-2, 124M-1.5B, DistilGPT2 and the models trained in its shape): learned
positions added to the embeddings, a LayerNorm before attention and one before the MLP, a two-matrix MLP
(GELU by tanh's approximation: ``gelu_new``), biases everywhere, the LM head tied to the embeddings. HF
parameter names (``transformer.h.N.attn.c_attn``...). GPT-BigCode (``gpt_bigcode``: StarCoder 1, SantaCoder,
WizardCoder 15B, SQLCoder) is these layers with one KV head (``multi_query``) and Linear weights.

NOTE: GPT-2's checkpoints store each projection as a ``Conv1D`` whose weight is (in, out): it loads
transposed (``checkpoint_tensor``), and ``c_attn``'s rows are then the queries', the keys', the values'.
OpenAI's own checkpoint names its tensors without the ``transformer.`` prefix (``h.0.attn.c_attn.weight``);
they load under it."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend, AttentionMetadata
from sloserve.engine.kv_cache import layer_caches
from sloserve.engine.models.gpt_neox import qkv_rows_by_kind

# A two-matrix MLP's activation by its config's name (``activation_function``, ``hidden_act``: transformers'
# ACT2FN names)
ACTIVATIONS = {
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),  # (Nemotron's and Arcee's squared ReLU)
}
# The projections a checkpoint stores as Conv1D weights, (in, out)
CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.c_attn = nn.Linear(h, h + 2 * self.num_kv_heads * self.head_dim)  # rows: q, k, v
        self.c_proj = nn.Linear(h, h)
        # head_dim ** -0.5 (1 where scale_attn_weights is false), over the layer's number where
        # scale_attn_by_inverse_layer_idx (Stanford CRFM's GPT-2s)
        scale = config.attention_multiplier if config.attention_multiplier is not None else self.head_dim**-0.5
        self.scale = scale / (layer + 1) if config.extra.get("scale_attn_by_inverse_layer_idx") else scale
        self.backend = backend

    def forward(self, x, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:  # (T, H) -> (T, H)
        t, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.c_attn(x).view(t, nh + 2 * nkv, self.head_dim)
        q, k, v = qkv.split((nh, nkv, nkv), dim=1)  # (T, nh, hd), (T, nkv, hd), (T, nkv, hd)
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta, scale=self.scale)
        return self.c_proj(out.reshape(t, -1))


class GPT2MLP(nn.Module):
    """c_proj(act(c_fc(x))), biases where ``mlp_bias`` (GPT-2's always; StarCoder2's MLP too)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, I) -> (T, H)
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.ln_1 = nn.LayerNorm(h, eps=config.norm_eps)
        self.attn = GPT2Attention(config, backend, layer)
        self.ln_2 = nn.LayerNorm(h, eps=config.norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x, k_cache, v_cache, meta):  # (T, H) the residual stream -> (T, H)
        x = self.attn(self.ln_1(x), k_cache, v_cache, meta) + x
        return self.mlp(self.ln_2(x)) + x


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, h)
        self.wpe = nn.Embedding(config.max_position_embeddings, h)
        self.h = nn.ModuleList(GPT2Block(config, backend, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(h, eps=config.norm_eps)


class GPT2LMHeadModel(nn.Module):
    """``forward`` returns the final hidden states ``(T, H)``; ``compute_logits`` the vocabulary scores."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_cache: torch.Tensor,  # (2, layers, num_slots, nh, hd)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H)
        model = self.transformer
        x = model.wte(input_ids) + model.wpe(positions)
        for i, block in enumerate(model.h):
            x = block(x, *layer_caches(kv_cache, i), meta)
        return model.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N, vocab)
        return self.lm_head(hidden)


def checkpoint_tensor(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor]:
    """A GPT-2 checkpoint's tensor as the engine's model names and holds it: under ``transformer.`` (OpenAI's
    checkpoint has no prefix), a Conv1D weight (in, out) transposed to a Linear's (out, in). GPT-BigCode's are
    Linear weights already; without ``multi_query`` its ``c_attn`` rows, each head's q, k and v side by side, are
    reordered to all the queries', the keys', the values'."""
    if not key.startswith(("transformer.", "lm_head.")):
        key = f"transformer.{key}"
    if config.model_type != "gpt_bigcode":
        return key, tensor.T if key.endswith(CONV1D_WEIGHTS) else tensor
    if config.num_key_value_heads > 1 and key.endswith((".attn.c_attn.weight", ".attn.c_attn.bias")):
        tensor = qkv_rows_by_kind(tensor, config.num_attention_heads)
    return key, tensor
